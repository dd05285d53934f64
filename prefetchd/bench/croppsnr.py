"""What `prefetchd pack --max-short-side` costs in pixels: the PSNR of the crops a trainer gets
from the packed image against those it gets from the raw one, at the same crop parameters.

For each image: draw a random-resized-crop box with prefetchd's own plan (ImagePipeline.plan,
the draws a worker makes), express it relative to the image's size, apply that same relative
box to the raw and to the packed image, resize both to the output with the pipeline's filter
(bilinear, Pillow's resize with ``box``) from a full decode (no DCT scaling, which would add a
loss of its own to either side), and compare the uint8 RGB results. No torch here.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from prefetchd.workers.transforms import ImagePipeline

# The PSNR of identical crops, instead of infinity: JSON has no infinity, and a single pixel off
# by one level in a 224 x 224 x 3 crop is already 99.9 dB, so 100 dB means "identical".
IDENTICAL_DB = 100.0
CROP = [{"op": "random_resized_crop", "size": 224}]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 arrays of one shape, in dB (IDENTICAL_DB if equal)."""
    if a.shape != b.shape or a.dtype != np.uint8 or b.dtype != np.uint8:
        raise ValueError(f"psnr needs two uint8 arrays of one shape, got {a.dtype} {a.shape} and {b.dtype} {b.shape}")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    if mse == 0:
        return IDENTICAL_DB
    return min(IDENTICAL_DB, 10 * math.log10(255.0**2 / mse))


def relative_box(size: tuple[int, int], rng: np.random.Generator, specs: list[dict] = CROP) -> tuple:
    """A crop box drawn by prefetchd's plan for an image of ``size`` (w, h), as fractions of it."""
    v = ImagePipeline(specs).plan(size, rng)
    w, h = size
    x0, y0, x1, y1 = v.box
    return (x0 / w, y0 / h, x1 / w, y1 / h), (v.w, v.h)


def crop(img: Image.Image, box: tuple, out: tuple[int, int]) -> np.ndarray:
    """``box`` (fractions of the image's size) of ``img`` resized to ``out`` (w, h), uint8 RGB."""
    w, h = img.size
    pixels = (box[0] * w, box[1] * h, min(float(w), box[2] * w), min(float(h), box[3] * h))
    return np.asarray(img.convert("RGB").resize(out, Image.Resampling.BILINEAR, box=pixels))


def crop_psnr(raw: bytes, packed: bytes, seed: int, specs: list[dict] = CROP) -> float:
    """The PSNR of one random-resized crop (drawn with ``seed``) of the packed image against the
    same relative crop of the raw one."""
    with Image.open(io.BytesIO(raw)) as a, Image.open(io.BytesIO(packed)) as b:
        box, out = relative_box(a.size, np.random.default_rng(seed), specs)
        return psnr(crop(a, box, out), crop(b, box, out))


def summarize(values: list[float]) -> dict:
    """The median and the 5th percentile (the worst images) over images, and how many were identical."""
    xs = np.asarray(values, np.float64)
    return {
        "images": len(values),
        "median_db": float(np.median(xs)),
        "p5_db": float(np.percentile(xs, 5)),
        "min_db": float(xs.min()),
        "identical": int((xs >= IDENTICAL_DB).sum()),
    }
