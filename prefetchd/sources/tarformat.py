"""The tar format as WebDataset shards use it: members grouped into samples by key, each
sample's image member and label found, a member read back as its own header defines it.

Nothing here knows where a shard lies: every function reads through a ``Pread`` (size, offset
-> bytes), ``os.pread`` with a local shard's descriptor bound, or an object's range reads
(sources.objects.ObjectFile), and ``index_tar`` takes a file object at the shard's start.
"""

from __future__ import annotations

import json
import logging
import re
import tarfile
from collections.abc import Callable

import numpy as np

from prefetchd.sources.index import MAX_FILE_BYTES, NO_LABEL

log = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # the first present is the sample's image
_MAX_LABEL_BYTES = 1 << 20  # a .cls or .json member bigger than this is not a label
TAR_NAME_BYTES = 100  # a ustar header's name field: a name that fills it may be cut (a pax or GNU long name)
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
NO_IMAGE = 1  # -1: the sample has no image member (header 0: none)
BY_HEADER = 2  # read as its header defines it: a sparse member (tar --sparse), or one whose size overruns its data
REPEATS = 3  # a member's extension repeats within the sample (WebDataset: "duplicate file name")


class NoLabels(Exception):
    """A shard none of whose samples has a label: every one would be a bad sample, and the
    daemon would stop in its first seconds; ``start`` says it instead, with the fix."""
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)  # tarfile's regular types but sparse
Pread = Callable[[int, int], bytes]  # (size, offset) -> the bytes there, as os.pread with its fd bound


def index_tar(f, pread: Pread, shard: str, label_key: str | None) -> np.ndarray:
    """One row per sample, grouped as WebDataset groups members: offset (see NO_IMAGE), size,
    label. ``f``: the shard open for reading from its start, ``pread`` reading it at an offset.
    Raises what tarfile or the reads raise when the shard cannot be read as a tar at all."""
    rows: list[list[int]] = []
    with_json = 0  # samples with a .json member, while label_key is unset (a hint when none has a label)
    key, extensions = None, set()  # the sample being grouped: its key and the extensions it has
    repeats, first_repeat = 0, None  # samples refused for a key that repeats, and the first: its key, member, header
    with tarfile.open(fileobj=f, mode="r:") as tar:
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
                warn_if_cut_short(pread, tar.offset, shard, len(rows))
                break
            tar.members.clear()  # tarfile keeps every member it read: 1e5 members would stay in memory
            name = member.name
            if not member.isreg() or _WDS_META.match(name) or ("/" not in name and name[:2] == name[-2:] == "__"):
                continue
            split = key_ext(name)
            if split is None:
                continue
            if split[0] != key:  # members of a sample are consecutive, as WebDataset reads them
                key, extensions = split[0], set()
                rows.append([-NO_IMAGE, 0, NO_LABEL, len(IMAGE_KEYS)])
            row, ext = rows[-1], split[1].lower()
            if ext in extensions:
                # WebDataset raises "duplicate file name"; pairing either image with either
                # label would be a guess: the whole sample is bad, its reader says why.
                if row[3] >= 0:
                    repeats, first_repeat = repeats + 1, first_repeat or (key, name, member.offset)
                    row[:] = [-(member.offset + REPEATS), 0, NO_LABEL, -1]  # the first repeat names it
                continue
            extensions.add(ext)
            if row[3] < 0:  # a sample already refused: nothing more is looked at
                continue
            if ext in IMAGE_KEYS and IMAGE_KEYS.index(ext) < row[3]:
                # plain: one pread at its offset, vouched for by its own header just before
                plain = plain_member(pread, member, tar.offset)
                row[0] = member.offset_data if plain else -(member.offset + BY_HEADER)
                row[1], row[3] = size_column(member.size), IMAGE_KEYS.index(ext)
            elif (ext == "cls" and label_key is None) or (ext == "json" and label_key is not None):
                row[2] = label_of(pread, member, tar.offset, label_key)
            elif ext == "json":
                with_json += 1
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
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    read = table[table[:, 3] >= 0]  # not refused for a repeated key
    if len(read) and (read[:, 2] == NO_LABEL).all():
        raise NoLabels(_why_no_labels(len(read), with_json, label_key))
    return table[:, :3].copy()


def _why_no_labels(samples: int, with_json: int, label_key: str | None) -> str:
    if label_key is not None:
        return (
            f"none of its {samples} samples has a .json member holding an integer label under label_key "
            f"{label_key!r}; set label_key to the key the labels are under, or leave it out to read .cls members"
        )
    if with_json:
        return (
            f"none of its {samples} samples has a .cls member, and {with_json} have a .json member: if the labels "
            'are in those, set label_key = "<the label\'s key in them>" in the [[source]] (label_key = "label", '
            "for example)"
        )
    return f"none of its {samples} samples has a label (a .cls member holding the class index); add them"


def size_column(size: int) -> int:
    """A member's size as the index keeps it: a pax size past 2**62 (not an int64) as 2**62, a
    negative one (which the cache would refuse, indexing the shard at every start) as 0; the
    read refuses such a member by its real size."""
    return min(max(size, 0), 1 << 62)


def plain_member(pread: Pread, member: tarfile.TarInfo, next_header: int) -> bool:
    """Whether a member is read with one pread at its offset: a regular member whose data lies
    before the next header and whose own header block, just before its data, says its size
    (a pax size that overrides it is read by its header instead)."""
    if member.issparse() or not 0 <= member.size <= next_header - member.offset_data:
        return False
    try:
        return header_vouches(pread(tarfile.BLOCKSIZE, member.offset_data - tarfile.BLOCKSIZE), member.size)
    except OSError:
        return False


def header_vouches(block: bytes, size: int) -> bool:
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


def key_ext(name: str) -> tuple[str, str] | None:
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


def warn_if_cut_short(pread: Pread, offset: int, shard: str, samples: int) -> None:
    """tarfile ends an archive at a header it cannot parse as quietly as at its end: say so
    when what lies there is neither the end of the file nor the zero blocks that end a tar."""
    try:
        block = pread(tarfile.BLOCKSIZE, offset)
    except (OSError, ValueError):  # a store's fault is the indexing's, raised by its next read
        return
    if block.strip(b"\0"):
        log.warning(
            "shard %s is damaged after %d samples (the block at byte %d is not a tar header); "
            "the rest of it is not served",
            shard,
            samples,
            offset,
        )


def label_of(pread: Pread, member: tarfile.TarInfo, next_header: int, label_key: str | None) -> int:
    """The label a .cls member (an integer as text) or a .json member's key holds; -1: none."""
    if member.size > _MAX_LABEL_BYTES:
        return NO_LABEL
    try:
        data = member_bytes(pread, member, next_header)
        value = json.loads(data)[label_key] if label_key is not None else int(data.strip())
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return NO_LABEL
    return value if type(value) is int and 0 <= value < 1 << 62 else NO_LABEL


def member_bytes(pread: Pread, member: tarfile.TarInfo, next_header: int) -> bytes:
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
        return _pread_exactly(pread, member.size, member.offset_data)
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
    data, out, pos = _pread_exactly(pread, stored, member.offset_data), bytearray(member.size), 0
    for at, n in segments:
        out[at : at + n] = data[pos : pos + n]
        pos += n
    return bytes(out)


def _pread_exactly(pread: Pread, size: int, offset: int) -> bytes:
    data = pread(size, offset)
    if len(data) != size:
        raise ValueError(f"the shard ends {size - len(data)} bytes into the member: truncated")
    return data


def member_at(f, header: int) -> tuple[tarfile.TarInfo, int]:
    """The member whose first header (pax or GNU long name included) begins at byte ``header`` of
    the shard open as ``f``, as tarfile reads it there, and where the next header begins. A
    TarFile reads its first member where its file object stands. ValueError when no member
    begins there (the shard changed)."""
    try:
        f.seek(header)
        with tarfile.open(fileobj=f, mode="r:") as tar:
            member = tar.next()
            next_header = tar.offset
    except (tarfile.TarError, OSError, ValueError, OverflowError, RecursionError) as exc:
        raise ValueError(f"the member at byte {header} cannot be read again ({exc}); has the shard changed?") from None
    if member is None or member.offset != header or not member.isreg():
        raise ValueError(f"no member begins at byte {header} any more; has the shard changed?")
    return member, next_header


def marked(offset: int) -> tuple[int, int]:
    """(header, reason) of a negative offset (see NO_IMAGE)."""
    header = -offset // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE
    return header, -offset - header
