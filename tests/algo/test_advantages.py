"""Advantages: group normalisation worked by hand, the global-std variant, clipping, the per-prompt tracker."""

import json
import math

import pytest
import torch

from gerl.algo.advantages import ADVANTAGES, PerPromptTracker, compute_advantages, global_std_advantages, group_advantages

REWARDS = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 0.0, 4.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])


def test_group_advantages_by_hand():
    adv = group_advantages(REWARDS, GROUPS)
    s = math.sqrt(2 / 3)  # population std of (1, 2, 3), as Flow-GRPO's np.std
    expected = torch.tensor([-1 / s, 0.0, 1 / s, 0.0, 0.0, 0.0, -1.0, 1.0])
    torch.testing.assert_close(adv, expected, rtol=1e-3, atol=1e-3)
    for g in (0, 2):  # every non-constant group is standardised on its own
        a = adv[GROUPS == g]
        assert abs(a.mean().item()) < 1e-6
        assert a.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)


def test_constant_group_gives_zeros_not_nan():
    adv = group_advantages(torch.full((4,), 0.7), torch.zeros(4, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(4))


def test_groups_are_independent_and_may_interleave():
    adv = group_advantages(REWARDS, GROUPS)
    changed = REWARDS.clone()
    changed[6:] = torch.tensor([-50.0, 100.0])  # only group 2 changes
    adv2 = group_advantages(changed, GROUPS)
    torch.testing.assert_close(adv2[:6], adv[:6], rtol=0, atol=0)
    # Group membership comes from the ids, not from positions.
    perm = torch.tensor([6, 0, 3, 1, 7, 4, 2, 5])
    torch.testing.assert_close(group_advantages(REWARDS[perm], GROUPS[perm]), adv[perm])


def test_global_std_uses_the_batch_std():
    adv = global_std_advantages(REWARDS, GROUPS)
    centred = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -2.0, 2.0])  # minus each group's mean
    batch_std = REWARDS.std(unbiased=False)
    torch.testing.assert_close(adv, centred / batch_std, rtol=1e-3, atol=1e-4)
    # Relative scale between groups survives (group 2 spreads twice as far as group 0), unlike group-std.
    assert adv[7] / adv[2] == pytest.approx(2.0, rel=1e-4)
    assert torch.all(global_std_advantages(torch.full((4,), 3.0), torch.tensor([0, 0, 1, 1])) == 0)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_compute_advantages_clips(name):
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # a lone success: advantage sqrt(7) ≈ 2.65
    groups = torch.zeros(8, dtype=torch.long)
    raw = ADVANTAGES[name](rewards, groups)
    clipped = compute_advantages(name, rewards, groups, clip=1.0)
    assert raw.max() > 1.0 and raw.min() > -1.0
    torch.testing.assert_close(clipped, raw.clamp(-1.0, 1.0))
    assert clipped.max() == 1.0
    # Integer rewards are accepted (cast to float).
    ints = compute_advantages(name, torch.tensor([0, 1, 0, 1]), torch.zeros(4, dtype=torch.long), clip=5.0)
    assert ints.dtype == torch.float32 and torch.allclose(ints.abs(), torch.ones(4), atol=1e-3)


def test_unknown_advantage_lists_registered_names():
    with pytest.raises(ValueError, match="unknown advantage 'rloo'") as e:
        compute_advantages("rloo", REWARDS, GROUPS, 5.0)
    assert all(name in str(e.value) for name in ADVANTAGES)


def test_per_prompt_tracker_uses_each_prompts_history():
    tracker = PerPromptTracker(buffer=4)
    a1 = tracker.advantages(["a", "a", "b", "b"], torch.tensor([1.0, 3.0, 5.0, 5.0]))
    torch.testing.assert_close(a1, torch.tensor([-1.0, 1.0, 0.0, 0.0]), rtol=1e-3, atol=1e-3)
    # Second step: prompt "a" is normalised against its 4 rewards so far (1, 3, 2, 2): mean 2, std sqrt(0.5).
    a2 = tracker.advantages(["a", "a"], torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(a2, torch.zeros(2), atol=1e-3, rtol=0)
    a3 = tracker.advantages(["a"], torch.tensor([4.0]))
    # The buffer keeps the last 4: (3, 2, 2, 4), mean 2.75, population std sqrt(0.6875).
    assert list(tracker.history["a"]) == [3.0, 2.0, 2.0, 4.0]
    assert a3.item() == pytest.approx((4 - 2.75) / (math.sqrt(0.6875) + 1e-4), rel=1e-5)
    assert list(tracker.history["b"]) == [5.0, 5.0]


def test_per_prompt_tracker_state_dict_round_trip():
    tracker = PerPromptTracker(buffer=3)
    tracker.advantages(["a", "b", "a", "a", "a"], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    state = json.loads(json.dumps(tracker.state_dict()))  # plain data: survives a JSON / checkpoint round trip
    restored = PerPromptTracker(buffer=99)
    restored.load_state_dict(state)
    assert restored.buffer == 3
    assert {p: list(h) for p, h in restored.history.items()} == {"a": [3.0, 4.0, 5.0], "b": [2.0]}
    nxt = (["a", "b", "c"], torch.tensor([0.5, 7.0, 1.0]))
    torch.testing.assert_close(restored.advantages(*nxt), tracker.advantages(*nxt))
    assert len(restored.history["a"]) == 3, "the restored buffer keeps its maxlen"
