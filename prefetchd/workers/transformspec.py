"""The ``[[transform]]`` list's schema: the ops, their keys and defaults, and its checks.

Imports neither numpy nor Pillow: ``prefetchd start`` checks a config with it before it hands the
job to the daemon, and pays only for what it runs. The pixels are prefetchd.workers.transforms's.

Ops, their keys and defaults (``size`` is an int for a square, or [height, width]):

    random_resized_crop  size (required), scale [0.08, 1.0], ratio [3/4, 4/3]
                         torchvision's algorithm: 10 tries with a log-uniform aspect
                         ratio, then a centre crop clamped to the ratio range.
    resize_short         size (fixed shortest side), or min and max (shortest side
                         drawn as an integer uniform in [min, max]); exactly one form.
    random_crop          size
    center_crop          size
    hflip                p 0.5
    color_jitter         brightness 0, contrast 0, saturation 0; each factor uniform in
                         [max(0, 1 - x), 1 + x], applied in that order (PIL.ImageEnhance
                         Brightness, Contrast, Color).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefetchd.errors import ConfigError


def _is_number(v: Any) -> bool:
    # TOML booleans are Python bools, which are ints; never accept them as numbers.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_int(v: Any) -> int:
    if _is_positive_int(v):
        return v
    raise ValueError(f"must be a positive integer, got {v!r}")


def _size(v: Any) -> tuple[int, int]:
    """int -> square; [height, width] -> as given. Returns (height, width)."""
    if _is_positive_int(v):
        return v, v
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_positive_int(x) for x in v):
        return v[0], v[1]
    raise ValueError(f"must be a positive integer or a list [height, width] of positive integers, got {v!r}")


def _range(v: Any, high_max: float) -> tuple[float, float]:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v) and 0 < v[0] <= v[1] <= high_max:
        return float(v[0]), float(v[1])
    bound = "" if high_max == math.inf else f" <= {high_max:g}"
    raise ValueError(f"must be a list [low, high] with 0 < low <= high{bound}, got {v!r}")


def _scale(v: Any) -> tuple[float, float]:
    return _range(v, 1.0)  # fractions of the image area


def _ratio(v: Any) -> tuple[float, float]:
    return _range(v, math.inf)  # width / height


def _probability(v: Any) -> float:
    if _is_number(v) and 0 <= v <= 1:
        return float(v)
    raise ValueError(f"must be a number in [0, 1], got {v!r}")


def _strength(v: Any) -> float:
    if _is_number(v) and v >= 0:
        return float(v)
    raise ValueError(f"must be a number >= 0, got {v!r}")


_REQUIRED = object()


@dataclass(frozen=True)
class Key:
    """One config key of an op."""

    parse: Callable[[Any], Any]  # returns the normalised value or raises ValueError
    default: Any = None  # _REQUIRED, None (optional, no default) or a value


# Op name -> its keys. resize_short's "size or min/max" rule is checked separately.
OPS: dict[str, dict[str, Key]] = {
    "random_resized_crop": {
        "size": Key(_size, _REQUIRED),
        "scale": Key(_scale, (0.08, 1.0)),
        "ratio": Key(_ratio, (3 / 4, 4 / 3)),
    },
    "resize_short": {"size": Key(_positive_int), "min": Key(_positive_int), "max": Key(_positive_int)},
    "random_crop": {"size": Key(_size, _REQUIRED)},
    "center_crop": {"size": Key(_size, _REQUIRED)},
    "hflip": {"p": Key(_probability, 0.5)},
    "color_jitter": {
        "brightness": Key(_strength, 0.0),
        "contrast": Key(_strength, 0.0),
        "saturation": Key(_strength, 0.0),
    },
}
_FIXED_SIZE_OPS = ("random_resized_crop", "random_crop", "center_crop")


def _parse_one(i: int, spec: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(spec, dict):
        raise ConfigError(f'transform #{i} must be a table like {{op = "center_crop", size = 224}}, got {spec!r}')
    known_ops = ", ".join(sorted(OPS))
    if "op" not in spec:
        raise ConfigError(f"transform #{i} has no 'op' key; known ops: {known_ops}")
    op = spec["op"]
    if not isinstance(op, str) or op not in OPS:
        raise ConfigError(f"unknown transform op {op!r} in transform #{i}; known ops: {known_ops}")
    keys = OPS[op]
    where = f"transform #{i} ({op})"
    params: dict[str, Any] = {}
    for name, value in spec.items():
        if name == "op":
            continue
        if name not in keys:
            raise ConfigError(f"{where}: unknown key {name!r}; known keys: {', '.join(keys)}")
        try:
            params[name] = keys[name].parse(value)
        except ValueError as e:
            raise ConfigError(f"{where}: key {name!r} {e}") from None
    for name, key in keys.items():
        if name not in params:
            if key.default is _REQUIRED:
                raise ConfigError(f"{where}: missing required key {name!r}")
            params[name] = key.default
    if op == "resize_short":
        fixed, lo, hi = params["size"], params["min"], params["max"]
        if (fixed is None) == (lo is None and hi is None) or (lo is None) != (hi is None):
            raise ConfigError(
                f"{where}: give either 'size' (fixed shortest side) or both 'min' and 'max' "
                f"(random shortest side), not both forms and not half of one"
            )
        if fixed is None and lo > hi:
            raise ConfigError(f"{where}: 'min' ({lo}) must not exceed 'max' ({hi})")
    return op, params


def parse_transforms(specs: Any) -> tuple[list[tuple[str, dict[str, Any]]], tuple[int, int]]:
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"transforms must be a list of tables, got {type(specs).__name__}")
    steps = [_parse_one(i, spec) for i, spec in enumerate(specs, start=1)]
    sizing = [(op, p) for op, p in steps if op in _FIXED_SIZE_OPS or op == "resize_short"]
    if not sizing or sizing[-1][0] == "resize_short":
        raise ConfigError(
            "transforms must end with a fixed output size so samples can be batched: add a "
            "center_crop, random_crop or random_resized_crop (after any resize_short)"
        )
    return steps, sizing[-1][1]["size"]


def random_steps(specs: list[dict]) -> list[str]:
    """The steps that draw from the sample's generator, as ``transform #i (op)``: an evaluation
    job reads every sample as it is, and refuses them."""
    random = []
    for i, (op, p) in enumerate(parse_transforms(specs)[0], start=1):
        if (
            op in ("random_resized_crop", "random_crop")
            or (op == "resize_short" and p["size"] is None)
            or (op == "hflip" and p["p"] > 0)
            or (op == "color_jitter" and any(p.values()))
        ):
            random.append(f"transform #{i} ({op})")
    return random


def validate_transforms(specs: list[dict]) -> tuple[int, int]:
    """Check the transform list; return the fixed output (height, width) or raise ConfigError."""
    return parse_transforms(specs)[1]
