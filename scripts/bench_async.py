"""Seconds per step of the asynchronous strategies, side by side in one run, with each mode's overlap efficiency.

Modes (tiny SD3, real OCR reward via rapidocr, 2 CPU cores):
  sync          local, rewards computed after generation (with_reward off)
  with_reward   local, each micro-batch's reward submitted as a future while generation goes on
  one_step_off  Ray, actor on 1 core + rollout on 1 core, generation of step t+1 overlaps training of step t
  hybrid        Ray, one colocated worker on 2 cores sharing the model (with_reward on)
Ideal step time per mode (efficiency = ideal / measured, target ≥ 0.9):
  sync          generate + decode + reward + train                (nothing to hide: efficiency ≈ 1 by definition)
  with_reward   generate + decode + one micro-batch's reward + train
  hybrid        as with_reward
  one_step_off  max(generate + decode + exposed reward, train + sync)  (measured on their own cores)

    python scripts/bench_async.py [--steps 8] [--modes sync,with_reward,one_step_off,hybrid] [key=value ...]
"""

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from gerl.cli import _quiet_libraries
from gerl.config import load_config
from gerl.trainer import train

MODES = {
    "sync": ["reward.with_reward=false"],
    "with_reward": ["reward.with_reward=true"],
    "one_step_off": ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1",
                     "engine.schedule=async", "engine.max_staleness=1"],
    "hybrid": ["engine.kind=ray", "engine.hybrid=true", "engine.device=cpu", "engine.cpus_per_worker=2"],
}


def run(mode: str, steps: int, extra: list[str], root: Path) -> list[dict]:
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"output_dir={root / mode}", f"max_steps={steps}", "reward.name=ocr", "log.tensorboard=false",
        "log.progress_bar=false", "validation.every=-1", "checkpoint.every=0", "log.images_every=0",
        *MODES[mode], *extra])
    train(cfg)
    rows = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_s" in r][1:]  # the first step warms up (OCR models, caches)


def ideal(mode: str, rows: list[dict], n_mb: int) -> float:
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
    gen = med("generate_s") + med("decode_s")
    if mode == "sync":
        return gen + med("reward_compute_s") + med("train_s")
    if mode == "one_step_off":
        return max(med("rollout_s"), med("train_s") + med("sync_s"))
    return gen + med("reward_compute_s") / n_mb + med("train_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    _quiet_libraries()
    root = Path(tempfile.mkdtemp(prefix="gerl_bench_async_"))
    cfg = load_config("recipes/tiny_cpu.yaml", args.overrides)
    n_mb = cfg.data.prompts_per_step * cfg.data.group_size // cfg.sampling.micro_batch_size
    print(f"{cfg.data.prompts_per_step}x{cfg.data.group_size} images/step at {cfg.model.resolution}px, {n_mb} "
          f"micro-batches, OCR reward (rapidocr), {args.steps - 1} measured steps per mode (medians)")
    print(f"{'mode':<14}{'step s':>8}{'gen+dec s':>10}{'reward wait s':>14}{'reward cpu s':>13}{'train s':>8}"
          f"{'sync s':>8}{'lag':>5}{'ideal s':>9}{'efficiency':>11}")
    for mode in args.modes.split(","):
        rows = run(mode, args.steps, args.overrides, root)
        med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
        step, best = med("step_s"), ideal(mode, rows, n_mb)
        print(f"{mode:<14}{step:>8.3f}{med('generate_s') + med('decode_s'):>10.3f}{med('reward_wait_s'):>14.3f}"
              f"{med('reward_compute_s'):>13.3f}{med('train_s'):>8.3f}{med('sync_s'):>8.3f}{med('policy_lag'):>5.0f}"
              f"{best:>9.3f}{best / step:>11.2f}", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
