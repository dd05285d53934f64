"""The hand-off between the /metrics HTTP threads and the master's loop.

The master's structures (the ledger, the pool, the intake) change under any other thread, so a
scrape never reads them: the HTTP thread asks, the loop answers in its turn with a snapshot it
takes itself (``prefetchd.ops.status.job_status``, the one ``prefetchd status`` shows), and the HTTP
thread turns that plain dict into metrics::

    HTTP thread (one per connection)               master's loop thread
    ────────────────────────────────               ────────────────────
    ask(timeout): append a Scrape to `waiting`
                  write 1 byte to the wake pipe ──► poll() returns (the pipe is registered)
                  wait on the Scrape's Event        answer(take): drain the pipe, take `waiting`,
                                                      one snapshot for all of them, set each Event
    ◄───────────────────────────────────────────────
    the snapshot, or None after `timeout`: a 503, never a hung scrape

A scrape that timed out removes itself, so a master that wakes later answers no one; scrapes
waiting together share one snapshot, so a flood costs the loop one snapshot per turn at most.
This module is light (no HTTP, no prometheus_client): the master imports it whether or not
``--metrics`` is set, and holds NOT_SERVED then.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("prefetchd")

_WAKE_READ_BYTES = 4096


class NotServed:
    """The master's metrics when --metrics is off: nothing to wait on, answer or close."""

    def wait_handles(self) -> list:
        return []

    def answer(self, take_snapshot: Callable[[], dict]) -> None:
        pass

    def close(self) -> None:
        pass


NOT_SERVED = NotServed()


class Scrape:
    """One HTTP request's wait for a snapshot."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.snapshot: dict | None = None


class ScrapeQueue:
    """Scrapes waiting for the master's loop (see the module's docstring)."""

    def __init__(self) -> None:
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._waiting: list[Scrape] = []
        self._closed = False
        self._failures = 0

    def fileno(self) -> int:
        """Readable when a scrape waits: the master's poller wakes on it."""
        return self._wake_read

    def ask(self, timeout_s: float) -> dict | None:
        """From an HTTP thread: the master's snapshot, or None when it did not answer in time
        (stopped, hung, or shutting down) or its snapshot failed."""
        scrape = Scrape()
        with self._lock:
            if self._closed:
                return None
            self._waiting.append(scrape)
            try:
                os.write(self._wake_write, b"!")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups the loop has not read yet: it will
        if not scrape.done.wait(timeout_s):
            with self._lock:
                if scrape in self._waiting:
                    self._waiting.remove(scrape)
        return scrape.snapshot  # answered between the wait's end and the lock, it still counts

    def answer(self, take_snapshot: Callable[[], dict]) -> None:
        """From the master's loop, every turn: the scrapes waiting get one snapshot taken now.

        The pipe is drained before ``waiting`` is read, so a scrape added after the read has
        left its byte in the pipe and the next turn comes at once."""
        try:
            os.read(self._wake_read, _WAKE_READ_BYTES)
        except BlockingIOError:
            pass
        if not self._waiting:  # most turns: no lock, one read that finds nothing
            return
        with self._lock:
            waiting, self._waiting = self._waiting, []
        try:
            snapshot = take_snapshot()
        except Exception:  # a scrape is peer input: a bug it finds must not stop the daemon
            self._failures += 1
            if self._failures <= 3:
                log.exception("taking the /metrics snapshot failed; the scrape gets a 503")
            snapshot = None
        for scrape in waiting:
            scrape.snapshot = snapshot
            scrape.done.set()

    def close(self) -> None:
        """Release the scrapes still waiting (a 503 now rather than at their timeout)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiting, self._waiting = self._waiting, []
            os.close(self._wake_read)
            os.close(self._wake_write)
        for scrape in waiting:
            scrape.done.set()
