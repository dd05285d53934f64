"""A daemon process's heap kept at its working size over a long run (glibc's malloc).

glibc raises its mmap threshold each time a large block that it had mapped is freed (up to
32 MiB): from then on blocks of that size come from the heap, whose pages stay with the process.
Measured on a master serving two fast ranks (tests/daemon/operations/test_soak.py, 20 minutes):
its private memory was flat for minutes 9 to 17, then stepped up 0.5 MiB at minute 18 and kept
it, in both runs (1.8-2.8 bytes per batch). With the thresholds fixed at glibc's defaults, large
blocks are mapped and unmapped each time and the heap's top is trimmed: 0.08 bytes per batch,
no step. Elsewhere (musl, macOS) there is no ``mallopt`` of these numbers and nothing is done.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_DEFAULT_THRESHOLD = 128 << 10  # glibc's own default of both, fixed: no longer moved by frees


def fix_thresholds() -> None:
    """In this process, and the processes it forks from now on."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD)
