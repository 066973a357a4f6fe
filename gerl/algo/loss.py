"""The Flow-GRPO objective: a PPO-clipped policy-ratio loss on per-step log-probs, plus an optional KL penalty."""

from __future__ import annotations

import torch

from gerl.algo.policy_loss import get_policy_loss

KL_STDS = ("transition", "noise_coef")


def kl_penalty(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """‖mean − ref_mean‖² / (2·std²), averaged over elements (like the log-prob) then over the batch → scalar.

    With `std` the transition's std (conventions.kl_std = transition) this is exactly KL(π‖π_ref) of the two
    Gaussian transitions, which share that std. Flow-GRPO and GeRL pass their `std_dev_t` instead (kl_std =
    noise_coef): the same for CPS, but for the SDE it is g without the sqrt(−dt) factor, so their KL is −dt times
    the true one (3.7–25× smaller on a 10-step shift-3 schedule) and their β means correspondingly more.

    Shapes: mean, ref_mean (B, C, h, w); std (B, 1, 1, 1).
    """
    return (((mean - ref_mean) ** 2) / (2 * std**2)).mean(dim=tuple(range(1, mean.ndim))).mean()


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    ratio_cap: float = 0.0,
    policy: str = "ppo_clip",
    is_cap: float = 1.0,
    rewards: torch.Tensor | None = None,
    cispo_eps_low: float = 0.0,
    cispo_eps_high: float = 0.0,
    topr_split: str = "advantage",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss for one micro-batch of denoising transitions.

    Args:
        log_prob: (B,) log-probs at the current weights (with grad).
        old_log_prob: (B,) log-probs of the policy that sampled the transitions (rollout's, or recomputed).
        advantages: (B,) already clipped.
        clip_range: ε of the PPO clip on the ratio.
        beta: KL weight; when > 0, `mean`, `ref_mean` (B, C, h, w) and `std` (B, 1, 1, 1) are needed: see
            `kl_penalty` (the caller picks which std the convention divides by).
        ratio_cap: ppo_clip only: if > 0, the ratio is truncated at this value before clipping (dual clip).
        policy: the policy term from gerl/algo/policy_loss.py (ppo_clip, tis, topr, cispo).
        is_cap, cispo_eps_low, cispo_eps_high, topr_split: its options (the train.* keys of the same names).
        rewards: (B,) the samples' rewards; read by topr with topr_split="reward".
    Returns:
        (scalar loss, detached stats: policy_loss, kl, ratio, clipfrac, approx_kl)
    """
    if ratio_cap and policy != "ppo_clip":
        raise ValueError(f"ratio_cap={ratio_cap} truncates ppo_clip's ratio; {policy} bounds its own weight: pass 0")
    ratio = torch.exp(log_prob - old_log_prob)
    per_sample, was_clipped = get_policy_loss(policy)(
        log_prob, old_log_prob, advantages, rewards, clip_range=clip_range, ratio_cap=ratio_cap, is_cap=is_cap,
        cispo_eps_low=cispo_eps_low, cispo_eps_high=cispo_eps_high, topr_split=topr_split)
    policy_loss = per_sample.mean()
    loss = policy_loss
    kl = torch.zeros((), device=log_prob.device)
    if beta > 0:
        kl = kl_penalty(mean, ref_mean, std)
        loss = loss + beta * kl
    stats = {
        "policy_loss": policy_loss.detach(),
        "kl": kl.detach(),
        "ratio_mean": ratio.detach().mean(),
        "clipfrac": was_clipped.float().mean(),
        "approx_kl": (0.5 * (log_prob - old_log_prob).detach() ** 2).mean(),
    }
    return loss, stats
