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
