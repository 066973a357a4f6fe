"""Policy-gradient objectives for rollout batches that may be stale: a registry of pure tensor functions.

`train.loss` picks one by name. Every entry has the signature

    fn(log_prob, old_log_prob, advantages, *, clip_range, ratio_cap, is_cap) -> (loss, clipped)

    log_prob      (B,) log-probs of the recorded transitions at the current weights (with grad)
    old_log_prob  (B,) log-probs under the policy that sampled them (the rollout's, possibly k versions old)
    advantages    (B,) already clipped
    loss          (B,) per-sample loss; the caller averages it
    clipped       (B,) bool: where the clip / truncation changed this sample's weight (logged as clipfrac)

r = exp(log_prob − old_log_prob) is the importance ratio current / behaviour policy; sg(·) stops the gradient.
The REINFORCE-style entries (tis, topr, cispo) weight −A·log π by a detached importance weight: their *value*
is not comparable with ppo_clip's, their *gradient* is (at r = 1 every entry's gradient is −A/B per sample).

When each suits generation k > 1 versions ahead (engine.max_staleness):
  ppo_clip  today's Flow-GRPO objective. The trust region is measured against the behaviour policy, so at large k
            the ratio has already drifted and clipping silences many samples: data is generated then wasted.
            Fine for k ≤ 1 (optionally with engine.ratio_cap on the pessimistic branch).
  tis       truncated importance sampling: every sample keeps a gradient, weighted by min(r, is_cap). Unbiased up
            to the truncation, variance bounded by is_cap. A good default for moderate staleness (k = 1–3).
  topr      TOPR (tapered off-policy REINFORCE): positive-advantage samples at full weight (no ratio), negative
            ones truncated at min(r, 1). Learns from good samples however stale and cannot blow up on bad ones;
            suits large k and heavy-tailed lag (streaming).
  cispo     CISPO: clip the importance *weight* to [1 − ε, 1 + ε] (ε = train.clip_range) and keep every sample's
            gradient — PPO's trust region without discarding the samples PPO would clip; suits k > 1 where
            ppo_clip's clipfrac is high.
"""

from __future__ import annotations

from typing import Callable

import torch

POLICY_LOSSES: dict[str, Callable] = {}


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
def ppo_clip(log_prob, old_log_prob, advantages, *, clip_range, ratio_cap=0.0, is_cap=0.0):
    """max(−A·r, −A·clip(r, 1 − ε, 1 + ε)); r first truncated at ratio_cap when > 0 (stale batches)."""
    ratio = torch.exp(log_prob - old_log_prob)
    if ratio_cap > 0:
        ratio = torch.clamp(ratio, max=ratio_cap)
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    return loss, (ratio.detach() - 1.0).abs() > clip_range


@register("tis")
def tis(log_prob, old_log_prob, advantages, *, clip_range=0.0, ratio_cap=0.0, is_cap=2.0):
    """−sg(min(r, is_cap))·A·log π: truncated importance sampling."""
    ratio = torch.exp(log_prob - old_log_prob).detach()
    return -torch.clamp(ratio, max=is_cap) * advantages * log_prob, ratio > is_cap


@register("topr")
def topr(log_prob, old_log_prob, advantages, *, clip_range=0.0, ratio_cap=0.0, is_cap=0.0):
    """−w·A·log π with w = 1 where A ≥ 0 and w = sg(min(r, 1)) where A < 0 (tapered off-policy REINFORCE)."""
    ratio = torch.exp(log_prob - old_log_prob).detach()
    negative = advantages < 0
    weight = torch.where(negative, torch.clamp(ratio, max=1.0), torch.ones_like(ratio))
    return -weight * advantages * log_prob, negative & (ratio > 1.0)


@register("cispo")
def cispo(log_prob, old_log_prob, advantages, *, clip_range, ratio_cap=0.0, is_cap=0.0):
    """−sg(clip(r, 1 − ε, 1 + ε))·A·log π: the weight is clipped, the gradient never is."""
    ratio = torch.exp(log_prob - old_log_prob).detach()
    return -torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range) * advantages * log_prob, (ratio - 1.0).abs() > clip_range
