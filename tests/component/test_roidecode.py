"""The region-of-interest decoder (decoder = "turbojpeg", prefetchd.workers.roidecode) against a whole
decode of the same JPEG by libjpeg-turbo (simplejpeg, the same geometry): every subsampling,
sizes off the MCU grid, boxes at the edges, progressive files; and the files it must decline
or refuse (damaged, CMYK, 12-bit headers, a header claiming a billion pixels, not a JPEG)."""

from __future__ import annotations

import io
import os
import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from prefetchd.workers import fastdecode, roidecode, tjlib

pytestmark = pytest.mark.skipif(
    not tjlib.available(), reason="no libturbojpeg 3 here (the turbojpeg wheel is not installed)"
)


def _jpeg(w: int, h: int, seed: int = 0, **save) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x * 255 // max(w, 1), y * 255 // max(h, 1), (x * y) % 256], -1).astype(np.float64)
    pixels += rng.normal(0, 20, pixels.shape)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    out = io.BytesIO()
    img.save(out, "JPEG", **{"quality": 90, **save})
    return out.getvalue()


def setup_module() -> None:
    roidecode.require()
    ImageFile.MAXBLOCK = 1 << 24  # Pillow writes a progressive JPEG in one block


def _whole_then_crop(data: bytes, box, out_w: int, out_h: int) -> np.ndarray:
    size = fastdecode.jpeg_size(data)
    return fastdecode.decode_resampled(data, size, box, out_w, out_h).astype(int)


SUBSAMPLINGS = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}


def _box(w: int, h: int, fx, fy) -> tuple[float, float, float, float]:
    """A box inside w x h, as plans make them: positive width and height, edges anywhere."""
    (a, b), (c, d) = sorted(fx), sorted(fy)
    x0, y0 = a * w * 0.99, c * h * 0.99
    return x0, y0, max(b * w, x0 + 0.01 * w), max(d * h, y0 + 0.01 * h)


@settings(max_examples=int(os.environ.get("ROI_EXAMPLES", 40)), deadline=None)
@given(
    w=st.integers(1, 420),
    h=st.integers(1, 420),
    subsampling=st.sampled_from(sorted(SUBSAMPLINGS)),
    progressive=st.booleans(),
    fx=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    fy=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    out=st.sampled_from([(224, 224), (64, 32), (3, 5)]),
)
def test_region_decode_matches_a_whole_decode_cropped(w, h, subsampling, progressive, fx, fy, out):
    data = _jpeg(w, h, progressive=progressive, subsampling=SUBSAMPLINGS[subsampling])
    box = _box(w, h, fx, fy)
    assert roidecode.jpeg_size(data) == (w, h)
    region = roidecode.decode_resampled(data, (w, h), box, *out).astype(int)
    whole = _whole_then_crop(data, box, *out)
    assert region.shape == whole.shape == (out[1], out[0], 3)
    if box[2] - box[0] >= 32 and box[3] - box[1] >= 32:
        # Only the region's edges see other neighbours in libjpeg-turbo's upsampling; a box of a
        # few pixels is all edge, and only its shape is compared.
        assert np.abs(region - whole).mean() < 1.5, np.abs(region - whole).mean()


def test_greyscale_and_the_usual_photo():
    data = _jpeg(640, 480, seed=2)
    grey = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("L").save(grey, "JPEG", quality=90)
    for jpeg in (data, grey.getvalue()):
        box = (37.5, 20.25, 480.0, 401.0)
        region = roidecode.decode_resampled(jpeg, (640, 480), box, 224, 224).astype(int)
        assert np.abs(region - _whole_then_crop(jpeg, box, 224, 224)).mean() < 0.5


def test_an_empty_box_or_a_size_not_the_files_is_refused():
    data = _jpeg(64, 48)
    with pytest.raises(ValueError, match="empty crop box"):
        roidecode.decode_resampled(data, (64, 48), (64.0, 0.0, 64.0, 48.0), 8, 8)
    with pytest.raises(ValueError, match="not 640 x 480"):  # a buffer sized for the wrong image: never written
        roidecode.decode_resampled(data, (640, 480), (0.0, 0.0, 640.0, 480.0), 8, 8)


def test_files_it_declines_go_to_pillow():
    cmyk = io.BytesIO()
    Image.new("CMYK", (64, 64), (10, 20, 30, 40)).save(cmyk, "JPEG")
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    for data in (cmyk.getvalue(), png.getvalue(), b"", b"\xff\xd8", b"\xff\xd8" + b"\x00" * 100, _jpeg(50, 50)[:20]):
        assert roidecode.jpeg_size(data) is None


def _with_size(data: bytes, w: int, h: int) -> bytes:
    """The JPEG with its frame header (SOF0) claiming w x h."""
    at = data.index(b"\xff\xc0") + 5
    return data[:at] + struct.pack(">HH", h, w) + data[at + 4 :]


def test_a_damaged_jpeg_is_a_value_error_and_a_huge_header_a_bomb():
    data = _jpeg(300, 200)
    with pytest.raises(ValueError, match="libjpeg-turbo could not"):
        roidecode.decode_resampled(data[: len(data) // 2], (300, 200), (0, 0, 300, 200), 64, 64)
    # The failed file leaves nothing behind: the thread's next decode is a clean one.
    assert roidecode.decode_resampled(data, (300, 200), (0, 0, 300, 200), 64, 64).shape == (64, 64, 3)
    huge = _with_size(data, 60000, 60000)
    assert roidecode.jpeg_size(huge) == (60000, 60000)
    with pytest.raises(Image.DecompressionBombError):
        roidecode.decode_resampled(huge, (60000, 60000), (0, 0, 60000, 60000), 64, 64)
    # A header that lies about a smaller size than the data holds: an error or an image, never a crash.
    try:
        roidecode.decode_resampled(_with_size(data, 40, 30), (40, 30), (0, 0, 40, 30), 16, 16)
    except ValueError:
        pass


def test_threads_decode_with_handles_of_their_own():
    data = [_jpeg(400 + 16 * i, 300, seed=i) for i in range(4)]
    boxes = [(10.0 * i, 5.0, 300.0, 290.0) for i in range(4)]
    expected = [
        roidecode.decode_resampled(d, (400 + 16 * i, 300), b, 96, 96) for i, (d, b) in enumerate(zip(data, boxes))
    ]
    got, errors = {}, []

    def work(n: int) -> None:
        try:
            for _ in range(20):
                i = n % 4
                got[n] = roidecode.decode_resampled(data[i], (400 + 16 * i, 300), boxes[i], 96, 96)
                assert np.array_equal(got[n], expected[i])
        except Exception as exc:  # noqa: BLE001  reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(got) == 8
