"""Rewards with injected faults, for tests (real pools, real timeouts; only the reward's misbehaviour is staged)."""

import os
import threading
import time
import zlib

from rewards.jpeg import jpeg_kb

_ATTEMPTS: dict = {}
_LOCK = threading.Lock()


def behaviour(prompt: str) -> str:
    """Deterministic per prompt: 'raise' on every call, 'hang' past the timeout on the first call, or 'ok'."""
    return ("raise", "hang", "ok", "ok")[zlib.crc32(prompt.encode()) % 4]


class Flaky:
    def __init__(self, hang_s: float = 2.0):
        self.hang_s = hang_s

    def __call__(self, images, prompts, metadata):
        kind = behaviour(prompts[0])
        with _LOCK:
            n = _ATTEMPTS[prompts[0]] = _ATTEMPTS.get(prompts[0], 0) + 1
        if kind == "raise":
            raise RuntimeError(f"injected failure for {prompts[0]!r}")
        if kind == "hang" and n == 1:
            time.sleep(self.hang_s)
        return [-jpeg_kb(im) for im in images]


def flaky(hang_s: float = 2.0) -> Flaky:
    return Flaky(hang_s)


class DiesOn:
    """Kills its worker process when it sees the prompt 'die' (a crashed reward worker)."""

    def __call__(self, images, prompts, metadata):
        if "die" in prompts:
            os._exit(1)
        return [float(len(p)) for p in prompts]


class Sleepy:
    """Sleeps `delays[prompt]` seconds: lets later micro-batches finish before earlier ones."""

    def __init__(self, delays: dict):
        self.delays = delays

    def __call__(self, images, prompts, metadata):
        time.sleep(self.delays.get(prompts[0], 0.0))
        return [float(self.delays.get(p, 0.0)) for p in prompts]


class Constant:
    def __init__(self, values: dict):
        self.values = values

    def __call__(self, images, prompts, metadata):
        return [self.values.get(p) for p in prompts]
