"""The optional fast decoder: libjpeg-turbo (through simplejpeg) decodes, OpenCV resamples.

Chosen with ``[job] decoder = "simplejpeg"`` (or ``--decoder simplejpeg``); installed with
``pip install 'prefetchd[fast]'``. It follows the same plan as the Pillow path (the same
random numbers, the same crop box in source pixels), so only the pixel arithmetic differs:

- the decode asks libjpeg-turbo for the strongest DCT scaling of 1/2, 1/4 or 1/8 whose image
  still holds the crop box at the output size or larger, as Pillow's draft does (libjpeg-turbo
  also offers M/8 scales, but those run without SIMD: a 3/4 decode took 2.1 ms against 1.5 ms
  for the whole 500 x 375 image here);
- the crop is the box widened to whole pixels, then one ``cv2.resize``: INTER_LINEAR while what
  is left to shrink is at most 2x (what the DCT scaling leaves: 0.1 ms for 300 -> 224 px,
  against 1.1 ms for INTER_AREA), INTER_AREA beyond that (an anti-aliased average);
- the flip is ``cv2.flip`` (a numpy copy through a negative stride took 0.46 ms).

Output is deterministic for given library versions, as with Pillow; it is not bit-equal to
Pillow's, and the decoder is part of the config hash, so a resume never mixes the two.
Files that are not JPEG, CMYK JPEGs and JPEGs libjpeg-turbo cannot read go through Pillow.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from prefetchd.workers.decoders import LIBRARIES, broken_advice, install_advice

# Imported on first use (a worker of a job that asked for this decoder): the CLI and the
# master never pay for OpenCV.
cv2 = simplejpeg = None


LIMITS_SCANS = False  # simplejpeg decodes every scan: the pipeline counts them first (transforms.py)


def require() -> None:
    """Import the fast decoder's libraries, or say how to install them (ImportError)."""
    global cv2, simplejpeg
    if simplejpeg is not None:
        return
    try:
        import cv2 as _cv2
        import simplejpeg as _simplejpeg
        _cv2.setNumThreads(1)  # one worker process per core already: no thread pool inside each
    except ModuleNotFoundError as exc:
        if exc.name in LIBRARIES:
            raise ImportError(install_advice(exc.name)) from None
        raise ImportError(broken_advice(exc)) from None
    except Exception as exc:  # noqa: BLE001 - found by decoders.resolve_decoder, but broken: whatever it raises
        raise ImportError(broken_advice(exc)) from None
    cv2, simplejpeg = _cv2, _simplejpeg


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of a YCbCr or greyscale JPEG; None for anything else.

    CMYK and YCCK JPEGs (rare, from print workflows) go through Pillow, so their colours
    come out the same whichever decoder is chosen.
    """
    if not simplejpeg.is_jpeg(data):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None  # a damaged header: Pillow reads it, and names the damage
    return (width, height) if colorspace in ("YCbCr", "Gray", "RGB") else None


def decode_resampled(data: bytes, size: tuple[int, int], box, out_w: int, out_h: int) -> np.ndarray:
    """The region ``box`` (source pixels) of the JPEG ``data`` at ``out_w`` x ``out_h``, uint8 RGB.

    ValueError when libjpeg-turbo cannot decode it (corrupt, or a colour space it cannot
    convert); Image.DecompressionBombError past Pillow's pixel limit, as on the Pillow path.
    """
    check_pixels(size)
    shrink = dct_shrink(box, out_w, out_h)
    (scaled_w, scaled_h), (left, top, right, bottom) = scaled_box(size, shrink, box)
    # Asking for exactly libjpeg-turbo's scaled size picks 1/shrink.
    img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=scaled_w, min_height=scaled_h)
    return resample(img[top:bottom, left:right], out_w, out_h)


def check_pixels(size: tuple[int, int]) -> None:
    """Image.DecompressionBombError past Pillow's pixel limit, as on the Pillow path."""
    if size[0] * size[1] > Image.MAX_IMAGE_PIXELS:
        raise Image.DecompressionBombError(
            f"image of {size[0] * size[1]} pixels exceeds the limit of {Image.MAX_IMAGE_PIXELS}"
        )


def dct_shrink(box, out_w: int, out_h: int) -> int:
    """1, 2, 4 or 8: the strongest DCT scaling whose decode still holds ``box`` at the output
    size or larger (halve while it does)."""
    x0, y0, x1, y1 = box
    shrink = 1
    while shrink < 8 and (x1 - x0) >= 2 * shrink * out_w and (y1 - y0) >= 2 * shrink * out_h:
        shrink *= 2
    return shrink


def scaled_box(size: tuple[int, int], shrink: int, box) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """The image's size decoded at 1/shrink (libjpeg-turbo rounds up), and ``box`` in its pixels
    widened to whole ones: ((width, height), (left, top, right, bottom)); ValueError if empty."""
    width, height = size
    scaled_w, scaled_h = -(-width // shrink), -(-height // shrink)
    sx, sy = scaled_w / width, scaled_h / height
    x0, y0, x1, y1 = box
    left, top = max(0, math.floor(x0 * sx)), max(0, math.floor(y0 * sy))
    right, bottom = min(scaled_w, math.ceil(x1 * sx)), min(scaled_h, math.ceil(y1 * sy))
    if right <= left or bottom <= top:  # to libjpeg-turbo, a region of width or height 0 is "to the edge"
        raise ValueError(f"empty crop box {box} in a {width} x {height} image")
    return (scaled_w, scaled_h), (left, top, right, bottom)


def resample(crop: np.ndarray, out_w: int, out_h: int) -> np.ndarray:
    """``crop`` (uint8 RGB) at ``out_w`` x ``out_h``: bilinear while at most 2x is left to shrink,
    an area average beyond (the module docstring says why)."""
    far = crop.shape[1] > 2 * out_w or crop.shape[0] > 2 * out_h
    return cv2.resize(crop, (out_w, out_h), interpolation=cv2.INTER_AREA if far else cv2.INTER_LINEAR)


def flip(pixels: np.ndarray) -> np.ndarray:
    return cv2.flip(pixels, 1)
