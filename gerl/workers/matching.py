"""The actor's update for the clean-sample objectives (algo.name = nft | awm, gerl/algo/matching.py).

Each sample's clean final latent x0 is noised again at `train_timesteps` noise levels σ of the sampling schedule,
with fresh noise ε seeded by (seed, step): x_σ = (1 − σ)·x0 + σ·ε. The transformer's velocity there (classifier-
free guided when sampling.guidance_scale > 1, as in the peers' training) enters the algorithm's loss:
- nft: with the anchor's velocity v_old at the same point (the anchor is the "old" policy that sampled x0);
- awm: as a flow-matching likelihood surrogate whose ratio to the same quantity at the weights this update started
  from is PPO-clipped (those old values come from a no-grad pass before the first optimizer step).
Optional velocity penalties: train.beta × ‖v − v_ref‖² (the adapter off, or the frozen copy) and
algo.anchor_beta × ‖v − v_anchor‖². The optimizer step itself (fp16 unscaling, data-parallel all-reduce, clip) is
ActorWorker.optimizer_step, shared with Flow-GRPO.
"""

from __future__ import annotations

import math

import torch

from gerl.algo.matching import awm_log_prob, awm_loss, noised, nft_loss, timestep_indices, velocity_penalty
from gerl.sampling.loop import predict_velocity


def training_points(actor, batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (B, K) into the sampling schedule, noise (B, K, C, h, w)) for this step's update, seeded by
    (seed, step): the same on every rank and after a resume."""
    s, a = actor.sampling, actor.algo
    B, K = len(batch), actor.train_timesteps
    g = torch.Generator().manual_seed(actor.seed * 7919 + step * 2 + 1)
    idx = timestep_indices(batch.schedule.num_steps, s.timestep_fraction, K, B, a.timesteps, g)
    x0 = batch.traj.final_latents
    noise = torch.randn((B, K, *x0.shape[1:]), generator=g, dtype=torch.float32)
    return idx, noise


def _point(batch, idx, k_idx, noise_k, device):
    """(x0, ε, σ, x_σ, transformer timestep, embeddings) of micro-batch `idx` at its schedule indices `k_idx` (B,)."""
    x0 = batch.traj.final_latents[idx].to(device)
    eps = noise_k.to(device)
    sigma = batch.schedule.sigmas[k_idx].to(device)
    return (x0, eps, sigma, noised(x0, eps, sigma), batch.schedule.timesteps[k_idx].to(device),
            batch.embeds.index(idx).to(device))


def matching_update(actor, batch, advantages: torch.Tensor, step: int) -> dict:
    cfg, a = actor.cfg, actor.algo
    idx_plan, noise = training_points(actor, batch, step)
    B, K = idx_plan.shape
    device = next(actor.transformer.parameters()).device
    old_lp = _awm_old_log_probs(actor, batch, idx_plan, noise, device) if a.name == "awm" else None
    sums: dict[str, float] = {}
    count, max_dev, stepped = 0, 0.0, False
    skipped: dict[str, int] = {}
    grad_norms: list[float] = []
    actor.transformer.train()
    for epoch in range(cfg.inner_epochs):
        for mini in actor.mini_batches(B, step, epoch):
            actor.optimizer.zero_grad(set_to_none=True)
            n_micro = math.ceil(len(mini) / cfg.micro_batch_size)
            finite = True
            for j in range(K):
                for u0 in range(0, len(mini), cfg.micro_batch_size):
                    idx = mini[u0:u0 + cfg.micro_batch_size]
                    k_idx = idx_plan[idx, j]
                    x0, eps, sigma, x_t, t, embeds = _point(batch, idx, k_idx, noise[idx, j], device)
                    g = actor.sampling.guidance_scale
                    # The anchor's velocity first: swapping its tensors in and out writes the parameters in place,
                    # which must happen before the policy's forward records them for backward.
                    v_anchor = None
                    if a.name == "nft" or a.anchor_beta > 0:
                        with torch.no_grad(), actor.anchor_swapped():
                            v_anchor = predict_velocity(actor.transformer, x_t, t, embeds, g).float()
                    v = predict_velocity(actor.transformer, x_t, t, embeds, g)
                    adv = advantages[idx].to(device)
                    if a.name == "nft":
                        loss, stats = nft_loss(v.float(), v_anchor, x0, x_t, sigma, adv, a.nft_beta, cfg.adv_clip_max)
                    else:
                        lp = awm_log_prob(v, x0, eps, sigma, a.awm_weighting, a.awm_ghuber_power)
                        old = old_lp[idx, j].to(device)
                        loss, stats = awm_loss(lp, old, adv, cfg.clip_range, cfg.adv_clip_max, a.awm_advantage_max)
                        if not stepped:
                            max_dev = max(max_dev, float((torch.exp(lp.detach() - old) - 1).abs().max()))
                    loss = loss + _penalties(actor, x_t, t, embeds, v, v_anchor, stats)
                    if not torch.isfinite(loss):
                        finite = False
                        continue
                    actor.backward(loss / (n_micro * K))
                    for key, val in stats.items():
                        sums[key] = sums.get(key, 0.0) + float(val)
                    count += 1
            gn, why = actor.optimizer_step(finite)
            if gn is None:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            grad_norms.append(gn)
            stepped = True
    metrics = {k: v / max(count, 1) for k, v in sums.items()}
    if a.name == "awm":
        metrics["ratio_max_dev_before_update"] = max_dev
    return actor.step_metrics(metrics, grad_norms, skipped, K)


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
def _awm_old_log_probs(actor, batch, idx_plan: torch.Tensor, noise: torch.Tensor, device) -> torch.Tensor:
    """(B, K) AWM log-probs at the weights this update starts from (the ratio's denominator), fp64 on the CPU."""
    a, mb = actor.algo, actor.cfg.micro_batch_size
    B, K = idx_plan.shape
    out = torch.zeros(B, K, dtype=torch.float64)
    actor.transformer.eval()
    for j in range(K):
        for s0 in range(0, B, mb):
            idx = torch.arange(s0, min(s0 + mb, B))
            x0, eps, sigma, x_t, t, embeds = _point(batch, idx, idx_plan[idx, j], noise[idx, j], device)
            v = predict_velocity(actor.transformer, x_t, t, embeds, actor.sampling.guidance_scale)
            out[idx, j] = awm_log_prob(v, x0, eps, sigma, a.awm_weighting, a.awm_ghuber_power).cpu()
    return out
