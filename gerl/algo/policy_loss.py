"""Policy-gradient objectives for rollout batches that may be stale: a registry of pure tensor functions.

`train.loss` picks one by name. Every entry has the signature

    fn(log_prob, old_log_prob, advantages, rewards=None, *, <its options>) -> (loss, clipped)

    log_prob      (B,) log-probs of the recorded transitions at the current weights (with grad)
    old_log_prob  (B,) log-probs under the policy that sampled them (the rollout's, possibly k versions old)
    advantages    (B,) already clipped
    rewards       (B,) the samples' rewards (RolloutBatch.rewards); only topr with topr_split="reward" reads them
    loss          (B,) per-sample loss; the caller averages it
    clipped       (B,) bool: where the clip / truncation changed this sample's weight (logged as clipfrac)

The options are keyword-only: clip_range, ratio_cap, is_cap, cispo_eps_low, cispo_eps_high, topr_split (the train.*
and engine.ratio_cap keys of the same names). `grpo_loss` passes all of them; each entry reads its own and ignores
the rest, and the config refuses an option set for a loss that would ignore it.

r = exp(log_prob − old_log_prob) is the importance ratio current / behaviour policy; sg(·) stops the gradient.
The REINFORCE-style entries (tis, topr, cispo) weight −A·log π by a detached importance weight: their *value*
is not comparable with ppo_clip's, their *gradient* is (at r = 1 every entry's gradient is −A/B per sample).

ROLL (alibaba/ROLL, roll/pipeline/rlvr/actor_pg_worker.py, `pg_variant`; the agentic worker has the same code) is
where tis, topr and cispo come from. Where gerl differs, the difference is a named option and its default is said:
  ppo_clip  Flow-GRPO's max(−A·r, −A·clip(r, 1 − ε, 1 + ε)), ε = train.clip_range, symmetric. engine.ratio_cap = c
            (0 = off; must be ≥ 1 + ε, see gerl/config.py) first truncates r at c: for A ≥ 0 and c ≥ 1 + ε that
            changes nothing, for A < 0 it bounds the pessimistic branch at −c·A: dual-clip PPO, the same loss as
            ROLL's `dual_clip_loss` with c = 1 + 2·pg_clip. ROLL's asymmetric pg_clip_low/high are not offered.
            Suits k ≤ 1: at large k the ratio has drifted and the clip silences many samples.
  tis       −sg(min(r, is_cap))·A·log π: every sample keeps a gradient, its weight truncated at train.is_cap
            (default 1.0, ROLL's tis_upper_bound default; ROLL's tis_lower_bound, default 0, is a no-op since r > 0
            and is not offered). Variance bounded by is_cap; for moderate staleness (k = 1–3).
  topr      TOPR (tapered off-policy REINFORCE, Le Roux et al. 2025): −w·A·log π with w = 1 on positive samples and
            w = sg(min(r, 1)) on negative ones. Which samples are negative is train.topr_split:
              advantage (gerl's default): A < 0 — the samples the update pushes down. Their term |A|·log π is
                unbounded below as log π → −∞; tapered, its gradient is that of |A|·π/μ, which is bounded.
              reward (ROLL's `_compute_topr_loss`): reward ≤ 0 (its `scores`), while the loss still multiplies
                by A. With the paper's ±1 rewards, or 0/1 ones, and a baseline inside the reward range, the two
                rules agree wherever A ≠ 0. With rewards that are always positive (PickScore, OCR similarity,
                aesthetic scores) ROLL's rule tapers nothing: topr becomes plain REINFORCE −A·log π, with no
                off-policy correction and the unbounded push-down of below-baseline samples — hence gerl's default.
            ROLL's topr_positive_weight / topr_negative_weight (default 1.0 each) are not offered.
            Learns from good samples however stale and cannot blow up on bad ones; suits large k (streaming).
  cispo     CISPO (MiniMax-M1): −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π, the weight clipped and the gradient
            never cut — PPO's trust region without discarding the samples PPO would clip; suits k > 1 where
            ppo_clip's clipfrac is high. ε_low, ε_high = train.cispo_eps_low / cispo_eps_high, 0 (the default)
            meaning train.clip_range for each, so the default is symmetric like ROLL's (cispo_epsilon_low =
            cispo_epsilon_high = 0.1). gerl does not take ROLL's 0.1: its log-probs are per-element means whose
            ratios move on train.clip_range's scale (1e-4 by default), where 0.1 would clip nothing. ROLL's
            cispo_use_unified_mask (default false) is not offered.
"""

from __future__ import annotations

from typing import Callable

# Tensor methods only, no `import torch`: gerl.config checks train.loss against this registry, and a config must
# validate in milliseconds, before any heavy import (tests/test_config.py checks that no torch is loaded).

POLICY_LOSSES: dict[str, Callable] = {}
TOPR_SPLITS = ("advantage", "reward")


def register(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def get_policy_loss(name: str) -> Callable:
    """The registered objective `name`; an unknown name raises ValueError listing the registered ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


@register("ppo_clip")
def ppo_clip(log_prob, old_log_prob, advantages, rewards=None, *, clip_range, ratio_cap=0.0, **_):
    """max(−A·r, −A·clip(r, 1 − ε, 1 + ε)); r first truncated at ratio_cap when > 0 (dual clip, stale batches)."""
    ratio = (log_prob - old_log_prob).exp()
    if ratio_cap > 0:
        ratio = ratio.clamp(max=ratio_cap)
    loss = (-advantages * ratio).maximum(-advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    return loss, (ratio.detach() - 1.0).abs() > clip_range


@register("tis")
def tis(log_prob, old_log_prob, advantages, rewards=None, *, is_cap, **_):
    """−sg(min(r, is_cap))·A·log π: truncated importance sampling."""
    ratio = (log_prob - old_log_prob).exp().detach()
    return -ratio.clamp(max=is_cap) * advantages * log_prob, ratio > is_cap


@register("topr")
def topr(log_prob, old_log_prob, advantages, rewards=None, *, topr_split, **_):
    """−w·A·log π, w = 1 on positive samples and sg(min(r, 1)) on negative ones: A < 0 (topr_split="advantage") or
    reward ≤ 0 (topr_split="reward", ROLL's rule; needs `rewards`)."""
    if topr_split == "advantage":
        negative = advantages < 0
    elif topr_split == "reward":
        if rewards is None:
            raise ValueError("topr with topr_split='reward' splits by the rewards' sign: pass rewards (B,)")
        negative = rewards <= 0
    else:
        raise ValueError(f"topr_split={topr_split!r}; choose one of {', '.join(TOPR_SPLITS)}")
    ratio = (log_prob - old_log_prob).exp().detach()
    weight = ratio.clamp(max=1.0).where(negative, 1.0)  # min(r, 1) where negative, else 1
    return -weight * advantages * log_prob, negative & (ratio > 1.0)


@register("cispo")
def cispo(log_prob, old_log_prob, advantages, rewards=None, *, clip_range, cispo_eps_low=0.0, cispo_eps_high=0.0, **_):
    """−sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π, ε_low / ε_high = 0 meaning clip_range: the weight is clipped,
    the gradient never is."""
    lo, hi = 1.0 - (cispo_eps_low or clip_range), 1.0 + (cispo_eps_high or clip_range)
    ratio = (log_prob - old_log_prob).exp().detach()
    return -ratio.clamp(lo, hi) * advantages * log_prob, (ratio < lo) | (ratio > hi)
