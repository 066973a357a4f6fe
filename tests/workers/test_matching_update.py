"""The nft/awm update (gerl/workers/matching.py) on the tiny model: AWM's old log-probs come from the training forward
until the weights move (the same update as a separate no-grad pass, with fewer forwards); each data-parallel rank and
inner epoch trains its own noise, reproducibly; a stale sample's weight shrinks its share of the update."""

import copy
import dataclasses

import pytest
import torch

from gerl.config import AlgoConfig, ModelConfig, SamplingConfig, TrainConfig
from gerl.workers.actor import ActorWorker
from gerl.workers.matching import matching_update

PROMPTS = ["a red cat", "a red cat", "a red cat", "a red cat", "hello 42", "hello 42", "hello 42", "hello 42"]
ADV = torch.tensor([1.5, -0.5, 0.7, -1.7, 0.9, -1.1, 1.3, -0.3])
SAMPLING = SamplingConfig(sampler="cps", num_steps=10, micro_batch_size=8)
AWM = AlgoConfig(name="awm", train_timesteps=2, timesteps="stratified", awm_weighting="ghuber", anchor_beta=0.5,
                 anchor_decay_rate=0.1, anchor_decay_max=0.3)
NFT = AlgoConfig(name="nft", train_timesteps=2, timesteps="random", nft_beta=0.5, anchor_decay_rate=1.0,
                 anchor_decay_max=0.5)
DGPO = AlgoConfig(name="dgpo", train_timesteps=2, timesteps="shared", dgpo_beta=10.0, anchor_decay_rate=0.1,
                  anchor_decay_max=0.3)


def _actor(base, algo, rank=0, grads=None, **train):
    """An actor over a copy of `base`; `grads` collects each optimizer step's (pre-clip) gradient."""
    hook = None if grads is None else (lambda ps, a, b: (grads.append(torch.cat([p.grad.flatten() for p in ps])), (a, b))[1])
    cfg = TrainConfig(**{"learning_rate": 1e-2, "mini_batch_size": 4, "micro_batch_size": 2, "clip_range": 0.5, **train})
    return ActorWorker(copy.deepcopy(base), cfg, ModelConfig(lora=True), SAMPLING, max_steps=1, images_per_step=8,
                       seed=0, algo=algo, grad_sync=hook, rank=rank)


def _count_forwards(transformer) -> list[int]:
    """Samples per transformer forward, appended as they run."""
    sizes: list[int] = []
    transformer.register_forward_pre_hook(lambda m, args, kw: sizes.append(kw["hidden_states"].shape[0]),
                                          with_kwargs=True)
    return sizes


def test_awm_old_log_probs_from_the_training_forward_give_the_same_update_with_fewer_forwards(clean_batch):
    """Two inner epochs of two mini-batches: the control takes every old log-prob from a no-grad pass over the
    starting weights; the default reuses the training forward's detached value for the points trained before the
    first optimizer step (the first mini-batch of epoch 0). Same gradients at every optimizer step, same weights
    after, and exactly that mini-batch's K forwards fewer."""
    base, batch = clean_batch
    out = {}
    for reuse in (False, True):
        grads: list[torch.Tensor] = []
        actor = _actor(base, AWM, grads=grads, inner_epochs=2)
        sizes = _count_forwards(actor.transformer)
        m = matching_update(actor, batch, ADV, step=3, reuse_training_forward=reuse)
        out[reuse] = (grads, torch.cat([p.detach().flatten() for p in actor.params]), sum(sizes), m)
    (g0, w0, n0, m0), (g1, w1, n1, m1) = out[False], out[True]
    assert len(g0) == len(g1) == 4 and m0["optimizer_steps"] == 4
    # the later mini-batches' ratios have left 1: a broken reuse (the detached value after the weights moved) shows
    assert abs(m0["ratio_mean"] - 1) > 2e-5  # (1e-4 here) well above the 1e-5 tolerance below
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-8)
    assert m1["policy_loss"] == pytest.approx(m0["policy_loss"], rel=1e-5, abs=1e-9)
    assert n0 - n1 == 4 * AWM.train_timesteps  # the first mini-batch (4 samples) × K noise levels, no more


def _inputs(actor, batch, step=3):
    """(hidden_states, timestep) of every gradient-recording forward of one update, in call order."""
    seen = []
    actor.transformer.register_forward_pre_hook(
        lambda m, args, kw: seen.append((kw["hidden_states"].detach().clone(), kw["timestep"].clone()))
        if torch.is_grad_enabled() else None, with_kwargs=True)
    matching_update(actor, batch, ADV, step)
    return seen


@pytest.mark.parametrize("algo", [NFT, AWM], ids=["nft", "awm"])
def test_each_rank_and_inner_epoch_trains_its_own_noise(algo, clean_batch):
    """The same batch on ranks 0 and 1, two inner epochs, mini-batches in rollout order: every training forward's
    noised input differs between the ranks and between the epochs (the old (seed, step) draw gave all four the
    same), and a second run of rank 0 repeats its inputs exactly (what a resume relies on)."""
    base, batch = clean_batch
    kw = dict(inner_epochs=2, shuffle_mini_batches=False, learning_rate=1e-6)
    r0 = _inputs(_actor(base, algo, rank=0, **kw), batch)
    r1 = _inputs(_actor(base, algo, rank=1, **kw), batch)
    again = _inputs(_actor(base, algo, rank=0, **kw), batch)
    per_epoch = len(r0) // 2  # K points × 2 mini-batches × 2 micro-batches
    assert len(r0) == len(r1) == 2 * per_epoch == 2 * 2 * 2 * algo.train_timesteps
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(r0, again))
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(r0, r1)), "two ranks drew the same noise"
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(r0[:per_epoch], r0[per_epoch:])), "two epochs drew the same noise"


def test_awm_draws_its_strata_per_training_micro_batch(clean_batch):
    """AWM's reference draws one set of stratified noise levels per training micro-batch: equal within each of the
    step's 4 micro-batches (2 mini-batches × 2), not all equal across them."""
    base, batch = clean_batch
    seen = _inputs(_actor(base, AWM, learning_rate=1e-6), batch)
    assert len(seen) == 4 * AWM.train_timesteps and all((t == t[0]).all() for _, t in seen)
    for j in range(AWM.train_timesteps):  # calls go point j, micro-batches, point j + 1, … within a mini-batch
        levels = {float(t[0]) for i, (_, t) in enumerate(seen) if (i // 2) % AWM.train_timesteps == j}
        assert len(levels) > 1, f"point {j}: one draw for the whole step"


@pytest.mark.parametrize("algo", [NFT, AWM, DGPO], ids=["nft", "awm", "dgpo"])
def test_a_stale_sample_weight_scales_its_share_of_the_update(algo, clean_batch):
    """batch.stale_weight (engine.stale=downweight) is a per-sample loss weight: the first optimizer step's gradient
    with weights w is Σ_i w_i × (sample i's gradient). For nft, scaling the advantage instead (the old behaviour)
    moves r toward ½, a pull toward the anchor that this identity catches; for dgpo it would move the margins."""
    base, batch = clean_batch
    plain = dict(beta=0.0, max_grad_norm=0.0, mini_batch_size=8, micro_batch_size=4)
    algo = dataclasses.replace(algo, anchor_beta=0.0)  # penalties are not weighted: leave them out

    def first_grad(weight):
        grads: list[torch.Tensor] = []
        b = copy.copy(batch)
        b.stale_weight = None if weight is None else torch.tensor(weight)
        actor = _actor(base, algo, grads=grads, **plain)
        # an anchor apart from the weights, as after any update with a decay > 0: where v = v_old, NFT's gradient
        # is linear in the advantage and could not tell a loss weight from a scaled advantage
        g = torch.Generator().manual_seed(1)
        actor.anchor = [a + 0.05 * torch.randn(a.shape, generator=g) for a in actor.anchor]
        matching_update(actor, b, ADV, step=3)
        return grads[0]

    full = first_grad(None)
    assert full.abs().sum() > 0
    torch.testing.assert_close(first_grad([0.25] * 8), 0.25 * full, rtol=1e-4, atol=1e-10)
    fresh, stale = first_grad([1.0] * 4 + [0.0] * 4), first_grad([0.0] * 4 + [1.0] * 4)
    torch.testing.assert_close(first_grad([1.0] * 4 + [0.25] * 4), fresh + 0.25 * stale, rtol=1e-4, atol=1e-10)
