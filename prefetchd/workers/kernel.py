"""What a daemon process asks of Linux and glibc, through ctypes: to die with its parent, a
name, and a heap that keeps its size. Elsewhere each is skipped. And what a fork that stands in
for an exec needs (the command forks its daemon, the daemon its worker server): a pipe to the
child, every other descriptor closed in it, and no second thread in the parent.

The heap: glibc raises its mmap threshold each time a large block that it had mapped is freed
(up to 32 MiB): from then on blocks of that size come from the heap, whose pages stay with the
process. Measured on a master serving two fast ranks (tests/daemon/operations/test_soak.py, 20
minutes): its private memory was flat for minutes 9 to 17, then stepped up 0.5 MiB at minute 18
and kept it, in both runs (1.8-2.8 bytes per batch). With the thresholds fixed at glibc's
defaults, large blocks are mapped and unmapped each time and the heap's top is trimmed: 0.08
bytes per batch, no step. Only the master's: a worker's per-image buffers (a decoded image,
0.5-1 MB) are what the dynamic threshold is for. Fixed, each is mapped afresh and its pages
faulted in (~120 more faults an image): one in-process loop of the pipeline ran 13-19 % slower.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable
from typing import NoReturn

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15  # <linux/prctl.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_DEFAULT_THRESHOLD = 128 << 10  # glibc's own default of both, fixed: no longer moved by frees


def die_with_the_parent(name: bytes | None = None) -> None:
    """SIGKILL when this process's parent dies; and ``name`` as its name in `ps -o comm` and
    top (at most 15 bytes). Not Linux: nothing (its parent's pipe closing remains)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if name is not None:
            libc.prctl(_PR_SET_NAME, name, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def fix_heap_thresholds() -> None:
    """glibc's malloc thresholds fixed, in this process and the processes it forks from now on.
    Not glibc (musl, macOS): nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD)


def fork_with_a_pipe(child: Callable[[int], NoReturn]) -> tuple[int, int]:
    """Fork a child that runs ``child(r)``, ``r`` the read end of a new pipe, and never returns;
    here, the child's pid and the pipe's write end."""
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        child(read_fd)
    os.close(read_fd)
    return pid, write_fd


def single_threaded() -> bool:
    """Whether this process runs one thread (any kind: one a sitecustomize or a C library
    started too). A fork copies only the calling thread, and a lock another thread held (an
    import's, say) stays held in the child for ever: with a second thread, exec instead."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no /proc: Python's own threads are all we can see
        import threading

        return threading.active_count() == 1


def close_descriptors_but(*keep: int) -> None:
    """Close every descriptor of this process but ``keep`` and stdio, as an exec with
    close_fds would: also those above the soft RLIMIT_NOFILE, which a parent with a higher limit
    may have left open (`exec 100>&1` in a shell, then `ulimit -n 64`)."""
    try:
        found = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number below the hard limit (the soft one, if unlimited)
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        found = range(3, os.sysconf("SC_OPEN_MAX") if hard == resource.RLIM_INFINITY else hard)
    for fd in found:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, closed since
                pass
