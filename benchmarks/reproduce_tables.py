"""The seed tables in miniature: one recipe trained under each asynchronous strategy on equal resources (the same
CPU cores), with GeRL's columns — throughput per core, steps and core-hours to reach and hold a target validation
reward, final reward — and the speed-up against sync.

Strategies (overrides from benchmarks/bench_async.py's MODES; every run is pinned to the first --cores cores):
  sync          local engine, rewards after generation (with_reward off)
  with_reward   local engine, reward futures per micro-batch
  one_step_off  Ray, actor on cores/2 + rollout on cores/2, max_staleness 1
  hybrid        Ray, one colocated worker on all cores (with_reward on)
  stale2        as one_step_off with max_staleness 2

Each run is `gerl train RECIPE` in a subprocess, stopped at --max-steps or after --budget-s wall seconds (SIGINT:
the run closes cleanly and keeps the validations it logged; SIGKILL if it has not stopped 60 s later). As soon as
a run finishes its row is appended: the markdown table (--table), a JSON copy (same path, .json) and the
comparison plot (--plot: validation reward vs core-hours and images/s per core) are rewritten.

Definitions: devices = cores; core-hours = cores × Σ(step_s + validate_s) (gerl/logging/throughput.py);
images/s/core = images generated / (cores × the same wall seconds); "to target" = the first validation ≥ --target
that holds for --hold validations.

    python -m benchmarks reproduce_tables --recipe recipes/tiny_cpu.yaml --max-steps 40 --budget-s 240 \\
        --target -3.5 --table runs/tables/table.md --plot runs/tables/strategies.png [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procgroup import pinned_and_interruptible  # noqa: E402
from bench_async import MODES, REPO  # noqa: E402  (benchmarks/ is on sys.path above)

from gerl.logging.throughput import gpu_hours, gpu_hours_to_target, images_per_s_per_device, row_wall_s  # noqa: E402

STRATEGIES = ["sync", "with_reward", "one_step_off", "hybrid", "stale2"]
PLACEMENT = {"sync": "{all} shared (local)", "with_reward": "{all} shared (local)", "one_step_off": "{half} / {half}",
             "hybrid": "{all} shared (Ray)", "stale2": "{half} / {half}"}
COLUMNS = ["strategy", "cores actor / rollout", "steps run", "images/s/core", "speed-up vs sync (images/s)",
           "steps to target", "core-hours to target", "speed-up vs sync (to target)", "final val reward",
           "best val reward"]


# ------------------------------------------------------------------ pure: one row from a run's metrics

def steps_to_target(rows: list[dict], target: float, hold: int) -> int | None:
    """Step of the first validation ≥ target that holds for `hold` validations (the rule of
    throughput.gpu_hours_to_target); None if never."""
    vals = [(r["step"], float(r["val_reward_mean"])) for r in rows
            if isinstance(r.get("val_reward_mean"), (int, float)) and math.isfinite(r["val_reward_mean"])]
    for i in range(len(vals) - hold + 1):
        if all(v >= target for _, v in vals[i:i + hold]):
            return vals[i][0]
    return None


def summarize(strategy: str, rows: list[dict], cores: int, target: float, hold: int) -> dict:
    """The numbers of one table row (None where a run never got there)."""
    # Over the whole run, validation included (as in core-hours): with an async schedule a validation waits for the
    # generation queued ahead of it, so per-step step_s alone would leave part of the generation out.
    images = sum(int(r.get("images") or 0) for r in rows)
    wall = sum(row_wall_s(r) for r in rows)
    vals = [float(r["val_reward_mean"]) for r in rows if isinstance(r.get("val_reward_mean"), (int, float))
            and math.isfinite(r["val_reward_mean"])]
    return {
        "strategy": strategy, "cores": cores, "steps_run": max((r["step"] for r in rows), default=0),
        "images_per_s_per_core": images_per_s_per_device(images, wall, cores) if images else None,
        "steps_to_target": steps_to_target(rows, target, hold),
        "core_hours_to_target": gpu_hours_to_target(rows, cores, target, hold),
        "core_hours_total": gpu_hours(rows, cores)[-1] if rows else 0.0,
        "final_val_reward": vals[-1] if vals else None, "best_val_reward": max(vals) if vals else None,
        "target": target, "hold": hold,
    }


def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table_markdown(results: list[dict], cores: int) -> str:
    """The markdown table; speed-ups are against the sync row (when present and measured)."""
    sync = next((r for r in results if r["strategy"] == "sync"), None)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in results:
        place = PLACEMENT.get(r["strategy"], "?").format(all=cores, half=max(cores // 2, 1))
        up = up_t = None
        if sync and sync["images_per_s_per_core"] and r["images_per_s_per_core"]:
            up = r["images_per_s_per_core"] / sync["images_per_s_per_core"]
        if sync and sync["core_hours_to_target"] and r["core_hours_to_target"]:
            up_t = sync["core_hours_to_target"] / r["core_hours_to_target"]
        hours = (_f(r["core_hours_to_target"], ".4f") if r["core_hours_to_target"] is not None
                 else f"not reached ({r['core_hours_total']:.4f} total)")
        cells = [r["strategy"], place, str(r["steps_run"]), _f(r["images_per_s_per_core"], ".2f"),
                 "–" if up is None else f"{up:.2f}×", _f(r["steps_to_target"], "d"), hours,
                 "–" if up_t is None else f"{up_t:.2f}×", _f(r["final_val_reward"], ".3f"),
                 _f(r["best_val_reward"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], curves: dict[str, list[tuple[float, float]]], path: Path, target: float) -> None:
    """Left: validation reward vs core-hours per strategy (target dashed); right: images/s per core."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    for name, pts in curves.items():
        ax.plot([h for h, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set(xlabel="core-hours", ylabel="validation reward (mean)", title="Validation reward vs core-hours")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = [r["strategy"] for r in results]
    bx.bar(names, [r["images_per_s_per_core"] or 0.0 for r in results], color="#4c78a8")
    bx.set(ylabel="images/s per core", title="Throughput at equal cores")
    bx.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


# ------------------------------------------------------------------ running

def read_rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a run stopped mid-write leaves its last line half written
            pass
    return out


def train_one(strategy: str, args, cores: list[int], overrides: list[str]) -> Path:
    """Run one strategy to --max-steps or --budget-s; returns its run directory."""
    half, allc = max(len(cores) // 2, 1), len(cores)
    run_dir = Path(args.runs_dir).resolve() / strategy
    cmd = [sys.executable, "-m", "gerl.cli", "train", args.recipe, f"output_dir={run_dir}", "overwrite=true",
           f"max_steps={args.max_steps}", "log.progress_bar=false", "engine.actor_workers=1",
           "engine.rollout_workers=1", f"metrics.target_val_reward={args.target}", f"metrics.target_hold={args.hold}",
           *[a.format(half=half, all=allc) for a in MODES[strategy]], *overrides]
    env = dict(os.environ, RAY_AUTH_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = (Path(args.runs_dir) / f"{strategy}.log").open("w")
    t0, stopped = time.monotonic(), False
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=pinned_and_interruptible(cores))
    try:
        while proc.poll() is None:
            if args.budget_s and time.monotonic() - t0 > args.budget_s:
                stopped = True
                proc.send_signal(signal.SIGINT)  # the trainer closes its engine and logs; validations are kept
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    # A run stopped by the budget keeps the rows it logged (maybe none: an empty row); a crash stops the table.
    if proc.returncode != 0 and not stopped:
        tail = (Path(args.runs_dir) / f"{strategy}.log").read_text()[-2000:]
        sys.exit(f"reproduce_tables: {strategy} failed (exit {proc.returncode}); its log ends:\n{tail}")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--recipe", required=True, help="base recipe (YAML); its validation.every must be > 0")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--max-steps", type=int, required=True, help="step budget per run")
    ap.add_argument("--budget-s", type=float, default=0.0, help="wall-clock budget per run, seconds (0 = none)")
    ap.add_argument("--target", type=float, required=True, help="target validation reward")
    ap.add_argument("--hold", type=int, default=2, help="validations in a row the target must hold")
    ap.add_argument("--cores", type=int, default=2, help="cores every run gets (the first N of this machine)")
    ap.add_argument("--runs-dir", default="runs/tables")
    ap.add_argument("--table", required=True, help="markdown table to write (and a .json beside it)")
    ap.add_argument("--plot", required=True, help="comparison plot PNG to write")
    ap.add_argument("--reuse", action="store_true", help="tabulate existing run directories instead of training")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = ap.parse_args(argv)
    strategies = args.strategies.split(",")
    avail = sorted(os.sched_getaffinity(0))
    problems = []
    if [s for s in strategies if s not in STRATEGIES]:
        problems.append(f"--strategies must be from {','.join(STRATEGIES)}")
    if not 2 <= args.cores <= len(avail):
        problems.append(f"--cores must be between 2 and {len(avail)}")
    if args.max_steps < 1 or args.hold < 1 or args.budget_s < 0:
        problems.append("--max-steps and --hold must be ≥ 1, --budget-s ≥ 0")
    if not (REPO / args.recipe).is_file() and not Path(args.recipe).is_file():
        problems.append(f"--recipe {args.recipe} does not exist")
    if problems:
        print("reproduce_tables: " + "; ".join(problems), file=sys.stderr)
        return 2
    from gerl.config import load_config
    from gerl.errors import UserError

    args.recipe = str(Path(args.recipe) if Path(args.recipe).is_file() else REPO / args.recipe)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except UserError as e:
        print(f"reproduce_tables: {e}", file=sys.stderr)
        return 2
    if cfg.validation.every <= 0:
        print("reproduce_tables: the recipe never validates during training; pass validation.every=N (N > 0)",
              file=sys.stderr)
        return 2
    cores = avail[:args.cores]
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    table, js, png = Path(args.table), Path(args.table).with_suffix(".json"), Path(args.plot)
    table.parent.mkdir(parents=True, exist_ok=True)
    results, curves = [], {}
    for s in strategies:
        run_dir = Path(args.runs_dir).resolve() / s
        if not (args.reuse and read_rows(run_dir)):
            run_dir = train_one(s, args, cores, args.overrides)
        rows = read_rows(run_dir)
        results.append(summarize(s, rows, len(cores), args.target, args.hold))
        results[-1]["load_avg_1min_after"] = os.getloadavg()[0]  # > cores: other jobs shared the machine
        hours = gpu_hours(rows, len(cores))
        curves[s] = [(h, float(r["val_reward_mean"])) for r, h in zip(rows, hours)
                     if isinstance(r.get("val_reward_mean"), (int, float)) and math.isfinite(r["val_reward_mean"])]
        table.write_text(table_markdown(results, len(cores)))
        js.write_text(json.dumps({"results": results, "curves": curves, "cores": cores, "argv": sys.argv}, indent=1))
        plot(results, curves, png, args.target)
        print(table_markdown(results, len(cores)).splitlines()[-1], flush=True)
    print(f"reproduce_tables: wrote {table}, {js} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
