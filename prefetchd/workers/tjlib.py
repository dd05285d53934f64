"""libjpeg-turbo 3's TurboJPEG API through ctypes, for prefetchd.workers.roidecode: finding and loading
``libturbojpeg``, one decompressor handle per thread, and its errors as ValueError.

Where the library comes from: the ``turbojpeg`` wheel on PyPI bundles libturbojpeg 3 (Linux
x86_64, macOS, Windows; CPython 3.7-3.13), and ``pip install prefetchd`` installs it where a
wheel exists; otherwise the system's, if it is 3.x (Debian 12's 2.1 has no TurboJPEG 3 API).
The API takes handles and plain integers, so nothing is assumed of a C struct's layout beyond
its two documented structs of four ints, and every call reports failure by its return value.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading

# From turbojpeg.h (libjpeg-turbo 3.0): the values are part of its stable ABI.
TJINIT_DECOMPRESS = 1
TJPARAM_STOPONWARNING, TJPARAM_SUBSAMP, TJPARAM_JPEGWIDTH, TJPARAM_JPEGHEIGHT = 0, 4, 5, 6
TJPARAM_PRECISION, TJPARAM_COLORSPACE, TJPARAM_SCANLIMIT, TJPARAM_LOSSLESS = 7, 8, 13, 15
TJCS_RGB, TJCS_YCbCr, TJCS_GRAY = 0, 1, 2
TJPF_RGB = 0
MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)  # tjMCUWidth, by subsampling (TJSAMP_444 ... TJSAMP_441)
# A progressive JPEG of thousands of tiny scans takes minutes to decode (a known denial of
# service); real photos have about 10. djpeg's -maxscans advice is a few hundred.
MAX_SCANS = 500


class ScalingFactor(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


lib = None  # the loaded libturbojpeg, after load() (the CLI and the master never load it)
_local = threading.local()  # a TurboJPEG handle is not thread-safe: one per thread


# The system's library by its usual names: dlopen searches the loader's paths itself, where
# ctypes.util.find_library would run ldconfig and gcc (~150 ms, in every worker's start).
SYSTEM_NAMES = ("libturbojpeg.so.0", "libturbojpeg.so", "libturbojpeg.dylib", "turbojpeg.dll")


def candidates() -> list[str]:
    """libturbojpeg files to try: the one the ``turbojpeg`` wheel bundles, then the system's."""
    found = []
    spec = importlib.util.find_spec("turbojpeg")  # without importing it: only its library is used
    if spec is not None and spec.origin:
        site = os.path.dirname(spec.origin)
        for folder in ("turbojpeg.libs", ".dylibs"):  # auditwheel / delocate put it there
            found += sorted(glob.glob(os.path.join(site, folder, "libturbojpeg*")))
    return found + list(SYSTEM_NAMES)


def _bind(path: str):
    found = ctypes.CDLL(path)
    found.tj3Init  # noqa: B018  AttributeError for a 2.x library, which has no TurboJPEG 3 API
    handle_t, buf, size, num = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
    found.tj3Init.restype, found.tj3Init.argtypes = handle_t, [num]
    found.tj3Destroy.restype, found.tj3Destroy.argtypes = None, [handle_t]
    found.tj3Set.argtypes = [handle_t, num, num]
    found.tj3Get.argtypes = [handle_t, num]
    found.tj3DecompressHeader.argtypes = [handle_t, buf, size]
    found.tj3SetScalingFactor.argtypes = [handle_t, ScalingFactor]
    found.tj3SetCroppingRegion.argtypes = [handle_t, Region]
    found.tj3Decompress8.argtypes = [handle_t, buf, size, ctypes.c_void_p, num, num]
    found.tj3GetErrorStr.restype, found.tj3GetErrorStr.argtypes = ctypes.c_char_p, [handle_t]
    return found


def load() -> None:
    """Load libturbojpeg 3 into ``lib``, or say how to install it (ImportError)."""
    global lib
    if lib is not None:
        return
    tried = []
    for path in candidates():
        try:
            lib = _bind(path)
            return
        except (OSError, AttributeError) as exc:
            if isinstance(exc, OSError) and path in SYSTEM_NAMES:
                continue  # not installed: nothing to report
            tried.append(f"{path}: {str(exc)[:80] or type(exc).__name__}")
    raise ImportError(
        "decoder = 'turbojpeg' needs libjpeg-turbo 3's libturbojpeg"
        + (f" (not usable: {'; '.join(tried)})" if tried else "")
        + ": pip install turbojpeg (a wheel that bundles it), or use decoder = 'simplejpeg'"
    )


def available() -> bool:
    """Whether libturbojpeg 3 loads here."""
    try:
        load()
    except ImportError:
        return False
    return True


def library_path() -> str | None:
    """The libturbojpeg file in use (for the decoder facts a Ray node is compared by)."""
    return None if lib is None else lib._name


def handle() -> int:
    """This thread's decompressor, made on first use."""
    h = getattr(_local, "handle", None)
    if h is None:
        h = lib.tj3Init(TJINIT_DECOMPRESS)
        if not h:
            raise MemoryError("tj3Init failed: out of memory")
        lib.tj3Set(h, TJPARAM_STOPONWARNING, 1)  # a damaged file fails fast; Pillow then decides
        lib.tj3Set(h, TJPARAM_SCANLIMIT, MAX_SCANS)
        _local.handle = h
    return h


def get(h: int, param: int) -> int:
    """A TJPARAM_* value of ``h`` (of the header read last)."""
    return lib.tj3Get(h, param)


def failed(h: int, what: str) -> ValueError:
    """The error to raise after a call on ``h`` failed. The handle is dropped: one that failed
    mid-file fails the next file too ("two SOI markers"), so the next call makes a new one."""
    message = lib.tj3GetErrorStr(h).decode(errors="replace")
    _local.handle = None
    lib.tj3Destroy(h)
    return ValueError(f"libjpeg-turbo could not {what}: {message}")


def read_header(h: int, data: bytes) -> None:
    """Read ``data``'s JPEG header into ``h``: what tj3Get reports, and what the scaling factor
    and cropping region set next apply to."""
    if lib.tj3DecompressHeader(h, data, len(data)) != 0:
        raise failed(h, "read the JPEG header")
