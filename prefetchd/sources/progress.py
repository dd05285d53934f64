"""How far a start's indexing is: a log line every PROGRESS_EVERY_S while it lasts (the
daemon's log, which a waiting `prefetchd start` echoes: cli.launch looks for ": indexed ")."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0  # an indexing progress line this often
MARK = ": indexed "  # in every progress line, after the source's name


class IndexingProgress:
    """One source's indexing, ``total`` ``unit`` (shards, class folders, files); thread-safe."""

    def __init__(self, total: int, where: str, unit: str):
        self.total, self.where, self.unit, self.done = total, where, unit, 0
        self._lock = threading.Lock()
        self._started = self._last = time.monotonic()

    def done_one(self) -> None:
        with self._lock:
            self.done += 1
            now = time.monotonic()
            if now - self._last >= PROGRESS_EVERY_S and self.done < self.total:
                self._last = now
                elapsed = now - self._started
                log.info("%s%s%d of %d %s (%.0f s)", self.where, MARK, self.done, self.total, self.unit, elapsed)
