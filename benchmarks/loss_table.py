"""Off-policy losses under staleness: Flow-GRPO-Fast with ppo_clip, tis, topr and cispo at max_staleness K on ocr-mini.

Every run is recipes/ocr_mini.yaml on Ray, 1 actor core + 1 rollout core, schedule async with max_staleness K
(the same engine as algo_table's async:K), a training seed, and one train.loss with its defaults (tis cap 1.0;
cispo ε = train.clip_range both sides; topr split by advantage sign). The runs are compared at equal optimizer
steps (--steps, not core-minutes: the four losses cost the same per step, and a step count does not change when
the machine is busy). Each run saves a checkpoint every --every steps; every checkpoint is scored on the sealed
test numbers with fresh noise, paired with the base (algo_table's scorer: 16 numbers × 8 images, 20-step ODE).

    python -m benchmarks loss_table --out docs/tables/losses                        # train, score, tabulate
    python -m benchmarks loss_table --out docs/tables/losses --only table

Columns: the test gain at the last step and at half of it (mean ± SE: over seeds when there are several, else
the paired standard error over the 16 numbers), the mean policy lag the actor actually trained at, the clipped
fraction, and the largest |ratio − 1| seen — what the loss had to correct.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks import algo_table  # noqa: E402

LOSSES = ("ppo_clip", "tis", "topr", "cispo")


def run_name(loss: str, k: int, seed: int) -> str:
    return f"grpo_{loss}_async{k}_seed{seed}"


def curve(run: Path, images_per_prompt: int) -> list[dict]:
    ev = json.loads((run / "test_eval.json").read_text())
    out = []
    for step, scores in sorted(ev["steps"].items(), key=lambda kv: int(kv[0])):
        gain, se = algo_table.paired(ev["base"], scores, images_per_prompt)
        out.append({"step": int(step), "gain": gain, "stderr": se})
    return out


def training_stats(run: Path) -> dict:
    rows = [r for r in algo_table.read_rows(run) if "step_s" in r]

    def mean(key):
        xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(xs) / len(xs) if xs else None

    dev = [r.get("ratio_max_dev_before_update") for r in rows if isinstance(r.get("ratio_max_dev_before_update"), (int, float))]
    return {"steps": len(rows), "s_per_step": mean("step_s"), "policy_lag": mean("policy_lag"),
            "clipfrac": mean("clipfrac"), "ratio_mean": mean("ratio_mean"), "approx_kl": mean("approx_kl"),
            "ratio_max_dev": max(dev) if dev else None}


def at(points: list[dict], step: int) -> dict | None:
    return next((p for p in points if p["step"] == step), None)


def cell(values: list[dict | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]['gain']:+.3f} ± {vals[0]['stderr']:.3f}"
    m, se = algo_table.mean_se([v["gain"] for v in vals])
    return f"{m:+.3f} ± {se:.3f}"


def table(results: dict, steps: int) -> str:
    half = steps // 2
    lines = [f"| loss | max_staleness | seeds | policy lag (mean) | clipfrac | max \|ratio − 1\| before update | s/step | test gain at step {half} | "
             f"test gain at step {steps} |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, runs in results.items():
        loss, k = key.split("|")

        def avg(name, fmt=".2f"):
            xs = [r["stats"][name] for r in runs if r["stats"][name] is not None]
            return format(sum(xs) / len(xs), fmt) if xs else "–"

        lines.append(f"| {loss} | {k} | {len(runs)} | {avg('policy_lag')} | {avg('clipfrac', '.3f')} | {avg('ratio_max_dev', '.1e')} | {avg('s_per_step')} | "
                     f"{cell([at(r['curve'], half) for r in runs])} | {cell([at(r['curve'], steps) for r in runs])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="OUT.md and OUT.json are written")
    ap.add_argument("--runs-dir", default="runs/loss_table")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--staleness", default="2,4", help="max_staleness values K")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    ap.add_argument("--every", type=int, default=10, help="checkpoint (and score) every N steps")
    ap.add_argument("--eval-seed", type=int, default=777)
    ap.add_argument("--images-per-prompt", type=int, default=8)
    ap.add_argument("--only", choices=["train", "eval", "table"], default=None)
    ap.add_argument("--eval-shard", default="0/1", help="I/N: score every N-th run starting at I")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args(argv)
    losses, ks = args.losses.split(","), [int(k) for k in args.staleness.split(",")]
    bad = [x for x in losses if x not in LOSSES]
    if bad or args.steps < 2 or any(k < 1 for k in ks):
        print(f"loss_table: losses are {', '.join(LOSSES)}; --steps ≥ 2; staleness ≥ 1 (got {args.losses!r}, "
              f"{args.steps}, {args.staleness!r})", file=sys.stderr)
        return 2
    runs_dir = Path(args.runs_dir).resolve()
    plan = [(loss, k, int(s), runs_dir / run_name(loss, k, int(s)))
            for k in ks for loss in losses for s in args.seeds.split(",")]
    # algo_table's trainer stops at a core-minute budget; here the run's own max_steps ends it.
    train_args = argparse.Namespace(cores=2, budget=math.inf, every=args.every, overrides=[])
    if args.only in (None, "train"):
        for loss, k, seed, run in plan:
            if (run / "checkpoints" / f"step_{args.steps:06d}").is_dir() and args.only != "train":
                continue
            print(f"loss_table: training {run.name}", flush=True)
            train_args.overrides = [f"train.loss={loss}", f"max_steps={args.steps}", *args.overrides]
            algo_table.train_run(run, "grpo", f"async:{k}", seed, train_args)
    if args.only in (None, "eval"):
        i, n = (int(x) for x in args.eval_shard.split("/"))
        for loss, k, seed, run in plan[i::n]:
            print(f"loss_table: scoring {run.name}", flush=True)
            algo_table.score_run(run, args)
    if args.only in (None, "table"):
        results: dict[str, list] = {}
        for loss, k, seed, run in plan:
            if (run / "test_eval.json").is_file():
                results.setdefault(f"{loss}|{k}", []).append(
                    {"run": run.name, "curve": curve(run, args.images_per_prompt), "stats": training_stats(run)})
        md = table(results, args.steps)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(md)
        out.with_suffix(".json").write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
