"""The batch file: one finished batch, readable without the daemon.

Layout (format version 3; all integers little-endian)::

    offset        size   content
    0             8      magic  b"PFDBATCH"
    8             4      u32    format version (3)
    12            4      u32    T, length of the field table in bytes
    16            4      u32    M, length of the meta object in bytes
    20            4      u32    0 (reserved)
    24            8      u64    epoch
    32            8      u64    step
    40            8      u64    rank
    48            T      field table, UTF-8 JSON (below): the same bytes in every batch of a job
    48+T          M      meta, UTF-8 JSON object (below)
    48+T+M        ...    zero padding up to the first field
    offset_i      n_i    field i: C-contiguous array data, offset_i a multiple of 64
    ...           ...    zero padding up to a multiple of 4096 bytes (whole pages)

The field table and the meta object::

    [{"name": "image", "dtype": "uint8", "shape": [B, H, W, 3], "offset": 4096}, ...]
    {"config_hash": "...", "xxh3_64": "16 hex digits", "sources": {...}, "replaced": [...]}

``xxh3_64`` is ``content_digest``, named by its algorithm: version 2 had zlib's CRC-32 there,
under ``crc32``, and a reader never compares digests of two algorithms.

Why binary numbers and a separate table (version 1 had one JSON header): a reader maps a
batch per training step, and the table is what it must check before touching any field.
A table byte-equal to the last one checked passes the same checks, so the reader compares
T bytes instead of parsing JSON; the meta object is parsed only when asked for (verify mode,
tools), not on the training path.

A writer reserves a header area of ``data_start`` bytes (4096 with the default layout), so
the header can be written after the pixels, and the first field is page-aligned for mapping.

The parser checks, before it touches any field, and raises BatchFormatError otherwise:
file at least 48 bytes; magic; version; reserved word 0; 2 <= T, 2 <= M, T + M <=
MAX_HEADER_BYTES and 48 + T + M <= file size; epoch/step/rank below 2**63; the table is a
UTF-8 JSON list of 1..MAX_FIELDS fields, each with a unique name (1-64 chars), a dtype from
ALLOWED_DTYPES, a shape of at most MAX_DIMS non-negative integers whose product, zeros left
out, times the item size is within the file size (so a shape like [0, 2**70], empty but past
numpy's limits, is refused too), an integer offset that is a multiple of FIELD_ALIGN, not
inside the header, and an extent (offset + size) within the file; extents do not overlap.
JSON nested too deep for the parser is the same error. The meta object, when first read
(``header["meta"]``), must be a UTF-8 JSON object, else the same error. ``map_batch`` opens
the file without following a symlink and without blocking (a FIFO named like a batch would
block ``open`` forever), and maps only a regular file.

What the checks cannot stop: a process of the same user that truncates a batch file while a
trainer maps it. The trainer's next touch of a page past the new end gets SIGBUS, which kills
it. A tmpfs file cannot be sealed against shrinking (F_ADD_SEALS is for memfd files only: on a
file opened by name it fails with EPERM), and the signal cannot be caught usefully: it arrives
inside numpy's or torch's C code at the faulting load, and a Python handler runs only between
bytecodes, after that code returns, which it never does. The only sure protection is copying
every batch out of the file before use, the cost the zero-copy mapping exists to avoid. The
job folder is 0700 and the files 0600, so no other user can do this; the daemon itself never
truncates a published batch, and overwrites a consumed one (as a spare for a later batch) only
once no client holds its shared lock (``map_batch``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from . import pagetables
from .errors import BatchFormatError
from .unmapper import UNMAPPER

MAGIC = b"PFDBATCH"
VERSION = 3
PREAMBLE = struct.Struct("<8sIIIIQQQ")  # magic, version, T, M, reserved, epoch, step, rank
MAX_POSITION = 2**63 - 1  # epoch, step and rank; more is a broken or hostile file
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

    @cached_property
    def table_bytes(self) -> bytes:
        """The field table as written: the same bytes for every batch of this layout."""
        fields = [dict(f.to_json(), offset=o) for f, o in zip(self.fields, self.offsets)]
        return json.dumps(fields, separators=(",", ":")).encode()

    def meta_fits(self, meta: dict) -> bool:
        """Whether ``meta`` fits the header area beside the preamble and the field table."""
        return PREAMBLE.size + len(self.table_bytes) + len(_meta_bytes(meta)) <= self.data_start

    def header_bytes(self, epoch: int, step: int, rank: int, meta: dict | None = None) -> bytes:
        """Preamble, field table and meta: everything before the first field."""
        table = self.table_bytes
        data = _meta_bytes(meta or {})
        size = PREAMBLE.size + len(table) + len(data)
        if size > self.data_start:
            raise ValueError(f"batch header of {size} bytes does not fit the {self.data_start}-byte header area")
        return PREAMBLE.pack(MAGIC, VERSION, len(table), len(data), 0, epoch, step, rank) + table + data


def _meta_bytes(meta: dict) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


DIGEST_KEY = "xxh3_64"  # the meta key of content_digest


def content_digest(arrays: dict[str, np.ndarray], fields) -> str:
    """XXH3-64 of the fields' bytes in layout order, as 16 hex digits: recorded as
    ``meta[DIGEST_KEY]`` by the daemon, so the client's verify mode can tell a torn or corrupted
    batch, and a regenerated batch can be compared with a published one cheaply. A check
    against accidents, not attacks (whoever can write the job directory can write a matching
    digest too). XXH3 because it runs at memory speed: four times zlib's CRC-32 and twice a
    hardware CRC32C on a 4.8 MB batch here (docs/benchmarks.md). Hex, not a JSON number: a
    64-bit integer loses its low bits in readers that hold numbers as doubles (JavaScript, jq)."""
    hasher = require_digest().xxh3_64()
    for f in fields:
        name = f.name if isinstance(f, FieldSpec) else f["name"]
        hasher.update(np.ascontiguousarray(arrays[name]))
    return hasher.hexdigest()


def require_digest():
    """The module ``content_digest`` needs; ImportError, naming what to install, without it.

    Imported here: the client's hard dependencies are numpy and pyzmq, and of the client only
    its verify mode needs a digest (the daemon depends on xxhash)."""
    try:
        import xxhash
    except ImportError:
        raise ImportError("batch digests need xxhash (the client's [verify] extra): pip install xxhash") from None
    return xxhash


def _fail(msg: str) -> BatchFormatError:
    return BatchFormatError(f"invalid batch file: {msg}")


def _nonneg_int(v, what: str) -> int:
    if type(v) is not int or v < 0:
        raise _fail(f"{what} must be a non-negative integer, got {v!r:.40}")
    return v


# The itemsize of each allowed dtype, looked up once: the parser runs on every batch a trainer
# reads, and np.dtype() per field would cost more than the rest of the checks.
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


class BatchHeader(dict):
    """A parsed header: ``epoch``, ``step``, ``rank`` and ``fields`` (each with ``nbytes``
    added), checked; ``meta`` is parsed on first access. Treat it as read-only: the field list
    is shared with the parser's memo."""

    def __init__(self, epoch: int, step: int, rank: int, fields: list, meta_bytes: bytes):
        super().__init__(epoch=epoch, step=step, rank=rank, fields=fields)
        self._meta_bytes = meta_bytes

    def __missing__(self, key):
        if key != "meta":
            raise KeyError(key)
        try:
            meta = json.loads(self._meta_bytes.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _fail(f"meta is not UTF-8 JSON ({type(exc).__name__}: {exc})") from None
        if type(meta) is not dict:
            raise _fail("meta must be an object")
        self["meta"] = meta
        return meta


def parse_header(buf, size: int) -> BatchHeader:
    """Validate the preamble and field table of a batch held in ``buf`` (``size`` bytes).

    Raises only BatchFormatError (``meta`` too, when it is read).
    """
    if size < PREAMBLE.size:
        raise _fail(f"{size} bytes, shorter than the {PREAMBLE.size}-byte preamble")
    magic, version, tlen, mlen, reserved, epoch, step, rank = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _fail(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _fail(f"format version {version}, this reader understands {VERSION}")
    if reserved or not (tlen >= 2 and mlen >= 2 and tlen + mlen <= MAX_HEADER_BYTES):
        raise _fail(f"field table ({tlen} bytes) or meta ({mlen} bytes) length out of range")
    data_floor = PREAMBLE.size + tlen + mlen
    if data_floor > size:
        raise _fail(f"header of {data_floor} bytes runs past the end of the {size}-byte file")
    if max(epoch, step, rank) > MAX_POSITION:
        raise _fail(f"epoch/step/rank {epoch}/{step}/{rank} out of range")
    table = bytes(buf[PREAMBLE.size : PREAMBLE.size + tlen])
    meta = bytes(buf[PREAMBLE.size + tlen : data_floor])
    memo = _last_fields
    # Every batch of a job has the same table: one byte-equal to the last table checked passes
    # the same checks, but for the two that depend on this file (header length, size).
    if memo is not None and table == memo.table and memo.first_offset >= data_floor and memo.end <= size:
        return BatchHeader(epoch, step, rank, memo.fields, meta)
    try:
        fields = json.loads(table.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: [[[[...
        raise _fail(f"field table is not UTF-8 JSON ({type(exc).__name__}: {exc})") from None
    _check_fields(fields, data_floor, size)
    _remember_fields(table, fields)
    return BatchHeader(epoch, step, rank, fields, meta)


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
        nbytes = _field_nbytes(name, itemsize, shape, size)
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


def _field_nbytes(name: str, itemsize: int, shape: list, size: int) -> int:
    """The bytes of a field of ``shape``. Every dimension, and their product with zeros left out,
    must fit the file: numpy refuses (ValueError) a shape such as [0, 2**70] although it holds
    no byte, and a reader must raise only BatchFormatError."""
    nbytes = bound = itemsize
    for d in shape:
        nbytes *= _nonneg_int(d, f"field {name!r} dimension")
        bound *= d or 1
        if bound > size:
            raise _fail(f"field {name!r}: shape {shape!r:.80} runs past the end of the {size}-byte file")
    return nbytes


@dataclass(frozen=True)
class _CheckedFields:
    table: bytes  # the field table as written
    fields: list  # as parsed and checked, nbytes added
    first_offset: int  # the checks that depend on the file: first_offset >= 48 + T + M, end <= size
    end: int


_last_fields: _CheckedFields | None = None


def _remember_fields(table: bytes, checked: list) -> None:
    global _last_fields
    # One assignment: a reader in another thread sees the old memo or the new, whole.
    _last_fields = _CheckedFields(
        table,
        checked,
        min(f["offset"] for f in checked),
        max(f["offset"] + f["nbytes"] for f in checked),
    )


def _open_regular_file(path: str | os.PathLike, pin: bool) -> tuple[int, os.stat_result]:
    """A descriptor of the batch file at ``path``, which must be a regular file, not a symlink,
    and its fstat, taken after the shared lock when ``pin`` (map_batch says why).

    Anyone who can write the job folder can plant a name: a FIFO would block a plain open()
    until a writer comes (forever, in the read-ahead thread, after the trainer's BatchTimeout),
    so O_NONBLOCK; a symlink could point anywhere, so O_NOFOLLOW. FileNotFoundError as for a
    missing file; BatchFormatError for anything else that is not a regular file.
    """
    # os.open, not open(): no buffered file object on a path that runs for every batch.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _fail(f"{path} is a symbolic link, not a batch; something other than prefetchd made it") from None
        raise
    try:
        if pin:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # the daemon holds it this instant: it is freeing it
                raise FileNotFoundError(errno.ENOENT, "batch is being retired", str(path)) from None
        st = os.fstat(fd)  # after the lock: the identity must be the locked file's
        if not stat.S_ISREG(st.st_mode):
            raise _fail(f"{path} is not a regular file (mode {st.st_mode:o}); something other than prefetchd made it")
        if pin and not _still_named(path, st):
            raise FileNotFoundError(errno.ENOENT, "batch was retired", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _still_named(path: str | os.PathLike, st: os.stat_result) -> bool:
    """Whether ``path`` still leads to the file ``st`` describes. Checked under the shared lock:
    the daemon may have retired the file between our open and our lock, and once no client
    locked it, freed it or handed it to a worker as a spare to overwrite with another batch
    (prefetchd.master.retire). It takes a file back only under an exclusive lock, so a file
    still named here after our lock stays this batch for as long as we hold it."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)


def map_batch(
    path: str | os.PathLike, *, pin: bool = True, unmap_in_background: bool = False, populate: bool = False
) -> tuple[dict, dict[str, np.ndarray]]:
    """Map a batch file and return (header, arrays) without copying the data.

    The map is private copy-on-write: the arrays are writable (torch wants that) while
    reads share the tmpfs pages; the daemon may unlink the file while the arrays live.

    ``pin`` takes a shared ``flock`` on the file for as long as the map lives (the mmap keeps
    a duplicate of the descriptor, and a flock belongs to the open file, so the lock goes
    when the last array over this map is freed). The daemon tries an exclusive lock before
    it frees or reuses a consumed batch's file: a file still mapped keeps counting against
    the byte bound, and is never overwritten. A file the daemon has already retired raises
    FileNotFoundError, like a missing one; a symlink, FIFO or anything else but a regular
    file raises BatchFormatError, at once. Map a file a daemon serves only with ``pin``:
    unpinned, its pages may be overwritten by a later batch under the map.

    ``unmap_in_background``: once the arrays are freed, the mapping is closed on a background
    thread (prefetchd_client.unmapper), not in the thread that dropped the last of them.
    ``populate``: the page-table entries of a valid batch are made now, in this thread, rather
    than by the page faults of whichever thread first reads it (prefetchd_client.pagetables).
    """
    fd, st = _open_regular_file(path, pin)
    try:
        size = st.st_size
        if size < PREAMBLE.size:
            raise _fail(f"{path}: {size} bytes, shorter than the {PREAMBLE.size}-byte preamble")
        buf = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the map keeps its own duplicate, and with it the lock
    header = parse_header(buf, size)
    if populate:
        pagetables.populate(buf)
    # One buffer export for the whole file, then a view per field: cheaper than a
    # frombuffer per field. Offsets are multiples of 64, so every view is aligned.
    whole = np.frombuffer(buf, dtype=np.uint8)
    if unmap_in_background:
        UNMAPPER.adopt(whole, buf)
    return header, _field_views(whole, header)


def read_batch(data) -> tuple[BatchHeader, dict[str, np.ndarray]]:
    """(header, arrays) of a whole batch file held in memory (bytes, or a uint8 array), checked
    like a mapped one; the arrays are views of ``data``. BatchFormatError when it is no batch."""
    whole = np.frombuffer(data, dtype=np.uint8)
    header = parse_header(whole, whole.size)
    return header, _field_views(whole, header)


def _field_views(whole: np.ndarray, header: BatchHeader) -> dict[str, np.ndarray]:
    arrays = {}
    for f in header["fields"]:
        start = f["offset"]
        arrays[f["name"]] = whole[start : start + f["nbytes"]].view(f["dtype"]).reshape(f["shape"])
    return arrays
