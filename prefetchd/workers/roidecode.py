"""The region-of-interest decoder (``[job] decoder = "turbojpeg"``): libjpeg-turbo decodes only
the part of a JPEG that the crop keeps, at the strongest DCT scaling that still holds it.

A random-resized crop keeps on average about half of the image. libjpeg-turbo 3's TurboJPEG API
can skip what lies outside a cropping region (``tj3SetCroppingRegion``): rows below the region
are never decoded, rows above are entropy-decoded but not transformed, and columns left and
right of it skip the inverse DCT, upsampling and colour conversion. Combined with the DCT
scaling (``tj3SetScalingFactor``) this is what DALI's CPU ``image_random_crop`` does.

The library, ``libturbojpeg`` 3, is reached through prefetchd.workers.tjlib (where it comes from,
and how it is called); where it is missing, ``decoder = "auto"`` picks simplejpeg.

The plan (crop box, output size, flip) is the one every decoder follows; the geometry below is
prefetchd.workers.fastdecode's exactly (the same scale, the same box widened to whole pixels, the same
resize), so the two differ only where libjpeg-turbo's upsampling sees the region's edge.
Files that are not 8-bit lossy YCbCr or greyscale JPEGs go through Pillow.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from prefetchd.workers import fastdecode, tjlib
from prefetchd.workers.tjlib import Region, ScalingFactor, get

LIMITS_SCANS = True  # libjpeg-turbo stops at tjlib.MAX_SCANS (TJPARAM_SCANLIMIT), and decode_resampled says so


def require() -> None:
    """Load libturbojpeg 3 and OpenCV (which resamples the region), or say how to install them."""
    fastdecode.require()
    tjlib.load()


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of an 8-bit lossy YCbCr, RGB or greyscale JPEG; None for anything else
    (not a JPEG, CMYK/YCCK, 12-bit, lossless, a damaged header), which Pillow then reads."""
    if not data.startswith(b"\xff\xd8"):
        return None
    h = tjlib.handle()
    try:
        tjlib.read_header(h, data)
    except ValueError:
        return None
    if get(h, tjlib.TJPARAM_COLORSPACE) not in (tjlib.TJCS_YCbCr, tjlib.TJCS_GRAY, tjlib.TJCS_RGB):
        return None
    if get(h, tjlib.TJPARAM_PRECISION) != 8 or get(h, tjlib.TJPARAM_LOSSLESS) == 1:
        return None
    return get(h, tjlib.TJPARAM_JPEGWIDTH), get(h, tjlib.TJPARAM_JPEGHEIGHT)


def decode_resampled(data: bytes, size: tuple[int, int], box, out_w: int, out_h: int) -> np.ndarray:
    """The region ``box`` (source pixels) of the JPEG ``data`` at ``out_w`` x ``out_h``, uint8 RGB,
    decoding only that region. The same contract as fastdecode.decode_resampled: ValueError
    when libjpeg-turbo cannot decode it, Image.DecompressionBombError past Pillow's limit, and
    also for a file of more than tjlib.MAX_SCANS scans (never handed to Pillow)."""
    fastdecode.check_pixels(size)
    shrink = fastdecode.dct_shrink(box, out_w, out_h)
    (scaled_w, scaled_h), (left, top, right, bottom) = fastdecode.scaled_box(size, shrink, box)
    h = tjlib.handle()
    tjlib.read_header(h, data)  # the scaling factor and region apply to the image whose header was read last
    if (get(h, tjlib.TJPARAM_JPEGWIDTH), get(h, tjlib.TJPARAM_JPEGHEIGHT)) != size:
        raise ValueError(f"the JPEG is not {size[0]} x {size[1]}: size must come from jpeg_size(data)")
    if tjlib.lib.tj3SetScalingFactor(h, ScalingFactor(1, shrink)) != 0:
        raise tjlib.failed(h, f"scale by 1/{shrink}")
    rx, ry, rw, rh = _set_region(h, shrink, left, top, right, bottom) or (0, 0, scaled_w, scaled_h)
    pixels = np.empty((rh, rw, 3), np.uint8)
    if tjlib.lib.tj3Decompress8(h, data, len(data), pixels.ctypes.data, rw * 3, tjlib.TJPF_RGB) != 0:
        error = tjlib.failed(h, "decode the JPEG")
        if data.count(b"\xff\xda") > tjlib.MAX_SCANS:  # SOS markers (an APPn or COM may hold a few more)
            # Not a ValueError: Pillow, which would decide next, has no scan limit and would spend
            # minutes on it (the denial of service that TJPARAM_SCANLIMIT is there to stop).
            raise Image.DecompressionBombError(f"{error}; the JPEG has more than {tjlib.MAX_SCANS} scans") from None
        raise error
    return fastdecode.resample(pixels[top - ry : bottom - ry, left - rx : right - rx], out_w, out_h)


def _set_region(h: int, shrink: int, left: int, top: int, right: int, bottom: int) -> tuple | None:
    """Ask for the scaled image's columns left..right and rows top..bottom; the region set, as
    (x, y, w, h), or None when the whole image will be decoded (an unusual subsampling)."""
    subsampling = get(h, tjlib.TJPARAM_SUBSAMP)
    if 0 <= subsampling < len(tjlib.MCU_WIDTH):
        # The region's left edge must fall on an iMCU column of the scaled image: the few
        # columns between it and the box are decoded too, and cut off by the caller.
        mcu = max(1, tjlib.MCU_WIDTH[subsampling] // shrink)
        region = (left - left % mcu, top, right - (left - left % mcu), bottom - top)
        if tjlib.lib.tj3SetCroppingRegion(h, Region(*region)) == 0:
            return region
    if tjlib.lib.tj3SetCroppingRegion(h, Region(0, 0, 0, 0)) != 0:  # TJUNCROPPED
        raise tjlib.failed(h, "decode the whole image")
    return None
