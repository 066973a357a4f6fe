"""Flow-matching objectives on clean samples: DiffusionNFT and Advantage Weighted Matching (AWM).

Both take the rollout's clean final latents x0 and their advantages A, noise x0 again at a schedule noise level σ —
x_σ = (1 − σ)·x0 + σ·ε, whose flow-matching target velocity is ε − x0 — and compare the policy's velocity v with
that target. Neither needs log-probs of the sampling process, an SDE, or the sampler that made x0.

DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", NVlabs): an implicit
positive policy v+ = β·v + (1 − β)·v_old and negative policy v− = (1 + β)·v_old − β·v around the old (sampling)
policy's velocity; each is fitted to x0 through its x0-prediction x̂0 = x_σ − σ·v±, with an adaptive per-sample
weight 1 / mean|x̂0 − x0| (not differentiated), and the two are mixed by the advantage mapped to r ∈ [0, 1]:

    r = clip(A / A_max / 2 + 1/2, 0, 1),   L = A_max · mean_B[ r·‖x̂0+ − x0‖²/w+ + (1 − r)·‖x̂0− − x0‖²/w− ] / β

where ‖·‖² is a mean over the latent's elements. Good samples (r > ½) pull v+ to x0; bad ones pull v− there, which
pushes v away from it.

AWM (Xue et al., "Advantage Weighted Matching"): the flow-matching error is a likelihood surrogate,
log p ≈ −w(σ, err), err = mean(‖v − (ε − x0)‖²), with the weighting w of `awm_log_prob`, and the policy takes a
PPO-clipped ratio step on it exactly as Flow-GRPO does on SDE log-probs:

    ratio = exp(log p − log p_old),   L = mean_B[ max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε)) ]

log p_old is the same quantity (same σ, same ε) under the weights the update started from.
"""

from __future__ import annotations

import torch

AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


def _mean_per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigma.reshape(-1, *([1] * (like.ndim - 1)))


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x0 + σ·ε: the flow-matching forward process (SD3's). x0, noise (B, C, h, w); sigma (B,)."""
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor,
             advantages: torch.Tensor, beta: float, adv_clip_max: float,
             weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """DiffusionNFT's policy loss for one micro-batch (see the module docstring).

    Args:
        v: (B, C, h, w) the policy's velocity at x_t (with grad); v_old: the old policy's (no grad).
        x0: (B, C, h, w) the clean sample; x_t: its noised version at sigma (B,).
        advantages: (B,) unclipped; beta: NFT's β > 0; adv_clip_max: A_max.
        weight: (B,) each sample's weight in the mean (a stale group's < 1), or None for 1. Scaling the advantage
            instead would move r toward ½, which pulls v toward v_old rather than making the update smaller.
    Returns:
        (scalar loss, detached stats: policy_loss, r_mean, old_deviation)
    """
    s = _per_sample(sigma, x0)
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    r = (a / adv_clip_max / 2 + 0.5).clamp(0, 1)
    v_old = v_old.detach()
    x0_pos = x_t - s * (beta * v + (1 - beta) * v_old)
    x0_neg = x_t - s * ((1 + beta) * v_old - beta * v)
    with torch.no_grad():  # the adaptive weights are constants of the loss
        w_pos = _mean_per_sample((x0_pos - x0).abs().double()).clamp(min=1e-5)
        w_neg = _mean_per_sample((x0_neg - x0).abs().double()).clamp(min=1e-5)
    pos = _mean_per_sample((x0_pos - x0) ** 2) / w_pos
    neg = _mean_per_sample((x0_neg - x0) ** 2) / w_neg
    per_sample = (r * pos + (1 - r) * neg) / beta
    if weight is not None:
        per_sample = per_sample * weight
    loss = (per_sample * adv_clip_max).mean()
    stats = {"policy_loss": loss.detach(), "r_mean": r.mean().detach(),
             "old_deviation": ((v.detach() - v_old) ** 2).mean()}
    return loss.float(), stats


def awm_log_prob(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                 weighting: str = "uniform", ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's likelihood surrogate per sample, (B,): −w(σ, err) with err = mean((v − (ε − x0))²), in fp64.

    uniform: −err; t: −σ·err; t2: −σ²·err; huber: −σ·(√(err + 1e-10) − 1e-5);
    ghuber: −σ·((err + 1e-10)^p − (1e-10)^p) / p.
    """
    err = _mean_per_sample((v.double() - (noise.double() - x0.double())) ** 2)
    sigma = sigma.double()
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -err * sigma
    if weighting == "t2":
        return -err * sigma**2
    if weighting == "huber":
        return -(torch.sqrt(err + 1e-10) - 1e-5) * sigma
    if weighting == "ghuber":
        p = ghuber_power
        return -((err + 1e-10) ** p - torch.tensor(1e-10, dtype=err.dtype) ** p) * sigma / p
    raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {', '.join(AWM_WEIGHTINGS)}")


def awm_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
             adv_clip_max: float, advantage_max: float = 0.0,
             weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """AWM's PPO-clipped policy loss on the surrogate log-probs (B,) (see the module docstring).

    advantages are clipped to ±adv_clip_max, then scaled by advantage_max / adv_clip_max when advantage_max > 0.
    weight: (B,) each sample's weight in the mean (a stale group's < 1), or None for 1.
    Returns (scalar loss, detached stats: policy_loss, ratio_mean, clipfrac).
    """
    a = advantages.clamp(-adv_clip_max, adv_clip_max).double()
    if advantage_max > 0:
        a = a / adv_clip_max * advantage_max
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1 - clip_range, 1 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_sample = per_sample * weight.double()
    loss = per_sample.mean()
    stats = {"policy_loss": loss.detach(), "ratio_mean": ratio.detach().mean(),
             "clipfrac": ((ratio.detach() - 1).abs() > clip_range).double().mean()}
    return loss.float(), stats


def velocity_penalty(v: torch.Tensor, v_other: torch.Tensor) -> torch.Tensor:
    """mean_B mean((v − v_other)²): NFT's and AWM's KL to the reference (or to the anchor), on velocities."""
    return _mean_per_sample((v - v_other.detach()) ** 2).mean()


def anchor_decay(optimizer_steps: int, flat: int, rate: float, cap: float) -> float:
    """d of θ_old ← d·θ_old + (1 − d)·θ: 0 for the first `flat` optimizer steps, then rising by `rate` per step up to
    `cap` (NVlabs' return_decay: type 1 = (0, 0.001, 0.5), type 2 = (75, 0.0075, 0.999); AWM's linear
    kl_ema_decay 0.3 = (0, 0.001, 0.3))."""
    if optimizer_steps < flat:
        return 0.0
    return min((optimizer_steps - flat) * rate, cap)


def timestep_indices(num_steps: int, fraction: float, k: int, batch: int, mode: str,
                     generator: torch.Generator) -> torch.Tensor:
    """(batch, k) indices into the sampling schedule's σ_0 … σ_{N−1} at which each sample is trained.

    random (NFT): k distinct indices per sample, a random permutation of all num_steps cut to k.
    stratified (AWM's discrete_wo_init): [1, int(num_steps·fraction)) cut into k strata, one uniform index in each,
    the same for all `batch` samples (AWM draws once per training micro-batch; index 0, σ = 1, is pure noise and
    never trained).
    shared (DGPO): k distinct indices of [0, int(num_steps·fraction)), the same for all `batch` samples (DGPO draws
    them once per inner epoch for every sample and rank: random.sample(range(trunc_steps + 1), k)).
    """
    if mode == "random":
        return torch.stack([torch.randperm(num_steps, generator=generator)[:k] for _ in range(batch)])
    if mode == "shared":
        top = int(num_steps * fraction)
        return torch.randperm(top, generator=generator)[:k].expand(batch, k).clone()
    if mode == "stratified":
        top = int(num_steps * fraction)
        bounds = torch.linspace(1, top, k + 1)
        lo, hi = bounds[:-1].long(), bounds[1:].long()
        idx = lo + (torch.rand(k, generator=generator) * (hi - lo)).long()
        return idx.expand(batch, k).clone()
    raise ValueError(f"unknown timestep mode {mode!r}; choose random, stratified or shared")
