"""Print a run's reward curve from metrics.jsonl: the first and last training rewards and every validation.

    python scripts/summarize_run.py RUN_DIR
"""

import json
import sys
from pathlib import Path


def main(run_dir: str) -> None:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("reward_mean") is not None]
    k = max(1, min(10, len(train) // 4))
    first = sum(r["reward_mean"] for r in train[:k]) / k
    last = sum(r["reward_mean"] for r in train[-k:]) / k
    total = sum(r.get("step_s", 0) for r in train)
    print(f"{run_dir}: {len(train)} steps in {total:.0f} s of step time")
    print(f"  train reward, mean of first {k} steps: {first:.4f}   last {k} steps: {last:.4f}   change: {last - first:+.4f}")
    val = [r for r in rows if r.get("val_reward_mean") is not None]
    for r in val:
        print(f"  validation at step {r['step']:>4}: {r['val_reward_mean']:.4f}")
    if len(val) > 1:
        print(f"  validation change: {val[-1]['val_reward_mean'] - val[0]['val_reward_mean']:+.4f} "
              f"(step {val[0]['step']} → {val[-1]['step']})")
    print(f"  max |ratio-1| before any update, over all steps: {max(r.get('ratio_max_dev_before_update', 0) for r in train):.2e}")
    print(f"  look at: {run_dir}/samples/*.png   tensorboard --logdir {run_dir}/tensorboard")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart")
