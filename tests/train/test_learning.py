"""The whole loop learns: on JPEG compressibility the reward rises; with the advantage sign flipped it does not.

Both runs share every seed, so the only difference is the sign of the policy gradient.
"""

import json

from gerl.trainer import train
from tests.train.helpers import small_config


def _curve(tmp_path, *extra):
    # The quickstart's shape (4 prompts × 8 images, four updates per step), cut to 40 steps.
    cfg = small_config(tmp_path, "max_steps=40", "data.prompts_per_step=4", "data.group_size=8",
                       "sampling.micro_batch_size=8", "train.mini_batch_size=8", "train.micro_batch_size=8",
                       "train.learning_rate=1.5e-2", "checkpoint.every=0", "reward.name=jpeg_compressibility", *extra)
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == 40
    assert max(r["ratio_max_dev_before_update"] for r in rows) < 1e-4  # on-policy: ratio = 1 before updating
    return sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10


def test_reward_rises_and_flipped_advantage_does_not(tmp_path):
    first, last = _curve(tmp_path / "learn")
    assert last - first > 0.15, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    f_first, f_last = _curve(tmp_path / "flip", "train.flip_advantage=true")
    assert f_last - f_first < 0.0, f"flipped advantages still raised the reward: {f_first:.3f} → {f_last:.3f}"
