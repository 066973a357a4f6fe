"""Local placement: actor and rollout colocated on one model (hybrid), schedule sync, in this process — or in each of
the N processes torchrun / accelerate launch started (gerl/engine/launcher.py), one colocated host per process.

The roles are the same classes the Ray engine runs as actors; here they share `pipe.transformer`, so weight sync
is only the policy-version hand-off. On N processes every one runs the trainer on the same whole batch, as the Ray
engine's driver does once: each generates its slice of the step's groups, the slices are all-gathered, and each
trains on its slice through the data-parallel layer (gerl/engine/parallel.py) over the launcher's process group.
"""

from __future__ import annotations

import time

import torch

from gerl.engine import launcher
from gerl.engine.roles import ActorRole, RolloutRole, build_pipeline
from gerl.workers.batch import merge, subset
from gerl.workers.reward import merge_results


class LocalEngine:
    def __init__(self, cfg, reward_fns, pipe=None):
        self.cfg = cfg
        self.rank, self.world = launcher.rank(), launcher.world()
        self.devices = self.actor_devices = self.rollout_devices = self.world
        pipe = pipe if pipe is not None else build_pipeline(cfg)
        self.rollout = RolloutRole(cfg, pipe, reward_fns)
        group = None
        if self.world > 1:  # the launcher's processes: torch's data-parallel engine over their group
            import torch.distributed as dist

            group = dist.group.WORLD
        elif cfg.engine.fsdp:  # FSDP2 over a group of this one process (the sharded code path and its memory)
            from gerl.engine.parallel import single_process_group

            group = single_process_group(pipe.transformer.device.type)
        self.actor = ActorRole(cfg, pipe, self.rank, self.world, group=group)
        self.restarts = 0

    def submit(self, step, prompts, metadata, group_ids):
        """Generates now (reward futures overlap generation inside); the 'handle' is the finished shard: this
        process's slice of the step's groups (all of them on one process). The shared transformer holds the sampling
        weights meanwhile (nft's anchor; the trained ones otherwise)."""
        n = len(prompts) // self.world
        part = slice(self.rank * n, (self.rank + 1) * n)
        with self.actor.worker.sampling_policy():
            return self.rollout.generate(prompts[part], metadata[part], group_ids[part], step, self.rank * n)

    def collect(self, handle):
        if self.world == 1:
            return handle
        import torch.distributed as dist

        # every process gets every slice, in rank order (gloo: the backend map's CPU entry carries objects)
        shards: list = [None] * self.world
        dist.all_gather_object(shards, handle)
        batches, results = zip(*shards)
        return merge(list(batches)), merge_results(list(results), [f"rollout{j}" for j in range(self.world)])

    def update(self, batch, advantages, step: int) -> dict:
        """Process r trains on the r-th contiguous slice of the batch (the Ray engine's split)."""
        t0 = time.time()
        if self.world > 1:
            size = len(batch) // self.world
            keep = torch.zeros(len(batch), dtype=torch.bool)
            keep[self.rank * size:(self.rank + 1) * size if self.rank < self.world - 1 else len(batch)] = True
            batch, advantages = subset(batch, keep), advantages[keep]
        m = self.actor.update(batch, advantages, step)
        m["_spans"] = [{"lane": "actor", "name": "train", "start": t0, "end": time.time()}]
        return m

    def sync(self) -> float:
        self.rollout.worker.policy_version = self.actor.version  # shared weights: nothing moves
        return 0.0

    def any_rank(self, flag: bool) -> bool:
        """Whether any process says yes (a signal seen by one process stops them all at the same step boundary)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t)
        return bool(t.item() > 0)

    @property
    def actor_version(self) -> int:
        return self.actor.version

    def validate(self, prompts, metadata):
        """On every process (a sharded forward all-gathers over all of them); rank 0's images and scores are logged."""
        with self.actor.validation_policy():
            return self.rollout.validate(prompts, metadata)

    def save(self, run_dir, step, extra, keep_last) -> None:
        self.actor.save(run_dir, step, extra, keep_last)  # rank 0; every rank its shard under engine.fsdp

    def load(self, path) -> dict:
        state = self.actor.load(path)
        self.sync()
        return state

    def close(self) -> None:
        self.rollout.close()
