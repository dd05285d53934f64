"""Per-sample image augmentation: one header read, one (drafted) decode, one resample.

The ops, their keys and defaults: prefetchd.workers.transformspec (what a config is checked with).

The geometric ops are all crops, scales and flips, so they compose into one crop box in
source-image coordinates, one output size and a flip flag. That plan is computed from the
image size alone (the file header), before any pixel is decoded. The decode then asks
libjpeg for a DCT-downscaled image (``Image.draft``) that is still at least as large as the
output once cropped, and a single ``Image.resize(..., box=...)`` does crop and scale together.

Pixel ops (color_jitter) always run on the output-sized image after the geometry, wherever
they appear in the list; their random numbers are still drawn at their position in the
list. For brightness and saturation this is exactly equivalent to applying them first;
for contrast the grey level blended towards is the mean of the output crop rather than of
the image at that point in the chain.

All random numbers come from the numpy Generator passed to ``apply`` and are drawn in
config order, so the output depends only on the file bytes, the specs and the rng state.
EXIF orientation is not applied; alpha is dropped, not composited.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from PIL import Image, ImageEnhance

from prefetchd.workers import fastdecode, roidecode, tjlib
from prefetchd.workers.decoders import resolve_decoder
from prefetchd.workers.transformspec import parse_transforms

Box = tuple[float, float, float, float]  # (left, top, right, bottom) in source pixels

# Only these decoders ever see a file: a crafted file cannot reach Pillow's rarer, less
# hardened plugins. Pillow's pixel limit (Image.MAX_IMAGE_PIXELS) stays on.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "PPM", "TIFF")
# The decoders besides Pillow (decoders.NATIVE), by name: each module has require() (a worker's
# import), jpeg_size() and decode_resampled(); files they decline (not JPEG, CMYK, damaged) go
# through Pillow. Whether they are installed is decoders.resolve_decoder's check.
NATIVE_DECODERS = {"simplejpeg": fastdecode, "turbojpeg": roidecode}


# ---------------------------------------------------------------- geometry planning


@dataclass
class CropPlan:
    """The image as it would be after the ops so far, without touching pixels."""

    w: int  # current (virtual) width and height
    h: int
    box: Box  # the source region the virtual image shows
    mirrored: bool = False
    enhance: list[tuple[type, float]] = field(default_factory=list)  # (ImageEnhance class, factor)

    def resize(self, w: int, h: int) -> None:
        self.w, self.h = w, h  # same source region, more or fewer pixels

    def crop(self, left: int, top: int, w: int, h: int) -> None:
        x0, y0, x1, y1 = self.box
        sx, sy = (x1 - x0) / self.w, (y1 - y0) / self.h
        if self.mirrored:  # virtual x = 0 is the source box's right edge
            x0, x1 = x1 - (left + w) * sx, x1 - left * sx
        else:
            x0, x1 = x0 + left * sx, x0 + (left + w) * sx
        self.box = (x0, y0 + top * sy, x1, y0 + (top + h) * sy)
        self.w, self.h = w, h

    def resize_short(self, short: int) -> None:
        # torchvision's Resize(int): the long side is truncated, not rounded.
        if self.w <= self.h:
            self.resize(short, int(short * self.h / self.w))
        else:
            self.resize(int(short * self.w / self.h), short)

    def fit(self, h: int, w: int) -> None:
        # A crop larger than the image: scale up first so the shortest side equals the crop's
        # larger side, so the crop fits in both directions (rather than padding).
        if self.w < w or self.h < h:
            self.resize_short(max(h, w))


def _random_resized_crop(v: CropPlan, p: dict, rng: np.random.Generator) -> None:
    area = v.w * v.h
    log_lo, log_hi = math.log(p["ratio"][0]), math.log(p["ratio"][1])
    for _ in range(10):
        target_area = area * rng.uniform(*p["scale"])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= v.w and 0 < h <= v.h:
            top = int(rng.integers(0, v.h - h + 1))
            left = int(rng.integers(0, v.w - w + 1))
            break
    else:  # fall back to a centre crop with the aspect ratio clamped to the allowed range
        in_ratio = v.w / v.h
        w, h = v.w, v.h
        if in_ratio < p["ratio"][0]:
            h = round(w / p["ratio"][0])
        elif in_ratio > p["ratio"][1]:
            w = round(h * p["ratio"][1])
        top, left = (v.h - h) // 2, (v.w - w) // 2
    v.crop(left, top, w, h)
    v.resize(p["size"][1], p["size"][0])


def _resize_short(v: CropPlan, p: dict, rng: np.random.Generator) -> None:
    v.resize_short(p["size"] if p["size"] is not None else int(rng.integers(p["min"], p["max"] + 1)))


def _random_crop(v: CropPlan, p: dict, rng: np.random.Generator) -> None:
    h, w = p["size"]
    v.fit(h, w)
    top = int(rng.integers(0, v.h - h + 1))
    left = int(rng.integers(0, v.w - w + 1))
    v.crop(left, top, w, h)


def _center_crop(v: CropPlan, p: dict, rng: np.random.Generator) -> None:
    h, w = p["size"]
    v.fit(h, w)
    v.crop(round((v.w - w) / 2), round((v.h - h) / 2), w, h)


def _hflip(v: CropPlan, p: dict, rng: np.random.Generator) -> None:
    # Always draw, so p does not change which numbers later ops get.
    if rng.random() < p["p"]:
        v.mirrored = not v.mirrored


def _color_jitter(v: CropPlan, p: dict, rng: np.random.Generator) -> None:
    for name, enhancer in (
        ("brightness", ImageEnhance.Brightness),
        ("contrast", ImageEnhance.Contrast),
        ("saturation", ImageEnhance.Color),
    ):
        if p[name] > 0:
            v.enhance.append((enhancer, rng.uniform(max(0.0, 1 - p[name]), 1 + p[name])))


_STEPS: dict[str, Callable[[CropPlan, dict, np.random.Generator], None]] = {
    "random_resized_crop": _random_resized_crop,
    "resize_short": _resize_short,
    "random_crop": _random_crop,
    "center_crop": _center_crop,
    "hflip": _hflip,
    "color_jitter": _color_jitter,
}


# ---------------------------------------------------------------- pixels


def _draft(img: Image.Image, box: Box, out_w: int, out_h: int) -> Box:
    """Let libjpeg downscale by 1/2, 1/4 or 1/8 while decoding, as far as the box stays at
    least the output size; return the box in the drafted image's coordinates."""
    src_w, src_h = img.size
    # Pillow picks the largest scale s with s <= src // request, so asking for the whole image at
    # (output size x source size / box size) keeps box / s >= output. ceil errs towards less scaling.
    request = (math.ceil(out_w * src_w / (box[2] - box[0])), math.ceil(out_h * src_h / (box[3] - box[1])))
    drafted = img.draft("RGB", request)  # None for non-JPEG files
    if drafted is None:
        return box
    # draft reports the source extent in drafted pixels (src / s), the exact DCT mapping.
    _, (_, _, ext_w, ext_h) = drafted
    sx, sy = ext_w / src_w, ext_h / src_h
    x0, y0, x1, y1 = box
    return x0 * sx, y0 * sy, x1 * sx, y1 * sy


class ImagePipeline:
    """A validated transform list; ``apply`` decodes and augments one image file.

    ``decoder``: one of settings.DECODERS: "pillow" (default here), "simplejpeg" (libjpeg-turbo
    and OpenCV, prefetchd.workers.fastdecode) or "turbojpeg" (only the crop's region, prefetchd.workers.roidecode);
    all follow the same plan, drawn from the same random numbers.
    """

    def __init__(self, specs: list[dict], decoder: str = "pillow"):
        self._steps, (h, w) = parse_transforms(specs)  # exactly validate_transforms' checks
        self.output_shape: tuple[int, int, int] = (h, w, 3)
        self.decoder = resolve_decoder(decoder)  # a job's was resolved when its config was built
        self._native = NATIVE_DECODERS.get(self.decoder)
        if self._native is not None:
            self._native.require()  # in a worker: its libraries, imported once
        # Whether its decoder decodes every scan (Pillow, simplejpeg): then scan bombs are
        # refused before it; libjpeg-turbo stops at MAX_SCANS itself, and only a file it hands
        # on to Pillow is counted (_refuse_a_scan_bomb).
        self._counts_scans_first = self._native is None or not self._native.LIMITS_SCANS

    def plan(self, size: tuple[int, int], rng: np.random.Generator) -> CropPlan:
        """Draw this sample's random numbers (in config order) for an image of `size` (w, h)."""
        v = CropPlan(size[0], size[1], (0.0, 0.0, float(size[0]), float(size[1])))
        for op, params in self._steps:
            _STEPS[op](v, params, rng)
        return v

    def apply(self, path: str, rng: np.random.Generator, out: np.ndarray, data: bytes) -> None:
        """Decode `data`, the encoded image of the sample at `path` (its name in messages; the
        sample reader read the bytes), augment it with draws from `rng` and write the uint8 RGB
        result into `out` (shape output_shape; may be a view into a batch buffer)."""
        if out.shape != self.output_shape or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 of shape {self.output_shape}, got {out.dtype} {out.shape}")
        v = None
        if self._counts_scans_first:
            _refuse_a_scan_bomb(data, path)
        if self._native is not None:
            size = self._native.jpeg_size(data)
            if size is not None:
                v = self.plan(size, rng)
                try:
                    pixels = self._native.decode_resampled(data, size, v.box, v.w, v.h)
                except ValueError:
                    pixels = None  # CMYK, or damaged: Pillow decides, with the same plan
                if pixels is not None:
                    if v.mirrored:
                        pixels = fastdecode.flip(pixels)
                    _finish(pixels, replace(v, mirrored=False), out)
                    return
            if not self._counts_scans_first:  # libjpeg-turbo handed it on: Pillow has no scan limit
                _refuse_a_scan_bomb(data, path)
        with _open_image(io.BytesIO(data), path) as src:
            if v is None:
                v = self.plan(src.size, rng)
            assert (v.h, v.w) == self.output_shape[:2]
            box = _draft(src, v.box, v.w, v.h)
            img = src if src.mode in ("RGB", "L") else src.convert("RGB")  # P/CMYK/RGBA/... resample badly
            # Rounding can push the box a hair past the edge, which resize rejects.
            x0, y0, x1, y1 = box
            box = (max(0.0, x0), max(0.0, y0), min(float(img.width), x1), min(float(img.height), y1))
            img = img.resize((v.w, v.h), Image.Resampling.BILINEAR, box=box)
        if v.mirrored:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if img.mode != "RGB":
            img = img.convert("RGB")
        for enhancer, factor in v.enhance:
            img = enhancer(img).enhance(factor)
        out[...] = np.asarray(img)


def _open_image(source, path: str) -> Image.Image:
    """Image.open, naming ``path`` when the bytes were read already: Pillow names a BytesIO
    by its address, which would make a bad sample's recorded error differ from run to run."""
    try:
        return Image.open(source, formats=ALLOWED_FORMATS)
    except Image.UnidentifiedImageError:
        if source is path:
            raise
        raise Image.UnidentifiedImageError(f"cannot identify image file {path!r}") from None


def _refuse_a_scan_bomb(data: bytes, path: str) -> None:
    """Image.DecompressionBombError for a JPEG of more scans than tjlib.MAX_SCANS: a progressive
    JPEG of thousands of tiny scans takes Pillow or simplejpeg minutes. Counted only before
    those decoders: libjpeg-turbo's own scan limit guards the turbojpeg one (roidecode), and
    the count reads every byte (~90 us of a 110 KB image's ~1.2 ms)."""
    if data[:2] == b"\xff\xd8" and data.count(b"\xff\xda") > tjlib.MAX_SCANS:  # SOS markers
        raise Image.DecompressionBombError(f"{path}: the JPEG has more than {tjlib.MAX_SCANS} scans")


def _finish(pixels: np.ndarray, v: CropPlan, out: np.ndarray) -> None:
    """Flip and colour-jitter an output-sized RGB array into ``out``."""
    if v.mirrored:
        pixels = pixels[:, ::-1]
    if v.enhance:
        img = Image.fromarray(np.ascontiguousarray(pixels))
        for enhancer, factor in v.enhance:
            img = enhancer(img).enhance(factor)
        pixels = np.asarray(img)
    out[...] = pixels
