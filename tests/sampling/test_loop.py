"""The denoising loop on the tiny SD3: the ODE path reproduces the stock diffusers pipeline, SDE windows are drawn
where they should be, and every recorded transition replays to the rollout's log-prob (batch splits, CFG, LoRA,
and the actor's first ratio)."""

import copy

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from torch.utils._python_dispatch import TorchDispatchMode

from gerl.config import ModelConfig, SamplingConfig, TrainConfig
from gerl.models.family import family_of
from gerl.models.tiny import RESOLUTION, TOKEN_LENGTH
from gerl.sampling.loop import denoise, make_schedule, predict_velocity, replay_log_prob, sde_window
from gerl.sampling.steps import ode_step, stochastic_step
from gerl.workers.actor import ActorWorker
from gerl.workers.rollout import decode, latent_noise

LATENT = (16, RESOLUTION // 4, RESOLUTION // 4)  # the tiny VAE downsamples 4x
PROMPTS = ["a red cat", "a red cat", "hello 42", "hello 42"]
GROUPS = torch.tensor([0, 0, 1, 1])
NUM_STEPS = 5
NOISE_LEVEL = 0.7


def sampling(sampler="sde", guidance=1.0, micro_batch_size=4, **kw):
    # window_size = 0: every step but the last is stochastic and recorded (K = NUM_STEPS − 1).
    return SamplingConfig(sampler=sampler, num_steps=NUM_STEPS, guidance_scale=guidance, noise_level=NOISE_LEVEL,
                          sde_window_size=kw.pop("sde_window_size", 0), micro_batch_size=micro_batch_size, **kw)


def stock_pipe(tiny_pipe):
    # A private scheduler: the stock call sets its timesteps and step index, and the session pipe stays untouched.
    return StableDiffusion3Pipeline(**{**tiny_pipe.components, "scheduler": copy.deepcopy(tiny_pipe.scheduler)})


# ------------------------------------------------------------------ schedule and windows

@pytest.mark.parametrize("n", [1, 4, 10])
def test_make_schedule_matches_the_models_scheduler(tiny_pipe, n):
    ref = copy.deepcopy(tiny_pipe.scheduler)
    ref.set_timesteps(n)
    s = make_schedule(tiny_pipe.scheduler.config, n)
    assert s.num_steps == n and s.sigmas.shape == (n + 1,) and s.timesteps.shape == (n,)
    torch.testing.assert_close(s.sigmas, ref.sigmas.float(), rtol=0, atol=0)
    torch.testing.assert_close(s.timesteps, ref.timesteps.float(), rtol=0, atol=0)
    assert s.sigmas[0] == 1 and s.sigmas[-1] == 0 and torch.all(s.sigmas[1:] < s.sigmas[:-1])
    torch.testing.assert_close(s.timesteps, s.sigmas[:-1] * 1000)  # SD3's timestep input is σ·1000
    if n > 1:
        assert s.sigma_max == pytest.approx(float(s.sigmas[1]))  # the largest σ below 1


@pytest.mark.parametrize("size,lo,hi", [(3, 0, 5), (1, 2, 4), (2, 1, 3), (4, 0, 4)])
def test_sde_window_respects_size_and_range_and_covers_every_start(size, lo, hi):
    rng = torch.Generator().manual_seed(0)
    starts = set()
    for _ in range(300):
        w = sde_window(10, size, (lo, hi), rng)
        assert w == list(range(w[0], w[0] + size)), "a window is `size` consecutive steps"
        assert lo <= w[0] and w[-1] < hi, f"window {w} leaves [{lo}, {hi})"
        starts.add(w[0])
    assert starts == set(range(lo, hi - size + 1))


def test_sde_window_zero_is_every_step_but_the_last():
    assert sde_window(6, 0, (0, 3), torch.Generator().manual_seed(0)) == [0, 1, 2, 3, 4]


def test_sde_window_is_seeded():
    def draws(seed):
        rng = torch.Generator().manual_seed(seed)
        return [sde_window(10, 2, (0, 9), rng) for _ in range(20)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


# ------------------------------------------------------------------ the ODE path = the stock pipeline

@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ode_denoise_reproduces_the_stock_pipeline(tiny_pipe, tiny_embedder, guidance):
    seeds = [11, 12]
    prompts = ["a red cat", "hello 42"]
    stock = stock_pipe(tiny_pipe)
    kw = dict(negative_prompt="") if guidance > 1 else {}
    common = dict(prompt=prompts, num_inference_steps=4, guidance_scale=guidance, height=RESOLUTION, width=RESOLUTION,
                  max_sequence_length=TOKEN_LENGTH, **kw)
    ref_latents = stock(generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="latent",
                        **common).images
    noise, _ = latent_noise(seeds, LATENT)
    embeds = tiny_embedder(prompts, with_negative=guidance > 1)
    traj = denoise(tiny_pipe.transformer, embeds, noise, make_schedule(tiny_pipe.scheduler.config, 4), [], "sde",
                   NOISE_LEVEL, guidance, None)
    torch.testing.assert_close(traj.final_latents, ref_latents.float(), rtol=0, atol=1e-5)
    assert traj.latents.shape == (2, 0, *LATENT) and traj.log_probs.shape == (2, 0)
    if guidance == 1.0:  # decoding too: our decode = the stock post-processing
        ref_images = stock(generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pil",
                           **common).images
        for ours, ref in zip(decode(tiny_pipe.vae, traj.final_latents, family_of(tiny_pipe)), ref_images):
            assert np.abs(np.asarray(ours, dtype=int) - np.asarray(ref, dtype=int)).max() <= 1


def test_denoise_refuses_a_stochastic_final_step(tiny_pipe, tiny_embedder):
    noise, gens = latent_noise([0], LATENT)
    sched = make_schedule(tiny_pipe.scheduler.config, 3)
    with pytest.raises(ValueError, match="final step"):
        denoise(tiny_pipe.transformer, tiny_embedder(["x"]), noise, sched, [1, 2], "cps", NOISE_LEVEL, 1.0, gens)


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_sde_steps_sit_at_their_schedule_index(tiny_pipe, tiny_embedder, sampler):
    # Independently of denoise/replay (which share their indexing): ODE up to step i by hand, then step i is the
    # stochastic step from σ_i to σ_{i+1} at timestep t_i, then ODE again to the end.
    tr, sched = tiny_pipe.transformer, make_schedule(tiny_pipe.scheduler.config, NUM_STEPS)
    embeds = tiny_embedder(PROMPTS[:2])
    noise, gens = latent_noise([5, 6], LATENT)
    traj = denoise(tr, embeds, noise, sched, [2], sampler, NOISE_LEVEL, 1.0, gens)
    assert traj.step_indices.tolist() == [2] and traj.latents.shape == (2, 1, *LATENT)
    x = noise
    with torch.no_grad():
        for i in range(NUM_STEPS):
            v = predict_velocity(tr, x, sched.timesteps[i].expand(2), embeds, 1.0)
            if i == 2:
                torch.testing.assert_close(traj.latents[:, 0], x, rtol=0, atol=1e-6)
                out = stochastic_step(sampler, v, x, float(sched.sigmas[2]), float(sched.sigmas[3]), NOISE_LEVEL,
                                      float(sched.sigmas[1]), prev_sample=traj.next_latents[:, 0])
                torch.testing.assert_close(traj.log_probs[:, 0], out.log_prob, rtol=0, atol=1e-5)
                # The recorded sample is a draw around this mean, not around the neighbouring steps' means.
                z = (traj.next_latents[:, 0] - out.mean) / out.std
                assert abs(z.std().item() - 1) < 0.1 and abs(z.mean().item()) < 0.1
                x = traj.next_latents[:, 0]
            else:
                x = ode_step(v, x, sched.sigmas[i], sched.sigmas[i + 1]).prev_sample
    torch.testing.assert_close(traj.final_latents, x, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ trajectory replay

class _HostToDeviceCopies(TorchDispatchMode):
    """Counts the copies of a CPU tensor onto another device (aten._to_copy / copy_ from the CPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            self.n += args[0].device.type == "cpu" and torch.device(kwargs["device"]).type != "cpu"
        elif func is torch.ops.aten.copy_.default:
            self.n += args[1].device.type == "cpu" and args[0].device.type != "cpu"
        return func(*args, **kwargs)


@pytest.mark.parametrize("sampler, guidance", [("sde", 1.0), ("cps", 4.5)])
def test_the_denoising_loop_copies_nothing_from_the_host_per_step(tiny_pipe, tiny_embedder, sampler, guidance):
    """On a GPU a copy from pageable host memory waits for the device's queue to drain: one per step keeps the host
    from queueing the next forward while the device runs this one. The loop runs here on the meta device (shapes
    only: no GPU needed), and its host-to-device copies are counted at 4 and at 8 steps: the schedule and the SDE
    noise go over once, whatever the number of steps (before: 3 more per step, σ, σ_next and t, and one per SDE
    step for its noise)."""
    tr = copy.deepcopy(tiny_pipe.transformer).to("meta")
    embeds = tiny_embedder(PROMPTS[:2])
    if guidance > 1:
        embeds = embeds.with_negative(tiny_embedder([""] * 2))
    embeds = embeds.to("meta")
    counts = {}
    for n in (4, 8):
        sched = make_schedule(tiny_pipe.scheduler.config, n)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        with _HostToDeviceCopies() as copies:
            traj = denoise(tr, embeds, torch.zeros(2, *LATENT, device="meta"), sched, [1, 2], sampler, NOISE_LEVEL,
                           guidance, gens)
        assert traj.final_latents.device.type == "meta" and traj.latents.shape == (2, 2, *LATENT)
        counts[n] = copies.n
    assert counts[4] == counts[8] <= 3, counts


def _replay_all(transformer, batch, cfg, split):
    """Replay every recorded transition in micro-batches of `split`, mixing steps within a micro-batch."""
    traj = batch.traj
    B, K = traj.log_probs.shape
    out = torch.full((B, K), float("nan"))
    with torch.no_grad():
        for j in range(K):
            for s in range(0, B, split):
                idx = torch.arange(s, min(s + split, B))
                k = (idx + j) % K  # sample i replays step (i + j) mod K: micro-batches hold different steps
                lp = replay_log_prob(transformer, traj.latents[idx, k], traj.next_latents[idx, k],
                                     traj.step_indices[k], batch.embeds.index(idx), batch.schedule, cfg.sampler,
                                     cfg.noise_level, cfg.guidance_scale).log_prob
                out[idx, k] = lp
    return out


@pytest.mark.parametrize("adapter", ["base", "lora"])
@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_replay_equals_rollout_and_generation_is_split_independent(make_rollout, lora_transformer, sampler, guidance,
                                                                   adapter):
    tr = lora_transformer(randomize=True) if adapter == "lora" else None
    cfg = sampling(sampler, guidance, micro_batch_size=4)
    batch = make_rollout(cfg, tr).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
    K = NUM_STEPS - 1
    assert batch.traj.log_probs.shape == (4, K) and batch.traj.step_indices.tolist() == list(range(K))
    assert torch.isfinite(batch.traj.log_probs).all()
    # Recorded transitions chain: each step starts where the previous one ended.
    torch.testing.assert_close(batch.traj.latents[:, 1:], batch.traj.next_latents[:, :-1], rtol=0, atol=0)

    # Generation does not depend on the rollout micro-batch size (per-sample seeds and generators).
    one_by_one = make_rollout(sampling(sampler, guidance, micro_batch_size=1), tr).generate(PROMPTS, [{}] * 4,
                                                                                           GROUPS, step=1)
    torch.testing.assert_close(one_by_one.traj.final_latents, batch.traj.final_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(one_by_one.traj.next_latents, batch.traj.next_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(one_by_one.traj.log_probs, batch.traj.log_probs, rtol=0, atol=1e-5)
    for a, b in zip(one_by_one.images, batch.images):
        assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 1
    # ... while samples, and steps, do differ (the SDE noise is not shared).
    assert not torch.allclose(batch.traj.next_latents[0], batch.traj.next_latents[1])

    # Replay at the rollout weights reproduces the rollout log-probs for any split, with steps mixed.
    model = tr if tr is not None else make_rollout(cfg).pipe.transformer
    for split in (1, 2, 3, 4):
        replayed = _replay_all(model, batch, cfg, split)
        torch.testing.assert_close(replayed, batch.traj.log_probs, rtol=0, atol=1e-5,
                                   msg=lambda m: f"split={split}: {m}")


def test_lora_adapter_changes_the_rollout(make_rollout, lora_transformer):
    # Guards the LoRA cases above: a randomised adapter must actually change the model.
    cfg = sampling("cps")
    base = make_rollout(cfg).generate(PROMPTS[:2], [{}] * 2, GROUPS[:2], step=1)
    lora = make_rollout(cfg, lora_transformer(randomize=True)).generate(PROMPTS[:2], [{}] * 2, GROUPS[:2], step=1)
    assert (base.traj.final_latents - lora.traj.final_latents).abs().max() > 1e-3
    fresh = make_rollout(cfg, lora_transformer()).generate(PROMPTS[:2], [{}] * 2, GROUPS[:2], step=1)
    torch.testing.assert_close(fresh.traj.final_latents, base.traj.final_latents, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampler,guidance,fraction", [("sde", 1.0, 1.0), ("cps", 3.0, 0.5)])
def test_actor_first_update_sees_ratio_one(make_rollout, lora_transformer, sampler, guidance, fraction):
    tr = lora_transformer(randomize=True)
    cfg = sampling(sampler, guidance, micro_batch_size=4, timestep_fraction=fraction)
    batch = make_rollout(cfg, tr).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    train = TrainConfig(micro_batch_size=2, learning_rate=1e-3, recompute_old_log_probs=True, inner_epochs=2)
    actor = ActorWorker(tr, train, ModelConfig(lora=True), cfg, max_steps=1, images_per_step=4, seed=0)
    metrics = actor.update(batch, adv, step=1)
    assert metrics["old_log_prob_recompute_max_dev"] <= 1e-5
    assert metrics["ratio_max_dev_before_update"] <= 1e-5
    assert metrics["nonfinite_updates_skipped"] == 0
    assert int(actor.optimizer.state[actor.params[0]]["step"]) == 2, "one optimizer step per inner epoch"
    assert actor.version == 1, "the policy version counts update calls"
    assert metrics["trained_steps_per_sample"] == (NUM_STEPS - 1 if fraction == 1 else 2)


def test_groups_with_different_windows_train_together(make_rollout, lora_transformer):
    # Streaming merges groups from different draws, whose Flow-GRPO-Fast windows differ: step_indices become
    # per-sample (B, K) and the actor must still replay every sample at its own steps (ratio one at first).
    from gerl.workers.batch import merge, subset

    tr = lora_transformer(randomize=True)
    cfg = SamplingConfig(sampler="cps", num_steps=8, noise_level=NOISE_LEVEL, sde_window_size=2,
                         sde_window_range=[0, 7], micro_batch_size=2)
    rollout = make_rollout(cfg, tr)
    calls = []
    parts = [rollout.generate(PROMPTS[:2], [{}] * 2, GROUPS[:2], step=s, between=lambda: calls.append(1))
             for s in range(1, 6)]
    assert len(calls) == 5, "the between-micro-batch hook runs before every micro-batch"
    a, b = next((p, q) for p in parts for q in parts if not torch.equal(p.traj.step_indices, q.traj.step_indices))
    batch = merge([a, b])
    assert batch.traj.step_indices.shape == (4, 2)
    assert torch.equal(subset(batch, torch.tensor([False, False, True, True])).traj.step_indices[0], b.traj.step_indices)
    batch.group_ids = torch.tensor([0, 0, 1, 1])
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    train = TrainConfig(micro_batch_size=2, learning_rate=1e-3, recompute_old_log_probs=True)
    actor = ActorWorker(tr, train, ModelConfig(lora=True), cfg, max_steps=1, images_per_step=4, seed=0)
    metrics = actor.update(batch, torch.tensor([1.0, -1.0, -1.0, 1.0]), step=1)
    assert metrics["old_log_prob_recompute_max_dev"] <= 1e-5
    assert metrics["ratio_max_dev_before_update"] <= 1e-5


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_init_same_noise_shares_the_start_within_a_group_only(make_rollout, sampler):
    # DanceGRPO's init_same_noise: a group's images start from one noise, so they differ only by the SDE window's
    # noise; different groups start apart. Window 2 of 5 steps placed at [1, 3): step 0 is ODE and identical.
    cfg = sampling(sampler, init_same_noise=True, sde_window_size=2, sde_window_range=[1, 3], micro_batch_size=4)
    batch = make_rollout(cfg).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
    start = batch.traj.latents[:, 0]  # the window's first state: after step 0's ODE step from the initial noise
    torch.testing.assert_close(start[0], start[1], rtol=0, atol=0)
    torch.testing.assert_close(start[2], start[3], rtol=0, atol=0)
    assert not torch.allclose(start[0], start[2], atol=1e-2)
    # The window's noise is per sample: the group's images still differ ...
    assert (batch.traj.final_latents[0] - batch.traj.final_latents[1]).abs().max() > 1e-2
    assert (batch.traj.final_latents[2] - batch.traj.final_latents[3]).abs().max() > 1e-2
    # ... and the batch does not depend on the micro-batch split, nor on where a shard starts.
    one = make_rollout(sampling(sampler, init_same_noise=True, sde_window_size=2, sde_window_range=[1, 3],
                                micro_batch_size=1)).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
    torch.testing.assert_close(one.traj.final_latents, batch.traj.final_latents, rtol=0, atol=1e-5)
    shard = make_rollout(cfg).generate(PROMPTS[2:], [{}] * 2, GROUPS[2:], step=1, index_offset=2)
    torch.testing.assert_close(shard.traj.final_latents, batch.traj.final_latents[2:], rtol=0, atol=1e-5)
    # Off (the default), the start differs within a group too.
    indep = make_rollout(sampling(sampler, sde_window_size=2, sde_window_range=[1, 3])).generate(
        PROMPTS, [{}] * 4, GROUPS, step=1)
    assert not torch.allclose(indep.traj.latents[0, 0], indep.traj.latents[1, 0], atol=1e-2)


def test_reused_velocity_steps_skip_the_transformer_and_reuse_the_previous_velocity(tiny_pipe, tiny_embedder):
    """sampling.reuse_velocity_steps (nft/awm/dgpo rollouts only): at a listed step the ODE step moves x along the
    previous step's velocity, with no transformer call — checked against a hand-rolled loop."""
    sched = make_schedule(tiny_pipe.scheduler.config, 6)
    emb = tiny_embedder(["a cat", "a dog"])
    noise = torch.randn(2, 16, RESOLUTION // 8, RESOLUTION // 8, generator=torch.Generator().manual_seed(0))
    calls = []
    tr = tiny_pipe.transformer
    handle = tr.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    try:
        got = denoise(tr, emb, noise, sched, [], "cps", 0.8, 1.0, None, frozenset({2, 3}))
    finally:
        handle.remove()
    assert len(calls) == 4  # 6 steps, 2 of them reusing
    x, v = noise.float(), None
    for i in range(6):
        if i not in (2, 3):
            v = predict_velocity(tr, x, sched.timesteps[i].expand(2), emb, 1.0)
        x = ode_step(v, x, sched.sigmas[i], sched.sigmas[i + 1]).prev_sample
    torch.testing.assert_close(got.final_latents, x, rtol=0, atol=0)
    plain = denoise(tr, emb, noise, sched, [], "cps", 0.8, 1.0, None)
    assert not torch.equal(plain.final_latents, got.final_latents)  # lossy: a different image
    with pytest.raises(ValueError, match="must avoid step 0 and the stochastic steps"):
        denoise(tr, emb, noise, sched, [1], "cps", 0.8, 1.0, [torch.Generator()] * 2, frozenset({1}))


def test_reused_velocity_steps_are_for_the_decoupled_algorithms_only():
    from gerl.config import load_config
    from gerl.errors import UserError

    assert load_config(None, ["algo.name=nft", "sampling.reuse_velocity_steps=[3,5]"]).sampling.reuse_velocity_steps
    with pytest.raises(UserError, match="flow_grpo compares the rollout's log-probs"):
        load_config(None, ["sampling.reuse_velocity_steps=[3]"])
    with pytest.raises(UserError, match=r"reuse_velocity_steps \[10\] out of range"):
        load_config(None, ["algo.name=awm", "sampling.reuse_velocity_steps=[10]"])
