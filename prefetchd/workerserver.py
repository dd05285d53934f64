"""The process local workers are forked from: multiprocessing's fork server, with the worker's
code (and the decoders it loads) imported once.

A spawned worker is a fresh interpreter that imports numpy, Pillow, OpenCV and prefetchd's
worker side: about 0.5 s before it can take a task, at every start and every replacement. A
worker forked from this server takes milliseconds. The server is started by the daemon before
it holds a lock, a socket or a thread, and it is itself a fresh interpreter (not a fork of the
master), so a worker inherits none of them, as with spawn. It boots beside the daemon's own
start-up. It exits when the master does (its pipe from the master closes); the workers then
follow (worker.py asks the kernel for SIGKILL when their parent dies).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

CONTEXT = multiprocessing.get_context("forkserver")
# Imported once in the server. The decoders are optional: one that is not installed is skipped.
PRELOAD = ["prefetchd.worker", "cv2", "simplejpeg"]


def start() -> None:
    """Boot the server now (in the background; a no-op when it runs). A worker started before
    it is ready waits for it; one started after it died starts it again."""
    CONTEXT.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
