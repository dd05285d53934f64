"""Unmap finished batches on a background thread, not on the trainer's.

Unmapping a batch the trainer has read is not free: the kernel tears down a page-table entry
per page it touched (a 9.6 MB batch of 64 x 224 x 224 x 3: ~1 ms here; 38.5 MB: ~2 ms). Done
where the last reference drops, that is inside the next ``next(loader)``, when the trainer is
waiting for data. Instead, each mapping is handed to one daemon thread when the arrays over
it are gone, and closed there (``munmap`` releases the GIL). The shared flock that pins the
batch (prefetchd_client.batchfile.map_batch) goes with the mapping, a moment later.
"""

from __future__ import annotations

import mmap
import queue
import threading
import time
import weakref

from . import pagetables

_RETRY_S = 0.001  # the array that announced its end still holds its export for a moment
_RETRIES = 1000  # then some other export holds it: drop ours, and it unmaps when that one goes


class Unmapper:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def adopt(self, owner, buf: mmap.mmap) -> None:
        """Close ``buf`` on the background thread once ``owner`` (the array every view of the
        batch derives from) has been freed."""
        self._start()
        finalizer = weakref.finalize(owner, self._queue.put, buf)
        finalizer.atexit = False  # at exit the process unmaps everything at once

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="prefetchd-unmap", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            buf = self._queue.get()
            # The owner's weakref callback runs at the start of its deallocation, before it
            # releases its buffer export: until then close() raises BufferError.
            for _ in range(_RETRIES):
                try:
                    pagetables.drop(buf)  # first: munmap would hold the map lock for writing
                    buf.close()
                    break
                except BufferError:
                    time.sleep(_RETRY_S)
            del buf


UNMAPPER = Unmapper()
