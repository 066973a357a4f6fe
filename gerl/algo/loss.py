"""The Flow-GRPO objective: a PPO-clipped policy-ratio loss on per-step log-probs, plus an optional KL penalty."""

from __future__ import annotations

import torch

from gerl.algo.policy_loss import get_policy_loss


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
    is_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss for one micro-batch of denoising transitions.

    Args:
        log_prob: (B,) log-probs at the current weights (with grad).
        old_log_prob: (B,) log-probs of the policy that sampled the transitions (rollout's, or recomputed).
        advantages: (B,) already clipped.
        clip_range: ε of the PPO clip on the ratio.
        beta: KL weight; when > 0, `mean`, `ref_mean` (B, C, h, w) and `std` (B, 1, 1, 1) are needed. Both
            policies' transitions are Gaussians with the same std, so KL = ‖mean − ref_mean‖² / (2 std²),
            averaged over elements like the log-prob.
        ratio_cap: if > 0, the ratio is truncated at this value before clipping (stale batches).
        policy, is_cap: the policy term from gerl/algo/policy_loss.py (ppo_clip, tis, topr, cispo) and tis's cap.
    Returns:
        (scalar loss, detached stats: policy_loss, kl, ratio, clipfrac, approx_kl)
    """
    ratio = torch.exp(log_prob - old_log_prob)
    per_sample, was_clipped = get_policy_loss(policy)(log_prob, old_log_prob, advantages, clip_range=clip_range,
                                                      ratio_cap=ratio_cap, is_cap=is_cap)
    policy_loss = per_sample.mean()
    loss = policy_loss
    kl = torch.zeros((), device=log_prob.device)
    if beta > 0:
        kl = (((mean - ref_mean) ** 2) / (2 * std**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + beta * kl
    stats = {
        "policy_loss": policy_loss.detach(),
        "kl": kl.detach(),
        "ratio_mean": ratio.detach().mean(),
        "clipfrac": was_clipped.float().mean(),
        "approx_kl": (0.5 * (log_prob - old_log_prob).detach() ** 2).mean(),
    }
    return loss, stats
