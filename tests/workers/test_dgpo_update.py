"""DGPO's update (gerl/workers/dgpo.py inside gerl/workers/matching.py's loop) on the tiny model: whole groups per
optimizer step; noise levels shared by every sample and rank, ε by a group's samples; the group margins from the
training forwards equal those of the no-grad pass (the same update, fewer forwards); a fresh adapter starts at
margin 0; the policy trains without classifier-free guidance while a guided base reference gets its negatives."""

import copy

import pytest
import torch

from gerl.config import AlgoConfig, ModelConfig, SamplingConfig, TrainConfig
from gerl.workers.actor import ActorWorker
from gerl.workers.dgpo import group_mini_batches, whole_groups
from gerl.workers.matching import matching_update, training_points

PROMPTS = ["a red cat"] * 4 + ["hello 42"] * 4
ADV = torch.tensor([1.5, -0.5, 0.7, -1.7, 0.9, -1.1, 1.3, -0.3])
SAMPLING = SamplingConfig(sampler="cps", num_steps=10, micro_batch_size=8)
DGPO = AlgoConfig(name="dgpo", train_timesteps=2, timesteps="shared", dgpo_beta=10.0, anchor_decay_rate=0.1,
                  anchor_decay_max=0.3)


def _actor(base, algo=DGPO, rank=0, grads=None, sampling=SAMPLING, **train):
    hook = None if grads is None else (
        lambda ps, a, b: (grads.append(torch.cat([p.grad.flatten() for p in ps])), (a, b))[1])
    cfg = TrainConfig(**{"learning_rate": 1e-2, "mini_batch_size": 4, "micro_batch_size": 4, "clip_range": 1e-3,
                         **train})
    return ActorWorker(copy.deepcopy(base), cfg, ModelConfig(lora=True), sampling, max_steps=1, images_per_step=8,
                       seed=0, algo=algo, grad_sync=hook, rank=rank)


def _sizes(transformer) -> list[int]:
    sizes: list[int] = []
    transformer.register_forward_pre_hook(lambda m, args, kw: sizes.append(kw["hidden_states"].shape[0]),
                                          with_kwargs=True)
    return sizes


class _Groups:
    """A batch as group_mini_batches sees it: its length and group ids."""

    def __init__(self, ids):
        self.group_ids = torch.tensor(ids)

    def __len__(self):
        return len(self.group_ids)


def test_mini_batches_hold_whole_groups_in_a_seeded_order(clean_batch):
    base, _ = clean_batch
    actor = _actor(base, mini_batch_size=8)  # 24 samples, 6 groups of 4 → 3 optimizer steps of 2 groups each
    batch = _Groups([g for g in range(6) for _ in range(4)])
    per_epoch = [group_mini_batches(actor, batch, step=3, epoch=e) for e in (0, 1)]
    for minis in per_epoch:
        assert len(minis) == 3 and sorted(torch.cat(minis).tolist()) == list(range(24))
        for m in minis:
            groups = batch.group_ids[m].unique()
            assert len(groups) == 2 and len(m) == 8 and all(int((batch.group_ids[m] == g).sum()) == 4 for g in groups)
    assert [m.tolist() for m in per_epoch[0]] != [m.tolist() for m in per_epoch[1]], "each epoch its own order"
    ordered = group_mini_batches(_actor(base, mini_batch_size=8, shuffle_mini_batches=False), batch, 3, 0)
    assert [m.tolist() for m in ordered] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    assert whole_groups([torch.arange(0, 4), torch.arange(4, 8)], batch.group_ids)
    assert not whole_groups([torch.arange(0, 2), torch.arange(2, 8)], batch.group_ids)


def test_points_are_shared_as_dgpo_draws_them(clean_batch):
    """One set of noise levels for every sample and both ranks, redrawn per inner epoch; one ε per group and point,
    the same on both ranks; another group, point or epoch draws another ε."""
    base, batch = clean_batch
    (i0, n0), (i1, n1) = training_points(_actor(base), batch, 3, 0), training_points(_actor(base, rank=1), batch, 3, 0)
    i2, n2 = training_points(_actor(base), batch, 3, 1)
    assert torch.equal(i0, i1) and (i0 == i0[0]).all() and len(set(i0[0].tolist())) == 2
    assert torch.equal(n0, n1)
    assert all(torch.equal(n0[k], n0[0]) for k in range(4)) and all(torch.equal(n0[k], n0[4]) for k in range(4, 8))
    assert not torch.equal(n0[0], n0[4]) and not torch.equal(n0[0, 0], n0[0, 1]) and not torch.equal(n0, n2)
    own = AlgoConfig(**{**DGPO.__dict__, "dgpo_shared_noise": False})
    per_sample = training_points(_actor(base, own), batch, 3, 0)[1]
    assert not torch.equal(per_sample[0], per_sample[1])


def test_margins_from_the_training_forwards_are_the_no_grad_pass_with_fewer_forwards(clean_batch):
    """Two inner epochs of one group per optimizer step: micro-batches of whole groups take their margins from the
    training forwards; the control (reuse_training_forward=False) and micro-batches of 2, which split each group,
    take them from the no-grad pass. The same gradient at all 4 optimizer steps, with 2 forwards (policy and
    reference) per point fewer. The anchor sits apart from the weights and the clip acts, as after any update."""
    base, batch = clean_batch
    out = {}
    for name, micro, reuse in (("whole", 4, True), ("control", 4, False), ("split", 2, True)):
        grads: list[torch.Tensor] = []
        actor = _actor(base, grads=grads, micro_batch_size=micro, inner_epochs=2)
        g = torch.Generator().manual_seed(1)
        actor.anchor = [a + 0.05 * torch.randn(a.shape, generator=g) for a in actor.anchor]
        sizes = _sizes(actor.transformer)
        m = matching_update(actor, batch, ADV, step=3, reuse_training_forward=reuse)
        out[name] = grads, sum(sizes), m
    (g0, n0, m0), (g1, n1, _), (g2, _, _) = out["whole"], out["control"], out["split"]
    assert len(g0) == len(g1) == len(g2) == 4 and m0["optimizer_steps"] == 4
    assert abs(m0["dgpo_weight_mean"] - 0.5) > 1e-3 and 0 < m0["clipfrac"] < 1, m0
    for a, b, c in zip(g0, g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-9)
    assert n1 - n0 == 2 * len(batch) * DGPO.train_timesteps * 2  # 2 forwards × 8 samples × K points × 2 epochs


@pytest.mark.parametrize("reference", ["base", "anchor"])
def test_a_fresh_adapter_starts_at_margin_zero_and_ratio_one(reference, make_rollout, lora_transformer):
    """lora_B = 0: the policy is the base and the anchor, so every margin is 0 (each group's weight σ(0) = ½), the
    ratio 1 and nothing clipped — and the gradient is not zero."""
    base = lora_transformer()
    worker = make_rollout(SAMPLING, base)
    worker.record_sde = False
    batch = worker.generate(PROMPTS, [{}] * 8, torch.tensor([0] * 4 + [1] * 4), step=1)
    algo = AlgoConfig(**{**DGPO.__dict__, "dgpo_reference": reference})
    m = matching_update(_actor(base, algo, mini_batch_size=8), batch, ADV, step=1)
    assert m["margin_mean"] == 0 and m["dgpo_weight_mean"] == 0.5 and m["clipfrac"] == 0
    assert m["ratio_mean"] == 1 and m["grad_norm"] > 0


def test_the_policy_trains_unguided_and_a_guided_base_reference_gets_its_negatives(clean_batch, make_rollout):
    """Rollouts at guidance 3 (DGPO's default mode: sample with CFG, train without): every training forward is one
    pass over the micro-batch (4). A base reference at guidance 4.5 under unguided rollouts (its CFG-free config):
    the rollout records the negative embeddings, and the base's forward is the one doubled pass per point."""
    base, _ = clean_batch
    guided = SamplingConfig(sampler="cps", num_steps=10, micro_batch_size=8, guidance_scale=3.0)
    worker = make_rollout(guided, base)
    worker.record_sde = False
    batch = worker.generate(PROMPTS, [{}] * 8, torch.tensor([0] * 4 + [1] * 4), step=3)
    actor = _actor(base, sampling=guided, beta=0.01)
    sizes = _sizes(actor.transformer)
    matching_update(actor, batch, ADV, step=3)
    assert set(sizes) == {4}
    worker = make_rollout(SAMPLING, base)
    worker.record_sde, worker.reference_guidance = False, 4.5
    batch = worker.generate(PROMPTS, [{}] * 8, torch.tensor([0] * 4 + [1] * 4), step=3)
    assert batch.embeds.neg_prompt is not None
    actor = _actor(base, AlgoConfig(**{**DGPO.__dict__, "dgpo_reference_guidance": 4.5}))
    sizes = _sizes(actor.transformer)
    m = matching_update(actor, batch, ADV, step=3)
    points = len(batch) // 4 * DGPO.train_timesteps  # micro-batches × points
    assert sizes.count(8) == points and sizes.count(4) == 2 * points and m["grad_norm"] > 0
