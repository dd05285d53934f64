"""WebDataset tar shards as a source with random access.

WebDataset's own readers stream each tar through a shuffle buffer; prefetchd indexes every
shard once instead (member offsets and sizes, members grouped into samples by key as
WebDataset groups them) and reads a sample's image with one ``pread`` at its offset. The
global permutation, resume, mixing and determinism then work as for a folder of files.

An index is cached per shard (prefetchd.sources.shardcache: ``$PREFETCHD_CACHE``, else
``~/.cache/prefetchd/shards``, used only where no other user can write) and reused while the
shard's size, mtime, inode and ctime are unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tarfile
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from prefetchd import stopsignals
from prefetchd.errors import DataError
from prefetchd.sources.index import MAX_FILE_BYTES, NO_LABEL, SampleBytes, SampleIndex, open_data_file
from prefetchd.sources.places import TAR_MEMBER
from prefetchd.sources.shardcache import _cache_file, _load_cached, _save_cached

log = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # the first present is the sample's image
MAX_SHARDS = 1_000_000  # what urls may name: a pattern like {0..99999999} is a mistake, not a dataset
_MAX_LABEL_BYTES = 1 << 20  # a .cls or .json member bigger than this is not a label
_OPEN_SHARDS = 64  # a worker keeps this many shards open
READ_AHEAD_BYTES = 64 << 20  # at most this much is asked for ahead, per batch
_TAR_NAME_BYTES = 100  # a ustar header's name field: a name that fills it may be cut (a pax or GNU long name)
# A sparse member's holes cost the shard nothing: a shard of a few KiB could make every read
# expand a gigabyte. An encoded image is not hundreds of MiB of mostly zeros.
_MAX_SPARSE_BYTES = 256 << 20
_MAX_SPARSE_SEGMENTS = 1 << 16  # GNU tar writes a segment per run of data; a map of millions costs seconds a read
# The names WebDataset skips before grouping (webdataset.tariterators: meta_prefix/meta_suffix
# and skip_meta).
_WDS_META = re.compile(r"__[^/]*__($|/)")
# A sample's place in the index's offset column: the image member's data offset (>= 0), or
# -(header + reason): no plain member to pread, and why; ``header`` is the byte (a multiple of
# tarfile.BLOCKSIZE) where the first header of the member to look at begins.
_NO_IMAGE = 1  # -1: the sample has no image member (header 0: none)
_BY_HEADER = 2  # read as its header defines it: a sparse member (tar --sparse), or one whose size overruns its data
_REPEATS = 3  # a member's extension repeats within the sample (WebDataset: "duplicate file name")
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)  # tarfile's regular types but sparse
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
                yield os.path.abspath(os.path.join(base, os.path.expanduser(path)))
        except UnbalancedBracesError:
            raise DataError(f"urls pattern {pattern!r} has unbalanced braces; write {{A..B}} or {{a,b}}") from None


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
    """int64 (samples, 3): the image member's offset (negative: see _NO_IMAGE) and size, and the label (-1: none)."""
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
    """One row per sample, grouped as WebDataset groups members: offset (see _NO_IMAGE), size, label."""
    rows: list[list[int]] = []
    key, extensions = None, set()  # the sample being grouped: its key and the extensions it has
    repeats, first_repeat = 0, None  # samples refused for a key that repeats, and the first: its key, member, header
    try:
        fd, _ = open_data_file(shard)  # a FIFO swapped in since the stat: refused, not a hung start
        with open(fd, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            while True:
                try:
                    member = tar.next()
                    # tar.offset is where tarfile reads the next header. A negative size (a pax
                    # header may say so) sends it back over the same member for ever (CPython's
                    # CVE-2025-8194): it must move forward. Not offset_data + size: a sparse
                    # member's size is its expanded size, more than the data it stores. A size
                    # that is not one (GNU.sparse.size=-5) where the offset still moves forward
                    # is that member's fault alone: webdataset reads on, and so does this.
                    if member is not None and tar.offset <= member.offset:
                        raise tarfile.ReadError(f"a member at byte {member.offset} goes backwards")
                except (tarfile.ReadError, OSError, ValueError, OverflowError, RecursionError) as exc:
                    # truncated or damaged past here: keep what came before. RecursionError:
                    # tarfile reads each GNU long-name or pax header by calling itself again.
                    log.warning(
                        "shard %s is damaged after %d samples (%s); the rest of it is not served", shard, len(rows), exc
                    )
                    break
                if member is None:
                    _warn_if_cut_short(f, tar.offset, shard, len(rows))
                    break
                tar.members.clear()  # tarfile keeps every member it read: 1e5 members would stay in memory
                name = member.name
                if not member.isreg() or _WDS_META.match(name) or ("/" not in name and name[:2] == name[-2:] == "__"):
                    continue
                split = _key_ext(name)
                if split is None:
                    continue
                if split[0] != key:  # members of a sample are consecutive, as WebDataset reads them
                    key, extensions = split[0], set()
                    rows.append([-_NO_IMAGE, 0, NO_LABEL, len(IMAGE_KEYS)])
                row, ext = rows[-1], split[1].lower()
                if ext in extensions:
                    # WebDataset raises "duplicate file name"; pairing either image with either
                    # label would be a guess: the whole sample is bad, its reader says why.
                    if row[3] >= 0:
                        repeats, first_repeat = repeats + 1, first_repeat or (key, name, member.offset)
                        row[:] = [-(member.offset + _REPEATS), 0, NO_LABEL, -1]  # the first repeat names it
                    continue
                extensions.add(ext)
                if row[3] < 0:  # a sample already refused: nothing more is looked at
                    continue
                if ext in IMAGE_KEYS and IMAGE_KEYS.index(ext) < row[3]:
                    # plain: one pread at its offset, vouched for by its own header just before
                    plain = _plain_member(f.fileno(), member, tar.offset)
                    row[0] = member.offset_data if plain else -(member.offset + _BY_HEADER)
                    row[1], row[3] = _size_column(member.size), IMAGE_KEYS.index(ext)
                elif (ext == "cls" and label_key is None) or (ext == "json" and label_key is not None):
                    row[2] = _label(f.fileno(), member, tar.offset, label_key)
    except (tarfile.TarError, OSError, ValueError, RecursionError) as exc:
        raise DataError(f"{where}: shard {shard} is not a readable tar file ({exc}); check urls") from None
    if first_repeat:  # one line a shard: a shard of a million such samples is one problem
        key, name, offset = first_repeat
        log.warning(
            "shard %s: %d sample(s) whose key repeats an extension are bad samples, the first key %r "
            "(a second %r at byte %d)",
            shard,
            repeats,
            key,
            name,
            offset,
        )
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)[:, :3].copy()


def _size_column(size: int) -> int:
    """A member's size as the index keeps it: a pax size past 2**62 (not an int64) as 2**62, a
    negative one (which the cache would refuse, indexing the shard at every start) as 0; the
    read refuses such a member by its real size."""
    return min(max(size, 0), 1 << 62)


def _plain_member(fd: int, member: tarfile.TarInfo, next_header: int) -> bool:
    """Whether a member is read with one pread at its offset: a regular member whose data lies
    before the next header and whose own header block, just before its data, says its size
    (a pax size that overrides it is read by its header instead)."""
    if member.issparse() or not 0 <= member.size <= next_header - member.offset_data:
        return False
    try:
        return _header_vouches(os.pread(fd, tarfile.BLOCKSIZE, member.offset_data - tarfile.BLOCKSIZE), member.size)
    except OSError:
        return False


def _header_vouches(block: bytes, size: int) -> bool:
    """Whether ``block`` is a regular member's tar header (its checksum right) of ``size`` bytes.
    A shard rewritten in place after indexing, its size and mtime kept (a worker's reads check
    no identity), moves its members: an offset of the index then lies inside another member, or
    after the header of one of another size."""
    try:
        if len(block) != tarfile.BLOCKSIZE or block[156:157] not in _REGULAR:
            return False
        if tarfile.nti(block[124:136]) != size:
            return False
        stored = tarfile.nti(block[148:156])
    except (tarfile.HeaderError, ValueError):
        return False
    # The bytes' sum, the checksum's own 8 read as spaces: what tarfile.calc_chksums computes, at a
    # tenth of its cost a read; then the signed sum that some old tars wrote.
    return stored == sum(block) - sum(block[148:156]) + 256 or stored in tarfile.calc_chksums(block)


def _key_ext(name: str) -> tuple[str, str] | None:
    """A member name's (key, extension) as WebDataset splits it, or None where it does not.

    webdataset.tariterators.base_plus_ext is ``re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)``:
    "d/.x.jpg" is key "d/" with extension "x.jpg". That regex backtracks in quadratic time
    over a name of many slashes (60 KB: 20 s; a pax name may be megabytes), so this is its
    linear equivalent (tests/component/test_shards.py checks it on every name of up to 6 of "a./\\n"): the
    extension follows the first dot of the last path part; the key before it must end in at
    least one non-dot after a slash that ".*" reaches (no newline before it) or the start."""
    last = name.rfind("/")
    dot = name.find(".", last + 1)
    if dot < 0:
        return None
    newline = name.find("\n")
    start = name.rfind("/", 0, len(name) if newline < 0 else newline) + 1
    if start == dot and start > 0:  # the last part starts with the dot: the key takes the part before
        start = name.rfind("/", 0, start - 1) + 1
    if start < dot and "." not in name[start:dot]:
        return name[:dot], name[dot + 1 :]
    return None


def _warn_if_cut_short(f, offset: int, shard: str, samples: int) -> None:
    """tarfile ends an archive at a header it cannot parse as quietly as at its end: say so
    when what lies there is neither the end of the file nor the zero blocks that end a tar."""
    try:
        block = os.pread(f.fileno(), tarfile.BLOCKSIZE, offset)
    except OSError:
        return
    if block.strip(b"\0"):
        log.warning(
            "shard %s is damaged after %d samples (the block at byte %d is not a tar header); "
            "the rest of it is not served",
            shard,
            samples,
            offset,
        )


def _label(fd: int, member: tarfile.TarInfo, next_header: int, label_key: str | None) -> int:
    """The label a .cls member (an integer as text) or a .json member's key holds; -1: none."""
    if member.size > _MAX_LABEL_BYTES:
        return NO_LABEL
    try:
        data = _member_bytes(fd, member, next_header)
        value = json.loads(data)[label_key] if label_key is not None else int(data.strip())
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return NO_LABEL
    return value if type(value) is int and 0 <= value < 1 << 62 else NO_LABEL


def _member_bytes(fd: int, member: tarfile.TarInfo, next_header: int) -> bytes:
    """A regular member's content as tar defines it; ValueError where the shard cannot vouch for it.

    A sparse member (GNU tar --sparse, GNU or pax format) stores only its data segments, one
    after the other from ``offset_data``; its map (offset, length per segment) places them in a
    file of ``member.size`` bytes, zeros in between (tarfile's own reading, _FileInFile). The map
    must be in order, inside the file and hold no more than the member stores (up to
    ``next_header``, where tarfile reads the next header); GNU's unused map slots read (0, 0)."""
    bound = _MAX_SPARSE_BYTES if member.issparse() else MAX_FILE_BYTES
    if member.size < 0:
        raise ValueError(f"its header gives it a size of {member.size}, which is not one")
    if member.size > bound:
        raise ValueError(f"it expands to {member.size:,} bytes, more than prefetchd reads for an image ({bound:,})")
    if not member.issparse():
        if member.offset_data + member.size > next_header:  # a pax size (GNU.sparse.realsize) not its own
            raise ValueError(
                f"it claims {member.size} bytes, but the next header begins after "
                f"{next_header - member.offset_data}: the rest would be other members' bytes"
            )
        return _pread_exactly(fd, member.size, member.offset_data)
    if len(member.sparse) > _MAX_SPARSE_SEGMENTS:
        raise ValueError(f"its sparse map has {len(member.sparse):,} segments, more than {_MAX_SPARSE_SEGMENTS:,}")
    segments = [(int(at), int(n)) for at, n in member.sparse if n]
    covered = stored = 0
    for at, n in segments:
        if at < covered or n < 0 or at + n > member.size:
            raise ValueError(
                f"its sparse map is out of order or runs past its {member.size} bytes: {member.sparse[:8]}"
            )
        covered, stored = at + n, stored + n
    if member.offset_data + stored > next_header:
        raise ValueError(f"its sparse map places {stored} bytes, more than the member stores")
    data, out, pos = _pread_exactly(fd, stored, member.offset_data), bytearray(member.size), 0
    for at, n in segments:
        out[at : at + n] = data[pos : pos + n]
        pos += n
    return bytes(out)


def _pread_exactly(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"the shard ends {size - len(data)} bytes into the member: truncated")
    return data


def _member_at(fd: int, header: int) -> tuple[tarfile.TarInfo, int]:
    """The member whose first header (pax or GNU long name included) begins at byte ``header``,
    as tarfile reads it there, and where the next header begins. A TarFile reads its first member
    where its file object stands. ValueError when no member begins there (the shard changed)."""
    try:
        with open(fd, "rb", closefd=False) as f:
            f.seek(header)
            with tarfile.open(fileobj=f, mode="r:") as tar:
                member = tar.next()
                next_header = tar.offset
    except (tarfile.TarError, OSError, ValueError, OverflowError, RecursionError) as exc:
        raise ValueError(f"the member at byte {header} cannot be read again ({exc}); has the shard changed?") from None
    if member is None or member.offset != header or not member.isreg():
        raise ValueError(f"no member begins at byte {header} any more; has the shard changed?")
    return member, next_header


def _marked(offset: int) -> tuple[int, int]:
    """(header, reason) of a negative offset (see _NO_IMAGE)."""
    header = -offset // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE
    return header, -offset - header


class TarMembers(SampleBytes):
    """A worker's reads of members: one pread each, from shards it keeps open."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()

    def read(self, shard: str, offset: int, size: int) -> bytes:
        """The image of a sample at (``offset``, ``size``) of the index; ValueError for a bad sample."""
        if offset >= 0:
            if size > MAX_FILE_BYTES:
                raise ValueError(f"the image member has {size:,} bytes, more than any image ({MAX_FILE_BYTES:,})")
            if offset < tarfile.BLOCKSIZE:
                raise ValueError(f"the index places an image member at byte {offset}, before any header could end")
            data = os.pread(self._fd(shard), tarfile.BLOCKSIZE + size, offset - tarfile.BLOCKSIZE)
            if len(data) != tarfile.BLOCKSIZE + size:
                missing = tarfile.BLOCKSIZE + size - len(data)
                raise ValueError(f"the shard ends {missing} bytes into the image member: truncated")
            if not _header_vouches(data[: tarfile.BLOCKSIZE], size):  # its own header, read in the same pread
                raise ValueError(
                    f"the block before byte {offset} is no longer the header of a {size}-byte member: "
                    "the shard has changed since it was indexed (rewritten in place?); start again to index it"
                )
            return data[tarfile.BLOCKSIZE :]
        header, reason = _marked(offset)
        if reason == _NO_IMAGE:
            raise ValueError(f"the sample has no image member ({', '.join('.' + k for k in IMAGE_KEYS)})")
        fd = self._fd(shard)
        member, next_header = _member_at(fd, header)
        if reason == _REPEATS:
            key, ext = _key_ext(member.name) or (member.name, "?")
            ext = ext.lower()
            raise ValueError(
                f"key {key!r} repeats .{ext} within one sample (a second {member.name!r} at byte {header}); "
                "which image goes with which label is not known, so neither is served (webdataset: "
                "'duplicate file name')"
            )
        if reason != _BY_HEADER or _size_column(member.size) != size:
            raise ValueError(f"the index does not match the member at byte {header} any more; has the shard changed?")
        try:
            return _member_bytes(fd, member, next_header)
        except ValueError as exc:
            kind = "sparse image member" if member.issparse() else "image member"
            raise ValueError(f"the {kind} {member.name!r} at byte {header}: {exc}") from None

    def read_sample(self, path: str, a: int, b: int, options: dict) -> bytes:
        return self.read(path, a, b)

    def where(self, path: str, a: int, b: int) -> str:
        if a < 0:  # none, or one the index marked (a sparse member, a key that repeats)
            return f"shard {path}, {self.place(path, a, b)}"
        name = _member_name(path, a, b)
        return f"shard {path} member {name}" if name else f"shard {path} member at byte {a} ({b} bytes)"

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
        if offset < 0 and _marked(offset)[1] == _REPEATS:
            self.read(shard, offset, 0)

    def place(self, shard: str, offset: int, size: int) -> str:
        """Where in its shard a sample without a plain image member is, for messages."""
        header, reason = _marked(offset)
        if reason == _NO_IMAGE:
            return "a sample with no image member"
        try:
            name = repr(_member_at(self._fd(shard), header)[0].name)
        except (OSError, ValueError):
            name = "?"
        if reason == _BY_HEADER:
            return f"member {name} at byte {header} ({size} bytes, sparse or overrunning)"
        return f"a sample whose key repeats (member {name} at byte {header})"

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


def _member_name(shard: str, offset: int, size: int) -> str | None:
    """The name of the tar member whose data starts at ``offset``: from the header block just
    before it, when that is a tar header (its checksum holds) of a member of ``size`` bytes and
    its name field is not full (else a pax or GNU long name may have been cut). None when it is
    not so, or when the name is not printable ASCII (a pax header before it may then hold the
    real name, which the ustar field only approximates): the member is then named by its byte
    offset. Read only for a bad sample."""
    if offset < tarfile.BLOCKSIZE:
        return None
    try:
        fd, _ = open_data_file(shard)
        try:
            block = os.pread(fd, tarfile.BLOCKSIZE, offset - tarfile.BLOCKSIZE)
        finally:
            os.close(fd)
        info = tarfile.TarInfo.frombuf(block, "utf-8", "backslashreplace")
    except (OSError, ValueError, tarfile.TarError):
        return None
    if info.size != size or b"\0" not in block[:_TAR_NAME_BYTES] or not info.isreg():
        return None
    return info.name if info.name.isascii() and info.name.isprintable() else None
