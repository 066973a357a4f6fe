"""`delayed`: another registered reward plus a fixed latency per call — simulates a slow reward server when sizing
the overlap of generation and rewards (benchmarks, capacity planning)."""

import time

from rewards.registry import build_reward, call_reward, register


class Delayed:
    def __init__(self, seconds: float, base: str, base_kwargs: dict | None):
        self.seconds, self.base, self.base_kwargs = seconds, base, base_kwargs or {}
        self._fn = None

    def __call__(self, images, prompts, metadata):
        if self._fn is None:
            self._fn = build_reward(self.base, self.base_kwargs)
        time.sleep(self.seconds)
        return call_reward(self._fn, images, prompts, metadata)


@register("delayed")
def delayed(seconds: float = 0.5, base: str = "jpeg_compressibility", base_kwargs: dict | None = None) -> Delayed:
    """Args: seconds of latency per call (one micro-batch); base: the reward actually computed."""
    return Delayed(seconds, base, base_kwargs)
