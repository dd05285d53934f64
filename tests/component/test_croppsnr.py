"""The packed rows' PSNR tool (prefetchd.bench.croppsnr): the crop a trainer gets from a packed
image against the same relative crop of the raw one. Real JPEGs from datagen, no torch."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from prefetchd.bench.croppsnr import IDENTICAL_DB, crop_psnr, psnr, relative_box, summarize
from prefetchd.cli.datagen import make_image


def jpeg(img: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality)
    return out.getvalue()


def shrunk(img: Image.Image, short: int, quality: int) -> bytes:
    """What `pack --max-short-side short --quality quality` makes of a JPEG."""
    w, h = img.size
    size = (short, round(h * short / w)) if w <= h else (round(w * short / h), short)
    return jpeg(img.resize(size, Image.Resampling.LANCZOS), quality)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return make_image(np.random.default_rng(7), 640, 480)


def test_psnr_of_known_arrays():
    a = np.zeros((4, 4, 3), np.uint8)
    assert psnr(a, a) == IDENTICAL_DB  # identical: capped, JSON has no infinity
    assert psnr(a, a + 1) == pytest.approx(10 * math.log10(255**2))  # MSE 1: 48.13 dB
    assert psnr(a, a + 255) == pytest.approx(0.0)
    one_pixel = a.copy()
    one_pixel[0, 0, 0] = 1  # the smallest difference is still below the cap
    assert 0 < psnr(a, one_pixel) < IDENTICAL_DB
    with pytest.raises(ValueError, match="one shape"):
        psnr(a, np.zeros((4, 5, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        psnr(a, a.astype(np.float32))


def test_the_box_is_relative_and_drawn_as_the_pipeline_draws():
    box, out = relative_box((500, 375), np.random.default_rng(3))
    assert out == (224, 224)
    assert 0 <= box[0] < box[2] <= 1 and 0 <= box[1] < box[3] <= 1
    # The same draws give the same box whatever the seed's user: a pure function of (size, rng).
    assert relative_box((500, 375), np.random.default_rng(3))[0] == box


def test_identical_images_give_the_cap(photo):
    data = jpeg(photo, 94)
    assert all(crop_psnr(data, data, seed) == IDENTICAL_DB for seed in range(5))


def test_a_more_degraded_pack_scores_lower(photo):
    raw = jpeg(photo, 94)
    mild = [crop_psnr(raw, shrunk(photo, 448, 95), seed) for seed in range(20)]
    harsh = [crop_psnr(raw, shrunk(photo, 96, 30), seed) for seed in range(20)]
    assert np.median(harsh) < np.median(mild) < IDENTICAL_DB
    assert all(h < m for h, m in zip(harsh, mild))  # crop for crop, the same boxes
    assert np.median(harsh) < 30  # 96 px and quality 30: clearly visible


def test_summary_reports_median_p5_and_identical():
    s = summarize([IDENTICAL_DB, 40.0, 38.0, 30.0] * 5)
    assert s["images"] == 20 and s["identical"] == 5 and s["min_db"] == 30.0
    assert s["median_db"] == 39.0 and s["p5_db"] == pytest.approx(30.0)
