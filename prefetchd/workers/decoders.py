"""Which JPEG decoder a job runs with, and whether it is installed, checked without loading it.

The decoders besides Pillow (prefetchd.workers.fastdecode, prefetchd.workers.roidecode) need
OpenCV and simplejpeg, and turbojpeg libturbojpeg 3 besides. ``prefetchd start`` and the master
check they are there (find_spec, and a few milliseconds to load libturbojpeg) without importing
OpenCV (~0.2 s of CPU) or numpy; a worker imports them (the decoder module's require) and says,
with these words, how to fix a library that is missing or does not load.
"""

from __future__ import annotations

import importlib.util

from prefetchd.settings import DECODERS
from prefetchd.workers import tjlib

LIBRARIES = ("cv2", "simplejpeg")  # what the native decoders import: checked here, preloaded by the worker server
NATIVE = tuple(name for name in DECODERS if name != "pillow")  # transforms.NATIVE_DECODERS holds their modules


def resolve_decoder(name: str) -> str:
    """The decoder a job runs with: ``name``, checked installed (ImportError saying how to
    install it), or for "auto" the fastest one installed here."""
    if name == "auto":
        for candidate in reversed(DECODERS):  # fastest first
            try:
                return resolve_decoder(candidate)
            except ImportError:
                continue
    if name not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {name!r}")
    if name in NATIVE:
        for module in LIBRARIES:
            if importlib.util.find_spec(module) is None:
                raise ImportError(install_advice(module))
    if name == "turbojpeg":
        tjlib.load()
    return name


def install_advice(missing: str | None) -> str:
    return (
        f"decoder = 'simplejpeg' or 'turbojpeg' needs simplejpeg and OpenCV ({missing} is missing): "
        "pip install opencv-python-headless simplejpeg, or use decoder = 'pillow'"
    )


def broken_advice(exc: Exception) -> str:
    """A library that is there (a system library it needs missing, a build for another numpy,
    a leftover folder of an uninstalled wheel): what failed, and the fix."""
    return (
        f"decoder = 'simplejpeg' or 'turbojpeg' needs OpenCV and simplejpeg, which are installed but do not "
        f"load ({type(exc).__name__}: {exc}): reinstall them (pip install --force-reinstall "
        "opencv-python-headless simplejpeg), or use decoder = 'pillow'"
    )
