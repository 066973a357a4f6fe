"""The report's figures, drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display).

Every function takes plain data (lists of floats, PIL images, timeline spans) and writes one PNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

# Span name → colour: the stage a span belongs to is its name without the " mbN" micro-batch suffix.
STAGE_COLOURS = {
    "step": "#e8e8e8", "generate": "#4c78a8", "decode": "#9ecae9", "reward": "#f58518", "wait_reward": "#e45756",
    "train": "#54a24b", "sync": "#b279a2", "validate": "#eeca3b", "checkpoint": "#9d755d",
}
_EXTRA_COLOURS = ["#72b7b2", "#ff9da6", "#bab0ac", "#79706e", "#d67195", "#439894"]


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def line_plot(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path, xlabel: str, ylabel: str,
              title: str, hline: float | None = None, hline_label: str = "") -> Path:
    """One line per run: series = {run name: (xs, ys)}; an optional dashed horizontal line (the target)."""
    fig = _figure(6.4, 3.8)
    ax = fig.add_subplot()
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ys_all = [y for _, ys in series.values() for y in ys]
    if hline is not None and ys_all:
        lo, hi = min(ys_all), max(ys_all)
        margin = max(hi - lo, 0.1 * abs(hi), 1e-9)
        if not lo - margin <= hline <= hi + margin:  # drawing it would squash the curves into a flat line
            title += f" (target {hline:g} off scale)"
            hline = None
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=hline_label or None)
    if not any(len(xs) for xs, _ in series.values()):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if series or hline is not None:
        ax.legend(fontsize=8)
    return _save(fig, path)


def band_plot(series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[float]]], path: Path,
              xlabel: str, ylabel: str, title: str) -> Path:
    """Mean line with a ±std band per run: series = {run name: (xs, means, stds)}."""
    fig = _figure(6.4, 3.8)
    ax = fig.add_subplot()
    for name, (xs, mean, std) in series.items():
        (line,) = ax.plot(xs, mean, label=name)
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path)


def panel_plot(panels: dict[str, dict[str, tuple[Sequence[float], Sequence[float]]]], path: Path,
               xlabel: str) -> Path:
    """Side-by-side line plots sharing the x label: panels = {panel title: {run name: (xs, ys)}}; a panel without
    points says "not logged"."""
    fig = _figure(4.0 * len(panels), 3.4)
    for i, (title, series) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=2, label=name)
        if not any(len(xs) for xs, _ in series.values()):
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif len(series) > 1:
            ax.legend(fontsize=7)
        ax.set(xlabel=xlabel, title=title)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _fit(draw, text: str, width: int) -> str:
    """`text` cut (with an ellipsis) to fit `width` pixels in the default font."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def grid_tiles(grid: Image.Image, num_images: int, count: int) -> list[Image.Image]:
    """The first `count` tiles of a validation grid written by `image_grid` (row-major, cols = ceil(√n))."""
    cols = math.ceil(math.sqrt(num_images))
    rows = math.ceil(num_images / cols)
    w, h = grid.width // cols, grid.height // rows
    return [grid.crop(((i % cols) * w, (i // cols) * h, (i % cols + 1) * w, (i // cols + 1) * h))
            for i in range(min(count, num_images))]


def sample_matrix(rows: list[tuple[int, list[Image.Image], list[str]]], path: Path, title: str,
                  tile: int = 160) -> Path:
    """Validation samples laid out steps (rows) × prompts (columns): rows = [(step, [tile per prompt], [caption per
    tile])], a caption being up to two lines ("score 0.83\nprompt text") printed under its tile ([] = none). Tiles
    are resized to `tile` px (nearest neighbour for small images, so tiny-model pixels stay visible)."""
    from PIL import ImageDraw

    n_cols = max(len(tiles) for _, tiles, _ in rows)
    caption_h = 26 if any(caps for _, _, caps in rows) else 0
    left, top, pad = 70, 40, 4
    row_h = tile + caption_h + pad
    sheet = Image.new("RGB", (left + n_cols * (tile + pad), top + len(rows) * row_h), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((4, 4), title, fill="black")
    for c in range(n_cols):
        draw.text((left + c * (tile + pad) + 4, top - 14), f"prompt {c}", fill="black")
    for r, (step, tiles, captions) in enumerate(rows):
        y = top + r * row_h
        draw.text((4, y + tile // 2 - 6), f"step {step}", fill="black")
        for c, im in enumerate(tiles):
            x = left + c * (tile + pad)
            resample = Image.NEAREST if im.width < tile else Image.LANCZOS
            sheet.paste(im.convert("RGB").resize((tile, tile), resample), (x, y))
            if c < len(captions):
                for k, line in enumerate(captions[c].splitlines()[:2]):
                    draw.text((x + 2, y + tile + 1 + 12 * k), _fit(draw, line, tile - 4), fill="black")
    sheet.save(path, format="PNG")
    return path


def stage_of(span: dict) -> str:
    """The colour key of a span: "reward" for reward lanes, else the name without its " mbN" suffix."""
    if span["lane"].startswith("reward"):
        return "reward"
    name = span["name"]
    head, _, tail = name.rpartition(" ")
    return head if head and tail.startswith("mb") else name


def lane_order(lanes: set[str]) -> list[str]:
    """trainer, then actor, rollout and reward lanes, then anything else; sorted within each group."""
    order = ("trainer", "actor", "rollout", "reward")
    rank = lambda ln: (next((i for i, p in enumerate(order) if ln.startswith(p)), len(order)), ln)  # noqa: E731
    return sorted(lanes, key=rank)


def gantt(spans: list[dict], path: Path, title: str) -> Path:
    """Timeline spans as a Gantt chart: one row per lane, depth-0 spans full height, deeper spans drawn inside
    them (thinner), coloured by stage; x = seconds from the first span's start; dotted lines at step starts."""
    lanes = lane_order({s["lane"] for s in spans})
    t0 = min(s["start"] for s in spans)
    min_w = 0.003 * (max(s["end"] for s in spans) - t0)  # a 2 ms reward call stays visible on a 20 s axis
    fig = _figure(10, 0.55 * len(lanes) + 1.6)
    ax = fig.add_subplot()
    colours = dict(STAGE_COLOURS)
    for s in sorted(spans, key=lambda s: s["depth"]):
        stage = stage_of(s)
        if stage not in colours:
            colours[stage] = _EXTRA_COLOURS[(len(colours) - len(STAGE_COLOURS)) % len(_EXTRA_COLOURS)]
        y = len(lanes) - 1 - lanes.index(s["lane"])
        height = 0.8 * (0.7 ** s["depth"])
        ax.barh(y, max(s["end"] - s["start"], min_w), left=s["start"] - t0, height=height, color=colours[stage],
                edgecolor="black", linewidth=0.3)
    step_starts = {}
    for s in spans:
        step_starts[s["step"]] = min(step_starts.get(s["step"], math.inf), s["start"])
    for step, start in step_starts.items():
        ax.axvline(start - t0, color="black", linestyle=":", linewidth=0.6)
        ax.text(start - t0, len(lanes) - 0.45, f" step {step}", fontsize=7, va="bottom")
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)), fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9, pad=14)
    used = {stage_of(s) for s in spans}
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items() if k in used], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)
