"""WebDataset tar shards as a source with random access.

WebDataset's own readers stream each tar through a shuffle buffer; prefetchd indexes every
shard once instead (member offsets and sizes, members grouped into samples by key as
WebDataset groups them) and reads a sample's image with one ``pread`` at its offset. The
global permutation, resume, mixing and determinism then work as for a folder of files.

An index is cached per shard (``$PREFETCHD_CACHE``, else ``~/.cache/prefetchd/shards``) and
reused while the shard's size and mtime are unchanged; a cache file that does not load as
expected is rebuilt, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from . import stopsignals
from .errors import DataError
from .sources import NO_LABEL, TAR_MEMBER, SampleIndex, open_data_file

log = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # the first present is the sample's image
_CACHE_VERSION = 2
MAX_SHARDS = 1_000_000  # what urls may name: a pattern like {0..99999999} is a mistake, not a dataset
_MAX_LABEL_BYTES = 1 << 20  # a .cls or .json member bigger than this is not a label
_OPEN_SHARDS = 64  # a worker keeps this many shards open
READ_AHEAD_BYTES = 64 << 20  # at most this much is asked for ahead, per batch
# WebDataset's split of a member name into the sample's key and the member's extension.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")


def expand_urls(urls: str | list[str], base: str = "") -> Iterator[str]:
    """The shard paths that the brace patterns name (``train-{000000..000127}.tar``), in order,
    lazily; a relative one joined to ``base`` (the config's folder), then made absolute."""
    from braceexpand import braceexpand

    for pattern in [urls] if isinstance(urls, str) else urls:
        names = _range_product(pattern)
        if names > MAX_SHARDS:  # braceexpand builds a range's names before the first comes out
            raise DataError(
                f"urls pattern {pattern!r} names {names:,} shards, more than {MAX_SHARDS:,}; is a brace range too wide?"
            )
        for path in braceexpand(pattern):
            yield os.path.abspath(os.path.join(base, os.path.expanduser(path)))


def _range_product(pattern: str) -> int:
    """How many names the numeric ranges ``{A..B}`` / ``{A..B..STEP}`` of a pattern make together."""
    names = 1
    for m in _RANGE.finditer(pattern):
        names *= abs(int(m[2]) - int(m[1])) // max(abs(int(m[3] or 1)), 1) + 1
    return names


def scan_webdataset(src: dict, where: str) -> SampleIndex:
    """Index the shards of a ``kind = "webdataset"`` source: one sample per key, in shard order."""
    label_key = src.get("label_key")
    shards, counts, members, labels = [], [], [], []
    for shard in expand_urls(src["urls"], src.get("base", "")):  # a missing shard stops it before the rest
        if len(shards) == MAX_SHARDS:
            raise DataError(f"{where}: urls names more than {MAX_SHARDS:,} shards; is a brace range too wide?")
        shards.append(shard)
        stopsignals.check_starting()  # indexing thousands of shards takes a while: a stop need not wait
        table = _shard_index(shard, label_key, where)
        counts.append(len(table))
        members.append(table[:, :2])
        labels.append(table[:, 2])
    if not shards:
        raise DataError(f"{where}: urls names no shard")
    if not sum(counts):
        raise DataError(f"{where}: the {len(shards)} shard(s) of urls hold no sample; is urls right?")
    return SampleIndex.in_containers(shards, counts, TAR_MEMBER, np.concatenate(members), np.concatenate(labels))


def _shard_index(shard: str, label_key: str | None, where: str) -> np.ndarray:
    """int64 (samples, 3): the image member's offset (-1: none) and size, and the label (-1: none)."""
    try:
        st = os.stat(shard)
    except OSError as exc:
        raise DataError(f"{where}: cannot read shard {shard}: {exc.strerror}; check urls") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{where}: shard {shard} is not a regular file; urls must name tar files")
    cache = _cache_file(shard, st, label_key)
    table = _load_cached(cache, st.st_size)
    if table is None:
        table = _index_tar(shard, label_key, where)
        _save_cached(cache, table)
    return table


def _index_tar(shard: str, label_key: str | None, where: str) -> np.ndarray:
    rows: list[list[int]] = []
    key, end = None, 0
    try:
        fd, _ = open_data_file(shard)  # a FIFO swapped in since the stat: refused, not a hung start
        with open(fd, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            while True:
                try:
                    member = tar.next()
                    # A negative size (a pax header may say so) sends tarfile back over the same
                    # member for ever (CPython's CVE-2025-8194): members must move forward.
                    if member is not None and (member.size < 0 or member.offset < end):
                        raise tarfile.ReadError(f"a member at byte {member.offset} goes backwards")
                except (tarfile.ReadError, OSError, ValueError, OverflowError) as exc:
                    # truncated or damaged past here: keep what came before
                    log.warning("shard %s is damaged after %d samples (%s); the rest of it is not served",
                                shard, len(rows), exc)
                    break
                if member is None:
                    break
                end = member.offset_data + member.size
                tar.members.clear()  # tarfile keeps every member it read: 1e5 members would stay in memory
                m = _KEY_EXT.match(member.name)
                if not member.isreg() or m is None or os.path.basename(member.name).startswith("."):
                    continue
                if m.group(1) != key:  # members of a sample are consecutive, as WebDataset reads them
                    key = m.group(1)
                    rows.append([-1, 0, NO_LABEL, len(IMAGE_KEYS)])
                row, ext = rows[-1], m.group(2).lower()
                if ext in IMAGE_KEYS and IMAGE_KEYS.index(ext) < row[3]:
                    row[0], row[1], row[3] = member.offset_data, member.size, IMAGE_KEYS.index(ext)
                elif (ext == "cls" and label_key is None) or (ext == "json" and label_key is not None):
                    row[2] = _label(f, member, label_key)
    except (tarfile.TarError, OSError, ValueError) as exc:
        raise DataError(f"{where}: shard {shard} is not a readable tar file ({exc}); check urls") from None
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)[:, :3].copy()


def _label(f, member: tarfile.TarInfo, label_key: str | None) -> int:
    """The label a .cls member (an integer as text) or a .json member's key holds; -1: none."""
    if member.size > _MAX_LABEL_BYTES:
        return NO_LABEL
    data = os.pread(f.fileno(), member.size, member.offset_data)
    try:
        value = json.loads(data)[label_key] if label_key is not None else int(data.strip())
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return NO_LABEL
    return value if type(value) is int and 0 <= value < 1 << 62 else NO_LABEL


def _cache_root() -> Path:
    env = os.environ.get("PREFETCHD_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefetchd" / "shards"


def _cache_file(shard: str, st: os.stat_result, label_key: str | None) -> Path:
    # The inode and ctime too: a shard rewritten in place with its mtime set back (cp -p, rsync -a)
    # changes its ctime, and one replaced by rename its inode.
    ident = json.dumps(
        [_CACHE_VERSION, os.path.realpath(shard), label_key, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    )
    return _cache_root() / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".npy")


def _load_cached(cache: Path, shard_size: int) -> np.ndarray | None:
    try:
        if not stat.S_ISREG(os.lstat(cache).st_mode):  # a FIFO would block np.load
            return None
        # Mapped, then copied: a header that claims more rows than the file holds fails the
        # mapping, where a plain load would first allocate what it claims.
        table = np.array(np.load(cache, mmap_mode="r", allow_pickle=False))
    except Exception:  # noqa: BLE001 - whatever is wrong with a cache file, it is indexed again
        return None
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != 3:
        return None
    offsets, sizes, labels = table.T
    has_image = offsets >= 0
    if (sizes < 0).any() or (offsets[has_image] + sizes[has_image] > shard_size).any() or (labels < NO_LABEL).any():
        return None
    return table


def _save_cached(cache: Path, table: np.ndarray) -> None:
    """Best effort: a cache that cannot be written costs the next start an indexing, nothing more."""
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            np.save(f, table, allow_pickle=False)
        os.replace(tmp, cache)
    except OSError as exc:
        log.info("shard index cache not written (%s): %s", cache, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


class TarMembers:
    """A worker's reads of members: one pread each, from shards it keeps open."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()

    def read(self, shard: str, offset: int, size: int) -> bytes:
        if offset < 0:
            raise ValueError(f"the sample has no image member ({', '.join('.' + k for k in IMAGE_KEYS)})")
        data = os.pread(self._fd(shard), size, offset)
        if len(data) != size:
            raise ValueError(f"the shard ends {size - len(data)} bytes into the image member: truncated")
        return data

    def will_need(self, places: list[tuple[str, int, int]]) -> None:
        """Have the kernel read these members in now, in shard-offset order, up to READ_AHEAD_BYTES."""
        budget = READ_AHEAD_BYTES
        for shard, offset, size in sorted(places):
            if offset < 0 or size > budget:
                continue
            budget -= size
            try:
                os.posix_fadvise(self._fd(shard), offset, size, os.POSIX_FADV_WILLNEED)
            except (OSError, ValueError):  # read() says what is wrong with it
                continue

    def _fd(self, shard: str) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        fd, _ = open_data_file(shard)
        self._fds[shard] = fd
        if len(self._fds) > _OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])
