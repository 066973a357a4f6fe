"""The trajectory batch: what a rollout hands to the trainer (the data contract between workers)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from gerl.sampling.loop import Embeds, Schedule, Trajectory


@dataclass
class RolloutBatch:
    prompts: list[str]  # B = prompts_per_step × group_size, each prompt repeated group_size times in a row
    metadata: list[dict]  # per-sample metadata from the prompt file
    group_ids: torch.Tensor  # (B,) long: index of the prompt's group within the step
    embeds: Embeds  # cached text embeddings, (B, L, D) / (B, P)
    schedule: Schedule  # σ / timestep schedule the trajectory was sampled on
    traj: Trajectory  # recorded SDE steps and rollout log-probs
    images: list  # B decoded PIL images (for rewards and logging)
    policy_version: int  # optimizer updates the generating weights had seen
    reward_futures: list[tuple[slice, Future]] = field(default_factory=list)  # one per micro-batch, in order
    rewards: torch.Tensor | None = None  # (B,) filled once the futures are gathered
    reward_extras: dict[str, list] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per rollout stage
    spans: list[dict] = field(default_factory=list)  # {"name", "start", "end"} wall-clock spans of the rollout's stages

    def __len__(self) -> int:
        return len(self.prompts)


def subset(batch: RolloutBatch, keep: torch.Tensor) -> RolloutBatch:
    """The samples where `keep` (B,) bool is true, for training after failed rewards were dropped."""
    idx = keep.nonzero().flatten()
    pick = lambda xs: [xs[i] for i in idx.tolist()]  # noqa: E731
    t = batch.traj
    return RolloutBatch(
        prompts=pick(batch.prompts), metadata=pick(batch.metadata), group_ids=batch.group_ids[idx],
        embeds=batch.embeds.index(idx), schedule=batch.schedule,
        traj=Trajectory(t.latents[idx], t.next_latents[idx], t.log_probs[idx], t.step_indices, t.final_latents[idx]),
        images=pick(batch.images), policy_version=batch.policy_version,
        rewards=None if batch.rewards is None else batch.rewards[idx],
        reward_extras={k: pick(v) for k, v in batch.reward_extras.items()}, timings=batch.timings,
    )
