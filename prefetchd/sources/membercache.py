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
  take, read and raised under an ``flock`` before an entry is written; an entry that would pass
  the bound is not written (the cache stops growing once full: what it holds stays until the
  folder is emptied). Entries are never evicted yet (the issue's "sample needed last goes first"
  is not built): a dataset bigger than the bound is cached up to it.
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
from pathlib import Path

from prefetchd_client.errors import UnsafeFolder
from prefetchd_client.folders import FILE_FLAGS, is_private, make_private_dir

log = logging.getLogger(__name__)

_WHAT = "member cache folder"
_FIX = "set the [[source]]'s cache to a folder of your own that only you can write (mode 700)"
_LEDGER = ".bytes"  # the bytes the entries take, as decimal text
_refused: set[str] = set()


class MemberCache:
    """One worker's view of a cache folder; ``bound``: the bytes its entries may take in all."""

    def __init__(self, folder: str, bound: int):
        self.folder, self.bound = Path(folder), bound
        self.hits = self.misses = self.hit_bytes = 0
        self._fd: int | None = None
        self._full = False  # the bound was met: no more writes are tried
        try:
            self._fd, made = make_private_dir(self.folder, _WHAT, fix=_FIX)
            made.close()
        except (UnsafeFolder, OSError) as exc:
            if str(self.folder) not in _refused:
                _refused.add(str(self.folder))
                log.warning("member cache %s not used, every read goes to the store: %s", self.folder, exc)

    def get(self, url: str, identity: list, start: int, end: int) -> bytes | None:
        if self._fd is None:
            return None
        try:
            fd = os.open(_name(url, identity, start, end), FILE_FLAGS, dir_fd=self._fd)
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

    def put(self, url: str, identity: list, start: int, end: int, data: bytes) -> None:
        """Best effort: an entry not written costs a later epoch a request, nothing more."""
        if self._fd is None or self._full or len(data) != end - start:
            return
        name = _name(url, identity, start, end)
        if not self._reserve(len(data)):
            self._full = True
            log.info("member cache %s is full (%d bytes): later reads go to the store", self.folder, self.bound)
            return
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd
            )
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(data)
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as exc:
            log.info("member cache entry not written: %s", exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _reserve(self, size: int) -> bool:
        """Count ``size`` more bytes in the ledger if the bound allows them (under its flock)."""
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
                return False
            data = str(used + size).encode()
            os.pwrite(fd, data.ljust(20), 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def _name(url: str, identity: list, start: int, end: int) -> str:
    return hashlib.sha256(json.dumps([url, identity, start, end]).encode()).hexdigest()[:40]
