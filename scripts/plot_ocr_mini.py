"""The README's ocr-mini figures: validation OCR reward vs training minutes for one or more runs (e.g. the quickstart
and its flipped-advantage control), and a before/after sheet of the first run's validation samples.

    python scripts/plot_ocr_mini.py runs/quickstart runs/quickstart_flip --labels "Flow-GRPO-Fast" "flipped advantage" \
        --out docs/img/ocr_mini
writes docs/img/ocr_mini_curve.png and docs/img/ocr_mini_before_after.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from PIL import Image, ImageDraw, ImageFont


def validation_curve(run: Path) -> tuple[list[float], list[float], list[int]]:
    """(minutes of training step time before each validation, val_reward_mean, step) from metrics.jsonl."""
    minutes, values, steps, elapsed = [], [], [], 0.0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        elapsed += r.get("step_s") or 0.0  # training time; validation runs outside step_s
        if r.get("val_reward_mean") is not None:
            minutes.append(elapsed / 60)
            values.append(r["val_reward_mean"])
            steps.append(r["step"])
    return minutes, values, steps


def plot_curves(runs: list[Path], labels: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for run, label in zip(runs, labels):
        m, v, _ = validation_curve(run)
        ax.plot(m, v, marker="o", label=label)
    ax.set_xlabel("training wall-clock (minutes, 2 CPU cores)")
    val = (yaml.safe_load((runs[0] / "config.yaml").read_text()) or {}).get("validation", {})
    ax.set_ylabel(f"validation OCR reward\n({val.get('num_prompts', '?')} held-out numbers × "
                  f"{val.get('images_per_prompt', 1)})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def before_after(run: Path, out: Path, after_step: int = 0) -> None:
    """The first validation grid beside the last one (or the one of `after_step`)."""
    grids = sorted((run / "samples").glob("val_step_*.png"))
    if after_step:
        grids = [g for g in grids if int(g.stem.rsplit("_", 1)[1]) <= after_step]
    if len(grids) < 2:
        raise SystemExit(f"{run}/samples holds fewer than two validation grids (up to the step asked for)")
    first, last = Image.open(grids[0]).convert("RGB"), Image.open(grids[-1]).convert("RGB")
    font = ImageFont.load_default(size=16)
    pad, title = 12, 26
    sheet = Image.new("RGB", (first.width + last.width + 3 * pad, max(first.height, last.height) + title + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (img, path) in enumerate(((first, grids[0]), (last, grids[-1]))):
        x = pad + i * (first.width + pad)
        step = int(path.stem.rsplit("_", 1)[1])
        draw.text((x, 4), f"{'before' if i == 0 else 'after'} (step {step})", fill="black", font=font)
        sheet.paste(img, (x, title))
    sheet.save(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="*", default=None)
    ap.add_argument("--out", default="docs/img/ocr_mini", help="output prefix")
    ap.add_argument("--after-step", type=int, default=0, help="the 'after' grid: the last validation at or before "
                                                                 "this step (0 = the run's last)")
    args = ap.parse_args(argv)
    labels = args.labels or [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        print("plot_ocr_mini: give one --labels entry per run", file=sys.stderr)
        return 2
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    plot_curves(args.runs, labels, prefix.with_name(prefix.name + "_curve.png"))
    before_after(args.runs[0], prefix.with_name(prefix.name + "_before_after.png"), args.after_step)
    print(f"wrote {prefix}_curve.png and {prefix}_before_after.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
