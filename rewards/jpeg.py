"""JPEG (in)compressibility, DDPO's sanity-check rewards: the size of the image saved as JPEG at quality 95.

No model, so no lazy loading; the rewards are instances of a module-level class so they pickle.
"""

from __future__ import annotations

import io

from rewards.registry import register


class JpegSize:
    """Score = `sign` * (JPEG size in kB at quality 95).

    Args:
        sign: +1 rewards large files (incompressible, detailed images), -1 small files (flat, compressible ones).
    """

    def __init__(self, sign: float):
        self.sign = sign
        self.name = "jpeg_compressibility" if sign < 0 else "jpeg_incompressibility"

    def __call__(self, images, prompts, metadata) -> list[float]:
        return [self.sign * jpeg_kb(image) for image in images]


def jpeg_kb(image) -> float:
    """Size in kB (1 kB = 1000 bytes, as in DDPO) of `image` encoded as JPEG at quality 95."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


@register("jpeg_compressibility")
def jpeg_compressibility() -> JpegSize:
    """Reward = -JPEG size in kB: pushes images towards flat, simple content."""
    return JpegSize(-1.0)


@register("jpeg_incompressibility")
def jpeg_incompressibility() -> JpegSize:
    """Reward = +JPEG size in kB: pushes images towards detail and texture."""
    return JpegSize(+1.0)
