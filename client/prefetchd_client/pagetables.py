"""The page-table work of a batch's mapping, done on the client's own threads, not the trainer's.

A fresh mapping has no page-table entries: each first touch of a 4 KiB page is a page fault,
and the trainer's thread is the one that touches the pixels (its copy to the GPU, its
normalisation). A 256 x 224 x 224 x 3 batch is 9,400 pages: 3.8 ms of faults on that thread
here. ``populate`` builds the entries on the read-ahead thread instead, right after the map
(``MADV_POPULATE_READ``, Linux 5.14: 2.9 ms for the same batch, and 0.1 ms left to the first
touch). Read-only entries to the file's own pages: nothing is copied, so a private mapping
still shares the tmpfs pages until something writes to them. ``drop`` tears them down before
``munmap`` (prefetchd_client.unmapper says why).

Both go through ctypes, which lets go of the GIL for the call, so the trainer's thread runs
meanwhile. A populate holds the process's memory-map lock for reading while it runs, and the
trainer's own ``mmap``/``munmap`` (a large temporary array) waits for it: so it goes 4 MiB at a
time (one call of ~0.3 ms here), letting the lock go between them. Where the kernel is older,
``populate`` does nothing and the faults stay where they were.

Two costs it moves, measured by an attack of this change: a file some process of the same user
made sparse (cut short and grown again) gets its holes filled on the tmpfs when populated,
within the file's size and so within the bound; and once the trainer writes into a populated
batch, a ``fork()`` copies the page tables of that whole mapping (0.7 -> 1.5 ms for a 38 MB batch).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python 3.11 does not name it
_POPULATE_STEP = 4 << 20  # the module docstring says why not all at once


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise() if hasattr(mmap, "MADV_DONTNEED") else None
_can_populate = _madvise is not None and sys.platform == "linux"  # the advice's number is Linux's


def populate(buf: mmap.mmap) -> None:
    """Give every page of ``buf`` its page-table entry now, readable, without copying any."""
    global _can_populate
    if not _can_populate or len(buf) == 0:
        return
    for start in range(0, len(buf), _POPULATE_STEP):
        if _advise(buf, _MADV_POPULATE_READ, start, min(_POPULATE_STEP, len(buf) - start)) != 0:
            # EINVAL: a kernel before 5.14. Any other failure (EFAULT: the file was cut short
            # under the map; ENOMEM) leaves the pages to fault in as before: the reader finds
            # out what happened to the file, not this call.
            _can_populate = ctypes.get_errno() != errno.EINVAL
            return


def drop(buf: mmap.mmap) -> None:
    """Zap the mapping's pages with madvise(MADV_DONTNEED). munmap holds the process's
    memory-map lock for writing while it tears down page tables, so every page fault of the
    trainer's threads waits for it (2-4 ms stalls here); MADV_DONTNEED does the same work
    under the lock for reading, beside page faults, and leaves munmap nothing to do."""
    if _madvise is not None and len(buf):
        _advise(buf, mmap.MADV_DONTNEED, 0, len(buf))


def _advise(buf: mmap.mmap, advice: int, start: int, length: int) -> int:
    """madvise ``length`` bytes of ``buf`` from ``start`` (a multiple of the page size)."""
    view = ctypes.c_char.from_buffer(buf)  # an export: released below, before anyone closes buf
    try:
        return _madvise(ctypes.addressof(view) + start, length, advice)
    finally:
        del view
