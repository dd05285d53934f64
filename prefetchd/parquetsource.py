"""Parquet files as a source: one sample per row, its image the encoded bytes in a column.

The index is built from each file's footer and its label column alone, never its images, so
indexing costs a read of the labels. pyarrow reads no less than a row group: a worker reads a
row from its data page instead where parquetpages can (nearly every image column), and
otherwise reads the row group's image column whole (for a Hugging Face ``Image`` struct only
its ``bytes`` child) and keeps recent ones in a byte-bounded LRU. pyarrow is an optional extra,
imported only here (and by parquetpages to decompress) and only when a Parquet source is used.

No file is opened before a stat says it is a regular file, and the open itself is O_NONBLOCK:
a FIFO planted under a ``.parquet`` name would otherwise block its reader forever.
"""

from __future__ import annotations

import glob
import os
import stat
from collections import OrderedDict

import numpy as np

from . import stopsignals
from .errors import ConfigError, DataError
from .parquetpages import ColumnChunk, Unsupported
from .sources import NO_LABEL, PARQUET_ROW, SampleIndex, open_data_file

CACHE_BYTES = 64 << 20  # decoded image columns of row groups kept per reader
OPEN_FILES = 32  # open ParquetFile objects kept per reader
_CHUNKS = 4096  # page tables kept per reader (a few hundred bytes each)
_IMAGE_TYPES = "binary, large_binary, or a struct with a binary 'bytes' field (Hugging Face datasets' Image)"


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "[[source]] kind = \"parquet\" needs pyarrow, which is not installed: pip install 'prefetchd[parquet]'"
        ) from None
    return pa, pq


def _arrow_failures(pa) -> tuple:
    # What a damaged file makes pyarrow raise: any ArrowException, an OSError (a footer it cannot
    # deserialize) or a UnicodeDecodeError (a column name that is not UTF-8).
    return pa.ArrowException, OSError, ValueError


def _shown(path: str) -> str:
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


class _Unreadable(Exception):
    """Why a file cannot be opened as Parquet, worded to follow its path."""


def _open(path: str):
    """(ParquetFile, identity) of ``path``, or _Unreadable.

    The fd opened here is fstat'ed again (the file may have been swapped since the stat) and
    pyarrow opens that very inode through /proc/self/fd. Without /proc it opens the path, checked
    a moment before: a race only a hostile writer could win.
    """
    pa, pq = _pyarrow()
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
            raise _Unreadable(f"is {kind}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _Unreadable("does not exist (or is a symlink to nothing)") from None
    except OSError as exc:
        raise _Unreadable(f"cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Unreadable("is not a regular file")
        via_fd = f"/proc/self/fd/{fd}"
        try:
            pf = pq.ParquetFile(via_fd if os.path.exists(via_fd) else path)
            pf.schema_arrow  # noqa: B018 -- parsed now, so that a damaged schema fails here
        except _arrow_failures(pa) as exc:
            raise _Unreadable(f"is not a readable Parquet file ({_first_line(exc)})") from None
        return pf, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


def parquet_files(path: str, where: str) -> list[str]:
    """The files ``path`` names: itself, a folder's ``*.parquet`` (not recursive), or a glob's
    matches; in the order of their path bytes. Hidden names are skipped, as a glob ``*`` skips them."""
    if os.path.isdir(path):
        files = glob.glob(os.path.join(glob.escape(path), "*.parquet"))
        if not files:
            raise DataError(f"{where}: folder {_shown(path)} has no *.parquet file; set path to a file, folder or glob")
    elif os.path.lexists(path) or not glob.has_magic(path):
        files = [path]  # a name with [ in it that exists is that file, not a pattern
    else:
        files = glob.glob(path)
        if not files:
            raise DataError(f"{where}: no file matches {_shown(path)}; set path to a file, folder or glob")
    return sorted(files, key=os.fsencode)


def scan_parquet(src: dict, where: str) -> SampleIndex:
    """Index a ``kind = "parquet"`` source: every row of every file, files in path order."""
    image_column, label_column = src["image_column"], src["label_column"]
    files, counts, members, labels = [], [], [], []
    for path in parquet_files(src["path"], where):
        stopsignals.check_starting()  # a stop during a long indexing need not wait for its end
        groups, file_labels = _scan_file(path, image_column, label_column, f"{where}: {_shown(path)}")
        if len(file_labels):
            files.append(path)
            counts.append(len(file_labels))
            # (row group, row within it) for every row, without a Python loop over the rows
            group_of_row = np.repeat(np.arange(len(groups), dtype=np.int64), groups)
            first_row = (np.cumsum(groups) - groups)[group_of_row]
            members.append(np.stack([group_of_row, np.arange(len(file_labels)) - first_row], axis=1))
            labels.append(file_labels)
    if not files:
        raise DataError(f"{where}: the Parquet file(s) at {_shown(src['path'])} hold no rows; point path at the data")
    return SampleIndex.in_containers(files, counts, PARQUET_ROW, np.concatenate(members), np.concatenate(labels))


def _scan_file(path: str, image_column: str, label_column: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The rows of each row group and every row's label (NO_LABEL for a null one)."""
    pa, _ = _pyarrow()
    try:
        pf, _ = _open(path)
    except _Unreadable as exc:
        raise DataError(f"{what} {exc}; remove it or fix path in [[source]]") from None
    with pf:
        schema, meta = pf.schema_arrow, pf.metadata
        image_type = _field(schema, image_column, "image_column", what).type
        if _image_read_as(pa, schema, image_column) is None:
            raise DataError(
                f"{what}: image_column {image_column!r} is {image_type}, not {_IMAGE_TYPES}; "
                "set image_column to the column of encoded images"
            )
        label_type = _field(schema, label_column, "label_column", what).type
        if not pa.types.is_integer(label_type):
            raise DataError(
                f"{what}: label_column {label_column!r} is {label_type}, not an integer type; labels must be "
                "class indices 0..N-1 (map class names to integers first), or set label_column"
            )
        groups = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)
        try:
            column = pf.read(columns=[label_column]).column(0).combine_chunks()
        except _arrow_failures(pa) as exc:
            raise DataError(f"{what}: cannot read label_column {label_column!r}: {_first_line(exc)}") from None
    if len(column) != groups.sum():
        raise DataError(f"{what}: its footer counts {groups.sum()} rows but the label column has {len(column)}")
    return groups, _labels(column, groups, what)


def _field(schema, name: str, key: str, what: str):
    if schema.get_field_index(name) < 0:  # missing, or there twice
        shown = ", ".join(repr(n) for n in schema.names[:20]) + (" ..." if len(schema.names) > 20 else "")
        raise DataError(f"{what} has no single column {name!r} (it has {shown}); set {key} in [[source]]")
    return schema.field(name)


def _image_read_as(pa, schema, column: str) -> str | None:
    """What to ask pyarrow for to get ``column``'s encoded images: the column itself, or only the
    ``bytes`` child of a Hugging Face Image struct (its ``path`` is never read); None if neither."""
    index = schema.get_field_index(column)  # -1: missing, or there twice
    t = schema.field(index).type if index >= 0 else None
    if t is not None and pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        column, t = f"{column}.bytes", t.field("bytes").type
    return column if t is not None and (pa.types.is_binary(t) or pa.types.is_large_binary(t)) else None


def _labels(column, groups: np.ndarray, what: str) -> np.ndarray:
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    values = column.fill_null(0).to_numpy()
    bad = np.flatnonzero(values < 0) if values.dtype.kind == "i" else np.flatnonzero(values > np.iinfo(np.int64).max)
    if len(bad):
        row = int(bad[0])
        group = int(np.searchsorted(np.cumsum(groups), row, side="right"))
        raise DataError(
            f"{what}: row {row} (row group {group}) has label {values[row]}; labels must be class indices "
            f"from 0 to 2**63-1 ({len(bad)} row(s) are not): fix the labels in the file"
        )
    labels = values.astype(np.int64)
    labels[nulls] = NO_LABEL
    return labels


class ParquetRows:
    """A worker's reader of Parquet rows: open files and recent row groups' images kept.

    ``cached_bytes`` (row groups read whole, decoded dictionaries) stays at most ``cache_bytes``,
    save when one row group alone is bigger: that one is kept on its own, since reading it again
    for each of its rows would cost far more.
    A file found changed (by its inode, size or mtime) when a row group is read is opened again
    and its cached row groups dropped; until then, cached row groups serve what was read.
    """

    def __init__(self, cache_bytes: int = CACHE_BYTES, open_files: int = OPEN_FILES, pages: bool = True):
        """``pages``: read a row from its data page where parquetpages can (False: row groups only)."""
        self.cache_bytes, self.pages = cache_bytes, pages
        self.open_files = open_files
        self.cached_bytes = 0
        self._groups: OrderedDict[tuple[str, str, int], object] = OrderedDict()  # -> a binary pyarrow Array
        # path -> (ParquetFile, identity, {column: read as}, fd for parquetpages or None)
        self._files: OrderedDict[str, tuple] = OrderedDict()
        # (path, column, row group) -> its pages, or None: read the row group whole
        self._chunks: OrderedDict[tuple[str, str, int], ColumnChunk | None] = OrderedDict()
        # the chunks holding a decoded dictionary (counted in cached_bytes), oldest first
        self._dictionaries: OrderedDict[tuple[str, str, int], ColumnChunk] = OrderedDict()

    def read(self, path: str, row_group: int, row: int, column: str) -> bytes:
        """The encoded image in ``column`` at ``row`` of ``row_group``; ValueError if there is none.
        From its data page alone where parquetpages reads the column; else from its row group."""
        key = (path, column, row_group)
        images = self._groups.get(key)
        if images is None:
            chunk = self._chunk(path, row_group, column) if self.pages else None
            if chunk is not None:
                try:
                    return self._page_value(chunk, path, row_group, row, column)
                except Unsupported:
                    self._chunks[key] = None  # this chunk is read whole from now on
            images = self._load(path, row_group, column)
        else:
            self._groups.move_to_end(key)
        if not 0 <= row < len(images):
            raise ValueError(f"{_shown(path)}: row {row} is out of range: row group {row_group} has {len(images)} rows")
        value = images[row].as_py()
        if value is None:
            raise ValueError(f"{_shown(path)}: null image in column {column!r} (row group {row_group}, row {row})")
        return value

    def _page_value(self, chunk: ColumnChunk, path: str, row_group: int, row: int, column: str) -> bytes:
        if not 0 <= row < chunk.rows:
            raise ValueError(f"{_shown(path)}: row {row} is out of range: row group {row_group} has {chunk.rows} rows")
        held = chunk.dictionary_bytes
        value = chunk.value(row)
        if chunk.dictionary_bytes != held:  # a dictionary decoded: it counts against the cache's bound
            self._make_room(chunk.dictionary_bytes)
            self._dictionaries[(path, column, row_group)] = chunk
            self.cached_bytes += chunk.dictionary_bytes
        if value is None:
            raise ValueError(f"{_shown(path)}: null image in column {column!r} (row group {row_group}, row {row})")
        return value

    def _make_room(self, size: int) -> None:
        """Drop the least recently cached row groups, then decoded dictionaries, until ``size`` fits."""
        while self.cached_bytes + size > self.cache_bytes and (self._groups or self._dictionaries):
            if self._groups:
                self.cached_bytes -= self._groups.popitem(last=False)[1].get_total_buffer_size()
            else:
                self._drop_dictionary(next(iter(self._dictionaries)))

    def _drop_dictionary(self, key: tuple) -> None:
        chunk = self._dictionaries.pop(key)
        self.cached_bytes -= chunk.dictionary_bytes
        chunk.drop_dictionary()

    def _chunk(self, path: str, row_group: int, column: str) -> ColumnChunk | None:
        """The page table of the image column in this row group; None where pages are not read."""
        key = (path, column, row_group)
        if key in self._chunks:
            self._chunks.move_to_end(key)
            self._file(path)  # a changed file drops its chunks (_forget)
            if key in self._chunks:
                return self._chunks[key]
        pa, _ = _pyarrow()
        pf, _, read_as, fd = self._file(path)
        chunk = None
        if fd is not None and 0 <= row_group < pf.metadata.num_row_groups:
            if column not in read_as:
                read_as[column] = _image_read_as(pa, pf.schema_arrow, column)
            leaf = [i for i in range(len(pf.schema)) if pf.schema.column(i).path == read_as[column]]
            if len(leaf) == 1:
                group = pf.metadata.row_group(row_group)
                try:
                    chunk = ColumnChunk(fd, group.column(leaf[0]), pf.schema.column(leaf[0]).max_definition_level,
                                        group.num_rows)
                except (Unsupported, OSError):
                    chunk = None
        self._chunks[key] = chunk
        if len(self._chunks) > _CHUNKS:
            old = next(iter(self._chunks))
            if old in self._dictionaries:
                self._drop_dictionary(old)
            del self._chunks[old]
        return chunk

    def _load(self, path: str, row_group: int, column: str):
        pa, _ = _pyarrow()
        pf, _, read_as, _ = self._file(path)
        groups = pf.metadata.num_row_groups
        if not 0 <= row_group < groups:
            raise ValueError(f"{_shown(path)}: row group {row_group} is out of range: the file has {groups} now")
        if column not in read_as:
            read_as[column] = _image_read_as(pa, pf.schema_arrow, column)
        if read_as[column] is None:
            raise ValueError(f"{_shown(path)}: no image column {column!r} of {_IMAGE_TYPES} in it now")
        try:  # use_threads=False: one column, and a worker process has no cores to spare
            table = pf.read_row_group(row_group, columns=[read_as[column]], use_threads=False)
            images = table.column(0).combine_chunks()
        except _arrow_failures(pa) as exc:
            raise ValueError(f"{_shown(path)}: cannot read row group {row_group}: {_first_line(exc)}") from None
        if pa.types.is_struct(images.type):
            images = images.flatten()[0]  # flatten, not .field(): a null struct makes its bytes null too
        size = images.get_total_buffer_size()
        self._make_room(size)
        self._groups[(path, column, row_group)] = images
        self.cached_bytes += size
        return images

    def _file(self, path: str) -> tuple:
        """The open file at ``path``, opened again when the file there is no longer the one that
        was opened (replaced, rewritten or truncated); a stat per row group read, not per row."""
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ValueError(f"{_shown(path)} cannot be read ({exc.strerror}); it changed since indexing") from None
        entry = self._files.get(path)
        if entry is not None and entry[1] == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
            self._files.move_to_end(path)
            return entry
        self._forget(path)
        try:
            pf, identity = _open(path)
        except _Unreadable as exc:
            raise ValueError(f"{_shown(path)} {exc}; it changed since indexing") from None
        self._files[path] = entry = (pf, identity, {}, _page_fd(path, identity))
        if len(self._files) > self.open_files:
            self._forget(next(iter(self._files)))
        return entry

    def _forget(self, path: str) -> None:
        entry = self._files.pop(path, None)
        if entry is not None:
            _close(entry)
        for key in [k for k in self._groups if k[0] == path]:
            self.cached_bytes -= self._groups.pop(key).get_total_buffer_size()
        for key in [k for k in self._chunks if k[0] == path]:
            del self._chunks[key]
        for key in [k for k in self._dictionaries if k[0] == path]:
            self._drop_dictionary(key)

    def close(self) -> None:
        """Close every open file and drop every cached row group."""
        while self._files:
            _close(self._files.popitem()[1])
        self._groups.clear()
        self._chunks.clear()
        self._dictionaries.clear()
        self.cached_bytes = 0


def _page_fd(path: str, identity: tuple) -> int | None:
    """An fd of the very file pyarrow opened, for parquetpages' reads; None if it is gone or swapped."""
    try:
        fd, st = open_data_file(path)
    except (OSError, ValueError):
        return None
    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != identity:
        os.close(fd)
        return None
    return fd


def _close(entry: tuple) -> None:
    entry[0].close()
    if entry[3] is not None:
        os.close(entry[3])
