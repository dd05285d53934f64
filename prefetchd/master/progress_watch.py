"""Intake of progress files: ``<jobdir>/progress/rank-<r>`` holds ``<epoch> <step>``
(``rank-<r>.<consumer>`` a named consumer's).

A trainer in any language can report progress by rewriting that file atomically (write
a temporary file, rename it over). watchdog watches the folder from its own thread; the
handler only queues the (rank, consumer), and the master's loop reads and applies the file.
"""

from __future__ import annotations

import os
import queue

from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from prefetchd_client.folders import read_regular_file
from prefetchd_client.layout import JobPaths, parse_progress, parse_progress_name

MAX_PROGRESS_BYTES = 64  # "<epoch> <step>\n" needs at most 30


class BadProgressFile(ValueError):
    """A progress file that is planted, oversized or not "<epoch> <step>"."""


class _QueueChanged(FileSystemEventHandler):
    def __init__(self, changed: queue.SimpleQueue):
        self._changed = changed

    def on_any_event(self, event) -> None:
        if event.is_directory or event.event_type not in ("created", "modified", "moved", "closed"):
            return
        path = getattr(event, "dest_path", "") or event.src_path
        key = parse_progress_name(os.path.basename(os.fsdecode(path)))
        if key is not None:
            self._changed.put(key)


class ProgressWatcher:
    def __init__(self, paths: JobPaths):
        self.paths = paths
        self.folder = str(paths.progress_dir)
        self.changed: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._observer = Observer()
        self._observer.schedule(_QueueChanged(self.changed), self.folder, recursive=False)

    def start(self) -> None:
        self._observer.start()
        for name in os.listdir(self.folder):  # files written before we watched
            key = parse_progress_name(name)
            if key is not None:
                self.changed.put(key)

    def drain(self) -> set[tuple[int, str]]:
        """The (rank, consumer) of each file that changed since the last drain."""
        keys = set()
        while True:
            try:
                keys.add(self.changed.get_nowait())
            except queue.Empty:
                return keys

    def read(self, rank: int, consumer: str) -> tuple[int, int] | None:
        """The position in the file of the rank and consumer; None if it vanished;
        BadProgressFile if it is not a small regular file holding "<epoch> <step>".

        The folder is peer input: a symlink or a FIFO planted under a rank's name must not
        block the master (O_NONBLOCK) or lead it anywhere (O_NOFOLLOW).
        """
        path = str(self.paths.progress(rank, consumer))
        try:
            data = read_regular_file(path, MAX_PROGRESS_BYTES)
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise BadProgressFile(str(exc)) from None
        except OSError as exc:  # EMFILE, ...
            raise BadProgressFile(f"{path}: cannot open ({os.strerror(exc.errno)})") from None
        try:
            return parse_progress(data.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadProgressFile(f"{path}: {exc}") from None

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)
