"""sampling.merge_lora (gerl/models/lora_merge.py): the rollout generates on W0 + s·B·A merged into each adapted
linear — the adapter's own matmuls never run — with the same samples as PEFT's unmerged forward (fp32: to
rounding), and every base weight is put back bit for bit afterwards, so a trainer sharing the transformer never
sees a merged weight. In bf16 the merged weight is the exact sum rounded once."""

from __future__ import annotations

import torch

from gerl.config import SamplingConfig

PROMPTS = ["a 12", "a 34", "a 56", "a 78"]
SAMPLING = dict(num_steps=4, sde_window_size=2, sde_window_range=[0, 3], micro_batch_size=2)


def _generate(make_rollout, tr, merge: bool, between=None):
    worker = make_rollout(SamplingConfig(**SAMPLING, merge_lora=merge), transformer=tr)
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for n, m in tr.named_modules()
             if n.endswith("lora_A.default")]
    try:
        with torch.no_grad():
            batch = worker.generate(PROMPTS, [{}] * 4, torch.tensor([0, 0, 1, 1]), step=0, between=between)
    finally:
        for h in hooks:
            h.remove()
    return batch.traj, len(calls)


def _base_weights(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.named_parameters() if "lora_" not in n}


def test_merged_generation_samples_what_the_unmerged_one_does_and_puts_the_weights_back(make_rollout, lora_transformer):
    tr = lora_transformer(randomize=True, scale=0.05)
    before = _base_weights(tr)
    plain, plain_calls = _generate(make_rollout, tr, merge=False)
    merged, merged_calls = _generate(make_rollout, tr, merge=True)
    assert plain_calls > 0 and merged_calls == 0  # merged: the adapter's matmuls never ran
    for key in ("latents", "next_latents", "log_probs", "final_latents"):
        torch.testing.assert_close(getattr(merged, key), getattr(plain, key), rtol=1e-4, atol=1e-5, msg=key)
    # ... and the adapter matters here: generating on W0 alone gives other samples
    tr.disable_adapters()
    base, _ = _generate(make_rollout, tr, merge=False)
    tr.enable_adapters()
    assert (base.final_latents - plain.final_latents).abs().max() > 1e-3
    after = _base_weights(tr)
    assert all(torch.equal(before[n], after[n]) for n in before)  # bit for bit, not W − s·B·A
    assert not any(getattr(m, "merged_adapters", None) for m in tr.modules())  # PEFT's forward is unmerged again
    again, calls = _generate(make_rollout, tr, merge=False)
    assert calls > 0 and torch.equal(again.final_latents, plain.final_latents)


def test_adapter_tensors_loaded_between_micro_batches_are_merged_before_the_next(make_rollout, lora_transformer):
    """Staged weights arrive between micro-batches (the streaming/async rollout): the second micro-batch must be
    generated with them, merged, as the unmerged rollout does."""
    new_b = {}
    g = torch.Generator().manual_seed(7)

    def run(merge: bool):
        tr = lora_transformer(randomize=True, scale=0.05)
        params = dict(tr.named_parameters())
        if not new_b:
            new_b.update({n: torch.randn(p.shape, generator=g) * 0.05 for n, p in params.items() if "lora_B" in n})
        worker_box = []
        state = {"n": 0}

        def between():
            state["n"] += 1
            if state["n"] == 2:  # before the second micro-batch: a new version of the adapter
                with torch.no_grad():
                    for n, t in new_b.items():
                        params[n].copy_(t)
                worker_box[0].policy_version = 1

        worker = make_rollout(SamplingConfig(**SAMPLING, merge_lora=merge), transformer=tr)
        worker_box.append(worker)
        with torch.no_grad():
            return worker.generate(PROMPTS, [{}] * 4, torch.tensor([0, 0, 1, 1]), step=0, between=between).traj

    plain, merged = run(False), run(True)
    torch.testing.assert_close(merged.final_latents, plain.final_latents, rtol=1e-4, atol=1e-5)
    # the change is visible: the second micro-batch differs from a run that kept the old adapter
    new_b_saved = dict(new_b)
    new_b.clear()
    new_b.update({n: torch.zeros_like(t) for n, t in new_b_saved.items()})
    zeroed = run(True)
    assert (zeroed.final_latents[2:] - merged.final_latents[2:]).abs().max() > 1e-3
    torch.testing.assert_close(zeroed.final_latents[:2], merged.final_latents[:2], rtol=0, atol=0)


def test_a_bf16_merge_is_the_exact_sum_rounded_once_and_is_undone_exactly():
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    from gerl.models.lora_merge import MergedLora

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q = nn.Linear(64, 48, bias=False)

    g = torch.Generator().manual_seed(0)
    model = One()
    with torch.no_grad():
        model.to_q.weight.copy_(torch.randn(48, 64, generator=g))
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8.0, target_modules=["to_q"]), model)
    model.to(torch.bfloat16)
    layer = model.to_q
    layer.lora_A["default"].float()  # as gerl trains it: the base in bf16, the adapter in fp32
    layer.lora_B["default"].float()
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(torch.randn(48, 4, generator=g) * 0.01)
    w0 = layer.base_layer.weight.detach().clone()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert a.dtype == b.dtype == torch.float32 and w0.dtype == torch.bfloat16
    expected = (w0.float() + (b @ a) * (8.0 / 4)).to(torch.bfloat16)  # α/r = 2
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    with MergedLora(model).merged():
        assert torch.equal(layer.base_layer.weight, expected)
        assert torch.equal(layer(x), x @ expected.T)  # the forward is the base layer on the merged weight alone
        assert not torch.equal(expected, w0)  # the delta survived the rounding here
    assert torch.equal(layer.base_layer.weight, w0) and not layer.merged_adapters


def test_merge_lora_without_an_adapter_is_refused():
    import pytest

    from gerl.config import load_config
    from gerl.errors import UserError

    with pytest.raises(UserError, match="sampling.merge_lora=true merges a LoRA adapter, but model.lora=false"):
        load_config(None, ["model.lora=false", "sampling.merge_lora=true"])
    assert load_config(None, ["sampling.merge_lora=true"]).sampling.merge_lora is True


def test_a_run_on_merged_rollouts_trains_like_one_on_unmerged_rollouts(tmp_path):
    """Three steps of the local engine (rollout and actor share the transformer): with merge_lora the first
    update's ratio is still 1 to fp32 rounding at every step — the trainer's unmerged forward recomputes what the
    merged rollout sampled, after the adapter has moved — and step 1 (B = 0: W0 + s·B·A is W0) is the unmerged
    run's exactly. (Later steps drift apart by pixel rounding: a JPEG reward of uint8 images, then AdamW.)"""
    import json

    from safetensors.torch import load_file

    from gerl.trainer import train
    from tests.train.helpers import small_config

    runs = {}
    for merge in (False, True):
        out = tmp_path / f"merge_{merge}"
        train(small_config(out, "max_steps=3", "checkpoint.every=3", f"sampling.merge_lora={str(merge).lower()}"))
        rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        runs[merge] = rows, load_file(str(next((out / "checkpoints").glob("step_*")) / "trainable.safetensors"))
    (plain, _), (merged, w_merged) = runs[False], runs[True]
    assert [r["step"] for r in merged] == [1, 2, 3]
    devs = [r["ratio_max_dev_before_update"] for r in merged]
    assert all(d < 1e-4 for d in devs), devs
    assert merged[0]["reward_mean"] == plain[0]["reward_mean"]
    assert any(w_merged[n].abs().max() > 0 for n in w_merged if "lora_B" in n)  # the adapter did move
