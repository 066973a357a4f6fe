"""Step-barrier async vs streaming under a reward with heavy-tailed latency, side by side in one run.

Both modes: Ray, 1 actor + 1 rollout worker (decoupled, 1 core each on CPU), the same max_staleness k, the same
fixed wall-clock budget of training. The reward is `delayed` with Pareto latency (most calls ~`--min-s`, a few up
to `--max-s`; sleeping costs no CPU) around a base reward. Printed per mode: trained and generated images/s, steps
done, the distribution of policy lag over trained groups, stale groups dropped, and the final reward (mean training
reward of the last 3 steps) after the budget.

    python -m benchmarks stream [--budget 90] [--config recipes/tiny_cpu.yaml] [--base jpeg_compressibility] \\
        [key=value ...]
"""

import argparse
import collections
import json
import shutil
import tempfile
import time
from pathlib import Path

from gerl.logging.quiet import quiet_libraries
from gerl.config import load_config
from gerl.trainer import Trainer, prepare

MODES = {"async": ["engine.schedule=async"], "stream": ["engine.schedule=stream"]}


class _Budget(Exception):
    pass


def run(mode: str, args, root: Path) -> list[dict]:
    reward = {"seconds": args.min_s, "distribution": "pareto", "alpha": args.alpha, "max_seconds": args.max_s,
              "base": args.base, "base_kwargs": json.loads(args.base_kwargs), "seed": 0}
    cfg = load_config(args.config, [
        f"output_dir={root / mode}", "max_steps=100000", "reward.name=delayed", f"reward.kwargs={json.dumps(reward)}",
        f"reward.workers={args.reward_workers}", "log.tensorboard=false", "log.progress_bar=false",
        "validation.every=-1", "checkpoint.every=0", "log.images_every=0", "engine.kind=ray", "engine.hybrid=false",
        "engine.device=cpu", "engine.cpus_per_worker=1", f"engine.max_staleness={args.k}", *MODES[mode],
        *args.overrides])
    trainer = Trainer(cfg, prepare(cfg))
    inner, t0 = trainer.run_step, []

    def run_step(step, handle):  # stop after the wall-clock budget, counted from the first step's start
        if not t0:
            t0.append(time.perf_counter())
        m = inner(step, handle)
        if time.perf_counter() - t0[0] > args.budget:
            raise _Budget
        return m

    trainer.run_step = run_step
    try:
        trainer.fit()
    except _Budget:
        pass
    return [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--budget", type=float, default=90.0, help="seconds of training per mode")
    ap.add_argument("--config", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--base", default="jpeg_compressibility", help="the reward behind the delay")
    ap.add_argument("--base-kwargs", default="{}", help='JSON kwargs of the base reward, e.g. \'{"rec_only": true}\' for ocr')
    ap.add_argument("--k", type=int, default=2, help="engine.max_staleness for both modes")
    ap.add_argument("--min-s", type=float, default=0.2, help="minimum (typical) reward latency per call, s")
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index (smaller = heavier tail)")
    ap.add_argument("--max-s", type=float, default=10.0, help="latency cap per call, s")
    ap.add_argument("--reward-workers", type=int, default=8, help="concurrent reward calls (threads)")
    ap.add_argument("--modes", default="async,stream")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    quiet_libraries()
    root = Path(tempfile.mkdtemp(prefix="gerl_bench_stream_"))
    cfg = load_config(args.config, args.overrides)
    n = cfg.data.group_size
    mean = args.min_s * args.alpha / (args.alpha - 1)
    print(f"{cfg.model.path}: {cfg.data.prompts_per_step}x{n} images/step, k={args.k}, reward {args.base} + Pareto "
          f"latency (min {args.min_s}s, alpha {args.alpha}, mean {mean:.2f}s uncapped, cap {args.max_s}s), "
          f"{args.budget:.0f}s budget per mode")
    print(f"{'mode':<8}{'steps':>6}{'trained img/s':>14}{'generated img/s':>16}{'dropped grp':>12}"
          f"{'final reward':>13}  policy lag over trained groups (lag: share)")
    for mode in args.modes.split(","):
        rows = [r for r in run(mode, args, root) if "step_s" in r]
        wall = sum(r["step_s"] for r in rows)
        trained = sum(r["images"] for r in rows)
        dropped = rows[-1].get("stale_groups_dropped_total", 0) if rows else 0
        lags = collections.Counter()
        for r in rows:
            for lag in r.get("policy_lags") or [r["policy_lag"]] * cfg.data.prompts_per_step:
                lags[lag] += 1
        total = sum(lags.values())
        hist = " ".join(f"{lag}:{c / total:.2f}" for lag, c in sorted(lags.items()))
        final = sum(r["reward_mean"] for r in rows[-3:]) / max(len(rows[-3:]), 1)
        print(f"{mode:<8}{len(rows):>6}{trained / wall:>14.2f}{(trained + dropped * n) / wall:>16.2f}{dropped:>12}"
              f"{final:>13.3f}  {hist}", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
