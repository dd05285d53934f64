"""Byte sizes as users write them: ``30G``, ``512M``, ``1.5T``, ``1048576`` (powers of 1024)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE | re.ASCII)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; ValueError with the accepted forms otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use bytes or a number with K, M, G or T (e.g. 30G)")
    return int(float(m[1]) * _UNITS[m[2].upper()])


def format_size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
