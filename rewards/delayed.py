"""`delayed`: another registered reward plus a latency per call — simulates a slow reward server when sizing the
overlap of generation and rewards (benchmarks, capacity planning). The latency is fixed, or heavy-tailed (Pareto):
most calls near `seconds`, a few many times longer, like a shared VLM server under load. Sleeping costs no CPU."""

import random
import threading
import time

from rewards.registry import build_reward, call_reward, register


class Delayed:
    def __init__(self, seconds: float, base: str, base_kwargs: dict | None, distribution: str = "fixed",
                 alpha: float = 1.5, max_seconds: float = 60.0, seed: int = 0):
        if distribution not in ("fixed", "pareto"):
            raise ValueError(f"delayed: distribution={distribution!r} is not one of fixed, pareto")
        if alpha <= 1.0:
            raise ValueError(f"delayed: alpha={alpha} must be > 1 (the Pareto mean is infinite otherwise)")
        self.seconds, self.base, self.base_kwargs = seconds, base, base_kwargs or {}
        self.distribution, self.alpha, self.max_seconds = distribution, alpha, max_seconds
        self._rng, self._lock = random.Random(seed), threading.Lock()
        self._fn = None

    def latency(self) -> float:
        """fixed: `seconds`. pareto: seconds · U^(−1/alpha), U ~ Uniform(0, 1] — minimum `seconds`, mean
        seconds · alpha / (alpha − 1), P(latency > x · seconds) = x^(−alpha); capped at max_seconds."""
        if self.distribution == "fixed":
            return self.seconds
        with self._lock:  # calls arrive from several pool threads
            u = 1.0 - self._rng.random()
        return min(self.seconds * u ** (-1.0 / self.alpha), self.max_seconds)

    def __call__(self, images, prompts, metadata):
        if self._fn is None:
            self._fn = build_reward(self.base, self.base_kwargs)
        time.sleep(self.latency())
        return call_reward(self._fn, images, prompts, metadata)


@register("delayed")
def delayed(seconds: float = 0.5, base: str = "jpeg_compressibility", base_kwargs: dict | None = None,
            distribution: str = "fixed", alpha: float = 1.5, max_seconds: float = 60.0, seed: int = 0) -> Delayed:
    """Args: seconds of latency per call (one micro-batch; the minimum for pareto); base: the reward actually
    computed; distribution: fixed | pareto; alpha: Pareto tail index (> 1; smaller = heavier tail);
    max_seconds: cap on one call's latency; seed: of the latency draws."""
    return Delayed(seconds, base, base_kwargs, distribution, alpha, max_seconds, seed)
