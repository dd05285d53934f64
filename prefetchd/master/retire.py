"""Freeing consumed batches, and counting the ones a client still maps.

Unlinking a file that a client still maps does not free its tmpfs pages: they stay
allocated until the last map goes. A daemon that only kept a ledger of its files would
exceed its byte bound by whatever trainers hold on to (a batch kept for logging, a tensor
kept alive by a reference cycle). So a consumed batch is first renamed into ``retired/``,
where no reader looks, then unlinked only once an exclusive ``flock`` succeeds: every
client holds a shared flock on a batch file for as long as its map lives
(``prefetchd_client.batchfile.map_batch``). Until then the file's blocks, as the
filesystem reports them, count against the bound.

A daemon killed with retired files keeps nothing in memory: the next one finds them in
``retired/`` and treats them the same way.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import time
from pathlib import Path


class RetiredBatches:
    def __init__(self, folder: Path):
        self.folder = folder
        self.pinned: dict[str, int] = {}  # name in retired/ -> bytes allocated on the filesystem
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
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            self.pinned.pop(name, None)
            return True
        except OSError as exc:
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
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.pinned[name] = os.fstat(fd).st_blocks * 512
                return False
            # Unlinked while we hold the lock: a reader that opened the file before the rename
            # and locks after us sees st_nlink == 0 and treats the batch as gone.
            os.unlink(path)
            self.pinned.pop(name, None)
            return True
        finally:
            os.close(fd)
