"""Advantages: each reward normalised against its prompt's group (GRPO), pure tensor functions in a registry.

`unbiased` picks the std estimator (conventions.group_std): False divides the summed squares by n (Flow-GRPO's
np.std, gerl's default), True by n − 1 (GeRL's torch.std). With n = 8 the unbiased std is sqrt(8/7) ≈ 1.069×
larger, so advantages are ≈ 6.5 % smaller.
"""

from __future__ import annotations

from collections import deque

import torch

EPS = 1e-4  # keeps a group whose rewards are all equal at advantage 0 instead of 0/0


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """(r − mean_g) / (std_g + eps) within each group. Shapes: rewards (B,) float, group_ids (B,) long → (B,)."""
    adv = torch.empty_like(rewards)
    for g in group_ids.unique():
        m = group_ids == g
        r = rewards[m]
        adv[m] = (r - r.mean()) / (r.std(unbiased=unbiased) + EPS)
    return adv


def global_std_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """(r − mean_g) / (std over the whole batch + eps): keeps the relative scale between groups (Flow-GRPO's
    and GeRL's global_std option). Shapes as `group_advantages`."""
    adv = torch.empty_like(rewards)
    for g in group_ids.unique():
        m = group_ids == g
        adv[m] = rewards[m] - rewards[m].mean()
    return adv / (rewards.std(unbiased=unbiased) + EPS)


ADVANTAGES = {"group": group_advantages, "global_std": global_std_advantages}


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, clip: float,
                       unbiased: bool = False) -> torch.Tensor:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage {name!r}; registered: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards.float(), group_ids, unbiased).clamp(-clip, clip)


class PerPromptTracker:
    """Normalise each reward by the mean/std of its prompt's recent rewards (this step's included), so a prompt
    seen across many steps gets a steadier baseline than its n images of one step alone."""

    def __init__(self, buffer: int, unbiased: bool = False):
        self.buffer, self.unbiased = buffer, unbiased
        self.history: dict[str, deque] = {}

    def advantages(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        for p, r in zip(prompts, rewards.tolist()):
            self.history.setdefault(p, deque(maxlen=self.buffer)).append(r)
        adv = torch.empty_like(rewards, dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, rewards.tolist())):
            h = torch.tensor(list(self.history[p]), dtype=torch.float32)
            adv[i] = (r - h.mean()) / (h.std(unbiased=self.unbiased) + EPS)
        return adv

    def state_dict(self) -> dict:
        return {"buffer": self.buffer, "history": {p: list(h) for p, h in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = state["buffer"]
        self.history = {p: deque(h, maxlen=self.buffer) for p, h in state["history"].items()}
