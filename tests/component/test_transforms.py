"""Tests for prefetchd.workers.transforms: validation, shapes, determinism, and the fused
crop/resize path against a naive full-decode Pillow reference."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageEnhance

from prefetchd.errors import ConfigError
from prefetchd.settings import DECODERS
from prefetchd.sources.index import read_image_file
from prefetchd.workers.transforms import NATIVE_DECODERS, ImagePipeline
from prefetchd.workers.transformspec import OPS, validate_transforms
from tests.conftest import REPO

NATIVE = sorted(NATIVE_DECODERS)

IMAGENET = [
    {"op": "resize_short", "min": 256, "max": 480},
    {"op": "random_crop", "size": 224},
    {"op": "hflip"},
    {"op": "color_jitter", "brightness": 0.4, "contrast": 0.4, "saturation": 0.4},
]


def _pixels(w: int, h: int, seed: int) -> np.ndarray:
    """Gradients, a smooth pattern and noise: structure for resampling to act on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    a = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h) + 64], -1)
    a += 60 * (np.sin(x / 17.0) * np.cos(y / 23.0))[..., None]
    a += rng.normal(0, 15, a.shape)
    return np.clip(a, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    made = {}

    def save(name, img, **kw):
        made[name] = str(d / name)
        img.save(made[name], **kw)

    save("big.jpg", Image.fromarray(_pixels(1200, 900, 1)), quality=90)
    save("medium.jpg", Image.fromarray(_pixels(500, 375, 2)), quality=90)
    save("tall.jpg", Image.fromarray(_pixels(300, 640, 3)), quality=90)
    save("small.jpg", Image.fromarray(_pixels(120, 90, 4)), quality=90)  # smaller than the crops
    save("gray.jpg", Image.fromarray(_pixels(640, 480, 5)).convert("L"), quality=90)
    save("cmyk.jpg", Image.fromarray(_pixels(400, 300, 6)).convert("CMYK"), quality=90)
    save("palette.png", Image.fromarray(_pixels(320, 240, 7)).quantize(64))
    rgba = Image.fromarray(_pixels(300, 260, 8)).convert("RGBA")
    rgba.putalpha(128)
    save("rgba.png", rgba)
    return made


def _run(specs, path, seed, decoder="pillow"):
    pipe = ImagePipeline(specs, decoder)
    out = np.zeros(pipe.output_shape, np.uint8)
    pipe.apply(path, np.random.default_rng(seed), out, read_image_file(path))
    return out


# ---------------------------------------------------------------- naive reference


def _hw(size):
    return (size, size) if isinstance(size, int) else tuple(size)


def _resize_short(img, short):
    w, h = img.size
    size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    return img.resize(size, Image.Resampling.BILINEAR)


def _rrc_params(width, height, scale, ratio, rng):
    """torchvision.transforms.RandomResizedCrop.get_params, with numpy draws."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.integers(0, height - h + 1))
            j = int(rng.integers(0, width - w + 1))
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def naive(path, specs, rng):
    """Decode fully, then apply each op to real pixels, in order (jitter included)."""
    with Image.open(path) as src:
        img = src.convert("RGB")
    for spec in specs:
        op = spec["op"]
        if op == "resize_short":
            s = spec.get("size") or int(rng.integers(spec["min"], spec["max"] + 1))
            img = _resize_short(img, s)
        elif op in ("random_crop", "center_crop"):
            h, w = _hw(spec["size"])
            if img.width < w or img.height < h:
                img = _resize_short(img, max(h, w))
            if op == "random_crop":
                top = int(rng.integers(0, img.height - h + 1))
                left = int(rng.integers(0, img.width - w + 1))
            else:
                top, left = round((img.height - h) / 2), round((img.width - w) / 2)
            img = img.crop((left, top, left + w, top + h))
        elif op == "random_resized_crop":
            h, w = _hw(spec["size"])
            i, j, ch, cw = _rrc_params(
                img.width, img.height, spec.get("scale", (0.08, 1.0)), spec.get("ratio", (3 / 4, 4 / 3)), rng
            )
            img = img.crop((j, i, j + cw, i + ch)).resize((w, h), Image.Resampling.BILINEAR)
        elif op == "hflip":
            if rng.random() < spec.get("p", 0.5):
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        elif op == "color_jitter":
            for key, cls in (
                ("brightness", ImageEnhance.Brightness),
                ("contrast", ImageEnhance.Contrast),
                ("saturation", ImageEnhance.Color),
            ):
                x = spec.get(key, 0)
                if x > 0:
                    img = cls(img).enhance(rng.uniform(max(0, 1 - x), 1 + x))
    return np.asarray(img)


def _mad(a, b):
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# ---------------------------------------------------------------- shapes

SHAPE_CASES = [
    ([{"op": "random_resized_crop", "size": 224}], (224, 224)),
    ([{"op": "random_resized_crop", "size": [96, 128], "scale": [0.5, 1.0], "ratio": [1, 2]}], (96, 128)),
    ([{"op": "resize_short", "size": 256}, {"op": "center_crop", "size": 224}], (224, 224)),
    ([{"op": "random_crop", "size": [200, 160]}], (200, 160)),
    ([{"op": "center_crop", "size": 224}], (224, 224)),
    ([{"op": "center_crop", "size": 64}, {"op": "hflip", "p": 1.0}], (64, 64)),
    ([{"op": "center_crop", "size": 64}, {"op": "color_jitter", "contrast": 0.5}], (64, 64)),
    (IMAGENET, (224, 224)),
]
IMAGE_NAMES = ["big.jpg", "medium.jpg", "tall.jpg", "small.jpg", "gray.jpg", "cmyk.jpg", "palette.png", "rgba.png"]


@pytest.mark.parametrize("name", IMAGE_NAMES)
@pytest.mark.parametrize(("specs", "hw"), SHAPE_CASES)
def test_output_shape_and_dtype(images, name, specs, hw):
    assert validate_transforms(specs) == hw
    pipe = ImagePipeline(specs)
    assert pipe.output_shape == (*hw, 3)
    out = np.zeros(pipe.output_shape, np.uint8)
    pipe.apply(images[name], np.random.default_rng(0), out, read_image_file(images[name]))
    assert out.dtype == np.uint8 and out.shape == (*hw, 3)
    assert out.std() > 5  # real content was written, not left blank


def test_writes_into_a_view_of_a_batch(images):
    pipe = ImagePipeline(IMAGENET)
    batch = np.zeros((3, *pipe.output_shape), np.uint8)
    pipe.apply(images["big.jpg"], np.random.default_rng(0), batch[1], read_image_file(images["big.jpg"]))
    assert not batch[0].any() and not batch[2].any()
    assert np.array_equal(batch[1], _run(IMAGENET, images["big.jpg"], 0))


def test_rejects_wrong_out_buffer(images):
    pipe = ImagePipeline([{"op": "center_crop", "size": 32}])
    with pytest.raises(ValueError, match="shape"):
        pipe.apply(images["big.jpg"], np.random.default_rng(0), np.zeros((32, 32, 4), np.uint8), b"")
    with pytest.raises(ValueError, match="uint8"):
        pipe.apply(images["big.jpg"], np.random.default_rng(0), np.zeros((32, 32, 3), np.float32), b"")


def test_grayscale_comes_out_as_equal_rgb_channels(images):
    out = _run(IMAGENET[:3], images["gray.jpg"], 0)
    assert np.array_equal(out[..., 0], out[..., 1]) and np.array_equal(out[..., 0], out[..., 2])


# ---------------------------------------------------------------- determinism and draws


@pytest.mark.parametrize("name", ["big.jpg", "palette.png"])
def test_same_seed_same_bytes_different_seed_different(images, name):
    a = _run(IMAGENET, images[name], 7)
    assert a.tobytes() == _run(IMAGENET, images[name], 7).tobytes()
    assert a.tobytes() != _run(IMAGENET, images[name], 8).tobytes()


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_hflip_p1_is_the_mirror_of_p0(images, name):
    base = [{"op": "resize_short", "min": 200, "max": 300}, {"op": "center_crop", "size": [120, 150]}]
    no = _run([*base, {"op": "hflip", "p": 0.0}], images[name], 3)
    yes = _run([*base, {"op": "hflip", "p": 1.0}], images[name], 3)
    assert np.array_equal(yes, no[:, ::-1])


def test_flip_before_crop_maps_the_crop_to_mirrored_source(images):
    # Pure crops on a PNG involve no resampling, so the fused result must be exact.
    specs = [{"op": "hflip", "p": 1.0}, {"op": "random_crop", "size": [150, 200]}]
    for seed in range(5):
        ref = naive(images["palette.png"], specs, np.random.default_rng(seed))
        assert np.array_equal(_run(specs, images["palette.png"], seed), ref)


def test_center_crop_of_png_is_exact(images):
    specs = [{"op": "center_crop", "size": [101, 203]}]
    with Image.open(images["palette.png"]) as src:
        rgb = np.asarray(src.convert("RGB"))
    top, left = round((240 - 101) / 2), round((320 - 203) / 2)
    assert np.array_equal(_run(specs, images["palette.png"], 0), rgb[top : top + 101, left : left + 203])


def test_jitter_draws_at_its_position_and_brightness_saturation_commute_with_geometry(images):
    # Brightness and saturation are per-pixel, so applying them after the crop is exact.
    specs = [
        {"op": "color_jitter", "brightness": 0.5, "saturation": 0.5},
        {"op": "random_crop", "size": 128},
        {"op": "hflip"},
    ]
    for seed in range(4):
        ref = naive(images["palette.png"], specs, np.random.default_rng(seed))
        assert np.array_equal(_run(specs, images["palette.png"], seed), ref)


def test_zero_jitter_is_a_no_op(images):
    base = [{"op": "random_resized_crop", "size": 96}]
    assert np.array_equal(_run([*base, {"op": "color_jitter"}], images["big.jpg"], 1), _run(base, images["big.jpg"], 1))


# ---------------------------------------------------------------- fused path vs naive reference

REFERENCE_CASES = [
    [{"op": "center_crop", "size": 224}],
    [{"op": "resize_short", "size": 256}, {"op": "center_crop", "size": 224}],
    [{"op": "resize_short", "size": 160}, {"op": "center_crop", "size": [128, 96]}],
    [{"op": "random_resized_crop", "size": 224}],
    [{"op": "random_resized_crop", "size": [112, 160], "scale": [0.02, 0.3]}],
    [{"op": "resize_short", "min": 256, "max": 480}, {"op": "random_crop", "size": 224}, {"op": "hflip"}],
    [
        {"op": "hflip", "p": 1.0},
        {"op": "resize_short", "size": 300},
        {"op": "random_crop", "size": 224},
        {"op": "random_resized_crop", "size": 128},
    ],
    [{"op": "random_crop", "size": 224}],  # upscales the small image first
    [
        {"op": "resize_short", "size": 256},
        {"op": "color_jitter", "brightness": 0.4, "saturation": 0.4},
        {"op": "random_crop", "size": 224},
        {"op": "hflip"},
    ],
]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", IMAGE_NAMES)
@pytest.mark.parametrize("specs", REFERENCE_CASES)
def test_fused_path_is_close_to_naive_reference(images, name, specs, decoder):
    # Both decoders follow one plan; only the DCT scaling and the resampling filter differ.
    for seed in range(3):
        fused = _run(specs, images[name], seed, decoder)
        ref = naive(images[name], specs, np.random.default_rng(seed))
        assert fused.shape == ref.shape
        assert _mad(fused, ref) < 6, (seed, _mad(fused, ref))


@pytest.mark.parametrize("decoder", NATIVE)
@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_fast_decoders_are_deterministic(images, name, decoder):
    first = _run(IMAGENET, images[name], 5, decoder)
    assert np.array_equal(first, _run(IMAGENET, images[name], 5, decoder))
    assert not np.array_equal(first, _run(IMAGENET, images[name], 6, decoder))


def test_fast_decoder_refuses_a_damaged_jpeg_like_pillow(images, tmp_path):
    damaged = tmp_path / "cut.jpg"
    damaged.write_bytes(Path(images["medium.jpg"]).read_bytes()[:3000])
    for decoder in DECODERS:
        with pytest.raises(OSError):  # the producer counts it as a bad sample and replaces it
            _run(IMAGENET, str(damaged), 0, decoder)


def test_unknown_decoder_is_refused():
    with pytest.raises(ValueError, match="decoder must be one of"):
        ImagePipeline(IMAGENET, "libjpeg")


PLAN_SPECS = [IMAGENET, *REFERENCE_CASES, *(s for s, _ in SHAPE_CASES)]


@settings(max_examples=300, deadline=None)
@given(
    w=st.integers(1, 5000),
    h=st.integers(1, 5000),
    which=st.integers(0, len(PLAN_SPECS) - 1),
    seed=st.integers(0, 2**32),
)
def test_plan_box_stays_inside_the_source(w, h, which, seed):
    pipe = ImagePipeline(PLAN_SPECS[which])
    plan = pipe.plan((w, h), np.random.default_rng(seed))
    x0, y0, x1, y1 = plan.box
    eps = 1e-6 * max(w, h)
    assert -eps <= x0 < x1 <= w + eps and -eps <= y0 < y1 <= h + eps
    assert (plan.h, plan.w, 3) == pipe.output_shape


def test_tiny_and_extreme_aspect_images(tmp_path):
    for w, h in [(1, 1), (1, 700), (900, 2), (7, 5)]:
        path = str(tmp_path / f"{w}x{h}.jpg")
        Image.fromarray(_pixels(w, h, 0)).save(path, quality=90)
        assert _run(IMAGENET, path, 0).shape == (224, 224, 3)
        assert _run([{"op": "random_resized_crop", "size": 64}], path, 0).shape == (64, 64, 3)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("specs", "pattern"),
    [
        ([], r"fixed output size.*center_crop.*random_crop.*random_resized_crop"),
        ([{"op": "hflip"}], r"fixed output size"),
        ([{"op": "center_crop", "size": 224}, {"op": "resize_short", "size": 256}], r"fixed output size"),
        (
            [{"op": "center_crop", "size": 8}, {"op": "blur"}],
            (
                r"unknown transform op 'blur' in transform #2; known ops: center_crop, color_jitter, hflip, "
                r"random_crop, random_resized_crop, resize_short"
            ),
        ),
        ([{"size": 224}], r"transform #1 has no 'op' key; known ops: center_crop"),
        ([{"op": 3}], r"unknown transform op 3 in transform #1"),
        (["center_crop"], r"transform #1 must be a table"),
        ("center_crop", r"must be a list"),
        (
            [{"op": "hflip"}, {"op": "random_crop", "sise": 224}],
            r"transform #2 \(random_crop\): unknown key 'sise'; known keys: size",
        ),
        ([{"op": "random_crop"}], r"transform #1 \(random_crop\): missing required key 'size'"),
        ([{"op": "random_resized_crop"}], r"transform #1 \(random_resized_crop\): missing required key 'size'"),
        ([{"op": "center_crop", "size": "224"}], r"transform #1 \(center_crop\): key 'size' must be a positive"),
        ([{"op": "center_crop", "size": 0}], r"key 'size' must be a positive"),
        ([{"op": "center_crop", "size": True}], r"key 'size' must be a positive"),
        ([{"op": "center_crop", "size": 224.0}], r"key 'size' must be a positive"),
        ([{"op": "center_crop", "size": [224, 224, 3]}], r"key 'size' must be .*\[height, width\]"),
        ([{"op": "random_resized_crop", "size": 8, "scale": [0.5, 0.1]}], r"\(random_resized_crop\): key 'scale'"),
        (
            [{"op": "random_resized_crop", "size": 8, "scale": [0.5, 1.5]}],
            r"key 'scale' must be a list \[low, high\] with 0 < low <= high <= 1",
        ),
        ([{"op": "random_resized_crop", "size": 8, "ratio": [0, 1]}], r"key 'ratio'"),
        ([{"op": "random_resized_crop", "size": 8, "ratio": "wide"}], r"key 'ratio'"),
        ([{"op": "hflip", "p": 1.5}, {"op": "center_crop", "size": 8}], r"transform #1 \(hflip\): key 'p'"),
        ([{"op": "color_jitter", "brightness": -0.1}], r"\(color_jitter\): key 'brightness' must be a number >= 0"),
        ([{"op": "color_jitter", "hue": 0.1}], r"unknown key 'hue'; known keys: brightness, contrast, saturation"),
        ([{"op": "resize_short"}, {"op": "center_crop", "size": 8}], r"\(resize_short\): give either 'size'"),
        (
            [{"op": "resize_short", "size": 256, "min": 256, "max": 480}, {"op": "center_crop", "size": 8}],
            r"transform #1 \(resize_short\): give either 'size'.*not both",
        ),
        ([{"op": "resize_short", "min": 256}, {"op": "center_crop", "size": 8}], r"\(resize_short\): give either"),
        (
            [{"op": "resize_short", "min": 480, "max": 256}, {"op": "center_crop", "size": 8}],
            r"'min' \(480\) must not exceed 'max' \(256\)",
        ),
        (
            [{"op": "resize_short", "size": [256, 256]}, {"op": "center_crop", "size": 8}],
            r"\(resize_short\): key 'size' must be a positive integer",
        ),
    ],
)
def test_validation_errors_name_the_transform_and_key(specs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_transforms(specs)
    with pytest.raises(ConfigError, match=pattern):
        ImagePipeline(specs)


def test_validate_returns_the_last_crop_size():
    assert validate_transforms(IMAGENET) == (224, 224)
    assert validate_transforms(
        [
            {"op": "center_crop", "size": 300},
            {"op": "resize_short", "size": 256},
            {"op": "random_crop", "size": [64, 48]},
            {"op": "hflip"},
        ]
    ) == (64, 48)


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 600),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-2, 600), st.floats()), max_size=3),
)
_spec = st.one_of(
    st.dictionaries(
        st.sampled_from(
            ["op", "size", "min", "max", "scale", "ratio", "p", "brightness", "contrast", "saturation", "bogus"]
        ),
        _values,
        max_size=4,
    ),
    st.sampled_from(sorted(OPS)).flatmap(
        lambda op: st.fixed_dictionaries({"op": st.just(op)}, optional={k: _values for k in OPS[op]})
    ),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_spec, max_size=4))
def test_validation_only_ever_raises_config_error(specs):
    try:
        h, w = validate_transforms(specs)
    except ConfigError:
        return
    assert h > 0 and w > 0


def test_module_does_not_import_torch():
    code = "import sys, prefetchd.workers.transforms; sys.exit('torch' in sys.modules)"
    root = REPO
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def test_every_decoder_setting_names_a_decoder_of_the_table():
    """settings.DECODERS (the names `--decoder` takes), decoders.NATIVE (what the command checks
    installed without importing a decoder) and transforms.NATIVE_DECODERS (the modules) describe
    one table: Pillow plus each native decoder, and each of those has the three functions the
    workers call."""
    from prefetchd.settings import DECODERS
    from prefetchd.workers.decoders import NATIVE
    from prefetchd.workers.transforms import NATIVE_DECODERS

    assert set(DECODERS) == {"pillow", *NATIVE_DECODERS} == {"pillow", *NATIVE}
    for name, module in NATIVE_DECODERS.items():
        for function in ("require", "jpeg_size", "decode_resampled"):
            assert callable(getattr(module, function, None)), f"{name}: {module.__name__}.{function}"
