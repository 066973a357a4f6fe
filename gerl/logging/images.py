"""Image grids for logs and validation."""

from __future__ import annotations

import math

from PIL import Image


def image_grid(images: list[Image.Image], cols: int | None = None) -> Image.Image:
    """Tile equally sized images row by row (cols defaults to ~sqrt(n))."""
    if not images:
        raise ValueError("image_grid needs at least one image")
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, im in enumerate(images):
        grid.paste(im.convert("RGB"), ((i % cols) * w, (i // cols) * h))
    return grid


def save_grid_captions(path, prompts: list[str], scores) -> None:
    """The sidecar of a validation grid: {"prompts": [...], "scores": [...]} in tile order, a non-finite or missing
    score as null. `gerl report` prints them under the sample tiles."""
    import json
    from pathlib import Path

    clean = [float(s) if s is not None and math.isfinite(float(s)) else None for s in scores]
    Path(path).write_text(json.dumps({"prompts": list(prompts), "scores": clean}))


def read_grid_captions(path) -> dict | None:
    """The sidecar written by save_grid_captions, or None when it is missing or unreadable (older runs)."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("prompts"), list) else None
