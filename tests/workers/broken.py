"""Rewards broken in each way a user's reward can be (for fault tests): only the misbehaviour is staged."""

import math
import threading

from rewards.jpeg import jpeg_kb


def wrong_length(images, prompts, metadata):
    return [1.0] * (len(images) + 1)


def strings(images, prompts, metadata):
    return ["good"] * len(images)


def all_nan(images, prompts, metadata):
    return [math.nan] * len(images)


def raises(images, prompts, metadata):
    raise RuntimeError("the reward model is not loaded")


def returns_none(images, prompts, metadata):
    return None


def nan_and_inf(images, prompts, metadata):
    """NaN for prompts containing 'nan', inf for 'inf', None for 'none', else the prompt length."""
    out = {"nan": math.nan, "inf": math.inf, "none": None}
    return [next((v for k, v in out.items() if k in p), float(len(p))) for p in prompts]


class BreaksAfter:
    """Scores by JPEG size for the first `calls` calls, then raises the same error on every call."""

    def __init__(self, calls: int = 2):
        self.calls, self.n, self.lock = calls, 0, threading.Lock()

    def __call__(self, images, prompts, metadata):
        with self.lock:
            self.n += 1
            n = self.n
        if n > self.calls:
            raise ValueError("reward server returned HTTP 500")
        return [-jpeg_kb(im) for im in images]


class OnlyPrompts:
    """Scores (by JPEG size) the prompts listed in `path`, returns None for every other prompt."""

    def __init__(self, path: str):
        with open(path) as f:
            self.known = {ln.strip() for ln in f if ln.strip()}

    def __call__(self, images, prompts, metadata):
        return [-jpeg_kb(im) if p in self.known else None for im, p in zip(images, prompts)]
