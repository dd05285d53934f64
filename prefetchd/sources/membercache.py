"""A bounded local cache of what workers read from a store: later epochs read it from local disk.

``[[source]] cache = "/local/nvme/prefetchd"`` and ``cache_size = "500G"`` (a webdataset source
whose shards are in a store). Each read a worker makes of a shard in a store (a member and its
tar header) is kept as one file, named by a hash of the object's URL and identity (size, ETag,
Last-Modified) and the byte range: an object rewritten in the store has another identity, so
its old entries are never read for it (each read checks the member's own tar header besides).

- The folder is the shard index cache's kind of folder (prefetchd_client.folders): this user's,
  writable by nobody else, under folders only root or this user can change; made 0700 if
  missing. Anything else: the cache is not used (logged once) and every read goes to the store.
- An entry is read only if it is a regular file of this user's that nobody else can write, of
  exactly the range's length; written 0600 under a new name and renamed into place.
- The bound holds across the workers of a node: ``<cache>/.bytes`` holds the bytes the entries
  take, read and changed under an ``flock``. An entry that would pass the bound makes room
  first, by the plan's next use (``next_use``: where in the plan, counted in samples across
  epochs, the sample is needed next): the entries needed last go first, as Belady's optimal
  rule has it, and only those needed later than the new one (else it is not written). The
  cache knows the order because each entry's mtime *is* its next use (set on write and again
  on each hit; a real mtime, ~1.7e18 ns, counts as needed after all the plan places, and one
  already past where the plan is, as needed never: it was not read when the plan said, as a
  sample drop_last leaves out): a folder scan gives them all at once, with no second file to
  keep in step with the entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from prefetchd.sources.index import NEVER
from prefetchd_client.errors import UnsafeFolder
from prefetchd_client.folders import FILE_FLAGS, is_private, make_private_dir

log = logging.getLogger(__name__)

_WHAT = "member cache folder"
_FIX = "set the [[source]]'s cache to a folder of your own that only you can write (mode 700)"
_LEDGER = ".bytes"  # the bytes the entries take, as decimal text
_ROOM = 0.05  # an eviction frees this share of the bound beyond what the new entry needs: one scan for many puts
_refused: set[str] = set()


class MemberCache:
    """One worker's view of a cache folder; ``bound``: the bytes its entries may take in all."""

    def __init__(self, folder: str, bound: int):
        self.folder, self.bound = Path(folder), bound
        self.hits = self.misses = self.hit_bytes = 0
        self._fd: int | None = None
        # After an eviction that could not make room: entries needed this late or later are not
        # tried until _retry_at (hits move the cached entries' next uses on meanwhile).
        self._needed_later, self._retry_at = NEVER + 1, 0.0
        try:
            self._fd, made = make_private_dir(self.folder, _WHAT, fix=_FIX)
            made.close()
        except (UnsafeFolder, OSError) as exc:
            if str(self.folder) not in _refused:
                _refused.add(str(self.folder))
                log.warning("member cache %s not used, every read goes to the store: %s", self.folder, exc)

    def get(self, url: str, identity: list, start: int, end: int, next_use: int = NEVER) -> bytes | None:
        """The entry of the range, or None; a hit's next use becomes ``next_use``."""
        if self._fd is None:
            return None
        name = _name(url, identity, start, end)
        try:
            fd = os.open(name, FILE_FLAGS, dir_fd=self._fd)
        except OSError:
            self.misses += 1
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read(end - start + 1) if stat.S_ISREG(st.st_mode) and is_private(st) else b""
        if len(data) != end - start:
            self.misses += 1
            return None
        self.hits += 1
        self.hit_bytes += len(data)
        with contextlib.suppress(OSError):  # evicted meanwhile: the read stands
            os.utime(name, ns=(next_use, next_use), dir_fd=self._fd, follow_symlinks=False)
        return data

    def has(self, url: str, identity, start: int, end: int) -> bool:
        """Whether an entry of the range is there (read_sample's get checks it)."""
        if self._fd is None or identity is None:
            return False
        try:
            return (
                os.stat(_name(url, identity, start, end), dir_fd=self._fd, follow_symlinks=False).st_size == end - start
            )
        except OSError:
            return False

    def put(
        self, url: str, identity: list, start: int, end: int, data: bytes, next_use: int = NEVER, now: int = 0
    ) -> None:
        """Best effort: an entry not written costs a later epoch a request, nothing more.
        ``next_use``: where the plan needs it next; ``now``: where the plan is (an entry whose
        next use is before it was not read when the plan said: it is needed never, as far as
        the cache knows)."""
        if self._fd is None or len(data) != end - start:
            return
        if next_use >= self._needed_later and time.monotonic() < self._retry_at:
            return
        name = _name(url, identity, start, end)
        began = time.monotonic()
        if not self._reserve(len(data), next_use, now):
            # a scan of the folder per put would cost more than the reads it spares: wait a while
            self._needed_later, self._retry_at = next_use, time.monotonic() + max(5.0, 10 * (time.monotonic() - began))
            log.info(
                "member cache %s is full (%d bytes) of samples needed sooner: the later ones are read from the store",
                self.folder,
                self.bound,
            )
            return
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd
            )
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(data)
                f.flush()  # before the mtime is set: a write after it would set it to now
                os.utime(f.fileno(), ns=(next_use, next_use))
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as exc:
            log.info("member cache entry not written: %s", exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _reserve(self, size: int, next_use: int, now: int) -> bool:
        """Count ``size`` more bytes in the ledger (under its flock), making room if the bound
        needs it by evicting the entries needed after ``next_use`` (or before ``now``), the last first."""
        try:
            fd = os.open(_LEDGER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and is_private(st)) or st.st_size > 64:
                return False
            text = os.pread(fd, 64, 0).strip()
            used = int(text) if text.isdigit() else 0
            if used + size > self.bound:
                used = self._evict(used, used + size - self.bound + int(_ROOM * self.bound), next_use, now)
            if used + size > self.bound:
                os.pwrite(fd, str(used).encode().ljust(20), 0)
                return False
            os.pwrite(fd, str(used + size).encode().ljust(20), 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _evict(self, used: int, wanted: int, next_use: int, now: int) -> int:
        """Remove entries needed after ``next_use``, the last needed first (those whose next use
        is already past ``now`` before all), until ``wanted`` bytes are free or none is left
        that is needed later; the bytes used then."""
        later = []
        with os.scandir(self._fd) as entries:
            for entry in entries:
                if entry.name.startswith("."):  # the ledger, and entries being written
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    mark = NEVER + 1 if st.st_mtime_ns < now else st.st_mtime_ns
                    if mark > next_use:
                        later.append((mark, st.st_size, entry.name))
        freed = 0
        for _, size, name in sorted(later, reverse=True):
            if freed >= wanted:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._fd)
                freed += size
        return max(used - freed, 0)


def _name(url: str, identity: list, start: int, end: int) -> str:
    return hashlib.sha256(json.dumps([url, identity, start, end]).encode()).hexdigest()[:40]
