"""The table that decides: Flow-GRPO-Fast, DiffusionNFT, AWM (and DGPO) on ocr-mini at equal cores, on the sealed test.

For each algorithm (its recipe), schedule and training seed, one run on the same --cores cores:
  sync      local engine, the recipe as it is (reward futures on), torch on all the cores
  async:K   Ray, 1 actor core + 1 rollout core, schedule async with max_staleness K (one-step-off at K = 1)
Every run saves a checkpoint every --every steps and is stopped (SIGINT: it checkpoints that step) once its
training costs --budget core-minutes, counted as cores × Σ step_s (generation, rewards, update and weight sync;
without its checkpoint writes, and without validation, which is off). Then every checkpoint is scored on the
sealed test numbers (assets/ocr_mini/test.txt) with fresh noise (--eval-seed, not the validation seed), 8 images
per number, 20-step ODE, rapidocr recognition-only — and the base with the same noise, so each gain is paired.

Columns per (algorithm, schedule), over the seeds: core-minutes to a test gain of --target (+0.15; the first
checkpoint at or above it; "> budget" when not reached), the test gain at the budget, mean ± standard error
over seeds (each seed's own standard error over the 16 numbers is in the JSON).

--grid G (issue 36's protocol): every run checkpoints every step, and the checkpoints kept and scored are those on
a fixed grid of core-minutes, the last one at or before each multiple of G, so every algorithm is read at the same
budgets. Time to --target is then the first grid point whose reading reaches it ("> B" for a run that never did
within its B core-minutes), and the table gives the gain at each of --budgets (a first crossing over many noisy
readings favours early crossings; the gains at fixed budgets do not). Runs of one table may have different
budgets (--budget is per invocation). A ratio table compares each algorithm's time to the target with
--reference's (Flow-GRPO-Fast by default) for the same schedule.

    python -m benchmarks algo_table --out docs/tables/algos          # everything: train, score, tabulate
    python -m benchmarks algo_table --out docs/tables/algos --only train --algos nft --schedules async:1,async:2,async:4
    python -m benchmarks algo_table --out docs/tables/algos --only eval --eval-shard 0/2   # score in two processes
    python -m benchmarks algo_table --out docs/tables/algos --only table
    python -m benchmarks algo_table --out docs/tables/sooner --grid 2.5 --algos grpo --budget 40   # issue 36
    python -m benchmarks algo_table --out docs/tables/ceiling --grid 2.5 --algos awm --seeds 0,1 --budget 60 --extend
    python -m benchmarks algo_table --out docs/tables/dgpo --grid 2.5 --algos dgpo --schedules sync,async:1   # DGPO

Writes OUT.md (the table), OUT.json (every number), OUT.png (the curves) and the run directories under --runs-dir.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._procgroup import pinned_and_interruptible  # noqa: E402

RECIPES = {"grpo": "recipes/ocr_mini.yaml", "nft": "recipes/ocr_mini_nft.yaml", "awm": "recipes/ocr_mini_awm.yaml",
           "dgpo": "recipes/ocr_mini_dgpo.yaml"}
NAMES = {"grpo": "Flow-GRPO-Fast", "nft": "DiffusionNFT", "awm": "AWM", "dgpo": "DGPO"}
TEST = REPO / "assets" / "ocr_mini" / "test.txt"


def schedule_overrides(schedule: str) -> list[str]:
    if schedule == "sync":
        return ["engine.kind=local"]
    k = int(schedule.split(":")[1])
    return ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1",
            "engine.schedule=async", f"engine.max_staleness={k}"]


def read_rows(run: Path) -> list[dict]:
    rows = []
    p = run / "metrics.jsonl"
    for line in (p.read_text().splitlines() if p.is_file() else []):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def core_minutes(rows: list[dict], cores: int) -> dict[int, float]:
    """{step: cumulative training core-minutes at its end} = cores × Σ step_s / 60."""
    out, total = {}, 0.0
    for r in rows:
        if r.get("step_s"):
            total += r["step_s"]
            out[r["step"]] = cores * total / 60
    return out


def train_command(run: Path, algo: str, schedule: str, seed: int, args, extend: bool) -> list[str]:
    return [sys.executable, "-m", "gerl.cli", "train", RECIPES[algo], f"output_dir={run}",
            "resume=true" if extend else "overwrite=true",
            f"seed={seed}", "max_steps=10000", "validation.every=-1",
            f"checkpoint.every={1 if args.grid else args.every}",
            "checkpoint.keep_last=0", "log.progress_bar=false", "log.tensorboard=false", "log.images_every=0",
            *schedule_overrides(schedule), *args.overrides]


def train_run(run: Path, algo: str, schedule: str, seed: int, args) -> None:
    """One run to --budget training core-minutes (stopped with SIGINT; it checkpoints the step it is on). With
    --extend, a run that has checkpoints continues from its last one (resume=true: its metrics after that step are
    dropped, its core-minutes keep counting from there) instead of starting over."""
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    extend = args.extend and any((run / "checkpoints").glob("step_*"))
    cmd = train_command(run, algo, schedule, seed, args, extend)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run.mkdir(parents=True, exist_ok=True)
    with (run.parent / f"{run.name}.log").open("a" if extend else "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pinned_and_interruptible(cores))
        stopped = False
        while proc.poll() is None:
            spent = max(core_minutes(read_rows(run), args.cores).values(), default=0.0)
            if not stopped and spent >= args.budget:
                proc.send_signal(signal.SIGINT)  # finish this step, checkpoint it, stop
                stopped = True
            time.sleep(0.5)
    if proc.returncode not in (0, 130):
        tail = (run.parent / f"{run.name}.log").read_text()[-1500:]
        sys.exit(f"algo_table: {run.name} failed (exit {proc.returncode}):\n{tail}")
    if args.grid:
        prune_to_grid(run, args)


def grid_steps(minutes: dict[int, float], grid: float) -> dict[float, int]:
    """{grid point g: the last step whose cumulative core-minutes are ≤ g} for g = grid, 2·grid, … (no step before
    the first point means no reading there; the base is the reading at 0)."""
    out: dict[float, int] = {}
    if not minutes:
        return out
    top = max(minutes.values())
    n = 1
    while n * grid <= top + 1e-9:
        g = round(n * grid, 6)
        within = [s for s, m in minutes.items() if m <= g + 1e-9]
        if within:
            out[g] = max(within)
        n += 1
    return out


def prune_to_grid(run: Path, args) -> None:
    """Delete every checkpoint that is not a grid reading (about 2.6 MB each on ocr-mini, one per step)."""
    import shutil

    keep = set(grid_steps(core_minutes(read_rows(run), args.cores), args.grid).values())
    for c in (run / "checkpoints").glob("step_*"):
        if int(c.name[5:]) not in keep:
            shutil.rmtree(c)


class Scorer:
    """Scores LoRA checkpoints of ocr-mini on the sealed test numbers: one pipeline, the adapter's tensors copied in."""

    def __init__(self, run: Path, eval_seed: int, images_per_prompt: int):
        import torch

        from gerl.config import SamplingConfig, load_config
        from gerl.data.prompts import load_prompts
        from gerl.models.loader import TextEmbedder, add_lora, load_pipeline
        from gerl.workers.rollout import RolloutWorker
        from rewards.ocr import OcrReward

        cfg = load_config(str(run / "config.yaml"))
        torch.set_num_threads(1)
        self.pipe = load_pipeline(cfg.model.path)
        add_lora(self.pipe.transformer, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
        self.params = dict(self.pipe.transformer.named_parameters())
        self.worker = RolloutWorker(self.pipe, TextEmbedder(self.pipe, cfg.model.max_sequence_length),
                                    SamplingConfig(micro_batch_size=32), cfg.model.resolution, 0)
        self.prompts = [p.text for p in load_prompts(str(TEST)) for _ in range(images_per_prompt)]
        self.k, self.seed, self.steps = images_per_prompt, eval_seed, cfg.sampling.eval_num_steps
        self.reward = OcrReward(rec_only=True)

    def __call__(self, trainable: Path | None) -> list[float]:
        import torch
        from safetensors.torch import load_file

        with torch.no_grad():
            if trainable is None:  # the base: every LoRA B at zero
                for n, p in self.params.items():
                    if "lora_" in n:
                        p.zero_() if "lora_B" in n else None
            else:
                for n, t in load_file(str(trainable)).items():
                    self.params[n].copy_(t)
        images = self.worker.sample_images(self.prompts, self.seed, self.steps, 1.0)
        return self.reward(images, self.prompts, [{} for _ in self.prompts])[0]


def score_run(run: Path, args) -> dict:
    """{"base": scores, "steps": {step: scores}} for the run's checkpoints (cached in run/test_eval.json)."""
    cache = run / "test_eval.json"
    done = json.loads(cache.read_text()) if cache.is_file() else {"eval_seed": args.eval_seed, "steps": {}}
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    todo = [c for c in ckpts if str(int(c.name[5:])) not in done["steps"]]
    if "base" not in done or todo:
        scorer = Scorer(run, args.eval_seed, args.images_per_prompt)
        done.setdefault("base", scorer(None))
        for c in todo:
            done["steps"][str(int(c.name[5:]))] = scorer(c / "trainable.safetensors")
            cache.write_text(json.dumps(done))
    cache.write_text(json.dumps(done))
    return done


def paired(base: list, scores: list, k: int) -> tuple[float, float]:
    """Mean gain over the test numbers (each number's k images, paired with the base's same noise) and its stderr."""
    from gerl.cli import paired_gain

    g = paired_gain(base, scores, k)
    return g["mean"], g["stderr"]


def summarize_run(run: Path, args) -> dict:
    rows, ev = read_rows(run), json.loads((run / "test_eval.json").read_text())
    minutes = core_minutes(rows, args.cores)
    curve = []
    for step, scores in sorted(ev["steps"].items(), key=lambda kv: int(kv[0])):
        gain, se = paired(ev["base"], scores, args.images_per_prompt)
        curve.append({"step": int(step), "core_min": minutes.get(int(step)), "gain": gain, "stderr": se})
    base_mean = sum(s for s in ev["base"] if s is not None) / len(ev["base"])
    spent = max(minutes.values(), default=0.0)
    if args.grid:  # read the curve on the grid only: the same budgets for every run
        by_step = {c["step"]: c for c in curve}
        curve = [dict(by_step[s], grid_min=g) for g, s in grid_steps(minutes, args.grid).items() if s in by_step]
        reached = next((c["grid_min"] for c in curve if c["gain"] >= args.target), None)
        at = {g: next((c["gain"] for c in curve if c["grid_min"] == g), None) for g in args.budgets}
        return {"run": run.name, "base_test": base_mean, "core_min_to_target": reached, "spent": spent,
                "gain_at": at, "curve": curve, "steps": max((r["step"] for r in rows if "step_s" in r), default=0),
                "s_per_step": (sum(r["step_s"] for r in rows if r.get("step_s")) /
                               max(1, sum(1 for r in rows if r.get("step_s"))))}
    reached = next((c["core_min"] for c in curve if c["gain"] >= args.target), None)
    within = [c for c in curve if c["core_min"] is not None and c["core_min"] <= args.budget + 1e-9]
    return {"run": run.name, "base_test": base_mean, "core_min_to_target": reached,
            "gain_at_budget": within[-1]["gain"] if within else None, "curve": curve,
            "steps": max((r["step"] for r in rows if "step_s" in r), default=0),
            "s_per_step": (sum(r["step_s"] for r in rows if r.get("step_s")) /
                           max(1, sum(1 for r in rows if r.get("step_s"))))}


def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else None
    return m, se


def fmt_mean_se(xs: list) -> str:
    m, se = mean_se(xs)
    if m is None:
        return "–"
    return f"{m:+.3f}" + ("" if se is None else f" ± {se:.3f}") + ("" if len([x for x in xs if x is not None]) ==
                                                                   len(xs) else f" ({sum(x is not None for x in xs)} of {len(xs)})")


def grid_table(results: dict, args) -> str:
    """One row per (algorithm, schedule): time to the target on the grid, then the gain at each fixed budget."""
    heads = " | ".join(f"gain at {b:g}" for b in args.budgets)
    lines = [f"| algorithm | schedule | seeds | s/step | core-min run | core-min to +{args.target:g} (each seed) | "
             f"{heads} | base test |", "| --- " * (7 + len(args.budgets)) + "|"]
    for key, runs in results.items():
        algo, schedule = key.split("|")
        shown = ", ".join(f"{r['core_min_to_target']:g}" if r["core_min_to_target"] is not None
                          else f"> {math.floor(r['spent'] / args.grid) * args.grid:g}" for r in runs)
        spent = ", ".join(f"{r['spent']:.1f}" for r in runs)
        gains = " | ".join(fmt_mean_se([r["gain_at"].get(b) for r in runs]) for b in args.budgets)
        lines.append(f"| {NAMES[algo]} | {schedule} | {len(runs)} | {sum(r['s_per_step'] for r in runs) / len(runs):.2f} "
                     f"| {spent} | {shown} | {gains} | {runs[0]['base_test']:.3f} |")
    return "\n".join(lines) + "\n"


def ratio_table(results: dict, args) -> str:
    """How many times sooner each algorithm reaches the target than --reference (Flow-GRPO-Fast), against each
    schedule the reference ran (its own schedule, and sync: what a user without the split would run).

    Ratio of the mean times over seeds, its standard error by the delta method (the seeds of the two algorithms
    are independent). A reference seed that never got there counts at its own budget, so the ratio is then a lower
    bound ("≥"); an algorithm seed that never got there makes its own mean a lower bound, so the ratio is an upper
    bound ("≤"); both: no ratio."""
    def times(rs):
        return ([r["core_min_to_target"] if r["core_min_to_target"] is not None
                 else math.floor(r["spent"] / args.grid) * args.grid for r in rs],
                any(r["core_min_to_target"] is None for r in rs))

    def show(m, se, cens):
        return f"{'≥ ' if cens else ''}{m:.1f}" + ("" if se is None or cens else f" ± {se:.1f}")

    lines = [f"| algorithm | schedule | mean core-min to +{args.target:g} | {NAMES[args.reference]} | its mean | "
             "× sooner |", "| --- | --- | --- | --- | --- | --- |"]
    for key, runs in results.items():
        algo, schedule = key.split("|")
        if algo == args.reference:
            continue
        for rkey, ref in results.items():
            ralgo, rsched = rkey.split("|")
            if ralgo != args.reference or rsched not in (schedule, "sync"):
                continue
            (t, t_cens), (tr, tr_cens) = times(runs), times(ref)
            (m, se), (mr, ser) = mean_se(t), mean_se(tr)
            if t_cens and tr_cens:
                ratio = "– (neither reached it on every seed)"
            else:
                r = mr / m
                rel = math.sqrt(((se or 0) / m) ** 2 + ((ser or 0) / mr) ** 2)
                bound = "≥ " if tr_cens else "≤ " if t_cens else ""
                ratio = f"{bound}{r:.2f}" + ("" if bound else f" ± {r * rel:.2f}")
            lines.append(f"| {NAMES[algo]} | {schedule} | {show(m, se, t_cens)} | {rsched} | "
                         f"{show(mr, ser, tr_cens)} | {ratio} |")
    return "\n".join(lines) + "\n"


def plateau_table(results: dict, args) -> str:
    """Where the curves flatten (issue 36's ceiling), for each (algorithm, schedule) with runs past --plateau-from
    core-minutes (F): each run's mean reading over (F, its last grid reading] (L long), the mean of those over the
    runs, and the rise from the L core-minutes before, (F − L, F] — near 0 where the curve is flat — then the
    fraction of the plateau that each fixed budget's mean gain reaches (over the same runs)."""
    f = args.plateau_from
    lines = [f"| algorithm | schedule | runs | readings per run after {f:g} core-min | plateau gain | rise from the "
             "window before | " + " | ".join(f"at {b:g}: fraction" for b in args.budgets) + " |",
             "| --- " * (6 + len(args.budgets)) + "|"]

    def window(r, lo, hi):
        return [c["gain"] for c in r["curve"] if lo + 1e-9 < c["grid_min"] <= hi + 1e-9]

    def end(r):  # the run's last grid reading
        return max((c["grid_min"] for c in r["curve"]), default=0.0)

    for key, runs in results.items():
        algo, schedule = key.split("|")
        long = [r for r in runs if end(r) > f]
        if not long:
            continue
        tails = [window(r, f, end(r)) for r in long]
        m, se = mean_se([sum(t) / len(t) for t in tails])
        before = [window(r, 2 * f - end(r), f) for r in long]
        rise, rise_se = mean_se([sum(t) / len(t) - sum(b) / len(b) for t, b in zip(tails, before) if b])
        fracs = []
        for b in args.budgets:
            g, _ = mean_se([r["gain_at"].get(b) for r in long])
            fracs.append("–" if g is None else f"{g:+.3f}: {g / m:.0%}")
        shown_rise = "–" if rise is None else f"{rise:+.3f}" + ("" if rise_se is None else f" ± {rise_se:.3f}")
        lines.append(f"| {NAMES[algo]} | {schedule} | {len(long)} | {', '.join(str(len(t)) for t in tails)} "
                     f"| {m:+.3f}" + ("" if se is None else f" ± {se:.3f}") + f" | {shown_rise} | {' | '.join(fracs)} |")
    return "\n".join(lines) + "\n"


def table(results: dict, args) -> str:
    if args.grid:
        out = grid_table(results, args) + "\n" + ratio_table(results, args)
        return out + ("\n" + plateau_table(results, args) if args.plateau_from else "")
    lines = [f"| algorithm | schedule | seeds | s/step | core-min to +{args.target:g} (each seed) | "
             f"test gain after {args.budget:g} core-min (mean ± SE over seeds) | base test |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, runs in results.items():
        algo, schedule = key.split("|")
        reach = [r["core_min_to_target"] for r in runs]
        shown = ", ".join(f"{x:.1f}" if x is not None else f"> {args.budget:g}" for x in reach)
        g, gse = mean_se([r["gain_at_budget"] for r in runs])
        lines.append(f"| {NAMES[algo]} | {schedule} | {len(runs)} | {sum(r['s_per_step'] for r in runs) / len(runs):.2f} "
                     f"| {shown} | {'–' if g is None else f'{g:+.3f}'}"
                     f"{'' if gse is None else f' ± {gse:.3f}'} | {runs[0]['base_test']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, args, path: Path) -> None:
    """Sealed-test gain vs training core-minutes: each seed's curve faint, the target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "nft": "tab:orange", "awm": "tab:green", "dgpo": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for key, runs in results.items():
        algo, schedule = key.split("|")
        for i, r in enumerate(runs):
            pts = [(c.get("grid_min", c["core_min"]), c["gain"]) for c in r["curve"] if c["core_min"] is not None]
            pts = [(0.0, 0.0), *pts]  # step 0 is the base: gain 0 by definition
            ax.plot(*zip(*pts), color=colors[algo], ls="-" if schedule == "sync" else "--", alpha=0.8, lw=1.2,
                    label=f"{NAMES[algo]}, {schedule}" if i == 0 else None)
    ax.axhline(args.target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(f"training core-minutes ({args.cores} cores)")
    ax.set_ylabel("sealed-test OCR gain (paired)")
    top = max((r.get("spent", args.budget) for runs in results.values() for r in runs), default=args.budget)
    ax.set_xlim(0, top * 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="OUT.md and OUT.json are written")
    ap.add_argument("--runs-dir", default="runs/algo_table")
    ap.add_argument("--algos", default="grpo,nft,awm")
    ap.add_argument("--schedules", default="sync,async:1", help="sync and/or async:K (1 actor core + 1 rollout core)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--budget", type=float, default=10.0, help="training core-minutes per run")
    ap.add_argument("--extend", action="store_true",
                    help="continue runs that have checkpoints from their last one up to --budget (a CPU resume is "
                         "bit-exact, so this equals one run to --budget)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps (without --grid)")
    ap.add_argument("--grid", type=float, default=0.0,
                    help="read every run on a grid of this many core-minutes (checkpoints every step, pruned to the grid)")
    ap.add_argument("--budgets", default="5,10,20,40", help="with --grid: the gain columns, in core-minutes")
    ap.add_argument("--reference", default="grpo", help="with --grid: the algorithm the × sooner ratios compare with")
    ap.add_argument("--plateau-from", type=float, default=0.0,
                    help="with --grid: also tabulate each run's mean reading from this many core-minutes on (the ceiling)")
    ap.add_argument("--target", type=float, default=0.15, help="test gain whose core-minutes are reported")
    ap.add_argument("--eval-seed", type=int, default=777, help="noise of the test evaluation (fresh: not 1234)")
    ap.add_argument("--images-per-prompt", type=int, default=8)
    ap.add_argument("--only", choices=["train", "eval", "table"], default=None)
    ap.add_argument("--eval-shard", default="0/1", help="I/N: score every N-th run starting at I (parallel scoring)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args(argv)
    args.budgets = [float(b) for b in args.budgets.split(",")]
    algos, schedules = args.algos.split(","), args.schedules.split(",")
    bad = [a for a in algos if a not in RECIPES] + [s for s in schedules if s != "sync" and not s.startswith("async:")]
    if bad:
        print(f"algo_table: unknown {bad[0]!r}; algos: {', '.join(RECIPES)}; schedules: sync, async:K", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    runs_dir = Path(args.runs_dir).resolve()
    plan = [(a, s, seed, runs_dir / f"{a}_{s.replace(':', '')}_seed{seed}") for a in algos for s in schedules
            for seed in seeds]
    if args.only in (None, "train"):
        for a, s, seed, run in plan:
            if not (run / "checkpoints").is_dir() or args.only == "train":
                print(f"algo_table: training {run.name}", flush=True)
                train_run(run, a, s, seed, args)
    if args.only in (None, "eval"):
        i, n = (int(x) for x in args.eval_shard.split("/"))
        for a, s, seed, run in plan[i::n]:
            print(f"algo_table: scoring {run.name}", flush=True)
            score_run(run, args)
    if args.only in (None, "table"):
        results: dict[str, list] = {}
        for a, s, seed, run in plan:
            if (run / "test_eval.json").is_file():
                results.setdefault(f"{a}|{s}", []).append(summarize_run(run, args))
        md = table(results, args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(md)
        out.with_suffix(".json").write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
        plot(results, args, out.with_suffix(".png"))
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
