"""Freeing consumed batches, and counting the ones a client still maps.

Unlinking a file that a client still maps does not free its tmpfs pages: they stay
allocated until the last map goes. A daemon that only kept a ledger of its files would
exceed its byte bound by whatever trainers hold on to (a batch kept for logging, a tensor
kept alive by a reference cycle). So a consumed batch is first renamed into ``retired/``,
where no reader looks, then unlinked only once an exclusive ``flock`` succeeds: every
client holds a shared flock on a batch file for as long as its map lives
(``prefetchd_client.batchfile.map_batch``). Until then the file's blocks, as the
filesystem reports them, count against the bound.

A freed file is not unlinked at once: it is kept as a *spare* in ``tmp/`` (``spare-<n>``),
handed to the next task's worker to overwrite with a later batch. Writing a batch into pages a
file already has costs a quarter of allocating and zeroing new ones, and the master saves the
unlink (docs/benchmarks.md). Spares count against the bound like batches (the buffer keeps no
more than fit beside them) and a spare no task took for ``SPARE_IDLE_S`` is unlinked, so a
buffer that stops refilling (an idle job, the end of the plan) gives its memory back. A file is
taken back only under the exclusive lock, so no client maps it then; a client that opened it by
its old name before and locks it after finds the name no longer leads to it
(``prefetchd_client.batchfile._still_named``).

A daemon killed with retired files keeps nothing in memory: the next one finds them in
``retired/`` and treats them the same way (its spares went with ``tmp/``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import shutil
import stat
import time
from pathlib import Path

SPARE_PREFIX = "spare-"  # no ".<pid>" suffix: the pool sweeps a dead writer's files by that
# Long enough to carry spares across a burst (files freed together, by one check of the pinned
# ones or a seek, and taken as workers come free), short enough to free an idle job's memory.
SPARE_IDLE_S = 2.0


class RetiredBatches:
    def __init__(self, folder: Path, spare_folder: Path, spare_size: int):
        self.folder = folder
        self.pinned: dict[str, int] = {}  # name in retired/ -> bytes allocated on the filesystem
        self.spare_size = spare_size  # a batch file's: a file of any other size is no spare
        self._spares: list[tuple[str, float]] = []  # (path, when freed) of each spare, oldest first
        self._spare_prefix = os.path.join(os.fspath(spare_folder), SPARE_PREFIX)
        # A batch can be consumed twice (made again after a backward seek) while its first copy
        # is still mapped: names get a sequence number so no retired file ever replaces another.
        self._sequence = itertools.count(time.time_ns())
        self._folder = os.fspath(folder)  # names joined as str: pathlib would intern each (layout.batch_file)

    @property
    def pinned_bytes(self) -> int:
        return sum(self.pinned.values())

    def retire(self, path: str | Path) -> bool:
        """Take ``path`` out of the buffer; free it now unless a client maps it. False if it was gone."""
        target = os.path.join(self._folder, f"{os.path.basename(path)}.{next(self._sequence)}")
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return False
        self._try_free(target)
        return True

    @property
    def spares(self) -> int:
        return len(self._spares)

    def take_spare(self, path: str) -> bool:
        """Move the newest spare to ``path``, where a writer will overwrite it; False when there
        is none."""
        while self._spares:
            spare = self._spares.pop()[0]
            try:
                os.rename(spare, path)
                return True
            except FileNotFoundError:  # removed by hand: not ours to count any more
                continue
            except OSError:  # something planted at ``path`` (a folder): the writer's own create fails on it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spare)
                return False
        return False

    def drop_spare(self) -> None:
        """Free the oldest spare."""
        try:
            os.unlink(self._spares.pop(0)[0])
        except FileNotFoundError:
            pass

    def drop_spares(self) -> None:
        """Free every spare (a daemon that stops and keeps its batches keeps no spares)."""
        while self._spares:
            self.drop_spare()

    def drop_idle_spares(self, now: float) -> None:
        """Free the spares no task took for SPARE_IDLE_S (``now``: time.monotonic())."""
        while self._spares and now - self._spares[0][1] > SPARE_IDLE_S:
            self.drop_spare()

    def sweep(self) -> int:
        """Free every retired file no client maps any more; returns the bytes still pinned."""
        for entry in list(os.scandir(self.folder)):
            self._try_free(Path(entry.path))
        return self.pinned_bytes

    def retry_pinned(self) -> int:
        """Like ``sweep`` but only over the files known to be pinned (cheap, for every tick)."""
        for name in list(self.pinned):
            self._try_free(os.path.join(self._folder, name))
        return self.pinned_bytes

    def _try_free(self, path: str | Path) -> bool:
        name = os.path.basename(path)
        try:
            # A name in retired/ may have been planted (a dead daemon's folder, reused): never
            # followed, never waited on (a FIFO), and anything but a batch file is only removed.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            self.pinned.pop(name, None)
            return True
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: the link goes, never what it points to
                return self._remove(path)
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # Out of descriptors: count it as pinned (its blocks, read without a descriptor) and
            # try again with the pinned ones; left out of the ledger it would stay past the bound.
            try:
                self.pinned[name] = os.lstat(path).st_blocks * 512
            except FileNotFoundError:
                self.pinned.pop(name, None)
                return True
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._remove(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.pinned[name] = st.st_blocks * 512
                return False
            # Taken back while we hold the lock: a reader that opened the file before the rename
            # and locks after us finds that the batch's name no longer leads to it. Only a file
            # of one batch's size with no other name becomes a spare: a worker overwrites it,
            # and a second name could lead out of the job folder (a hard link planted here).
            if not (st.st_nlink == 1 and st.st_size == self.spare_size and self._keep(path)):
                os.unlink(path)
            self.pinned.pop(name, None)
            return True
        finally:
            os.close(fd)

    def _keep(self, path: str | Path) -> bool:
        """Make the freed file at ``path`` a spare; False when its spare name cannot be had."""
        spare = f"{self._spare_prefix}{next(self._sequence)}"
        try:
            os.rename(path, spare)
        except OSError:  # something planted under that name (a folder): this file is unlinked instead
            return False
        self._spares.append((spare, time.monotonic()))
        return True

    def _remove(self, path: str | Path) -> bool:
        """Remove what is not a batch file (a symlink, a FIFO, a folder) from retired/."""
        self.pinned.pop(os.path.basename(path), None)
        try:
            os.unlink(path)
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)  # never follows a symlink inside
        except FileNotFoundError:
            pass
        return True
