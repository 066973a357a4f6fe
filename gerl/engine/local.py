"""Local placement: one process, actor and rollout colocated on one model (hybrid), schedule sync.

The roles are the same classes the Ray engine runs as actors; here they share `pipe.transformer`, so weight sync
is only the policy-version hand-off.
"""

from __future__ import annotations

import time

from gerl.engine.roles import ActorRole, RolloutRole, build_pipeline


class LocalEngine:
    devices = 1
    actor_devices = rollout_devices = 1

    def __init__(self, cfg, reward_fns, pipe=None):
        self.cfg = cfg
        pipe = pipe if pipe is not None else build_pipeline(cfg)
        self.rollout = RolloutRole(cfg, pipe, reward_fns)
        # engine.fsdp: FSDP2 over a group of this one process (the sharded code path and its memory, on one device)
        group = None
        if cfg.engine.fsdp:
            from gerl.engine.parallel import single_process_group

            group = single_process_group(pipe.transformer.device.type)
        self.actor = ActorRole(cfg, pipe, group=group)
        self.restarts = 0

    def submit(self, step, prompts, metadata, group_ids):
        """Generates now (reward futures overlap generation inside); the 'handle' is the finished shard. The shared
        transformer holds the sampling weights meanwhile (nft's anchor; the trained ones otherwise)."""
        with self.actor.worker.sampling_policy():
            return self.rollout.generate(prompts, metadata, group_ids, step)

    def collect(self, handle):
        batch, res = handle
        return batch, res

    def update(self, batch, advantages, step: int) -> dict:
        t0 = time.time()
        m = self.actor.update(batch, advantages, step)
        m["_spans"] = [{"lane": "actor", "name": "train", "start": t0, "end": time.time()}]
        return m

    def sync(self) -> float:
        self.rollout.worker.policy_version = self.actor.version  # shared weights: nothing moves
        return 0.0

    @property
    def actor_version(self) -> int:
        return self.actor.version

    def validate(self, prompts, metadata):
        with self.actor.validation_policy():
            return self.rollout.validate(prompts, metadata)

    def save(self, run_dir, step, extra, keep_last) -> None:
        self.actor.save(run_dir, step, extra, keep_last)

    def load(self, path) -> dict:
        state = self.actor.load(path)
        self.sync()
        return state

    def close(self) -> None:
        self.rollout.close()
