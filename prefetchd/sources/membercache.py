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
  exactly the range's length; written 0600 under a new name and linked into place (where two
  workers read one range at once, the first entry stays and the second's bytes are not
  counted). Only names the cache makes are entries: a folder (a disk's lost+found) or a file of
  anyone else's in the folder is neither counted nor removed.
- The bound holds across the workers of a node: ``<cache>/.bytes`` holds the bytes the entries
  take, read and changed under an ``flock``; a ledger that is new or not a count, and each
  eviction's scan, count the entries afresh (so do entries being written; a reservation not
  yet a file is not, so the bound may be passed by the few entries being written at that
  moment). An entry that would pass the bound makes room
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
import re
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
            # A link, not a rename: where another worker wrote the same range meanwhile, its entry
            # stays and this one's reservation is given back (a rename would count it twice).
            os.link(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except FileExistsError:
            self._release(len(data))
        except OSError as exc:
            log.info("member cache entry not written: %s", exc)
            self._release(len(data))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _reserve(self, size: int, next_use: int, now: int) -> bool:
        """Count ``size`` more bytes in the ledger (under its flock), making room if the bound
        needs it by evicting the entries needed after ``next_use`` (or before ``now``), the last first."""
        with self._ledger() as ledger:
            if ledger is None:
                return False
            used = ledger.used
            if used + size > self.bound:
                used = self._evict(used + size - self.bound + int(_ROOM * self.bound), next_use, now)
            if used + size > self.bound:
                ledger.write(used)
                return False
            ledger.write(used + size)
            return True

    def _release(self, size: int) -> None:
        """Give back a reservation whose entry was not written."""
        with self._ledger() as ledger:
            if ledger is not None:
                ledger.write(max(ledger.used - size, 0))

    @contextlib.contextmanager
    def _ledger(self):
        """The ledger, held under its flock: None where it cannot be used (the cache then takes
        nothing new). A ledger that is new or not a count is counted afresh from the entries."""
        try:
            fd = os.open(_LEDGER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)
        except OSError:
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and is_private(st)) or st.st_size > 64:
                yield None
                return
            text = os.pread(fd, 64, 0).strip()
            yield _Ledger(fd, int(text) if text.isdigit() else sum(size for _, size, _ in self._entries()))
        except OSError:
            yield None
        finally:
            os.close(fd)

    def _entries(self) -> list[tuple[int, int, str]]:
        """(mark, bytes, name) of each entry, and of each being written (mark 0, never evicted
        by name: its writer removes it): only names this cache makes, regular files, so a folder
        or a file of another's in the folder is neither counted nor removed."""
        found = []
        with os.scandir(self._fd) as entries:
            for entry in entries:
                writing = _WRITING.fullmatch(entry.name)
                if not (writing or _ENTRY.fullmatch(entry.name)):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        found.append((0 if writing else st.st_mtime_ns, st.st_size, "" if writing else entry.name))
        return found

    def _evict(self, wanted: int, next_use: int, now: int) -> int:
        """Remove entries needed after ``next_use``, the last needed first (those whose next use
        is already past ``now`` before all), until ``wanted`` bytes are free or none is left
        that is needed later; the bytes the entries take then (counted, so a ledger that drifted
        from them is set right)."""
        found = self._entries()
        held = sum(size for _, size, _ in found)
        later = []
        for mark, size, name in found:
            mark = NEVER + 1 if name and mark < now else mark
            if name and mark > next_use:
                later.append((mark, size, name))
        freed = 0
        for _, size, name in sorted(later, reverse=True):
            if freed >= wanted:
                break
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)
                freed += size
        return held - freed


class _Ledger:
    def __init__(self, fd: int, used: int):
        self.fd, self.used = fd, used

    def write(self, used: int) -> None:
        os.pwrite(self.fd, str(used).encode().ljust(20), 0)
        self.used = used


_ENTRY = re.compile(r"[0-9a-f]{40}")  # _name's
_WRITING = re.compile(r"\.[0-9a-f]{40}\.\d+\.[0-9a-f]{8}\.tmp")  # put's


def _name(url: str, identity: list, start: int, end: int) -> str:
    return hashlib.sha256(json.dumps([url, identity, start, end]).encode()).hexdigest()[:40]
