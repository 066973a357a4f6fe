"""with_reward on vs off with the real OCR reward (rapidocr, PP-OCR ONNX): seconds per step side by side.

Steps alternate between the two modes inside one run (same model, same prompts, same seeds), so machine noise
hits both alike. "ideal" is the on-mode step if only the last micro-batch's reward were exposed:
    ideal = generate + decode + (reward compute of one micro-batch, measured in off mode) + train
and "efficiency" = ideal / measured on-mode step time (1.0 = perfect overlap). The ideal is given twice: with stage
times measured alone (off mode) and with the on-mode's own stage times, which include the cost of the reward
sharing CPU cores with generation.

    python -m benchmarks with_reward [--steps 6] [key=value config overrides ...]
"""

import argparse
import statistics
import sys
import time

from gerl.logging.quiet import quiet_libraries
from gerl.config import load_config
from gerl.trainer import Trainer, prepare


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=6, help="steps per mode")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    quiet_libraries()
    cfg = load_config("recipes/tiny_cpu.yaml", [
        "output_dir=runs/bench_with_reward", "overwrite=true", "reward.name=ocr", "log.tensorboard=false",
        "log.progress_bar=false", "validation.every=-1", "data.prompts_per_step=4", "data.group_size=8",
        "sampling.micro_batch_size=8", *args.overrides])
    trainer = Trainer(cfg, prepare(cfg))
    rollout = trainer.engine.rollout  # the local engine's in-process RolloutRole
    n_mb = trainer.sizes["rollout_micro_batches"]
    rows = {True: [], False: []}
    rollout.generate(*trainer.next_prompts(0), 0)  # warm-up: loads the OCR models
    for step in range(1, 2 * args.steps + 1):
        on = step % 2 == 1
        cfg.reward.with_reward = on  # the role reads this flag on every call
        t0 = time.perf_counter()
        batch, res = rollout.generate(*trainer.next_prompts(step), step)
        m = trainer._train_on(batch, step, res)
        m["step_s"] = time.perf_counter() - t0
        rows[on].append(m)
    trainer.engine.close()

    med = lambda mode, key: statistics.median(r[key] for r in rows[mode])  # noqa: E731
    per_mb_reward = med(False, "reward_compute_s") / n_mb
    # Two ideals: with the stage times measured alone (off mode) — what perfect overlap on free cores would give —
    # and with the on-mode's own stage times, which include the slowdown of sharing the CPU with the reward.
    ideal_clean = med(False, "generate_s") + med(False, "decode_s") + per_mb_reward + med(False, "train_s")
    ideal = med(True, "generate_s") + med(True, "decode_s") + per_mb_reward + med(True, "train_s")
    print(f"{cfg.data.prompts_per_step}x{cfg.data.group_size} images at {cfg.model.resolution}px, {n_mb} micro-batches, "
          f"reward pool={cfg.reward.pool}x{cfg.reward.workers}, {args.steps} steps per mode (medians)")
    print(f"{'mode':<8}{'step s':>8}{'gen s':>8}{'decode s':>9}{'reward wait s':>14}{'reward compute s':>17}{'train s':>8}")
    for mode in (False, True):
        print(f"{'on' if mode else 'off':<8}{med(mode, 'step_s'):>8.3f}{med(mode, 'generate_s'):>8.3f}"
              f"{med(mode, 'decode_s'):>9.3f}{med(mode, 'reward_wait_s'):>14.3f}{med(mode, 'reward_compute_s'):>17.3f}"
              f"{med(mode, 'train_s'):>8.3f}")
    on = med(True, "step_s")
    print(f"speed-up off/on = {med(False, 'step_s') / on:.2f}x; ideal on-mode step = {ideal_clean:.3f} s with "
          f"stand-alone stage times (efficiency {ideal_clean / on:.2f}), {ideal:.3f} s with on-mode stage times "
          f"(efficiency {ideal / on:.2f})")


if __name__ == "__main__":
    sys.exit(main())
