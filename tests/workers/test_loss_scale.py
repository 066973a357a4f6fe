"""fp16 dynamic loss scaling: the scaler's rule on hand-worked values, and the actor's use of it — gradients
unscaled before anyone reads them, an overflow skipped (also when only another rank overflowed) and counted, a
non-finite loss skipped without counting as a clean step, and the fraction of exactly-zero gradient entries."""

import copy

import pytest
import torch

from gerl.config import ModelConfig, SamplingConfig, TrainConfig
from gerl.workers.actor import ActorWorker, compute_dtype
from gerl.workers.loss_scale import DynamicLossScaler, grad_zero_fraction

PROMPTS = ['a sign that says "42"'] * 2 + ['a sign that says "17"'] * 2
GROUPS = torch.tensor([0, 0, 1, 1])


def test_unscale_divides_and_reports_non_finite():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([8.0, 12.0])
    assert s.unscale_([p]) is True and p.grad.tolist() == [2.0, 3.0]
    assert s.scale_loss(torch.tensor(1.5)).item() == 6.0
    p.grad = torch.tensor([float("inf"), 1.0])
    assert s.unscale_([p]) is False
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    q.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16 gradients cannot be unscaled"):
        s.unscale_([q])


def test_grad_zero_fraction_counts_exact_zeros_and_missing_gradients():
    p, q, r = (torch.nn.Parameter(torch.zeros(n)) for n in (4, 3, 1))
    p.grad, r.grad = torch.tensor([0.0, 1e-30, -0.0, 2.0]), torch.tensor([5.0])  # q has no gradient: 3 zeros
    assert grad_zero_fraction([p, q, r]) == 5 / 8  # hand count: 0.0, -0.0 and q's three; 1e-30 is not zero
    assert grad_zero_fraction([q]) == 1.0 and grad_zero_fraction([]) == 0.0


def test_scale_halves_on_overflow_and_doubles_after_a_clean_stretch():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    s.update(overflow=True)
    assert (s.scale, s.clean_steps, s.overflows) == (512.0, 0, 1)
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 512.0
    s.update(overflow=False)  # the third clean step in a row
    assert (s.scale, s.clean_steps) == (1024.0, 0)
    s.update(overflow=False)
    s.update(overflow=True)  # an overflow resets the stretch
    assert (s.scale, s.clean_steps) == (512.0, 0)
    s.update(overflow=False)
    s.update(overflow=False, clean=False)  # a step skipped for a non-finite loss: no evidence about the scale
    assert (s.scale, s.clean_steps, s.overflows) == (512.0, 1, 2)
    s.update(overflow=False)
    s.update(overflow=False)
    assert (s.scale, s.clean_steps) == (1024.0, 0)  # 3 clean steps, not counting the skipped one
    s.scale, s.clean_steps = 512.0, 0
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == {"scale": 512.0, "clean_steps": 0, "overflows": 2}


@pytest.fixture(scope="module")
def ocr_mini():
    """The shipped ocr-mini pipeline (trained weights, well-conditioned numerics)."""
    from gerl.models.loader import TextEmbedder, load_pipeline

    pipe = load_pipeline("ocr-mini")
    return pipe, TextEmbedder(pipe, 32)


@pytest.fixture
def lora_copy(ocr_mini):
    """Factory: copies of one ocr-mini transformer with a seeded, non-zero LoRA (the same adapter every call: a
    fresh add_lora would draw new lora_A weights); fp16 base weights if asked, the LoRA staying fp32."""
    from gerl.models.loader import add_lora

    tr = copy.deepcopy(ocr_mini[0].transformer)
    torch.manual_seed(0)
    add_lora(tr, 4, 8.0, ["to_q", "to_k", "to_v", "to_out.0"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)

    def make(fp16: bool):
        out = copy.deepcopy(tr)
        if fp16:
            for p in out.parameters():
                if not p.requires_grad:
                    p.data = p.data.half()
        return out

    return make


def _batch(ocr_mini, transformer):
    from types import SimpleNamespace

    from gerl.workers.rollout import RolloutWorker

    pipe, embedder = ocr_mini
    cfg = SamplingConfig(sampler="cps", num_steps=4, noise_level=0.8, sde_window_size=1, sde_window_range=[0, 2],
                         micro_batch_size=4)
    parts = SimpleNamespace(transformer=transformer, vae=pipe.vae, scheduler=pipe.scheduler)
    batch = RolloutWorker(parts, embedder, cfg, 64, 0).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
    return cfg, batch, torch.tensor([1.0, -1.0, -1.0, 1.0])


def _grads_of_update(transformer, cfg, batch, adv, scale, other_rank_overflows=False):
    grads = []

    def grad_sync(params, loss_ok, grads_ok):  # the data-parallel hook: sees the gradients after unscaling
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().clone() for p in params]))
        return loss_ok, grads_ok and not other_rank_overflows

    train = TrainConfig(micro_batch_size=4, learning_rate=1e-3, fp16_loss_scale=scale, max_grad_norm=0.0)
    actor = ActorWorker(transformer, train, ModelConfig(lora=True), cfg, max_steps=1, images_per_step=4, seed=0,
                        world=1, grad_sync=grad_sync)
    before = [p.detach().clone() for p in actor.params]
    m = actor.update(batch, adv, step=1)
    moved = any(not torch.equal(b, p) for b, p in zip(before, actor.params))
    return grads[0], m, moved, actor


# The gradient of a step's log-prob is a mean over the latent's elements: 16 × 8 × 8 at ocr-mini's 64 px against
# 16 × 64 × 64 at 512 px, so ocr-mini's per-element gradients are ~64× larger than SD3.5's and fp16 keeps them
# without any scaling (cosine 0.998 with fp32 at scale 1). Advantages × 1e-3 bring them down to the range of a 512 px
# run, where fp16 flushes them to zero (measured: every entry zero without scaling, cosine 0.99998 with it).
SMALL_ADVANTAGES = 1e-3


def test_fp16_actor_gradients_are_unscaled_and_match_fp32(ocr_mini, lora_copy):
    tr16 = lora_copy(fp16=True)
    assert compute_dtype(tr16) == torch.float16
    cfg, batch, adv = _batch(ocr_mini, tr16)
    adv = adv * SMALL_ADVANTAGES
    g32, _, _, _ = _grads_of_update(lora_copy(fp16=False), cfg, batch, adv, 65536.0)
    assert (g32 != 0).all(), "the fp32 reference gradient is dense"
    # the control: the same update with loss scaling off underflows — these gradients do need the scaling
    g0, m0, _, actor0 = _grads_of_update(lora_copy(fp16=True), cfg, batch, adv, 0.0)
    assert actor0.scaler is None and m0["grad_zero_frac"] > 0.99
    assert torch.nn.functional.cosine_similarity(g0, g32, dim=0) < 0.5
    g16, m, moved, actor = _grads_of_update(tr16, cfg, batch, adv, 65536.0)
    assert actor.scaler is not None and m["loss_scale"] == 65536.0 and m["overflow_updates_skipped"] == 0
    assert moved and m["optimizer_steps"] == 1
    cos = torch.nn.functional.cosine_similarity(g16, g32, dim=0)
    assert cos > 0.99 and 0.9 < float(g16.norm() / g32.norm()) < 1.1, "unscaled: same direction and size as fp32"
    # grad_zero_frac is the fraction of exactly-zero entries of the gradient the optimizer steps with
    assert m["grad_zero_frac"] == pytest.approx(float((g16 == 0).double().mean()), abs=1e-12) and m["grad_zero_frac"] < 0.01
    assert m0["grad_zero_frac"] == pytest.approx(float((g0 == 0).double().mean()), abs=1e-12)


def test_all_nan_losses_fail_the_ratio_check_and_are_no_clean_scaler_step(ocr_mini, lora_copy):
    """Every loss NaN (here NaN advantages): no step, counted as non-finite, the scale neither grows nor counts a
    clean step, and the pre-update ratio reads NaN — a `<= bound` check cannot pass on it."""
    tr16 = lora_copy(fp16=True)
    cfg, batch, adv = _batch(ocr_mini, tr16)
    _, m, moved, actor = _grads_of_update(tr16, cfg, batch, adv * float("nan"), 65536.0)
    assert not moved and m["optimizer_steps"] == 0 and m["nonfinite_updates_skipped"] == 1
    assert actor.scaler.state_dict() == {"scale": 65536.0, "clean_steps": 0, "overflows": 0}
    dev = m["ratio_max_dev_before_update"]
    assert dev != dev and not dev <= 1e-3  # NaN
    _, ok, _, ok_actor = _grads_of_update(lora_copy(fp16=True), cfg, batch, adv, 65536.0)
    assert ok["ratio_max_dev_before_update"] < 1e-3 and ok_actor.scaler.clean_steps == 1  # the same batch, finite


def test_an_overflow_is_skipped_counted_and_halves_the_scale(ocr_mini, lora_copy):
    tr16 = lora_copy(fp16=True)
    cfg, batch, adv = _batch(ocr_mini, tr16)
    _, m, moved, actor = _grads_of_update(tr16, cfg, batch, adv, 2.0**60)  # far past fp16's 65504
    assert not moved and m["optimizer_steps"] == 0
    assert m["overflow_updates_skipped"] == 1 and m["nonfinite_updates_skipped"] == 0
    assert actor.scaler.scale == 2.0**59 and m["overflow_updates_total"] == 1


def test_another_ranks_overflow_skips_this_ranks_step_too(ocr_mini, lora_copy):
    tr16 = lora_copy(fp16=True)
    cfg, batch, adv = _batch(ocr_mini, tr16)
    _, m, moved, actor = _grads_of_update(tr16, cfg, batch, adv, 65536.0, other_rank_overflows=True)
    assert not moved and m["overflow_updates_skipped"] == 1 and actor.scaler.scale == 32768.0


def test_no_scaler_outside_fp16(lora_transformer):
    cfg = SamplingConfig(micro_batch_size=4)
    actor = ActorWorker(lora_transformer(), TrainConfig(), ModelConfig(lora=True), cfg, 1, 4, 0)
    assert actor.scaler is None


def test_the_loss_scale_survives_a_checkpoint(ocr_mini, lora_copy, tmp_path):
    from gerl.checkpoint import load_checkpoint, save_checkpoint

    cfg = SamplingConfig(micro_batch_size=4)

    def actor():
        return ActorWorker(lora_copy(fp16=True), TrainConfig(), ModelConfig(lora=True), cfg, 1, 4, 0)

    a = actor()
    a.scaler.load_state_dict({"scale": 1024.0, "clean_steps": 7, "overflows": 3})
    path = save_checkpoint(tmp_path, 1, a, {})
    b = actor()
    assert b.scaler.scale == 65536.0
    load_checkpoint(path, b)
    assert b.scaler.state_dict() == {"scale": 1024.0, "clean_steps": 7, "overflows": 3}
