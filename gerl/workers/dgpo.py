"""DGPO's parts of the clean-sample update (algo.name = dgpo; gerl/algo/dgpo.py has the loss, the loop is
gerl/workers/matching.py's `matching_update`).

What DGPO needs beyond NFT/AWM, as its reference (scripts/train_sd3_dgpo.py) trains:
- groups kept whole inside an optimizer step (`group_mini_batches`): a group's margin S_g sums over all its samples;
- the training velocity without classifier-free guidance (its predict_v with cfg=False), whatever the rollout used;
- per point, the anchor's velocity (the "old" policy of the clip; the reference when dgpo_reference=anchor) and the
  frozen base's at algo.dgpo_reference_guidance (the reference when dgpo_reference=base; the KL's target);
- the margins: from the training forwards themselves when each training micro-batch holds whole groups (the
  reference's layout: one group per GPU micro-batch), else from a no-grad pass over the mini-batch before training
  it (`margins_pass`: the weights do not move inside a mini-batch, so both give the same S_g; tests check it).
"""

from __future__ import annotations

import torch

from gerl.algo.dgpo import dgpo_clip, dgpo_loss, flow_matching_error, group_margins
from gerl.algo.matching import velocity_penalty
from gerl.models.family import family_of
from gerl.sampling.loop import predict_velocity


def train_guidance(actor) -> float:
    """The guidance of the policy's training velocity: none where the family's guidance at sampling.guidance_scale
    is a classifier-free pass (SD3 > 1: DGPO trains the conditional velocity alone), else that guidance (FLUX.1-dev's
    distilled embedding, which has no unconditional pass to leave out)."""
    g = actor.sampling.guidance_scale
    return 1.0 if family_of(actor.transformer).uses_negative(g) else g


def base_guidance(actor) -> float:
    """The frozen base's guidance (DGPO's kl_cfg): algo.dgpo_reference_guidance when > 1, else the policy's own."""
    g = actor.algo.dgpo_reference_guidance
    return g if g > 1 else train_guidance(actor)


def group_mini_batches(actor, batch, step: int, epoch: int) -> list[torch.Tensor]:
    """The sample indices of each optimizer step of this inner epoch, whole groups each: the groups in a seeded
    permutation (the seed `actor.mini_batches` uses; in rollout order with train.shuffle_mini_batches=false), cut
    into as many mini-batches as the samples make, each group's samples together in rollout order."""
    ids = batch.group_ids
    groups = ids.unique()
    gen = torch.Generator().manual_seed(actor.seed * 104_729 + step * 31 + epoch)
    perm = torch.randperm(len(groups), generator=gen) if actor.cfg.shuffle_mini_batches else torch.arange(len(groups))
    n_mini = len(actor.mini_batches(len(batch), step, epoch))
    return [torch.cat([(ids == groups[k]).nonzero().flatten() for k in part.tolist()])
            for part in torch.tensor_split(perm, n_mini) if len(part)]


def whole_groups(micros: list[torch.Tensor], groups: torch.Tensor) -> bool:
    """Whether every micro-batch holds all of the mini-batch's samples of each group it touches."""
    for i, idx in enumerate(micros):
        rest = torch.cat([m for k, m in enumerate(micros) if k != i]) if len(micros) > 1 else idx[:0]
        if torch.isin(groups[idx], groups[rest]).any():
            return False
    return True


def _anchor_velocity(actor, x_t, t, embeds) -> torch.Tensor:
    # swapping the anchor's tensors in and out writes the parameters in place: call before the policy's forward
    with torch.no_grad(), actor.anchor_swapped():
        return predict_velocity(actor.transformer, x_t, t, embeds, train_guidance(actor)).float()


def _base_velocity(actor, x_t, t, embeds) -> torch.Tensor:
    with torch.no_grad(), actor._reference() as ref:
        return predict_velocity(ref, x_t, t, embeds, base_guidance(actor)).float()


@torch.no_grad()
def margins_pass(actor, batch, micros, idx_plan, noise, advantages, point) -> torch.Tensor:
    """(B, K) group margins S of the mini-batch `micros` at the weights the update is at (NaN elsewhere): the
    policy's and the reference's flow-matching errors at every point of the mini-batch, no gradient, summed per
    group. For micro-batches that split a group; `point(idx, j)` gives (x0, ε, σ, x_σ, t, embeds)."""
    a = actor.algo
    B, K = idx_plan.shape
    out = torch.full((B, K), float("nan"), dtype=torch.float64)
    mini = torch.cat(micros)
    actor.transformer.eval()
    for j in range(K):
        err, ref_err = [], []
        for idx in micros:
            x0, eps, _, x_t, t, embeds = point(idx, j)
            v_ref = (_anchor_velocity(actor, x_t, t, embeds) if a.dgpo_reference == "anchor"
                     else _base_velocity(actor, x_t, t, embeds))
            v = predict_velocity(actor.transformer, x_t, t, embeds, train_guidance(actor))
            err.append(flow_matching_error(v, x0, eps).cpu())
            ref_err.append(flow_matching_error(v_ref, x0, eps).cpu())
        out[mini, j] = group_margins(torch.cat(err), torch.cat(ref_err), advantages[mini].double(),
                                     batch.group_ids[mini], a.dgpo_beta)
    actor.transformer.train()
    return out


def point_loss(actor, x0, eps, x_t, t, embeds, adv, groups, margin, weight) -> tuple[torch.Tensor, dict]:
    """DGPO's loss on one training micro-batch at one point: the anchor's and the base's velocities (no grad), the
    policy's (with grad, no classifier-free pass), the clip against the anchor, the group margins (from this
    micro-batch when `margin` is None: it then holds whole groups), + train.beta × ‖v − v_base‖²."""
    a, cfg = actor.algo, actor.cfg
    v_anchor = _anchor_velocity(actor, x_t, t, embeds)
    v_base = _base_velocity(actor, x_t, t, embeds) if a.dgpo_reference == "base" or cfg.beta > 0 else None
    v = predict_velocity(actor.transformer, x_t, t, embeds, train_guidance(actor))
    err = flow_matching_error(v, x0, eps)
    old_err = flow_matching_error(v_anchor, x0, eps)
    ref_err = old_err if a.dgpo_reference == "anchor" else flow_matching_error(v_base, x0, eps)
    ratio, clipped = dgpo_clip(err, old_err, adv, cfg.clip_range)
    if margin is None:
        margin = group_margins(err, ref_err, adv, groups, a.dgpo_beta)
    loss, stats = dgpo_loss(err, margin, adv, clipped, weight)
    stats.update(ratio_mean=ratio.mean(), clipfrac=clipped.double().mean())
    if cfg.beta > 0:
        kl = velocity_penalty(v.float(), v_base)
        stats["kl"] = kl.detach()
        loss = loss + cfg.beta * kl
    return loss, stats
