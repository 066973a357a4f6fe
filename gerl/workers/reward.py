"""Reward execution: a pool that takes one decoded micro-batch at a time and returns a future.

The rollout submits each micro-batch's images as soon as they are decoded and moves on (ddpo-pytorch's pattern);
the trainer gathers when advantages need the rewards, and only the wait it actually suffers is "exposed".
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor

from rewards.registry import call_reward

_WORKER_FN = None  # the reward installed once per worker process (so its lazily loaded model is loaded once)


def _install(fn) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


def _timed_call(fn, images, prompts, metadata):
    t0 = time.perf_counter()
    scores, extras = call_reward(fn if fn is not None else _WORKER_FN, images, prompts, metadata)
    return scores, extras, time.perf_counter() - t0


class RewardExecutor:
    """Runs a reward callable in a thread or process pool. `submit` → Future of (scores, extras, compute_s)."""

    def __init__(self, fn, pool: str = "thread", workers: int = 1):
        self.fn = fn
        self.pool_kind = pool
        if pool == "thread":
            self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        elif pool == "process":
            # forkserver: forking a process that holds torch threads can deadlock
            ctx = multiprocessing.get_context("forkserver")
            self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_install, initargs=(fn,))
        else:
            raise ValueError(f"unknown reward pool {pool!r}; choose thread or process")

    def submit(self, images, prompts, metadata) -> Future:
        fn = self.fn if self.pool_kind == "thread" else None
        return self.pool.submit(_timed_call, fn, images, prompts, metadata)

    def call(self, images, prompts, metadata):
        """Synchronous call in this thread (with_reward off, validation)."""
        return _timed_call(self.fn, images, prompts, metadata)

    @staticmethod
    def gather(futures: list[Future]) -> tuple[list, dict[str, list], float, float]:
        """Wait for futures in submission order. Returns (scores, extras, wait_s, compute_s)."""
        t0 = time.perf_counter()
        scores, extras, compute = [], {}, 0.0
        for fut in futures:
            s, ex, c = fut.result()
            scores.extend(s)
            compute += c
            for k, v in ex.items():
                extras.setdefault(k, []).extend(v)
        return scores, extras, time.perf_counter() - t0, compute

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
