"""`gerl report RUN... [--out PATH]`: one self-contained HTML page (inline CSS, PNGs in a sibling folder referenced
by relative paths, nothing fetched from the network) comparing runs: validation reward against steps and against
GPU-hours (core-hours for CPU runs), training reward ± std, KL / clip fraction / gradient norm where they apply to
the run's algorithm (gerl/logging/describe.py), the seed table's columns — algorithm, loss and schedule read from
each run's config.yaml — with the final and best validation reward, validation samples across steps (each tile
captioned with its score and prompt from the grid's JSON sidecar), and a Gantt chart of each run's stage timeline.

Everything is recomputed from the run directory (config.yaml, metrics.jsonl, timeline.jsonl, samples/), so runs
logged before a metric existed still get their throughput and GPU-hour columns.
"""

from __future__ import annotations

import html
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from PIL import Image

from gerl.errors import UserError
from gerl.logging import plots
from gerl.logging.describe import TRAIN_CURVES, algorithm, curves_that_apply, loss, schedule, setting
from gerl.logging.images import read_grid_captions
from gerl.logging.throughput import gpu_hours, gpu_hours_to_target, images_per_s_per_device
from gerl.logging.timeline import read_timeline

SEED_COLUMNS = ["Run", "Model", "Algorithm", "Loss", "Hybrid Engine", "# Cards", "Reward Fn", "Async Strategy",
                "# GPUs actor / rollout", "Batch Size", "rollout.n", "Learning Rate", "# Val Samples",
                "Throughput (images/s/GPU)", "# GPU Hour", "Final Val Reward", "Best Val Reward"]
STAGES = ["generate_s", "decode_s", "reward_wait_s", "reward_compute_s", "train_s", "sync_s", "validate_s", "step_s"]
SAMPLE_PROMPTS = 4  # validation prompts shown across steps
SAMPLE_STEPS = 6  # at most this many validation steps in the sample matrix
GANTT_STEPS = 3  # the Gantt chart shows the last this many steps
_MISSING = object()


@dataclass
class Run:
    path: Path
    name: str
    config: dict
    rows: list[dict]
    spans: list[dict]
    warnings: list[str] = field(default_factory=list)


def _get(cfg: dict, dotted: str, default=_MISSING):
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def load_run(path: Path) -> Run:
    """Read a run directory. UserError (one line: the path and the fix) when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"run directory {path} does not exist; pass a directory written by `gerl train` "
                        "(it holds metrics.jsonl)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path} holds no metrics.jsonl; pass a run directory written by `gerl train` (its output_dir)")
    warnings: list[str] = []
    lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a run still writing: its last line may be half written
                warnings.append("the last line of metrics.jsonl is incomplete and was left out")
                continue
            raise UserError(f"{metrics} line {i + 1} is not JSON; repair or delete that line") from None
    if not rows:
        raise UserError(f"{metrics} is empty: the run has not logged a step yet; report it after its first step")
    config = {}
    if (path / "config.yaml").is_file():
        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    else:
        warnings.append("no config.yaml: the table's config columns are unknown")
    spans = read_timeline(path)
    return Run(path, path.resolve().name, config, rows, spans, warnings)


# ------------------------------------------------------------------ derived numbers

def devices_of(run: Run) -> float:
    """Devices in use: the last logged "devices", else what config.yaml's engine section implies."""
    for row in reversed(run.rows):  # a float when hosts share GPUs (engine.gpus_per_worker < 1)
        if isinstance(row.get("devices"), (int, float)) and row["devices"] > 0:
            return row["devices"]
    return _placement(run.config)[0]


def _placement(cfg: dict) -> tuple[int, int, int, bool]:
    """(devices, actor devices, rollout devices, shared) from engine.{kind, hybrid, actor_workers, rollout_workers};
    the local engine (or a config without an engine section) is one shared device."""
    if setting(cfg, "engine.kind") == "local":
        return 1, 1, 1, True
    actor, rollout = setting(cfg, "engine.actor_workers"), setting(cfg, "engine.rollout_workers")
    if setting(cfg, "engine.hybrid"):
        return max(actor, rollout), actor, rollout, True
    return actor + rollout, actor, rollout, False


def is_cpu_run(run: Run) -> bool:
    """The run logged device_type=cpu (runs from before that key are taken for GPU runs)."""
    return any(r.get("device_type") == "cpu" for r in run.rows)


def hour_units(run: Run) -> tuple[int, str]:
    """(units counted per device-hour, name): (1, "GPU-hours"), or on CPU (cores per device, "core-hours")."""
    if not is_cpu_run(run):
        return 1, "GPU-hours"
    cores = next((r["cores_per_device"] for r in reversed(run.rows) if isinstance(r.get("cores_per_device"), int)), 1)
    return max(cores, 1), "core-hours"


def validation_points(run: Run) -> list[tuple[int, float, float]]:
    """[(step, cumulative GPU-hours — core-hours on CPU — at the end of that validation, val_reward_mean)]."""
    hours = gpu_hours(run.rows, devices_of(run) * hour_units(run)[0])
    return [(r["step"], h, float(r["val_reward_mean"])) for r, h in zip(run.rows, hours)
            if isinstance(r.get("val_reward_mean"), (int, float)) and math.isfinite(r["val_reward_mean"])]


def throughput(run: Run) -> float | None:
    """Median over training steps of images / (step_s × devices)."""
    d = devices_of(run)
    vals = [images_per_s_per_device(r["images"], r["step_s"], d) for r in run.rows
            if isinstance(r.get("images"), int) and isinstance(r.get("step_s"), (int, float))]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _model_name(path: str) -> str:
    p = str(path).lower()
    for key, name in (("3.5-large", "SD3.5-L"), ("3.5-medium", "SD3.5-M"), ("3-medium", "SD3-M")):
        if key in p:
            return name
    return "tiny SD3 (offline)" if p == "tiny" else Path(str(path)).name or str(path)


def seed_row(run: Run) -> dict[str, str]:
    """The seed table's columns for one run, as display strings ("?" where the config does not say)."""
    cfg = run.config
    g = lambda key: _get(cfg, key, None)  # noqa: E731
    _, actor, rollout, shared = _placement(cfg)
    devices = devices_of(run)
    if g("engine.hybrid") is None or g("engine.kind") in (None, "local"):
        hybrid_text = "yes (local)"
    else:
        hybrid_text = "yes" if g("engine.hybrid") else "no"
    comps = g("reward.components") or []
    reward = (" + ".join(f"{c.get('weight', 1)}×{c.get('name')}" for c in comps) if comps
              else str(g("reward.name") or "?"))
    placement = f"{actor} / {rollout}" + (" (shared)" if shared else "")
    pps, n = g("data.prompts_per_step"), g("data.group_size")
    batch = f"{pps * n} ({pps}×{n})" if isinstance(pps, int) and isinstance(n, int) else "?"
    lr = g("train.learning_rate")
    val_n = next((r["val_num_prompts"] for r in run.rows if "val_num_prompts" in r), None)
    if val_n is None:
        val_n = g("validation.num_prompts") if (g("validation.every") or 0) >= 0 else 0
    tput = throughput(run)
    target, hold = _target(cfg)
    per_device, unit = hour_units(run)
    to_target = gpu_hours_to_target(run.rows, devices * per_device, target, hold)
    total = gpu_hours(run.rows, devices * per_device)[-1]
    hours = (f"{to_target:.3g} (to val ≥ {target:g})" if to_target is not None
             else f"{total:.3g} total (target {target:g} not reached)")
    if unit != "GPU-hours":
        hours += f" {unit}"
    vals = validation_points(run)
    best = max(vals, key=lambda v: v[2]) if vals else None
    text = lambda v, spec="": "?" if v is None else format(v, spec)  # noqa: E731
    return {
        "Run": run.name, "Model": _model_name(g("model.path") or "?"),
        "Algorithm": algorithm(cfg) if cfg else "?", "Loss": loss(cfg) if cfg else "?",
        "Hybrid Engine": hybrid_text, "# Cards": f"{devices:g}", "Reward Fn": reward,
        "Async Strategy": schedule(cfg) if cfg else "?", "# GPUs actor / rollout": placement, "Batch Size": batch,
        "rollout.n": text(n), "Learning Rate": text(lr, "g"), "# Val Samples": text(val_n),
        "Throughput (images/s/GPU)": text(tput, ".3g"), "# GPU Hour": hours,
        "Final Val Reward": f"{vals[-1][2]:.4g} (step {vals[-1][0]})" if vals else "–",
        "Best Val Reward": f"{best[2]:.4g} (step {best[0]})" if best else "–",
    }


def _target(cfg: dict) -> tuple[float, int]:
    return float(setting(cfg, "metrics.target_val_reward")), int(setting(cfg, "metrics.target_hold"))


def component_curves(run: Run) -> dict[str, dict[str, tuple[list, list]]]:
    """Every reward component (and numeric per-sample extra) the run logged, raw:
    {name: {"train" | "validation": (steps, means)}}. Train keys are `reward/<name>`, validation keys
    `val_reward/<name>`, a trailing "_raw" dropped; the raw weighted total (`reward_raw_mean`) is "total (raw)"."""
    out: dict[str, dict[str, tuple[list, list]]] = {}
    for row in run.rows:
        for key, v in row.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or "step" not in row:
                continue
            split = "validation" if key.startswith("val_") else "train"
            name = key.removeprefix("val_")
            if name == "reward_raw_mean":
                name = "total (raw)"
            elif name.startswith("reward/"):
                name = name.removeprefix("reward/").removesuffix("_raw")
            else:
                continue
            xs, ys = out.setdefault(name, {}).setdefault(split, ([], []))
            xs.append(row["step"])
            ys.append(float(v))
    return out


def stage_medians(run: Run) -> dict[str, float | None]:
    """Median seconds per training step of each stage, plus median MFU and the largest peak memory logged."""
    steps = [r for r in run.rows if "step_s" in r]

    def med(key: str) -> float | None:
        vals = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    out = {k: med(k) for k in STAGES}
    out["mfu"] = med("mfu")
    mem = [r["peak_mem_gib"] for r in run.rows if isinstance(r.get("peak_mem_gib"), (int, float))]
    out["peak_mem_gib"] = max(mem) if mem else None
    return out


# ------------------------------------------------------------------ timeline checks

def timeline_problems(spans: list[dict], tol_s: float = 1e-3) -> list[str]:
    """Violations of the timeline's invariants (see gerl/logging/timeline.py), as readable strings:
    end < start; two spans of one lane and depth overlapping by more than tol_s; a depth-d span (d ≥ 1) not inside
    a depth d−1 span of the same lane and step."""
    problems = []
    by_key: dict[tuple[str, int], list[dict]] = {}
    for s in spans:
        if s["end"] < s["start"]:
            problems.append(f"{s['lane']}: {s['name']!r} (step {s['step']}) ends before it starts")
        by_key.setdefault((s["lane"], s["depth"]), []).append(s)
    for (lane, depth), group in by_key.items():
        group = sorted(group, key=lambda s: s["start"])
        for a, b in zip(group, group[1:]):
            if b["start"] < a["end"] - tol_s:
                problems.append(f"{lane} depth {depth}: {a['name']!r} (step {a['step']}) and {b['name']!r} "
                                f"(step {b['step']}) overlap by {a['end'] - b['start']:.3f} s")
        if depth > 0:
            parents = by_key.get((lane, depth - 1), [])
            for s in group:
                if not any(p["step"] == s["step"] and p["start"] - tol_s <= s["start"] and s["end"] <= p["end"] + tol_s
                           for p in parents):
                    problems.append(f"{lane} depth {depth}: {s['name']!r} (step {s['step']}) lies in no depth-{depth - 1} "
                                    "span of its lane and step")
    return problems


def last_steps(spans: list[dict], count: int = GANTT_STEPS) -> list[dict]:
    """The spans of the last `count` steps that have any (step 0, validation before training, included if last)."""
    steps = sorted({s["step"] for s in spans})[-count:]
    return [s for s in spans if s["step"] in steps]


def busy_fractions(spans: list[dict]) -> dict[str, float]:
    """Per lane: time covered by its depth-0 spans / the window from the first span's start to the last's end."""
    if not spans:
        return {}
    t0, t1 = min(s["start"] for s in spans), max(s["end"] for s in spans)
    out = {}
    for lane in plots.lane_order({s["lane"] for s in spans}):
        busy, cursor = 0.0, t0
        for s in sorted((s for s in spans if s["lane"] == lane and s["depth"] == 0), key=lambda s: s["start"]):
            start, end = max(s["start"], cursor), s["end"]
            if end > start:
                busy += end - start
                cursor = end
        out[lane] = busy / (t1 - t0) if t1 > t0 else 0.0
    return out


# ------------------------------------------------------------------ writing

def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _unique_names(runs: list[Run]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        if sum(o.name == r.name for o in runs) > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name} ({seen[r.name]})"


def _sample_rows(run: Run) -> list[tuple[int, list[Image.Image]]]:
    grids = sorted(run.path.glob("samples/val_step_*.png"))
    if not grids:
        return []
    if len(grids) > SAMPLE_STEPS:  # evenly spaced, first and last kept
        idx = sorted({round(i * (len(grids) - 1) / (SAMPLE_STEPS - 1)) for i in range(SAMPLE_STEPS)})
        grids = [grids[i] for i in idx]
    n_by_step = {r["step"]: r["val_num_prompts"] for r in run.rows if "val_num_prompts" in r}
    out = []
    for g in grids:
        step = int(g.stem.rsplit("_", 1)[1])
        n = n_by_step.get(step) or _get(run.config, "validation.num_prompts", None)
        if not isinstance(n, int):
            run.warnings.append(f"{g.name}: unknown number of validation images; left out of the samples")
            continue
        with Image.open(g) as im:
            tiles = plots.grid_tiles(im.convert("RGB"), n, SAMPLE_PROMPTS)
        out.append((step, tiles, _captions(g.with_suffix(".json"), len(tiles))))
    return out


def _captions(sidecar: Path, count: int) -> list[str]:
    """"score 0.83\nprompt" for the first `count` tiles, from the grid's JSON sidecar ([] for older runs)."""
    data = read_grid_captions(sidecar)
    if data is None:
        return []
    scores = list(data.get("scores") or []) + [None] * count
    return [("score –" if scores[i] is None else f"score {scores[i]:.3g}") + "\n" + str(p)
            for i, p in enumerate(data["prompts"][:count])]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hour_header(column: str, runs: list[Run]) -> str:
    """The seed table's "# GPU Hour" reads "# Core Hour" when every run is a CPU run."""
    return "# Core Hour" if column == "# GPU Hour" and all(is_cpu_run(r) for r in runs) else column


def _table(header: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}.warn{color:#a33}.note{color:#666;font-size:13px}
h2{margin-top:2em;border-bottom:1px solid #ddd}"""


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the HTML report of `run_dirs` and its PNGs; return the HTML's path.

    out=None: RUN_DIR/report.html for a single run (several runs need an explicit path). An existing directory
    as `out` gets report.html inside it. PNGs go to `<html stem>_files/` beside the HTML.
    """
    if not run_dirs:
        raise UserError("no run directories given; pass one or more directories written by `gerl train`")
    runs = [load_run(Path(p)) for p in run_dirs]
    if out is None:
        if len(runs) > 1:
            raise UserError(f"{len(runs)} runs need --out PATH.html: where to write the combined report")
        out = runs[0].path / "report.html"
    out = Path(out)
    if out.is_dir():
        out = out / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    assets = out.parent / f"{out.stem}_files"
    assets.mkdir(exist_ok=True)
    _unique_names(runs)
    rel = lambda p: f"{assets.name}/{p.name}"  # noqa: E731
    target, _ = _target(runs[0].config)

    units = {hour_units(r)[1] for r in runs}
    unit = units.pop() if len(units) == 1 else "GPU-hours (core-hours for CPU runs)"
    vals = {r.name: validation_points(r) for r in runs}
    val_pngs = []
    if any(vals.values()):  # runs with validation.every=-1 have nothing to plot
        val_pngs = [plots.line_plot({n: ([p[0] for p in v], [p[2] for p in v]) for n, v in vals.items()},
                                    assets / "val_reward_vs_step.png", "step", "validation reward (mean)",
                                    "Validation reward vs step", target, f"target {target:g}"),
                    plots.line_plot({n: ([p[1] for p in v], [p[2] for p in v]) for n, v in vals.items()},
                                    assets / "val_reward_vs_gpu_hours.png", unit, "validation reward (mean)",
                                    f"Validation reward vs {unit}", target, f"target {target:g}")]
    # A curve is drawn for the runs it applies to (describe.curves_that_apply), and left out when it applies to none.
    applies = {r.name: curves_that_apply(r.config) for r in runs}
    keys = [k for k in TRAIN_CURVES if any(k in a for a in applies.values())]
    panels = {TRAIN_CURVES[key]: {r.name: ([x["step"] for x in r.rows if _finite(x.get(key))],
                                           [x[key] for x in r.rows if _finite(x.get(key))])
                                  for r in runs if key in applies[r.name]} for key in keys}
    train_stats = plots.panel_plot(panels, assets / f"{'_'.join(keys)}.png", "step")
    train = {}
    for r in runs:
        pts = [(x["step"], x["reward_mean"], x.get("reward_std") or 0.0) for x in r.rows
               if isinstance(x.get("reward_mean"), (int, float))]
        train[r.name] = ([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
    train_png = plots.band_plot(train, assets / "train_reward.png", "step", "training reward (mean ± std)",
                                "Training reward")
    curves = {r.name: component_curves(r) for r in runs}
    component_pngs = [
        plots.line_plot({f"{run} ({split})": c[name][split] for run, c in curves.items() if name in c
                         for split in ("train", "validation") if split in c[name]},
                        assets / f"component_{i}_{_safe(name)}.png", "step", f"{name} (raw mean)",
                        f"Reward component: {name}")
        for i, name in enumerate(sorted({n for c in curves.values() for n in c}))]

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gerl report</title><style>{CSS}</style></head><body>",
             "<h1>gerl report</h1>",
             f"<p class='note'>Runs: {html.escape(', '.join(str(r.path) for r in runs))}. Definitions: docs/report.md.</p>",
             "<h2>Seed table</h2>",
             _table([_hour_header(c, runs) for c in SEED_COLUMNS], [[seed_row(r)[c] for c in SEED_COLUMNS] for r in runs]),
             "<p class='note'>Throughput: median over steps of images / (step_s × devices). # GPU Hour: devices × "
             "Σ(step_s + validate_s) up to the first validation at or above metrics.target_val_reward held for "
             "metrics.target_hold validations, else the run's total; a CPU run counts core-hours (devices × cores "
             "per device × hours). Final / best val reward: the last and the highest val_reward_mean, with the "
             "step.</p>",
             "<h2>Stage times (median seconds per step)</h2>"]
    stage_rows = []
    for r in runs:
        m = stage_medians(r)
        stage_rows.append([r.name] + [_fmt(m[k]) for k in STAGES] + [_fmt(m["mfu"]), _fmt(m["peak_mem_gib"])])
    parts.append(_table(["Run"] + STAGES + ["MFU", "peak mem GiB"], stage_rows))
    parts.append("<h2>Curves</h2>")
    parts += ([f"<img src='{rel(png)}' alt='{alt}'>" for png, alt in
               zip(val_pngs, ("validation reward vs step", "validation reward vs GPU-hours"))]
              or ["<p class='note'>No run logged a validation reward (validation.every=-1, or none reached).</p>"])
    parts += [f"<img src='{rel(train_png)}' alt='training reward'>",
              f"<img src='{rel(train_stats)}' alt='{html.escape(', '.join(panels))}'>"]
    if component_pngs:
        parts += ["<h2>Reward components (raw scores, train and validation)</h2>"]
        parts += [f"<img src='{rel(png)}' alt='reward component'>" for png in component_pngs]

    for i, r in enumerate(runs):
        tag = f"{i}_{_safe(r.name)}"
        parts.append(f"<h2>{html.escape(r.name)}</h2>")
        rows = _sample_rows(r)
        if rows:
            png = plots.sample_matrix(rows, assets / f"samples_{tag}.png",
                                      f"{r.name}: validation samples (first {SAMPLE_PROMPTS} prompts, fixed noise)")
            parts.append(f"<img src='{rel(png)}' alt='validation samples'>")
        else:
            parts.append("<p class='note'>No validation grids in samples/.</p>")
        window = last_steps(r.spans)
        if window:
            steps = sorted({s["step"] for s in window})
            png = plots.gantt(window, assets / f"timeline_{tag}.png",
                              f"{r.name}: stage timeline, steps {steps[0]}–{steps[-1]}")
            parts.append(f"<img src='{rel(png)}' alt='stage timeline'>")
            busy = busy_fractions(window)
            parts.append(_table(["lane", "busy fraction of the window"], [[k, f"{v:.0%}"] for k, v in busy.items()]))
            problems = timeline_problems(r.spans)
            if problems:
                parts.append(f"<p class='warn'>Timeline inconsistencies ({len(problems)}): "
                             f"{html.escape('; '.join(problems[:5]))}</p>")
        else:
            parts.append("<p class='note'>No timeline.jsonl spans.</p>")
        for w in r.warnings:
            parts.append(f"<p class='warn'>{html.escape(w)}</p>")
    parts.append("</body></html>")
    out.write_text("\n".join(parts))
    return out
