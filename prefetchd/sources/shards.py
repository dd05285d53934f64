"""WebDataset tar shards as a source with random access.

WebDataset's own readers stream each tar through a shuffle buffer; prefetchd indexes every
shard once instead (member offsets and sizes, members grouped into samples by key as
WebDataset groups them: sources.tarformat) and reads a sample's image with one ``pread`` at
its offset, or one range request for a shard in a store (sources.tarmembers). The global
permutation, resume, mixing and determinism then work as for a folder of files.

A shard's table comes from the index object ``prefetchd pack`` wrote beside it (``<shard>.idx``,
parse_index_object) or the index cache (prefetchd.sources.shardcache: ``$PREFETCHD_CACHE``,
else ``~/.cache/prefetchd/shards``, used only where no other user can write; keyed by a local
shard's size, mtime, inode and ctime, or an object's URL and identity), whichever is cheaper to
read first (a local file's index beside it; an object's cache, which needs no request); else
from reading the shard through once.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import logging
import os
import re
import stat
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from prefetchd import stopsignals
from prefetchd.errors import ConfigError, DataError
from prefetchd.sizes import parse_size
from prefetchd.sources import objects
from prefetchd.sources.index import SampleIndex, open_data_file
from prefetchd.sources.objectfile import ObjectFile
from prefetchd.sources.places import TAR_MEMBER
from prefetchd.sources.progress import IndexingProgress
from prefetchd.sources.shardcache import (
    _cache_file,
    _load_cached,
    _object_cache_file,
    _save_cached,
    last_known_object,
    read_table,
    remember_object,
    table_fits,
)
from prefetchd.sources.tarformat import NoLabels, index_tar

log = logging.getLogger(__name__)

MAX_SHARDS = 1_000_000  # what urls may name: a pattern like {0..99999999} is a mistake, not a dataset
# A shard's index object, written by `prefetchd pack` beside it (parse_index_object): "<shard>.idx".
INDEX_SUFFIX = ".idx"
_INDEX_MAGIC = int.from_bytes(b"pfd-idx", "little")
_INDEX_VERSION = 2  # 2: the shard's MD5 in row 1
_MAX_INDEX_OBJECT_BYTES = 1 << 30  # 44 M samples' rows: no shard holds that many
_INDEXING_THREADS = 8  # shards in a store indexed at once: each waits on the network more than on the CPU
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")


def expand_urls(urls: str | list[str], base: str = "") -> Iterator[str]:
    """The shard paths that the brace patterns name (``train-{000000..000127}.tar``), in order,
    lazily; a relative one joined to ``base`` (the config's folder), then made absolute."""
    from braceexpand import UnbalancedBracesError, braceexpand

    for pattern in [urls] if isinstance(urls, str) else urls:
        names = _range_product(pattern)
        if names > MAX_SHARDS:  # braceexpand builds a range's names before the first comes out
            raise DataError(
                f"urls pattern {pattern!r} names {names:,} shards, more than {MAX_SHARDS:,}; is a brace range too wide?"
            )
        try:
            for path in braceexpand(pattern):  # lazily: a product of {a,b} lists is not counted above
                if "://" in path:
                    yield _checked_url(path)
                else:
                    yield os.path.abspath(os.path.join(base, os.path.expanduser(path)))
        except UnbalancedBracesError:
            raise DataError(f"urls pattern {pattern!r} has unbalanced braces; write {{A..B}} or {{a,b}}") from None


def _checked_url(url: str) -> str:
    why = objects.check_url(url)
    if why:
        raise DataError(f"urls: {objects.shown(url)} cannot be read: {why}")
    return url


def _range_product(pattern: str) -> int:
    """How many names the numeric ranges ``{A..B}`` / ``{A..B..STEP}`` of a pattern make together."""
    names = 1
    for m in _RANGE.finditer(pattern):
        names *= abs(int(m[2]) - int(m[1])) // max(abs(int(m[3] or 1)), 1) + 1
    return names


def scan_webdataset(src: dict, where: str) -> SampleIndex:
    """webdataset_parts' index whole, in memory (a small dataset: tests, tools)."""
    return SampleIndex.concat(list(webdataset_parts(src, where)))


def webdataset_parts(src: dict, where: str) -> Iterator[SampleIndex]:
    """Index the shards of a ``kind = "webdataset"`` source: one sample per key, in shard order,
    a shard's samples at a time (the job's index is written as they come: 10^4 shards of 10^4
    samples are never in memory at once). Shards in a store are indexed several at a time
    (each one a stream of range requests)."""
    label_key = src.get("label_key")
    _check_cache(src, where)
    shards = []
    for shard in expand_urls(src["urls"], src.get("base", "")):
        if len(shards) == MAX_SHARDS:
            raise DataError(f"{where}: urls names more than {MAX_SHARDS:,} shards; is a brace range too wide?")
        shards.append(shard)
    if not shards:
        raise DataError(f"{where}: urls names no shard")
    progress = IndexingProgress(len(shards), where, "shards")
    store = objects.Objects() if any(objects.is_url(shard) for shard in shards) else None
    down: set[str] = set()  # stores that do not answer
    remembered: list[str] = []  # shards served with the last start's index, their store not answering

    def index_one(shard: str) -> SampleIndex:
        stopsignals.check_starting()  # indexing thousands of shards takes a while: a stop need not wait
        in_store = None
        if store is None or not objects.is_url(shard):
            table = _shard_index(shard, label_key, where)
        else:
            info, table, from_before = _object_index(store, shard, label_key, where, down)
            in_store = {shard: info.to_json()}
            if from_before:
                remembered.append(shard)
        progress.done_one()
        return SampleIndex.in_containers([shard], [len(table)], TAR_MEMBER, table[:, :2], table[:, 2], in_store)

    samples = 0
    if store is None:
        for shard in shards:  # a missing shard stops it before the rest
            part = index_one(shard)
            samples += len(part)
            yield part
    else:
        pool = ThreadPoolExecutor(_INDEXING_THREADS, thread_name_prefix="prefetchd-index")
        try:
            for part in _in_order(pool, index_one, shards, ahead=4 * _INDEXING_THREADS):
                samples += len(part)
                yield part
        finally:
            # The first failure (a missing shard, a store down, a stop) ends it: the shards not
            # begun are not, or a store that is down would be asked about each in turn.
            pool.shutdown(wait=True, cancel_futures=True)
            store.close()
    if remembered:
        log.warning(
            "%s: the store of %d of the %d shards (%s) does not answer: they are served with the index of the "
            "start that last read them, and their batches wait for the store (an object changed meanwhile stops "
            "the job)",
            where,
            len(remembered),
            len(shards),
            ", ".join(sorted(down)),
        )
    if not samples:
        raise DataError(f"{where}: the {len(shards)} shard(s) of urls hold no sample; is urls right?")


def _in_order(pool: ThreadPoolExecutor, fn, items: list, ahead: int) -> Iterator:
    """``pool.map(fn, items)`` with at most ``ahead`` results begun before the one given next
    (map would begin them all, and keep every result that comes before its turn)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


PACK_MANIFEST = "pack.json"  # what `prefetchd pack` writes beside its shards, last
_MAX_PACK_JSON_BYTES = 64 << 20


def packed_class_names(src: dict) -> list[str] | None:
    """The class names `prefetchd pack` wrote in ``pack.json`` beside the shards (local ones:
    the first shard's folder), if that file lists the first shard; else None."""
    first = next(expand_urls(src["urls"], src.get("base", "")), None)
    if first is None or objects.is_url(first):
        return None
    try:
        fd, st = open_data_file(os.path.join(os.path.dirname(first), PACK_MANIFEST))
    except (OSError, ValueError):
        return None
    with open(fd, "rb") as f:
        data = f.read(_MAX_PACK_JSON_BYTES + 1)
    try:
        pack = json.loads(data)
        listed = {shard["name"] for shard in pack["shards"]}
        names = pack["classes"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if os.path.basename(first) not in listed or not isinstance(names, list):
        return None
    return names if all(isinstance(n, str) for n in names) else None


def _check_cache(src: dict, where: str) -> None:
    """A source's member cache (sources.membercache): an absolute folder and its bound, both or neither."""
    folder, size = src.get("cache"), src.get("cache_size")
    if folder is None and size is None:
        return
    if folder is None or size is None:
        raise ConfigError(f'{where}: cache and cache_size go together: cache = "/local/disk/dir", cache_size = "100G"')
    if not os.path.isabs(folder):
        raise ConfigError(f"{where}: cache must be an absolute folder (the workers' own), got {folder!r}")
    try:
        parse_size(size)
    except ValueError as exc:
        raise ConfigError(f"{where}: cache_size: {exc}") from None


def _shard_index(shard: str, label_key: str | None, where: str) -> np.ndarray:
    """int64 (samples, 3): the image member's offset (negative: see NO_IMAGE) and size, and the label (-1: none)."""
    try:
        st = os.stat(shard)
    except OSError as exc:
        raise DataError(f"{where}: cannot read shard {shard}: {exc.strerror}; check urls") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{where}: shard {shard} is not a regular file; urls must name tar files")
    table = _index_file(shard, st) if label_key is None else None
    if table is not None:
        return table
    cache = _cache_file(shard, st, label_key)
    table = _load_cached(cache, st.st_size)
    if table is None:
        try:
            fd, _ = open_data_file(shard)  # a FIFO swapped in since the stat: refused, not a hung start
            with open(fd, "rb") as f:
                table = index_tar(f, functools.partial(os.pread, fd), shard, label_key)
        except NoLabels as exc:
            raise DataError(f"{where}: shard {shard}: {exc}") from None
        except (tarfile.TarError, OSError, ValueError, RecursionError) as exc:
            raise DataError(f"{where}: shard {shard} is not a readable tar file ({exc}); check urls") from None
        _save_cached(cache, table)
    return table


def _index_file(shard: str, st: os.stat_result) -> np.ndarray | None:
    """The table of the index file beside a local shard (INDEX_SUFFIX), or None: absent, not one
    of this shard's, or not newer than the shard (written for an earlier version of it, which
    may have had other labels: the shard is read then, which is always right)."""
    try:
        fd, index_st = open_data_file(shard + INDEX_SUFFIX)
    except (OSError, ValueError):  # none, or not a regular file: the shard is indexed as ever
        return None
    with open(fd, "rb") as f:
        data = f.read(_MAX_INDEX_OBJECT_BYTES + 1) if index_st.st_size <= _MAX_INDEX_OBJECT_BYTES else b""
    found = parse_index_object(data, st.st_size)
    why = None if found else f"it is not a prefetchd index of this {st.st_size}-byte shard"
    if found and index_st.st_mtime_ns <= st.st_mtime_ns:
        why = "it is not newer than its shard, so it may have been written for an earlier version of it"
    if why:
        log.warning("index file %s not used: %s; the shard is indexed by reading it", shard + INDEX_SUFFIX, why)
        return None
    return found.table


def _object_index(
    store: objects.Objects, url: str, label_key: str | None, where: str, down: set
) -> tuple[objects.ObjectInfo, np.ndarray, bool]:
    """A shard in a store: its identity, its table, and whether both are the last start's because
    the store does not answer. The table comes from the index cache, else the index object
    `prefetchd pack` wrote beside the shard, else by streaming the shard once. ``down``: the
    stores found not answering by this indexing (asked no more: their shards' HEADs would each
    retry for seconds)."""
    try:
        store_name = objects.store_name(url)
        if store_name not in down:
            try:
                info = store.head(url)
            except objects.StoreUnreachable:
                down.add(store_name)
        if store_name in down:
            known = _last_known(url, label_key)
            if known is None:
                raise objects.StoreUnreachable(url, "the store does not answer, and no start before indexed this shard")
            return (*known, True)
        cache = _object_cache_file(url, info, label_key)
        table = _load_cached(cache, info.size)
        if table is None:
            table = _index_object(store, url, info) if label_key is None else None
            if table is None:
                with ObjectFile(store, url, info) as f:
                    table = index_tar(f, f.pread, url, label_key)
            _save_cached(cache, table)
            remember_object(url, info.to_json(), label_key)  # for a start while the store does not answer
    except objects.StoreUnreachable as exc:
        raise DataError(
            f"{where}: cannot reach the store for shard {objects.shown(url)}: {exc}; check the endpoint "
            "(AWS_ENDPOINT_URL) and the network, then start again"
        ) from None
    except objects.ObjectError as exc:
        raise DataError(f"{where}: shard {exc}") from None
    except objects.ObjectChanged:
        raise DataError(
            f"{where}: shard {objects.shown(url)} changed while it was indexed (the store gave it another ETag "
            "from one request to the next); start again once it is written, or fix a store whose ETags change"
        ) from None
    except NoLabels as exc:
        raise DataError(f"{where}: shard {objects.shown(url)}: {exc}") from None
    except (tarfile.TarError, ValueError, RecursionError) as exc:
        raise DataError(f"{where}: shard {objects.shown(url)} is not a readable tar file ({exc}); check urls") from None
    return info, table, False


def _last_known(url: str, label_key: str | None) -> tuple[objects.ObjectInfo, np.ndarray] | None:
    """The identity and table a start before indexed ``url`` with (from the index cache), or None."""
    try:
        info = objects.ObjectInfo.from_json(last_known_object(url, label_key))
    except (TypeError, ValueError):  # none kept, or not one
        return None
    table = _load_cached(_object_cache_file(url, info, label_key), info.size)
    return None if table is None else (info, table)


def _index_object(store: objects.Objects, url: str, info: objects.ObjectInfo) -> np.ndarray | None:
    """The table of the index object beside ``url`` (INDEX_SUFFIX), or None: absent, or not one
    for this shard (another size, or older than the shard: written for an earlier version of
    it, which may have had other labels) or not one at all."""
    index_url = url + INDEX_SUFFIX
    try:
        index_info = store.head(index_url)
    except objects.ObjectError:
        return None
    if index_info.size > _MAX_INDEX_OBJECT_BYTES:
        log.warning("index object %s not used: %d bytes is too big for one", objects.shown(index_url), index_info.size)
        return None
    found = parse_index_object(store.read(index_url, 0, index_info.size, index_info), info.size)
    why = _stale(found, info, index_info) if found else f"it is not a prefetchd index of this {info.size}-byte shard"
    if why:
        log.warning("index object %s not used: %s; the shard is indexed by reading it", objects.shown(index_url), why)
        return None
    return found.table


def _stale(found: IndexObject, shard: objects.ObjectInfo, index: objects.ObjectInfo) -> str | None:
    """Why an index object cannot be known to be its shard's as the shard is now, or None.

    The shard may have been rewritten since (labels fixed, the same size): where its ETag is
    the MD5 of its bytes (S3 and S3-compatible stores, for an object put in one part), that
    MD5 must be the one pack wrote in the index; elsewhere the index must be newer than the
    shard (pack writes it after its shard, and an upload of the folder puts it after it). In
    the same second either may be the later (Last-Modified is to the second): the shard is
    read then, which is always right."""
    etag = shard.etag.strip('"').lower()
    if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag):
        return None if etag == found.md5 else f"it was written for a shard of MD5 {found.md5}, and this one's is {etag}"
    if index.modified and shard.modified and index.modified <= shard.modified:
        return (
            f"it is not newer than its shard ({index.modified} against {shard.modified}), so it may have been "
            "written for an earlier version of it"
        )
    return None


class IndexObject(NamedTuple):
    table: np.ndarray
    md5: str  # of the shard's bytes, hex


def index_object_bytes(table: np.ndarray, shard_size: int, md5: str) -> bytes:
    """What `prefetchd pack` writes beside a shard as ``<shard>.idx`` (see parse_index_object)."""
    digest = bytes.fromhex(md5)
    head = np.asarray(
        [[_INDEX_MAGIC, _INDEX_VERSION, shard_size], [*np.frombuffer(digest, "<i8"), 0]], dtype="<i8"
    )
    out = io.BytesIO()
    np.save(out, np.concatenate([head, np.asarray(table, dtype="<i8").reshape(-1, 3)]), allow_pickle=False)
    return out.getvalue()


def parse_index_object(data: bytes, shard_size: int) -> IndexObject | None:
    """A shard's index table, and the MD5 of the shard it was written for, from its index object;
    None when it is not one for a shard of ``shard_size`` bytes.

    The object is a ``.npy`` array, int64 little-endian, shape (samples + 2, 3): row 0 is
    (_INDEX_MAGIC, _INDEX_VERSION, the shard's size in bytes), row 1 the MD5 of the shard's
    bytes (16 bytes as two int64) and a 0, then one row per sample as the index keeps it: the
    image member's data offset (negative: no plain image member, see NO_IMAGE), its size, its
    label (-1: none). Its header must declare exactly the bytes that follow, and every row must
    fit the shard (shardcache.table_fits); each read checks the member's own tar header
    besides, so an index of another shard serves no other member's bytes (its labels are what
    _stale guards)."""
    try:
        table = read_table(io.BytesIO(data), len(data))
    except ValueError:
        return None
    if table is None or len(table) < 2 or table[0].tolist() != [_INDEX_MAGIC, _INDEX_VERSION, shard_size]:
        return None
    md5 = table[1, :2].astype("<i8").tobytes().hex()
    rows = table[2:]
    return IndexObject(rows, md5) if table_fits(rows, shard_size) else None
