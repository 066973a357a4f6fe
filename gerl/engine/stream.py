"""engine.schedule=stream, the driver side: rollout hosts pull whole groups from one shared prompt stream.

The stream is the sequence of the prompt sampler's draws (draw d = the prompts a sync run would train at step d),
cut into units of whole groups (as many as fill one rollout micro-batch). Whenever a rollout host is idle it gets
the next unit; `start` generates it and submits its rewards, and the host moves straight on to its next unit while
`finish` (another thread of the same host) waits for the scores. A unit whose rewards are all in is *complete*;
`take` hands the trainer the first `prompts_per_step` complete groups in completion order — a group with a slow
reward never holds back the others. Noise seeds are those of (draw, index), so a group's images depend only on
the weights it was generated with.

Every unit carries its policy version (the oldest its micro-batches saw). At `take`, lag = actor version − that
version; a group with lag > max_staleness is dropped, or kept with its samples' weight in the policy loss
stale_decay^(lag − max_staleness) (engine.stale; `RolloutBatch.stale_weight`). Generation runs ahead by at most
max_staleness batches: groups issued but not yet trained or dropped ≤ (max_staleness + 1) × prompts_per_step.
"""

from __future__ import annotations

import torch

from gerl.errors import RunAborted
from gerl.workers.batch import merge
from gerl.workers.reward import merge_results


class GroupStream:
    def __init__(self, engine, draw, first_draw: int = 1, consumed: list[int] = (), dropped: int = 0,
                 steps_left: int | None = None):
        """engine: the RayEngine (its ray module, rollouts, config); draw(d) -> (prompts, metadata, group_ids) of
        draw d; resume: start at first_draw, skipping the group numbers in `consumed` (already trained);
        steps_left: training steps still to come (nothing is generated beyond what they can take)."""
        cfg = engine.cfg
        self.ray, self.engine, self.draw = engine.ray, engine, draw
        self.P, self.n, self.k = cfg.data.prompts_per_step, cfg.data.group_size, cfg.engine.max_staleness
        per_mb = max(1, cfg.sampling.micro_batch_size // self.n)
        self.unit = per_mb if self.P % per_mb == 0 else 1  # groups per call; never crosses a draw
        self.stale, self.decay = cfg.engine.stale, cfg.engine.stale_decay
        self.next_group = (first_draw - 1) * self.P  # global group number g: draw g // P + 1, index g % P
        self.consumed = set(consumed)  # trained or dropped, at or after the first unfinished draw
        self.draws: dict[int, tuple] = {}
        self.last_draw = first_draw - 1
        self.generating: dict = {}  # ref of start() → (host index, first group)
        self.scoring: dict = {}  # ref of finish() → (host index, first group)
        self.busy: list[int] = []  # host index per start() call not yet returned
        self.ready: list[tuple] = []  # (first group, host, batch, res) in completion order
        self.dropped_total = dropped
        self.steps_left = steps_left if steps_left is not None else cfg.max_steps
        self.closed = False
        # start() calls queued per host: its share of the in-flight bound, so a host never idles while the driver
        # trains and enough groups are in flight to skip stragglers (a queued unit loads the newest staged weights
        # when it begins, so queueing does not age it)
        hosts = len(engine.rollouts)
        self.queue = max(1, -(-(self.k + 1) * self.P // (self.unit * hosts)))

    def _open_groups(self) -> list[int]:
        return [g for _, g in self.generating.values()] + [g for _, g in self.scoring.values()] + \
            [u[0] for u in self.ready]

    def _issue(self) -> None:
        """Keep `queue` units queued on every host, while generation is within max_staleness batches of training —
        and never more groups open than the remaining steps can take (the run ends with nothing left running)."""
        limit = min((self.k + 1) * self.P, self.steps_left * self.P)
        for j, host in [*enumerate(self.engine.rollouts)] * self.queue:
            while self.next_group in self.consumed:  # resume: already trained before the checkpoint
                self.next_group += 1
            if self.closed or self.busy.count(j) >= self.queue or len(self._open_groups()) * self.unit >= limit:
                continue
            g = self.next_group
            d, i = g // self.P + 1, g % self.P
            while self.last_draw < d:  # draws are taken in order, even those a resume skips entirely
                self.last_draw += 1
                self.draws[self.last_draw] = self.draw(self.last_draw)
            prompts, metadata, gids = self.draws[d]
            sl = slice(i * self.n, (i + self.unit) * self.n)
            ref = host.start.remote(prompts[sl], metadata[sl], gids[sl], d, i * self.n)
            self.generating[ref] = (j, g)
            self.busy.append(j)
            self.next_group += self.unit

    def take(self, actor_version: int):
        """Block until prompts_per_step fresh-enough groups are complete; return (batch, reward result)."""
        dropped_now = 0
        while sum(self.unit for _ in self.ready) < self.P:
            self._issue()
            refs = list(self.generating) + list(self.scoring)
            [ref], _ = self.ray.wait(refs, num_returns=1)
            try:
                out = self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                raise RunAborted("a rollout worker died under engine.schedule=stream (not replaced in this schedule); "
                                 "check its logs, then rerun with resume=true") from None
            if ref in self.generating:
                j, g = self.generating.pop(ref)
                self.busy.remove(j)  # generation done: the host takes its next unit while this one is scored
                host = self.engine.rollouts[j]
                self.scoring[host.finish.options(concurrency_group="rewards").remote(out)] = (j, g)
                continue
            j, g = self.scoring.pop(ref)
            batch, res = out
            lag = actor_version - batch.policy_version
            if lag > self.k and self.stale == "drop":
                self.consumed.update(range(g, g + self.unit))
                dropped_now += self.unit
                continue
            self.ready.append((g, j, batch, res))
        units = self.ready[: self.P // self.unit]
        self.ready = self.ready[self.P // self.unit:]
        self.consumed.update(g + u for g, *_ in units for u in range(self.unit))
        self._forget_finished_draws()
        self.dropped_total += dropped_now
        self.steps_left -= 1
        return self._assemble(units, actor_version, dropped_now)

    def cancel(self) -> int:
        """At the end of a run: issue nothing more and cancel the generation and reward calls still open (a
        call already running finishes on its host, whose close then drops its reward pools' queued work).
        Returns how many calls were open."""
        self.closed = True
        refs = [*self.generating, *self.scoring]
        for ref in refs:
            self.ray.cancel(ref)
        self.generating.clear()
        self.scoring.clear()
        return len(refs)

    def _forget_finished_draws(self) -> None:
        first = min([self.next_group, *self._open_groups()]) // self.P + 1
        for d in [d for d in self.draws if d < first]:
            del self.draws[d]
        self.consumed = {g for g in self.consumed if g >= (first - 1) * self.P}

    def _assemble(self, units, actor_version: int, dropped_now: int):
        for _, j, b, _ in units:
            for sp in b.spans:
                sp["shard"] = j
        spans = [sp for _, _, b, _ in units for sp in b.spans]
        load_s = sum(b.timings.get("weight_load_s", 0.0) for _, _, b, _ in units)
        batch = merge([b for _, _, b, _ in units])
        res = merge_results([r for *_, r in units], [f"rollout{j}" for _, j, _, _ in units])
        batch.spans = spans
        batch.group_ids = torch.arange(self.P).repeat_interleave(self.n)  # this step's groups, in taken order
        lags = [actor_version - b.policy_version for _, _, b, _ in units for _ in range(self.unit)]
        if self.stale == "downweight":
            excess = torch.tensor([max(0, lag - self.k) for lag in lags], dtype=torch.float32)
            batch.stale_weight = (self.decay ** excess).repeat_interleave(self.n)
        batch.timings.update(policy_lag_mean=sum(lags) / len(lags), policy_lags=lags, weight_load_s=load_s,
                             stale_groups_dropped=dropped_now, stale_groups_dropped_total=self.dropped_total)
        return batch, res

    def state_dict(self) -> dict:
        """Where a resumed run restarts the stream: the first draw with a group not yet trained, and which of
        that draw's (and later draws') groups were already trained or dropped. In-flight groups are regenerated."""
        first = min([self.next_group, *self._open_groups()]) // self.P + 1
        return {"first_draw": first, "consumed": sorted(g for g in self.consumed if g >= (first - 1) * self.P),
                "dropped_total": self.dropped_total}
