"""A worker's reader of WebDataset samples: the image member of each, from a local shard or
an object in a store (sources.objects), its own tar header checked in the same read."""

from __future__ import annotations

import contextlib
import functools
import os
import tarfile
from collections import OrderedDict
from concurrent.futures import Future

from prefetchd.sizes import parse_size
from prefetchd.sources import objects
from prefetchd.sources.index import MAX_FILE_BYTES, SampleBytes, open_data_file
from prefetchd.sources.membercache import MemberCache
from prefetchd.sources.objectfile import ObjectFile
from prefetchd.sources.tarformat import (
    BY_HEADER,
    IMAGE_KEYS,
    NO_IMAGE,
    REPEATS,
    TAR_NAME_BYTES,
    header_vouches,
    key_ext,
    marked,
    member_at,
    member_bytes,
    size_column,
)

_OPEN_SHARDS = 64  # a worker keeps this many shards open
READ_AHEAD_BYTES = 64 << 20  # at most this much is asked for ahead, per batch
# Members read ahead from a store are fetched in one request when the bytes between them are
# fewer than this: the .cls member and the headers between two samples' images (~1.5 KiB).
_COALESCE_GAP = 16 << 10
_AHEAD_WAIT_S = 120.0  # past obstore's own bound (request timeout, retries): a read ahead that never ends
_MEMBER_CHUNK = 1 << 20  # a member read as its header defines it (sparse, pax): in ranges of this


class TarMembers(SampleBytes):
    """A worker's reads of members: one pread each from shards it keeps open, or one range
    request each (adjacent members coalesced, asked for ahead) from shards in a store."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._store: objects.Objects | None = None
        self._ahead: dict[str, list[tuple[int, int, Future]]] = {}  # per shard URL: ranges asked for ahead
        self._caches: dict[tuple[str, str], MemberCache] = {}  # (cache, cache_size) -> that local cache
        self._cache: MemberCache | None = None  # the cache of the source whose sample is being read
        self._infos: dict[str, objects.ObjectInfo] = {}  # objects_indexed's, parsed once

    def read(self, shard: str, offset: int, size: int) -> bytes:
        """The image of a sample at (``offset``, ``size``) of the index; ValueError for a bad sample."""
        if offset >= 0:
            if size > MAX_FILE_BYTES:
                raise ValueError(f"the image member has {size:,} bytes, more than any image ({MAX_FILE_BYTES:,})")
            if offset < tarfile.BLOCKSIZE:
                raise ValueError(f"the index places an image member at byte {offset}, before any header could end")
            data = self._bytes(shard, offset - tarfile.BLOCKSIZE, tarfile.BLOCKSIZE + size)
            if len(data) != tarfile.BLOCKSIZE + size:
                missing = tarfile.BLOCKSIZE + size - len(data)
                raise ValueError(f"the shard ends {missing} bytes into the image member: truncated")
            if not header_vouches(data[: tarfile.BLOCKSIZE], size):  # its own header, read in the same pread
                raise ValueError(
                    f"the block before byte {offset} is no longer the header of a {size}-byte member: "
                    "the shard has changed since it was indexed (rewritten in place?); start again to index it"
                )
            return data[tarfile.BLOCKSIZE :]
        header, reason = marked(offset)
        if reason == NO_IMAGE:
            raise ValueError(f"the sample has no image member ({', '.join('.' + k for k in IMAGE_KEYS)})")
        with self._opened(shard) as (f, pread):
            member, next_header = member_at(f, header)
            if reason == REPEATS:
                key, ext = key_ext(member.name) or (member.name, "?")
                ext = ext.lower()
                raise ValueError(
                    f"key {key!r} repeats .{ext} within one sample (a second {member.name!r} at byte {header}); "
                    "which image goes with which label is not known, so neither is served (webdataset: "
                    "'duplicate file name')"
                )
            if reason != BY_HEADER or size_column(member.size) != size:
                raise ValueError(
                    f"the index does not match the member at byte {header} any more; has the shard changed?"
                )
            try:
                return member_bytes(pread, member, next_header)
            except ValueError as exc:
                kind = "sparse image member" if member.issparse() else "image member"
                raise ValueError(f"the {kind} {member.name!r} at byte {header}: {exc}") from None

    def read_sample(self, path: str, a: int, b: int, options: dict) -> bytes:
        self._cache = self._cache_for(options)
        try:
            return self.read(path, a, b)
        finally:
            self._cache = None

    def where(self, path: str, a: int, b: int) -> str:
        shown = objects.shown(path) if objects.is_url(path) else path
        if a < 0:  # none, or one the index marked (a sparse member, a key that repeats)
            return f"shard {shown}, {self.place(path, a, b)}"
        name = self._member_name(path, a, b)
        return f"shard {shown} member {name}" if name else f"shard {shown} member at byte {a} ({b} bytes)"

    def why_no_label(self, path: str, a: int, b: int, options: dict) -> str:
        """A sample without a label, in the words of its source's config: the index keeps only
        that the label is missing, the config says where it was looked for. A sample refused at
        indexing (a key that repeats) says why instead (read's ValueError)."""
        self.check_refused(path, a)
        key = options.get("label_key")
        if not isinstance(key, str | None):
            return "the sample has no label (no .cls member, or its .json has no such label key)"
        if key is None:
            return (
                "the sample has no label: it has no .cls member, and label_key is not set in its [[source]]; "
                'if the shards hold labels in .json members, set label_key = "<the label\'s key in them>"'
            )
        return (
            f"the sample has no label: it has no .json member with an integer label under label_key {key!r} "
            "(the key absent, not an integer from 0, or the .json not JSON)"
        )

    def check_refused(self, shard: str, offset: int) -> None:
        """Raise read's ValueError for a sample refused at indexing (a key that repeats): it has
        no label either, and the repeat is the reason to give."""
        if offset < 0 and marked(offset)[1] == REPEATS:
            self.read(shard, offset, 0)

    def place(self, shard: str, offset: int, size: int) -> str:
        """Where in its shard a sample without a plain image member is, for messages."""
        header, reason = marked(offset)
        if reason == NO_IMAGE:
            return "a sample with no image member"
        try:
            with self._opened(shard) as (f, _):
                name = repr(member_at(f, header)[0].name)
        except (OSError, ValueError, objects.StoreUnreachable, objects.ObjectChanged):
            name = "?"
        if reason == BY_HEADER:
            return f"member {name} at byte {header} ({size} bytes, sparse or overrunning)"
        return f"a sample whose key repeats (member {name} at byte {header})"

    def will_need(self, places: list[tuple]) -> None:
        """The coming samples' image members (in the order they will be read), up to
        READ_AHEAD_BYTES: a local shard's read in by the kernel now, in shard-offset order; a
        store's asked for now, objects.IN_FLIGHT requests at a time, members that lie close
        together in one request (each with its header), the request the batch reads first first."""
        self._drop_ahead()
        budget = READ_AHEAD_BYTES
        wanted: dict[str, list[tuple[int, int, int]]] = {}  # shard URL -> (start, end, first use) of each member
        local = []
        for used, (shard, offset, size, *options) in enumerate(places):
            if offset < tarfile.BLOCKSIZE or size > budget:
                continue
            budget -= size
            if objects.is_url(shard):
                cache = self._cache_for(options[0] if options else {})
                if cache is not None and cache.has(
                    shard, self.objects_indexed.get(shard), offset - tarfile.BLOCKSIZE, offset + size
                ):
                    continue  # read from the local cache when its sample is made
                wanted.setdefault(shard, []).append((offset - tarfile.BLOCKSIZE, offset + size, used))
            else:
                local.append((shard, offset, size))
        for shard, offset, size in sorted(local):
            try:
                os.posix_fadvise(self._fd(shard), offset, size, os.POSIX_FADV_WILLNEED)
            except (OSError, ValueError):  # read() says what is wrong with it
                continue
        requests = []
        for shard, members in wanted.items():
            try:
                info = self._info(shard)
            except objects.ObjectError:  # read() says so, for its sample
                continue
            for a, b, first in coalesce(members, _COALESCE_GAP, info.size):
                requests.append((first, shard, a, b, info))
        for _, shard, a, b, info in sorted(requests, key=lambda r: r[0]):
            self._ahead.setdefault(shard, []).append((a, b, self._objects().submit(shard, a, b, info)))

    def io_totals(self) -> dict[str, list]:
        totals = {} if self._store is None else self._store.totals()
        for cache in self._caches.values():  # hits: reads the store was spared (requests, bytes from the cache)
            totals[f"cache:{cache.folder}"] = [cache.hits, cache.hit_bytes, 0, 0, 0.0]
        return totals

    def _cache_for(self, options: dict) -> MemberCache | None:
        """The local cache of a source's reads from its store (its cache and cache_size), or None."""
        folder, size = options.get("cache"), options.get("cache_size")
        if not (isinstance(folder, str) and isinstance(size, str)):
            return None
        cache = self._caches.get((folder, size))
        if cache is None:
            cache = self._caches[(folder, size)] = MemberCache(folder, parse_size(size))
        return cache

    def close(self) -> None:
        self._drop_ahead()
        for cache in self._caches.values():
            cache.close()
        self._caches.clear()
        while self._fds:
            os.close(self._fds.popitem()[1])
        if self._store is not None:
            self._store.close()
            self._store = None

    def _bytes(self, shard: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` of the shard, fewer where it ends."""
        if not objects.is_url(shard):
            return os.pread(self._fd(shard), length, start)
        info = self._info(shard)
        start, end = min(start, info.size), min(start + length, info.size)
        cache = self._cache
        identity = self.objects_indexed[shard]
        if cache is not None and (data := cache.get(shard, identity, start, end, self.next_use)) is not None:
            return data
        data = self._from_ahead(shard, start, end)
        if data is None:
            data = self._objects().read(shard, start, end, info)
        if cache is not None:
            cache.put(shard, identity, start, end, data, self.next_use, self.now)
        return data

    def _from_ahead(self, shard: str, start: int, end: int) -> bytes | None:
        """The bytes [start, end) from a range asked for ahead, or None: none holds them, or it
        failed for a reason its own read will say better (read again alone)."""
        for a, b, future in self._ahead.get(shard, ()):
            if a <= start and end <= b:
                try:
                    data = future.result(timeout=_AHEAD_WAIT_S)
                except TimeoutError:
                    raise objects.StoreUnreachable(shard, f"no answer in {_AHEAD_WAIT_S:.0f} s") from None
                except (objects.StoreUnreachable, objects.ObjectChanged):
                    raise
                except Exception:  # noqa: BLE001 - a bad range, an object gone: the sample's own read says
                    return None
                return data[start - a : end - a]
        return None

    def _drop_ahead(self) -> None:
        for ranges in self._ahead.values():
            for _, _, future in ranges:
                future.cancel()
        self._ahead.clear()

    @contextlib.contextmanager
    def _opened(self, shard: str):
        """(a file object at the shard, its pread) to read a member as its header defines it."""
        if objects.is_url(shard):
            with ObjectFile(self._objects(), shard, self._info(shard), chunk=_MEMBER_CHUNK) as f:
                yield f, f.pread
            return
        fd = self._fd(shard)
        with open(fd, "rb", closefd=False) as f:
            yield f, functools.partial(os.pread, fd)

    def _info(self, shard: str) -> objects.ObjectInfo:
        info = self._infos.get(shard)
        if info is None:
            identity = self.objects_indexed.get(shard)
            if identity is None:
                raise objects.ObjectError(f"{objects.shown(shard)} is not among the objects the job indexed")
            info = self._infos[shard] = objects.ObjectInfo.from_json(identity)
        return info

    def _objects(self) -> objects.Objects:
        if self._store is None:
            self._store = objects.Objects()
        return self._store

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

    def _member_name(self, shard: str, offset: int, size: int) -> str | None:
        """The name of the tar member whose data starts at ``offset``: from the header block just
        before it, when that is a tar header (its checksum holds) of a member of ``size`` bytes and
        its name field is not full (else a pax or GNU long name may have been cut). None when it is
        not so, or when the name is not printable ASCII (a pax header before it may then hold the
        real name, which the ustar field only approximates): the member is then named by its byte
        offset. Read only for a bad sample."""
        if offset < tarfile.BLOCKSIZE:
            return None
        try:
            block = self._bytes(shard, offset - tarfile.BLOCKSIZE, tarfile.BLOCKSIZE)
            info = tarfile.TarInfo.frombuf(block, "utf-8", "backslashreplace")
        except (OSError, ValueError, tarfile.TarError, objects.StoreUnreachable, objects.ObjectChanged):
            return None
        if info.size != size or b"\0" not in block[:TAR_NAME_BYTES] or not info.isreg():
            return None
        return info.name if info.name.isascii() and info.name.isprintable() else None


def coalesce(ranges: list[tuple[int, int, int]], gap: int, size: int) -> list[tuple[int, int, int]]:
    """Ranges [a, b) merged where fewer than ``gap`` bytes lie between them, in offset order, each
    cut to ``size``; the third of each (the order it is used in) becomes its merged range's least."""
    merged: list[list[int]] = []
    for a, b, used in sorted(ranges):
        a, b = min(a, size), min(b, size)
        if merged and a - merged[-1][1] < gap:
            merged[-1][1] = max(merged[-1][1], b)
            merged[-1][2] = min(merged[-1][2], used)
        else:
            merged.append([a, b, used])
    return [(a, b, used) for a, b, used in merged]
