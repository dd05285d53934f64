"""Generate a small ImageFolder dataset of real JPEG files (for the demo, tests and benchmarks).

Images are smooth colour gradients with blobs and noise, so they compress like photos
rather than like flat colour, in varied sizes and aspect ratios.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image


def make_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        (fx, fy), phase = rng.uniform(0.5, 4, 2) / max(width, height), rng.uniform(0, 6.3)
        img[..., c] = 127 + 100 * np.sin(2 * np.pi * (fx * x + fy * y) * 3 + phase)
    for _ in range(4):  # a few blobs: edges for the JPEG coder
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.05, 0.3) * min(width, height)
        mask = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        img[mask] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 12, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_image_folder(
    root: str | os.PathLike,
    classes: int = 4,
    per_class: int = 16,
    size: tuple[int, int] = (160, 320),
    seed: int = 0,
    quality: int = 90,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``classes * per_class`` JPEGs as root/class_XX/img_XXXX.jpg (skips files that exist);
    ``progress(done, total)`` after each image."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(size[0], size[1] + 1, 2))
            path = folder / f"img_{i:04d}.jpg"
            image_seed = int(rng.integers(2**31))
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                make_image(np.random.default_rng(image_seed), w, h).save(tmp, "JPEG", quality=quality)
                os.replace(tmp, path)
            if progress is not None:
                progress(c * per_class + i + 1, classes * per_class)
    return root
