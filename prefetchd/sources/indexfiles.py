"""The index's files in the job folder: written part by part, read row by row.

An index of 10^8 samples is gigabytes (a container's sample is an offset, a size and a label:
24 bytes, plus its kind). The master never holds it whole: IndexWriter appends each source's
parts (a shard's rows, a folder's files) to one ``.npy`` file per column as they are indexed,
and writes each header, which must give the final shape, at the end into the room kept for
it. Workers do not map the files either: a mapped page touched stays in the process's RSS,
and a worker touching random samples for an epoch would come to hold every page of the
index. ColumnFile reads the rows a sample needs with one ``pread`` each (1.5 us, against
8.8 us for a row of a numpy memmap), so the index lives once per node, in the tmpfs, in the
page cache that every process of the job shares.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from prefetchd.sources.places import FILE

# The files of an index: a sample's label, and where it lies: its place (a file of its own or
# a container) named by ``paths`` and ``offsets``; in containers, also its kind and its row of
# ``members`` (where in the container), and ``starts``, the first sample of each place.
FILE_COLUMNS = ("paths.npy", "offsets.npy", "labels.npy")
CONTAINER_COLUMNS = ("kinds.npy", "members.npy", "starts.npy")
_LAYOUT = {  # each column's type and row width (0: one value a row)
    "paths.npy": ("|u1", 0),
    "offsets.npy": ("<i8", 0),
    "labels.npy": ("<i8", 0),
    "kinds.npy": ("|u1", 0),
    "members.npy": ("<i8", 2),
    "starts.npy": ("<i8", 0),
}
OBJECTS_FILE = "objects.json"  # {url: [size, etag, modified]}: each object in a store as indexed (sources.objects)
HEADER_BYTES = 128  # room for an .npy header of any shape this index has, written last
_DTYPES = {"<i8": "q", "|u1": "B"}  # the columns' types: int64 and uint8, as struct formats
_CHUNK_ROWS = 1 << 20  # rows written or hashed at a time: memory per step, not per index


class ColumnFile:
    """One column of a saved index, read with ``pread`` (see the module docstring). Indexing as
    a numpy array's: an int gives a Python int (a 1-d column) or a tuple (a row of a 2-d one),
    a slice gives an array; ``np.asarray`` reads it whole."""

    def __init__(self, path: Path):
        # Opened without blocking: a FIFO planted under the name is refused, not waited on.
        self._file = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb", buffering=0)
        try:
            st = os.fstat(self._file.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if np.lib.format.read_magic(self._file) == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(self._file)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(self._file)
            if fortran or dtype.str not in _DTYPES or not 1 <= len(shape) <= 2:
                raise ValueError(f"{path} is not an index column (int64 or uint8, 1 or 2 dimensions)")
            self.offset, self.shape, self.dtype = self._file.tell(), shape, dtype
            self._row = struct.Struct("<" + _DTYPES[dtype.str] * (shape[1] if len(shape) == 2 else 1))
            if st.st_size != self.offset + self._row.size * shape[0]:
                raise ValueError(f"{path} holds {st.st_size} bytes, not the {shape} its header declares")
        except BaseException:
            self._file.close()
            raise
        self._fd, self._width = self._file.fileno(), len(shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self._row.size * self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("an index column is read in runs: step 1 only")
            return self._rows(start, max(stop - start, 0))
        i = int(key)  # numpy integers too
        if not -self.shape[0] <= i < self.shape[0]:
            raise IndexError(f"row {i} of a column of {self.shape[0]}")
        i %= self.shape[0]
        row = self._row.unpack(os.pread(self._fd, self._row.size, self.offset + i * self._row.size))
        return row if self._width == 2 else row[0]

    def __array__(self, dtype=None, copy=None):
        whole = self._rows(0, self.shape[0])
        return whole if dtype is None else whole.astype(dtype)

    def chunks(self):
        """The column's bytes in order, a chunk at a time (for a digest)."""
        for start in range(0, self.shape[0], _CHUNK_ROWS):
            n = min(_CHUNK_ROWS, self.shape[0] - start)
            yield os.pread(self._fd, n * self._row.size, self.offset + start * self._row.size)

    def _rows(self, start: int, n: int) -> np.ndarray:
        data = os.pread(self._fd, n * self._row.size, self.offset + start * self._row.size)
        if len(data) != n * self._row.size:
            raise ValueError("an index column was cut short while it was read")
        return np.frombuffer(data, self.dtype).reshape((n, *self.shape[1:]))


def column_chunks(column) -> Iterator[bytes]:
    """A column's bytes in order, a chunk at a time: a ColumnFile's preads or an array's rows."""
    if isinstance(column, ColumnFile):
        yield from column.chunks()
        return
    column = np.ascontiguousarray(column)
    for start in range(0, len(column), _CHUNK_ROWS):
        yield column[start : start + _CHUNK_ROWS].tobytes()


class ColumnWriter:
    """A column file written row after row, its header (and so its shape) last."""

    def __init__(self, path: Path, dtype: str, width: int = 0):
        self.path, self.dtype, self.width, self.rows = path, np.dtype(dtype), width, 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        self._file = open(os.open(path, flags, 0o600), "wb")
        self._file.seek(HEADER_BYTES)

    def append(self, values) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self._file.write(values.tobytes())
        self.rows += len(values)

    def append_constant(self, value: int, rows: int) -> None:
        for start in range(0, rows, _CHUNK_ROWS):
            n = min(_CHUNK_ROWS, rows - start)
            self.append(np.full((n, self.width) if self.width else n, value, self.dtype))

    def finish(self) -> None:
        if self._file.closed:
            return
        shape = (self.rows, self.width) if self.width else (self.rows,)
        header = repr({"descr": self.dtype.str, "fortran_order": False, "shape": shape}).encode("latin1")
        # magic, version 1.0, the header's length, then the header padded with spaces to a newline
        head = b"\x93NUMPY\x01\x00" + struct.pack("<H", HEADER_BYTES - 10) + header
        self._file.seek(0)
        self._file.write(head.ljust(HEADER_BYTES - 1) + b"\n")
        self._file.close()

    def close(self) -> None:
        self._file.close()


class IndexWriter:
    """An index written to ``folder`` part by part (SampleIndex parts, each a source's or a
    shard's samples, in sample order): no more than one part is in memory. Files-only parts
    keep the files-only layout; from the first container on, every column is written (the
    samples before it given kind FILE, no member, and a place each)."""

    def __init__(self, folder: Path):
        folder.mkdir(mode=0o700, exist_ok=True)
        self.folder, self.samples, self.objects = folder, 0, {}
        self.max_label = -1  # the classes are 0..max_label, as far as the labels tell
        self._columns = {name: ColumnWriter(folder / name, *_LAYOUT[name]) for name in FILE_COLUMNS}
        self._columns["offsets.npy"].append([0])
        self._path_bytes = 0

    @property
    def containers(self) -> bool:
        return "kinds.npy" in self._columns

    def add(self, part) -> None:
        """Append a SampleIndex's samples (an in-memory part)."""
        if part.kinds is not None and not self.containers:
            self._begin_containers()
        places = len(part.offsets) - 1
        c = self._columns
        c["paths.npy"].append(part.paths)
        c["offsets.npy"].append(np.asarray(part.offsets[1:]) + self._path_bytes)
        c["labels.npy"].append(part.labels)
        if self.containers:
            if part.kinds is None:  # files of their own: a place each
                c["kinds.npy"].append_constant(FILE, len(part))
                c["members.npy"].append_constant(-1, len(part))
                c["starts.npy"].append(np.arange(1, places + 1, dtype=np.int64) + self.samples)
            else:
                c["kinds.npy"].append(part.kinds)
                c["members.npy"].append(part.members)
                c["starts.npy"].append(np.asarray(part.starts[1:]) + self.samples)
        self._path_bytes += len(part.paths)
        self.samples += len(part)
        if len(part):
            self.max_label = max(self.max_label, int(np.max(part.labels)))
        self.objects.update(part.objects or {})

    def finish(self) -> None:
        for column in self._columns.values():
            column.finish()
        if self.objects:
            (self.folder / OBJECTS_FILE).write_text(json.dumps(self.objects))

    def close(self) -> None:
        """Close what is open (finished or not: a failed start leaves its files to the job
        folder's cleanup)."""
        for column in self._columns.values():
            column.close()

    def _begin_containers(self) -> None:
        places = self._columns["offsets.npy"].rows - 1
        for name in CONTAINER_COLUMNS:
            self._columns[name] = ColumnWriter(self.folder / name, *_LAYOUT[name])
        self._columns["kinds.npy"].append_constant(FILE, self.samples)
        self._columns["members.npy"].append_constant(-1, self.samples)
        self._columns["starts.npy"].append(np.arange(places + 1, dtype=np.int64))  # the files before: a place each
