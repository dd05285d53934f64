"""The batch file: one finished batch, readable without the daemon.

Layout (format version 1; all integers little-endian)::

    offset        size   content
    0             8      magic  b"PFDBATCH"
    8             4      u32    format version (1)
    12            4      u32    H, length of the JSON header in bytes
    16            H      JSON header, UTF-8 (see below)
    16+H          ...    zero padding up to the first field
    offset_i      n_i    field i: C-contiguous array data, offset_i a multiple of 64
    ...           ...    zero padding up to a multiple of 4096 bytes (whole pages)

The header is one JSON object::

    {"epoch": E, "step": K, "rank": R,
     "fields": [{"name": "image", "dtype": "uint8", "shape": [B, H, W, 3], "offset": 4096}, ...],
     "meta": {"config_hash": "...", "crc32": N}}   # small; CRC-32 of the fields' bytes

A writer reserves a header area of ``data_start - 16`` bytes (a multiple of 4096 with the
default layout), so the header can be written after the pixels, and the first field is
page-aligned for mapping.

The parser checks, before it touches any field, and raises BatchFormatError otherwise:
file at least 16 bytes; magic; version; 2 <= H <= MAX_HEADER_BYTES and 16 + H <= file size;
header is a UTF-8 JSON object; epoch/step/rank non-negative integers; 1..MAX_FIELDS fields,
each with a unique name (1-64 chars), a dtype from ALLOWED_DTYPES, a shape of at most
MAX_DIMS non-negative integers, an integer offset that is a multiple of FIELD_ALIGN, not
inside the header, and an extent (offset + size) within the file; extents do not overlap.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import math
import mmap
import os
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .errors import BatchFormatError
from .unmapper import UNMAPPER

MAGIC = b"PFDBATCH"
VERSION = 1
PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20
MAX_FIELDS = 64
MAX_DIMS = 8
FIELD_ALIGN = 64
HEADER_AREA_ALIGN = 4096
ALLOWED_DTYPES = frozenset(
    ["uint8", "int8", "uint16", "int16", "int32", "uint32", "int64", "float16", "float32", "float64", "bool"]
)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> FieldSpec:
        return cls(str(d["name"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]))


@dataclass(frozen=True)
class BatchLayout:
    """Where each field of a batch lives; the same for every batch of a job."""

    fields: tuple[FieldSpec, ...]
    offsets: tuple[int, ...]
    data_start: int
    size: int

    @classmethod
    def plan(cls, fields: list[FieldSpec], header_area: int = HEADER_AREA_ALIGN) -> BatchLayout:
        data_start = _align(max(header_area, PREAMBLE.size + 1), HEADER_AREA_ALIGN)
        offsets, pos = [], data_start
        for f in fields:
            if f.dtype not in ALLOWED_DTYPES:
                raise ValueError(f"field {f.name!r}: dtype {f.dtype} is not one of {sorted(ALLOWED_DTYPES)}")
            offsets.append(pos)
            pos = _align(pos + f.nbytes, FIELD_ALIGN)
        # A whole number of pages: the file's size is then exactly what it holds on the tmpfs,
        # and the byte bound, counted in file sizes, is a bound on memory.
        return cls(tuple(fields), tuple(offsets), data_start, _align(max(pos, data_start), HEADER_AREA_ALIGN))

    def header_bytes(self, epoch: int, step: int, rank: int, meta: dict | None = None) -> bytes:
        fields = [dict(f.to_json(), offset=o) for f, o in zip(self.fields, self.offsets)]
        header = {"epoch": epoch, "step": step, "rank": rank, "fields": fields, "meta": meta or {}}
        data = json.dumps(header, separators=(",", ":")).encode()
        if PREAMBLE.size + len(data) > self.data_start:
            raise ValueError(f"batch header of {len(data)} bytes does not fit the {self.data_start}-byte header area")
        return data


class BatchBuffer:
    """A batch laid out in memory exactly as in its file, header area included.

    A worker keeps one and fills it for every batch: its pages are faulted in once, where
    writing through a fresh mapping of each new file paid a page fault per 4 KiB and then
    an unmap. Every field is overwritten by the next fill; the header area is cleared by
    each write, so nothing of an earlier batch can leak into a later file.
    """

    def __init__(self, layout: BatchLayout):
        self.layout = layout
        self.data = np.zeros(layout.size, dtype=np.uint8)
        self.arrays = {
            f.name: self.data[o : o + f.nbytes].view(f.dtype).reshape(f.shape)
            for f, o in zip(layout.fields, layout.offsets)
        }


class BatchWriter:
    """Writes one batch file: space is reserved first, the batch is filled in memory
    (``arrays``), then ``finish`` writes the header and the whole file with ``pwrite``.

    ``posix_fallocate`` reserves every block before any work is done, so a full tmpfs fails
    here with ENOSPC (and costs no decoding); the file is never mapped for writing, so a
    full filesystem can never kill the writer with SIGBUS. Pass a ``BatchBuffer`` to reuse
    its memory across batches (one writer at a time per buffer).
    """

    def __init__(self, path: str | os.PathLike, layout: BatchLayout, buffer: BatchBuffer | None = None):
        if buffer is not None and buffer.layout != layout:
            raise ValueError("the buffer was planned for another layout")
        self.layout = layout
        self._buffer = buffer or BatchBuffer(layout)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, layout.size)
        except BaseException:
            os.close(self._fd)
            os.unlink(path)
            raise
        self.arrays = self._buffer.arrays

    def finish(self, epoch: int, step: int, rank: int, meta: dict | None = None) -> None:
        header = self.layout.header_bytes(epoch, step, rank, meta)
        view, pos = memoryview(self._buffer.data), 0
        view[: self.layout.data_start] = bytes(self.layout.data_start)  # no tail of a longer header
        PREAMBLE.pack_into(view, 0, MAGIC, VERSION, len(header))
        view[PREAMBLE.size : PREAMBLE.size + len(header)] = header
        while pos < len(view):  # pwrite may write less than asked; ENOSPC raises OSError
            pos += os.pwrite(self._fd, view[pos:], pos)
        self.close()

    def close(self) -> None:
        self.arrays = {}
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def content_digest(arrays: dict[str, np.ndarray], fields) -> int:
    """CRC-32 of the fields' bytes in layout order: recorded as ``meta.crc32`` by the daemon,
    so the client's verify mode can tell a torn or corrupted batch, and a regenerated batch
    can be compared with a published one cheaply. A check against accidents, not attacks
    (whoever can write the job directory can write a matching digest too): CRC-32 runs at
    memory speed in zlib, where SHA-256 took ~3 % of a worker's time."""
    crc = 0
    for f in fields:
        name = f.name if isinstance(f, FieldSpec) else f["name"]
        crc = zlib.crc32(memoryview(np.ascontiguousarray(arrays[name])).cast("B"), crc)
    return crc


def _fail(msg: str) -> BatchFormatError:
    return BatchFormatError(f"invalid batch file: {msg}")


def _nonneg_int(v, what: str) -> int:
    if type(v) is not int or v < 0:
        raise _fail(f"{what} must be a non-negative integer, got {v!r:.40}")
    return v


# The itemsize of each allowed dtype, looked up once: the parser runs on every batch a trainer
# reads, and np.dtype() per field would cost more than the rest of the checks.
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


def parse_header(buf, size: int) -> dict:
    """Validate the preamble and header of a batch held in ``buf`` (``size`` bytes).

    Returns the header with each field's ``nbytes`` added. Raises only BatchFormatError.
    """
    if size < PREAMBLE.size:
        raise _fail(f"{size} bytes, shorter than the {PREAMBLE.size}-byte preamble")
    magic, version, hlen = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _fail(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _fail(f"format version {version}, this reader understands {VERSION}")
    if not 2 <= hlen <= MAX_HEADER_BYTES or PREAMBLE.size + hlen > size:
        raise _fail(f"header length {hlen} out of range for a {size}-byte file")
    try:
        header = json.loads(bytes(buf[PREAMBLE.size : PREAMBLE.size + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(f"header is not UTF-8 JSON ({exc})") from None
    if type(header) is not dict:
        raise _fail("header is not a JSON object")
    for key in ("epoch", "step", "rank"):
        _nonneg_int(header.get(key), key)
    if type(header.get("meta", {})) is not dict:
        raise _fail("meta must be an object")
    fields = header.get("fields")
    data_floor = PREAMBLE.size + hlen
    memo = _last_fields
    # Every batch of a job has the same field table: one that equals the last table checked
    # passes the same checks, but for the two that depend on this file (header length, size).
    # Python's == holds for 1.0 and True against 1: the numbers must be ints, as checked.
    if (
        memo is not None
        and fields == memo.table
        and _all_ints(fields)
        and memo.first_offset >= data_floor
        and memo.end <= size
    ):
        for f, nbytes in zip(fields, memo.nbytes):
            f["nbytes"] = nbytes
        return header
    table = copy.deepcopy(fields)
    _check_fields(fields, data_floor, size)
    _remember_fields(table, fields)
    return header


def _all_ints(fields: list) -> bool:
    for f in fields:
        if type(f["offset"]) is not int:
            return False
        for d in f["shape"]:
            if type(d) is not int:
                return False
    return True


def _check_fields(fields, data_floor: int, size: int) -> None:
    """The field table's checks (module docstring); adds each field's ``nbytes``."""
    if type(fields) is not list or not 1 <= len(fields) <= MAX_FIELDS:
        raise _fail(f"fields must be a list of 1 to {MAX_FIELDS} entries")
    extents, names = [], set()
    for i, f in enumerate(fields):
        if type(f) is not dict:
            raise _fail(f"field #{i} is not an object")
        name, dtype, shape, offset = f.get("name"), f.get("dtype"), f.get("shape"), f.get("offset")
        if type(name) is not str or not 1 <= len(name) <= 64 or name in names:
            raise _fail(f"field #{i} has a missing, overlong or repeated name")
        names.add(name)
        itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise _fail(f"field {name!r}: dtype {dtype!r:.40} not allowed")
        if type(shape) is not list or len(shape) > MAX_DIMS:
            raise _fail(f"field {name!r}: shape must be a list of at most {MAX_DIMS} dimensions")
        nbytes = itemsize
        for d in shape:
            nbytes *= _nonneg_int(d, f"field {name!r} dimension")
        _nonneg_int(offset, f"field {name!r} offset")
        if offset % FIELD_ALIGN or offset < data_floor:
            raise _fail(f"field {name!r}: offset {offset} misaligned or inside the header")
        if offset + nbytes > size:
            raise _fail(f"field {name!r}: extent {offset}+{nbytes} runs past the end of the {size}-byte file")
        f["nbytes"] = nbytes
        extents.append((offset, offset + nbytes, name))
    extents.sort()
    for (_, end, a), (start, _, b) in zip(extents, extents[1:]):
        if start < end:
            raise _fail(f"fields {a!r} and {b!r} overlap")


@dataclass(frozen=True)
class _CheckedFields:
    table: list  # the field table as parsed, before nbytes was added
    nbytes: tuple[int, ...]
    first_offset: int  # the checks that depend on the file: first_offset >= 16 + H, end <= size
    end: int


_last_fields: _CheckedFields | None = None


def _remember_fields(table: list, checked: list) -> None:
    global _last_fields
    # One tuple assignment: a reader in another thread sees the old memo or the new, whole.
    _last_fields = _CheckedFields(
        table,
        tuple(f["nbytes"] for f in checked),
        min(f["offset"] for f in checked),
        max(f["offset"] + f["nbytes"] for f in checked),
    )


def map_batch(
    path: str | os.PathLike, *, pin: bool = True, unmap_in_background: bool = False
) -> tuple[dict, dict[str, np.ndarray]]:
    """Map a batch file and return (header, arrays) without copying the data.

    The map is private copy-on-write: the arrays are writable (torch wants that) while
    reads share the tmpfs pages; the daemon may unlink the file while the arrays live.

    ``pin`` takes a shared ``flock`` on the file for as long as the map lives (the mmap keeps
    a duplicate of the descriptor, and a flock belongs to the open file, so the lock goes
    when the last array over this map is freed). The daemon tries an exclusive lock before
    it frees a consumed batch: a file still mapped keeps counting against the byte bound.
    A file the daemon has already retired raises FileNotFoundError, like a missing one.

    ``unmap_in_background``: once the arrays are freed, the mapping is closed on a background
    thread (prefetchd_client.unmapper), not in the thread that dropped the last of them.
    """
    # os.open, not open(): no buffered file object on a path that runs for every batch.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if pin:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # the daemon holds it this instant: it is freeing it
                raise FileNotFoundError(errno.ENOENT, "batch is being retired", str(path)) from None
        st = os.fstat(fd)
        if pin and st.st_nlink == 0:  # freed between our open and our lock
            raise FileNotFoundError(errno.ENOENT, "batch was retired", str(path))
        size = st.st_size
        if size < PREAMBLE.size:
            raise _fail(f"{path}: {size} bytes, shorter than the {PREAMBLE.size}-byte preamble")
        buf = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the map keeps its own duplicate, and with it the lock
    header = parse_header(buf, size)
    # One buffer export for the whole file, then a view per field: cheaper than a
    # frombuffer per field. Offsets are multiples of 64, so every view is aligned.
    whole = np.frombuffer(buf, dtype=np.uint8)
    if unmap_in_background:
        UNMAPPER.adopt(whole, buf)
    arrays = {}
    for f in header["fields"]:
        start = f["offset"]
        arrays[f["name"]] = whole[start : start + f["nbytes"]].view(f["dtype"]).reshape(f["shape"])
    return header, arrays
