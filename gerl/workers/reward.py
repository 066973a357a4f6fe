"""Reward execution: pools that take one decoded micro-batch at a time and return futures, with faults contained.

The rollout submits each micro-batch's images as soon as they are decoded and moves on (ddpo-pytorch's pattern);
the trainer gathers when the advantages need the scores, and only the wait it actually suffers is "exposed".

Faults never stop or hang a run: every call has a timeout (the call runs on a helper thread that is abandoned if
it overstays), errors and timeouts are retried with exponential backoff, a dead worker process is replaced, and a
last-resort deadline on each future bounds the wait. A sample whose call still fails is marked *failed* (never
given a made-up score); the trainer's `reward.on_failure` policy decides what happens to it.

One rule for non-finite scores: a reward that returns NaN or ±inf for a sample has failed on that sample (the
score is useless as a baseline), exactly like a call that raised — `None` alone means "not applicable". The
reward's own error text travels with the result (`RewardResult.errors`) so the trainer can show it.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import torch

from gerl.data.prompts import with_source_images
from rewards.registry import call_reward

_WORKER_FN = None  # the reward installed once per worker process (so its lazily loaded model is loaded once)


def _install(fn) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


@dataclass
class CallResult:
    """One reward on one micro-batch."""

    scores: list  # float | None per sample (None = not applicable, or failed)
    failed: list  # bool per sample: no score after every attempt
    extras: dict = field(default_factory=dict)
    compute_s: float = 0.0  # time spent inside the reward, all attempts
    retries: int = 0
    timeouts: int = 0
    errors: int = 0
    nonfinite: int = 0  # samples whose score came back NaN or ±inf (marked failed)
    last_error: str = ""
    start: float = 0.0  # wall clock (epoch seconds) of the first attempt, for the timeline
    end: float = 0.0
    worker: str = ""  # thread name or process id that ran it

    @staticmethod
    def failure(n: int, **counts) -> "CallResult":
        return CallResult([None] * n, [True] * n, **counts)


def _call_with_timeout(fn, images, prompts, metadata, timeout_s: float):
    """Run one call on a daemon thread; returns ('ok', (scores, extras)) | ('error', msg) | ('timeout', None)."""
    box: dict = {}

    def target():
        try:
            box["ok"] = call_reward(fn, images, prompts, metadata)
        except BaseException as e:  # noqa: BLE001 — any failure of user code is a counted reward fault
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=target, daemon=True, name="reward-call")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return "timeout", None  # the thread is abandoned; a daemon thread cannot block exit
    return ("ok", box["ok"]) if "ok" in box else ("error", box["error"])


def run_attempts(fn, images, prompts, metadata, timeout_s: float, retries: int, backoff_s: float) -> CallResult:
    """The whole life of one micro-batch's call: attempts, timeouts, backoff. Runs inside a pool worker."""
    fn = fn if fn is not None else _WORKER_FN
    n = len(images)
    res = CallResult.failure(n)
    res.start = time.time()
    res.worker = f"pid{os.getpid()}" if fn is _WORKER_FN else threading.current_thread().name
    t0 = time.perf_counter()
    for attempt in range(retries + 1):
        if attempt:
            res.retries += 1
            time.sleep(backoff_s * 2 ** (attempt - 1))
        status, value = _call_with_timeout(fn, images, prompts, metadata, timeout_s)
        if status == "ok":
            scores, extras = value
            bad = [s is not None and not math.isfinite(s) for s in scores]
            res.scores = [None if b else s for s, b in zip(scores, bad)]
            res.failed, res.extras = bad, extras
            if any(bad):  # deterministic in the inputs: a retry would return the same thing
                res.nonfinite = sum(bad)
                vals = sorted({str(s) for s, b in zip(scores, bad) if b})
                res.last_error = f"returned non-finite scores ({', '.join(vals)}); return None for 'not applicable'"
            break
        if status == "timeout":
            res.timeouts += 1
            res.last_error = f"timed out after {timeout_s:g} s"
        else:
            res.errors += 1
            res.last_error = value
    res.compute_s = time.perf_counter() - t0
    res.end = time.time()
    return res


class RayRewardWorker:
    """One reward replica as a Ray actor (its own process, CPUs and GPUs); the model loads once per replica."""

    def __init__(self, fn):
        _install(fn)

    def run(self, images, prompts, metadata, timeout_s, retries, backoff_s) -> CallResult:
        return run_attempts(None, images, prompts, metadata, timeout_s, retries, backoff_s)


class _RayPool:
    """`workers` RayRewardWorker replicas used round-robin; a dead replica is replaced on the next submit."""

    def __init__(self, fn, workers: int, num_cpus: float, num_gpus: float):
        import ray

        if not ray.is_initialized():
            from gerl.engine.resources import own_ray_env

            own_ray_env()
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False)  # our own, never a `ray start` one
        from gerl.engine import pool

        pool.evict(ray)  # hosts kept idle for a later run would hold the CPUs these replicas ask for
        self.ray, self.fn = ray, fn
        self.cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RayRewardWorker)
        self.replicas = [self.cls.remote(fn) for _ in range(workers)]
        self.next = 0
        self._broken = False

    def submit(self, fn_, *args):
        i = self.next % len(self.replicas)
        self.next += 1
        fut = self.replicas[i].run.remote(*args[1:]).future()
        fut.gerl_replica = i
        return fut

    def replace(self, i: int) -> None:
        self.ray.kill(self.replicas[i])
        self.replicas[i] = self.cls.remote(self.fn)

    def shutdown(self, wait=False, cancel_futures=True):
        for r in self.replicas:
            self.ray.kill(r)


def auto_workers(pool: str) -> int:
    """reward.workers=0: one worker per CPU this process may run on (its affinity: a Ray host's pinned share of the
    node), less the one that drives generation, at least 1; a Ray pool's replicas reserve their own CPUs: 1."""
    if pool == "ray":
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus - 1)


def chunks(n: int, parts: int) -> list[slice]:
    """`n` samples cut into min(parts, n) contiguous slices whose sizes differ by at most one."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class JoinedFuture:
    """The futures of one micro-batch's split calls, as one: its result is their CallResults joined in sample order
    (scores, failures and per-sample extras concatenated, counts and compute time summed, the first error kept)."""

    def __init__(self, parts: list[Future]):
        self.parts = parts

    def result(self, timeout: float | None = None) -> CallResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        results = [p.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for p in self.parts]
        out = CallResult([s for r in results for s in r.scores], [f for r in results for f in r.failed])
        for r in results:
            for k, v in r.extras.items():
                out.extras.setdefault(k, []).extend(v if isinstance(v, list) else [v] * len(r.scores))
            for k in ("compute_s", "retries", "timeouts", "errors", "nonfinite"):
                setattr(out, k, getattr(out, k) + getattr(r, k))
            out.last_error = out.last_error or r.last_error
        out.start = min((r.start for r in results if r.start), default=0.0)
        out.end = max(r.end for r in results)
        out.worker = f"{results[0].worker}+{len(results) - 1}" if len(results) > 1 else results[0].worker
        return out

    def cancel(self) -> bool:
        return all([p.cancel() for p in self.parts])


class RewardExecutor:
    """Runs one reward callable in a thread, process or Ray-actor pool. `submit` → Future[CallResult].

    With `split` and a reward that scores each image on its own (`per_sample = True` on the callable, as the OCR
    reward declares), a micro-batch is cut into one call per worker: its scores are back when the slowest slice
    is, not after the whole micro-batch ran in one worker (the last micro-batch's wait is what the GPU idles on)."""

    def __init__(self, fn, pool: str = "thread", workers: int = 1, timeout_s: float = 120.0, retries: int = 2,
                 backoff_s: float = 0.5, num_cpus: float = 1.0, num_gpus: float = 0.0, split: bool = False):
        if pool not in ("thread", "process", "ray"):
            raise ValueError(f"unknown reward pool {pool!r}; choose thread, process or ray")
        workers = workers or auto_workers(pool)
        self.fn, self.pool_kind, self.workers = fn, pool, workers
        # Ray replicas are replaced by the future that failed: one call, one replica
        self.split = split and pool != "ray" and workers > 1 and bool(getattr(fn, "per_sample", False))
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.worker_restarts = 0
        self._lock = threading.Lock()
        self.pool = self._new_pool()

    def _new_pool(self):
        if self.pool_kind == "ray":
            return _RayPool(self.fn, self.workers, self.num_cpus, self.num_gpus)
        if self.pool_kind == "thread":
            return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reward")
        # forkserver: forking a process that holds torch threads can deadlock
        ctx = multiprocessing.get_context("forkserver")
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=_install, initargs=(self.fn,))

    @property
    def deadline_s(self) -> float:
        """Longest a healthy call can take: every attempt timing out, plus the backoffs, plus slack."""
        backoff = sum(self.backoff_s * 2**i for i in range(self.retries))
        return (self.retries + 1) * self.timeout_s + backoff + 30.0

    def submit(self, images, prompts, metadata) -> Future | JoinedFuture:
        if self.split and len(images) > 1:
            fut = JoinedFuture([self._submit(images[sl], prompts[sl], metadata[sl])
                                for sl in chunks(len(images), self.workers)])
            fut.gerl_n, fut.gerl_submitted = len(images), fut.parts[0].gerl_submitted
            return fut
        return self._submit(images, prompts, metadata)

    def _submit(self, images, prompts, metadata) -> Future:
        fn = self.fn if self.pool_kind == "thread" else None
        args = (fn, images, prompts, metadata, self.timeout_s, self.retries, self.backoff_s)
        with self._lock:
            try:
                fut = self.pool.submit(run_attempts, *args)
            except (BrokenProcessPool, RuntimeError):
                self._restart()
                fut = self.pool.submit(run_attempts, *args)
        fut.gerl_n = len(images)
        fut.gerl_submitted = time.monotonic()
        return fut

    def call(self, images, prompts, metadata) -> CallResult:
        """Synchronous call in this thread, with the same fault handling (with_reward off, validation)."""
        return run_attempts(self.fn, images, prompts, metadata, self.timeout_s, self.retries, self.backoff_s)

    def result(self, fut: Future) -> CallResult:
        """The future's result; a dead worker or an overdue future becomes a failed CallResult, never a hang."""
        remaining = max(0.0, fut.gerl_submitted + self.deadline_s - time.monotonic())
        try:
            return fut.result(timeout=remaining)
        except FutureTimeout:
            fut.cancel()
            return CallResult.failure(fut.gerl_n, timeouts=1, last_error="no result before the deadline")
        except BrokenProcessPool:
            with self._lock:
                self._restart()
            return CallResult.failure(fut.gerl_n, errors=1, last_error="reward worker process died")
        except Exception as e:  # noqa: BLE001 — a Ray replica that died (RayActorError) or lost its result
            if self.pool_kind != "ray":
                raise
            with self._lock:
                self.pool.replace(fut.gerl_replica)
                self.worker_restarts += 1
            return CallResult.failure(fut.gerl_n, errors=1, last_error=f"reward replica died: {type(e).__name__}")

    def _restart(self) -> None:
        if isinstance(self.pool, ProcessPoolExecutor) and getattr(self.pool, "_broken", False):
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = self._new_pool()
            self.worker_restarts += 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class RewardResult:
    """All components on a whole batch, combined."""

    total: torch.Tensor  # (B,) weighted sum of (normalised) components; NaN where no component applied or failed
    failed: torch.Tensor  # (B,) bool: some component failed on this sample after all attempts
    not_applicable: torch.Tensor  # (B,) bool: every component returned None
    components: dict[str, torch.Tensor]  # raw (un-normalised) score per component, NaN = None/failed
    extras: dict[str, list]
    wait_s: float  # time the caller was blocked gathering
    compute_s: float  # time spent inside rewards, summed over calls
    counts: dict[str, int]  # retries, timeouts, errors, worker restarts of this batch
    spans: list[dict] = field(default_factory=list)  # one per call: {"lane", "name", "start", "end"}
    raw_total: torch.Tensor | None = None  # (B,) weighted sum of the raw components (no normalisation); NaN as total
    errors: dict[str, int] = field(default_factory=dict)  # "<component>: <reward's error text>" → samples it failed


class RewardSet:
    """The configured rewards (one or several weighted components), each with its own pool."""

    def __init__(self, components: list, fns: list, timeout_s: float, retries: int, backoff_s: float):
        self.specs = components
        self.names = _unique_names([c.name.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for c in components])
        self.executors = [RewardExecutor(fn, c.pool, c.workers, timeout_s, retries, backoff_s,
                                         getattr(c, "num_cpus", 1.0), getattr(c, "num_gpus", 0.0),
                                         getattr(c, "split", False))
                          for c, fn in zip(components, fns)]

    def submit(self, images, prompts, metadata) -> list[Future]:
        """One future per component for this micro-batch. A prompt's conditioning image (an edit) reaches the rewards
        opened, as metadata["source_image"] (gerl.data.prompts.with_source_images)."""
        metadata = with_source_images(metadata)
        return [ex.submit(images, prompts, metadata) for ex in self.executors]

    def gather(self, handles: list[list[Future]]) -> RewardResult:
        """Wait for every micro-batch's futures (in submission order) and combine."""
        t0 = time.perf_counter()
        per_mb = [[ex.result(f) for ex, f in zip(self.executors, futs)] for futs in handles]
        return self._combine(per_mb, time.perf_counter() - t0)

    def score_now(self, images, prompts, metadata, micro_batch_size: int) -> RewardResult:
        """Score in this thread, micro-batch after micro-batch (with_reward off; validation)."""
        t0 = time.perf_counter()
        metadata = with_source_images(metadata)
        per_mb = []
        for s in range(0, len(images), micro_batch_size):
            sl = slice(s, s + micro_batch_size)
            per_mb.append([ex.call(images[sl], prompts[sl], metadata[sl]) for ex in self.executors])
        return self._combine(per_mb, time.perf_counter() - t0)

    def _combine(self, per_mb: list[list[CallResult]], wait_s: float) -> RewardResult:
        counts = {"retries": 0, "timeouts": 0, "errors": 0, "nonfinite": 0}
        raw, failed_by, extras, compute, spans, errors = [], [], {}, 0.0, [], {}
        for i, name in enumerate(self.names):
            results = [mb[i] for mb in per_mb]
            scores = [s for r in results for s in r.scores]
            raw.append(torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float64))
            # A reward can flag individual samples as failed (e.g. one HTTP request of a batch) with extras["failed"].
            flagged = [bool(f) or bool(x) for r in results
                       for f, x in zip(r.failed, r.extras.get("failed", [0] * len(r.failed)))]
            failed_by.append(torch.tensor(flagged, dtype=torch.bool))
            for j, r in enumerate(results):
                if r.end > 0:
                    spans.append({"lane": f"reward/{name}/{r.worker}", "name": f"{name} mb{j}", "start": r.start, "end": r.end})
                compute += r.compute_s
                for k in counts:
                    counts[k] += getattr(r, k)
                if r.last_error and any(r.failed):
                    key = f"{name}: {r.last_error}"
                    errors[key] = errors.get(key, 0) + sum(r.failed)
                for k, v in r.extras.items():
                    extras.setdefault(k if len(self.names) == 1 else f"{name}/{k}", []).extend(v)
        counts["worker_restarts"] = sum(ex.worker_restarts for ex in self.executors)
        failed = torch.stack(failed_by).any(0)
        none = torch.stack([torch.isnan(r) for r in raw])
        total, raw_total = torch.zeros_like(raw[0]), torch.zeros_like(raw[0])
        for spec, r in zip(self.specs, raw):
            total += spec.weight * torch.nan_to_num(normalize(r, spec.normalize, spec.scale, failed), nan=0.0)
            raw_total += spec.weight * torch.nan_to_num(r, nan=0.0)
        not_applicable = none.all(0) & ~failed
        total[failed | not_applicable] = math.nan
        raw_total[failed | not_applicable] = math.nan
        # (NaN/inf scores were turned into failures in run_attempts: the one rule for non-finite rewards.)
        return RewardResult(total.float(), failed, not_applicable, {n: r.float() for n, r in zip(self.names, raw)},
                            extras, wait_s, compute, counts, spans, raw_total.float(), errors)

    def close(self) -> None:
        for ex in self.executors:
            ex.close()


def normalize(scores: torch.Tensor, how: str, scale: float, failed: torch.Tensor) -> torch.Tensor:
    """Per-batch normalisation of one component before weighting. NaN entries (None/failed) are ignored."""
    if how == "scale":
        return scores * scale
    if how == "zscore":
        valid = scores[~torch.isnan(scores) & ~failed]
        if len(valid) < 2:
            return scores - (valid.mean() if len(valid) else 0.0)
        return (scores - valid.mean()) / (valid.std(unbiased=False) + 1e-8)
    return scores


def _unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out


def merge_results(results: list[RewardResult], lanes: list[str]) -> RewardResult:
    """Concatenate per-shard reward results of one step; each shard's reward lanes are prefixed by its worker."""
    if len(results) == 1:
        return results[0]
    cat = lambda xs: torch.cat(xs)  # noqa: E731
    extras: dict[str, list] = {}
    for r in results:
        for k, v in r.extras.items():
            extras.setdefault(k, []).extend(v)
    counts = {k: sum(r.counts.get(k, 0) for r in results) for k in results[0].counts}
    spans = [dict(sp, lane=f"{lane}/{sp['lane']}") for r, lane in zip(results, lanes) for sp in r.spans]
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
    return RewardResult(
        cat([r.total for r in results]), cat([r.failed for r in results]), cat([r.not_applicable for r in results]),
        {n: cat([r.components[n] for r in results]) for n in results[0].components}, extras,
        max(r.wait_s for r in results), sum(r.compute_s for r in results), counts, spans,
        cat([r.raw_total for r in results]), errors,
    )
