"""The `delayed` reward's latency: fixed, or Pareto with the tail the docstring promises (drawn, not slept)."""

import pytest

from gerl.errors import UserError
from rewards.registry import build_reward


def test_fixed_latency():
    assert build_reward("delayed", {"seconds": 0.3}).latency() == 0.3


def test_pareto_latency_has_the_promised_heavy_tail():
    r = build_reward("delayed", {"seconds": 0.1, "distribution": "pareto", "alpha": 1.5, "max_seconds": 50.0})
    xs = [r.latency() for _ in range(20000)]
    assert min(xs) >= 0.1 and max(xs) <= 50.0
    # P(latency > x·seconds) = x^(−alpha): 10 × the minimum is exceeded by about 10^-1.5 ≈ 3.2 % of the calls
    assert sum(x > 1.0 for x in xs) / len(xs) == pytest.approx(10 ** -1.5, rel=0.15)
    assert sorted(xs)[len(xs) // 2] == pytest.approx(0.1 * 2 ** (1 / 1.5), rel=0.05)  # the median
    capped = build_reward("delayed", {"seconds": 0.1, "distribution": "pareto", "max_seconds": 0.2})
    assert max(capped.latency() for _ in range(1000)) == 0.2


def test_bad_arguments_are_refused():
    # the registry turns a factory's ValueError into a one-line UserError naming the reward
    with pytest.raises(UserError, match="'delayed' raised ValueError: delayed: alpha=1.0 must be > 1"):
        build_reward("delayed", {"distribution": "pareto", "alpha": 1.0})
    with pytest.raises(UserError, match="not one of fixed, pareto"):
        build_reward("delayed", {"distribution": "lognormal"})
