"""Deterministic test images: smooth RGB pictures with structure a tower can tell apart."""

from __future__ import annotations

import numpy as np
from PIL import Image


def make_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A smooth RGB test image (gradients plus a block): structure the tower can tell apart."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    a = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * rng.uniform(100, 255, 3)
    a[height // 3 :, : width // 2] = rng.integers(0, 256, 3)
    return Image.fromarray(a.astype(np.uint8))
