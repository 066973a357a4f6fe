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
    # (B,) each sample's weight in the policy loss (streaming, engine.stale=downweight: < 1 for stale groups); None = 1
    stale_weight: torch.Tensor | None = None

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
        traj=Trajectory(t.latents[idx], t.next_latents[idx], t.log_probs[idx],
                        t.step_indices[idx] if t.step_indices.ndim == 2 else t.step_indices, t.final_latents[idx]),
        images=pick(batch.images), policy_version=batch.policy_version,
        rewards=None if batch.rewards is None else batch.rewards[idx],
        reward_extras={k: pick(v) for k, v in batch.reward_extras.items()}, timings=batch.timings,
        stale_weight=None if batch.stale_weight is None else batch.stale_weight[idx],
    )


def merge(shards: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate the shards of one step (in rollout-rank order) into the step's batch."""
    if len(shards) == 1:
        return shards[0]
    first = shards[0]
    spans = [dict(sp, shard=i) for i, b in enumerate(shards) for sp in b.spans]
    timings = {k: max(b.timings.get(k, 0.0) for b in shards) for k in first.timings}  # shards run in parallel
    extras: dict[str, list] = {}
    for b in shards:
        for k, v in b.reward_extras.items():
            extras.setdefault(k, []).extend(v)
    return RolloutBatch(
        prompts=[p for b in shards for p in b.prompts], metadata=[m for b in shards for m in b.metadata],
        group_ids=torch.cat([b.group_ids for b in shards]), embeds=Embeds.cat([b.embeds for b in shards]),
        schedule=first.schedule, traj=Trajectory.cat([b.traj for b in shards]),
        images=[im for b in shards for im in b.images], policy_version=min(b.policy_version for b in shards),
        rewards=None if first.rewards is None else torch.cat([b.rewards for b in shards]),
        reward_extras=extras, timings=timings, spans=spans,
    )
