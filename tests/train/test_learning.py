"""The whole loop learns the mission's task: on ocr-mini with the real OCR reward (rapidocr) the reward rises; with the
advantage sign flipped it does not.

Both runs share every seed, so the only difference is the sign of the policy gradient. The margins were set from
the measured curves (docs/benchmarks.md, "ocr-mini quickstart"): the learning run gains far more than the noise of a
20-step mean, and the flipped run loses.
"""

import json
from pathlib import Path

from gerl.config import load_config
from gerl.trainer import train

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def _curve(tmp_path, *extra):
    cfg = load_config(str(REPO / "recipes" / "ocr_mini.yaml"), [
        f"output_dir={tmp_path}", f"max_steps={STEPS}",
        f"data.train_prompts={REPO / 'assets/ocr_mini/train.txt'}",
        f"data.test_prompts={REPO / 'assets/ocr_mini/test.txt'}",
        "validation.every=-1", "log.tensorboard=false", "log.progress_bar=false", "log.images_every=0",
        "checkpoint.every=0", *extra])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    assert len(rewards) == STEPS
    assert max(r["ratio_max_dev_before_update"] for r in rows if "ratio_max_dev_before_update" in r) < 1e-4
    k = 8
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def test_ocr_reward_rises_and_flipped_advantage_does_not(tmp_path):
    first, last = _curve(tmp_path / "learn")
    f_first, f_last = _curve(tmp_path / "flip", "train.flip_advantage=true")
    summary = f"learning {first:.3f} → {last:.3f}, flipped {f_first:.3f} → {f_last:.3f} (mean of the first/last 8 steps)"
    assert last - first > 0.02, f"OCR reward did not rise: {summary}"
    assert f_last - f_first < 0.0, f"flipped advantages did not lower the OCR reward: {summary}"
    assert last - f_last > 0.1, f"the policy gradient's sign barely matters: {summary}"
