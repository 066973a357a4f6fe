"""The actor's update for the clean-sample objectives (algo.name = nft | awm | dgpo; gerl/algo/matching.py,
gerl/algo/dgpo.py).

Each sample's clean final latent x0 is noised again at `train_timesteps` noise levels σ of the sampling schedule,
with fresh noise ε: x_σ = (1 − σ)·x0 + σ·ε. As in the references, every data-parallel rank and every inner epoch
draws its own points (`training_points`, seeded by seed, step, rank, epoch and sample or micro-batch, so a run and
its resume draw the same ones); DGPO's are shared: its noise levels by every sample and rank, its ε by a group's
samples. The transformer's velocity there enters the algorithm's loss:
- nft: with the anchor's velocity v_old at the same point (the anchor is the "old" policy that sampled x0); always
  without classifier-free guidance, as DiffusionNFT trains (config validation refuses nft with guidance > 1);
- awm: as a flow-matching likelihood surrogate whose ratio to the same quantity at the weights this update started
  from is PPO-clipped (classifier-free guided when sampling.guidance_scale > 1, AWM's train.cfg). Until the first
  optimizer step of the update the weights have not moved, so that old value is the training forward's own,
  detached; only points trained after it take theirs from a no-grad pass over the starting weights, as the AWM
  reference computes "old log-probs only for the off-policy samples" (with one optimizer step per epoch, none);
- dgpo: its flow-matching error against a reference's, summed per group into the margin of a log-sigmoid group
  preference, clipped against the anchor (gerl/workers/dgpo.py); mini-batches hold whole groups.
Optional velocity penalties: train.beta × ‖v − v_ref‖² (the adapter off, or the frozen copy) and, for nft/awm,
algo.anchor_beta × ‖v − v_anchor‖². A stale group's samples (engine.stale=downweight) weigh less in the policy loss.
The optimizer step itself (fp16 unscaling, data-parallel all-reduce, clip) is ActorWorker.optimizer_step, shared
with Flow-GRPO.
"""

from __future__ import annotations

import math

import torch

from gerl.algo.matching import awm_log_prob, awm_loss, noised, nft_loss, timestep_indices, velocity_penalty
from gerl.determinism import point_seed
from gerl.sampling.loop import predict_velocity
from gerl.workers.dgpo import group_mini_batches, margins_pass, point_loss, whole_groups


def mini_batches(actor, batch, step: int, epoch: int) -> list[torch.Tensor]:
    """The sample indices of each optimizer step of inner epoch `epoch`: whole groups for dgpo (its margin sums over
    a group), the actor's sample mini-batches otherwise."""
    if actor.algo.name == "dgpo":
        return group_mini_batches(actor, batch, step, epoch)
    return actor.mini_batches(len(batch), step, epoch)


def training_points(actor, batch, step: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (B, K) into the sampling schedule, noise (B, K, C, h, w)) that this rank trains in inner epoch
    `epoch` of `step`.

    Each sample's noise (and, for timesteps=random, its K distinct indices: NFT's per-sample permutation) comes
    from a generator seeded by (seed, step, rank, epoch, sample); timesteps=stratified draws one set of strata per
    training micro-batch (AWM redraws them for every micro-batch), seeded by (seed, step, rank, epoch, mini-batch,
    micro-batch); timesteps=shared one set for all samples, seeded by (seed, step, epoch) — the same on every rank,
    as DGPO broadcasts its draw. dgpo with dgpo_shared_noise: each group's ε at point j is one draw seeded by (seed,
    step, epoch, group), so a group split over ranks or micro-batches shares it too. Nothing depends on the order
    of calls, so a no-grad pass and the training loop see the same points, and a resumed run the same as an
    uninterrupted one."""
    s, a = actor.sampling, actor.algo
    B, K = len(batch), actor.train_timesteps
    n, key = batch.schedule.num_steps, (actor.seed, step, actor.rank, epoch)
    gens = [torch.Generator().manual_seed(point_seed(*key, "sample", i)) for i in range(B)]
    if a.timesteps == "random":
        idx = torch.cat([timestep_indices(n, s.timestep_fraction, K, 1, "random", g) for g in gens])
    elif a.timesteps == "shared":
        g = torch.Generator().manual_seed(point_seed(actor.seed, step, epoch, "shared"))
        idx = timestep_indices(n, s.timestep_fraction, K, B, "shared", g)
    else:
        idx = torch.empty(B, K, dtype=torch.long)
        mb = actor.cfg.micro_batch_size
        for m, mini in enumerate(mini_batches(actor, batch, step, epoch)):
            for u, u0 in enumerate(range(0, len(mini), mb)):
                micro = mini[u0:u0 + mb]
                g = torch.Generator().manual_seed(point_seed(*key, "micro", m, u))
                idx[micro] = timestep_indices(n, s.timestep_fraction, K, len(micro), a.timesteps, g)
    shape = batch.traj.final_latents.shape[1:]
    if a.name == "dgpo" and a.dgpo_shared_noise:
        ids = batch.group_ids
        drawn = {int(gid): torch.randn((K, *shape), dtype=torch.float32, generator=torch.Generator().manual_seed(
            point_seed(actor.seed, step, epoch, "group", int(gid)))) for gid in ids.unique()}
        return idx, torch.stack([drawn[int(gid)] for gid in ids])
    noise = torch.stack([torch.randn((K, *shape), generator=g, dtype=torch.float32) for g in gens])
    return idx, noise


def _point(batch, idx, k_idx, noise_k, device):
    """(x0, ε, σ, x_σ, transformer timestep, embeddings) of micro-batch `idx` at its schedule indices `k_idx` (B,)."""
    x0 = batch.traj.final_latents[idx].to(device)
    eps = noise_k.to(device)
    sigma = batch.schedule.sigmas[k_idx].to(device)
    return (x0, eps, sigma, noised(x0, eps, sigma), batch.schedule.timesteps[k_idx].to(device),
            batch.embeds.index(idx).to(device))


def matching_update(actor, batch, advantages: torch.Tensor, step: int, reuse_training_forward: bool = True) -> dict:
    """Inner epochs of optimizer steps on `batch` with nft_loss, awm_loss or DGPO's. `reuse_training_forward=False`
    takes every AWM old log-prob from the no-grad pass, and every DGPO margin from its no-grad pass (the controls
    that tests and benchmarks/bench_awm_old_pass.py compare with); the result is the same."""
    cfg, a = actor.cfg, actor.algo
    K = actor.train_timesteps
    device = next(actor.transformer.parameters()).device
    old_lp = _awm_old_log_probs(actor, batch, step, reuse_training_forward) if a.name == "awm" else None
    weight = batch.stale_weight  # (B,) or None: a stale group's samples count less in the policy loss
    g = actor.sampling.guidance_scale
    sums: dict[str, float] = {}
    count, stepped = 0, False  # stepped: has an optimizer step moved the weights in this update?
    skipped: dict[str, int] = {}
    grad_norms: list[float] = []
    actor.transformer.train()
    for epoch in range(cfg.inner_epochs):
        idx_plan, noise = training_points(actor, batch, step, epoch)
        point = lambda idx, j: _point(batch, idx, idx_plan[idx, j], noise[idx, j], device)  # noqa: E731
        for mini in mini_batches(actor, batch, step, epoch):
            actor.optimizer.zero_grad(set_to_none=True)
            micros = [mini[u0:u0 + cfg.micro_batch_size] for u0 in range(0, len(mini), cfg.micro_batch_size)]
            margins = None  # dgpo: (B, K) group margins from a no-grad pass when a micro-batch splits a group
            if a.name == "dgpo" and not (reuse_training_forward and whole_groups(micros, batch.group_ids)):
                margins = margins_pass(actor, batch, micros, idx_plan, noise, advantages, point)
            finite = True
            for j in range(K):
                for idx in micros:
                    x0, eps, sigma, x_t, t, embeds = point(idx, j)
                    w = None if weight is None else weight[idx].to(device)
                    adv = advantages[idx].to(device)
                    if a.name == "dgpo":
                        m = None if margins is None else margins[idx, j].to(device)
                        loss, stats = point_loss(actor, x0, eps, x_t, t, embeds, adv, batch.group_ids[idx].to(device),
                                                 m, w)
                    else:
                        loss, stats = _nft_awm_loss(actor, batch, idx, j, epoch, (x0, eps, sigma, x_t, t, embeds), adv,
                                                    w, old_lp, reuse_training_forward and not stepped, g)
                    if not actor.backward(loss / (len(micros) * K), last=j == K - 1 and idx is micros[-1]):
                        finite = False
                        continue
                    for key, val in stats.items():
                        sums[key] = sums.get(key, 0.0) + float(val)
                    count += 1
            gn, why = actor.optimizer_step(finite)
            if gn is None:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            grad_norms.append(gn)
            stepped = True
    return actor.step_metrics(actor.mean_stats(sums, count), grad_norms, skipped, K)


def _nft_awm_loss(actor, batch, idx, j, epoch, pt, adv, w, old_lp, reuse: bool, g: float):
    """nft_loss or awm_loss (+ penalties) on micro-batch `idx` at point j; `reuse`: the weights have not moved yet,
    so the training forward is AWM's own old value."""
    a, cfg = actor.algo, actor.cfg
    x0, eps, sigma, x_t, t, embeds = pt
    # The anchor's velocity first: swapping its tensors in and out writes the parameters in place, which must happen
    # before the policy's forward records them for backward.
    v_anchor = None
    if a.name == "nft" or a.anchor_beta > 0:
        with torch.no_grad(), actor.anchor_swapped():
            v_anchor = predict_velocity(actor.transformer, x_t, t, embeds, g).float()
    v = predict_velocity(actor.transformer, x_t, t, embeds, g)
    if a.name == "nft":
        loss, stats = nft_loss(v.float(), v_anchor, x0, x_t, sigma, adv, a.nft_beta, cfg.adv_clip_max, w)
    else:
        lp = awm_log_prob(v, x0, eps, sigma, a.awm_weighting, a.awm_ghuber_power)
        # weights not yet moved: this forward is the starting weights' own (the reference's on-policy micro-batches);
        # later, the no-grad pass's value at the same point
        old = lp.detach() if reuse else old_lp[epoch, idx, j].to(lp.device)
        loss, stats = awm_loss(lp, old, adv, cfg.clip_range, cfg.adv_clip_max, a.awm_advantage_max, w)
    return loss + _penalties(actor, x_t, t, embeds, v, v_anchor, stats), stats


def _penalties(actor, x_t, t, embeds, v, v_anchor, stats: dict) -> torch.Tensor:
    """train.beta × ‖v − v_ref‖² and algo.anchor_beta × ‖v − v_anchor‖² (each only when its weight is > 0)."""
    total = torch.zeros((), device=v.device)
    if actor.cfg.beta > 0:
        with torch.no_grad(), actor._reference() as ref:
            v_ref = predict_velocity(ref, x_t, t, embeds, actor.sampling.guidance_scale)
        kl = velocity_penalty(v.float(), v_ref.float())
        stats["kl"] = kl.detach()
        total = total + actor.cfg.beta * kl
    if actor.algo.anchor_beta > 0:
        pen = velocity_penalty(v.float(), v_anchor)
        stats["anchor_penalty"] = pen.detach()
        total = total + actor.algo.anchor_beta * pen
    return total


@torch.no_grad()
def _awm_old_log_probs(actor, batch, step: int, reuse_training_forward: bool) -> torch.Tensor:
    """(inner_epochs, B, K) AWM log-probs at the weights this update starts from (the ratio's denominator), fp64 on
    the CPU, for every point that may be trained after the first optimizer step: all of them but the first
    mini-batch of epoch 0 (whose training forward runs before any step), or all with reuse_training_forward=False.
    Entries left out are NaN."""
    a, mb = actor.algo, actor.cfg.micro_batch_size
    B, K, E = len(batch), actor.train_timesteps, actor.cfg.inner_epochs
    device = next(actor.transformer.parameters()).device
    out = torch.full((E, B, K), math.nan, dtype=torch.float64)
    actor.transformer.eval()
    for epoch in range(E):
        need = torch.ones(B, dtype=torch.bool)
        if reuse_training_forward and epoch == 0:
            need[actor.mini_batches(B, step, 0)[0]] = False
        todo = need.nonzero().flatten()
        if not len(todo):
            continue
        idx_plan, noise = training_points(actor, batch, step, epoch)
        for j in range(K):
            for s0 in range(0, len(todo), mb):
                idx = todo[s0:s0 + mb]
                x0, eps, sigma, x_t, t, embeds = _point(batch, idx, idx_plan[idx, j], noise[idx, j], device)
                v = predict_velocity(actor.transformer, x_t, t, embeds, actor.sampling.guidance_scale)
                out[epoch, idx, j] = awm_log_prob(v, x0, eps, sigma, a.awm_weighting, a.awm_ghuber_power).cpu()
    return out
