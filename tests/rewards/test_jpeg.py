"""JPEG (in)compressibility: DDPO's definition (size in kB at quality 95) and its sign."""

import io

import numpy as np
from PIL import Image

from rewards import build_reward, call_reward

FLAT = Image.new("RGB", (64, 64), (120, 160, 200))
NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def test_flat_image_is_more_compressible_than_noise():
    compress = build_reward("jpeg_compressibility", {})
    (flat, noise), extras = call_reward(compress, [FLAT, NOISE], ["", ""], [{}, {}])
    assert flat > noise and flat < 0 and noise < 0 and extras == {}


def test_incompressibility_is_the_negation_in_kilobytes():
    incompress = build_reward("jpeg_incompressibility", {})
    compress = build_reward("jpeg_compressibility", {})
    buffer = io.BytesIO()
    NOISE.save(buffer, format="JPEG", quality=95)
    size_kb = buffer.tell() / 1000
    assert call_reward(incompress, [NOISE], [""], [{}])[0] == [size_kb]
    assert call_reward(compress, [NOISE], [""], [{}])[0] == [-size_kb]
    assert size_kb > 5  # 64x64 noise barely compresses: ~12 kB of raw pixels
