"""Parquet files as a source: one sample per row, its image the encoded bytes in a column.

The index is built from each file's footer and its label column alone, never its images, so
indexing costs a read of the labels. pyarrow reads no less than a row group: a worker reads a
row from its data page instead where parquetpages can (nearly every image column), and
otherwise reads the row group's image column whole (for a Hugging Face ``Image`` struct only
its ``bytes`` child) and keeps recent ones in a byte-bounded LRU. pyarrow is an optional extra,
imported only here (and by parquetpages to decompress) and only when a Parquet source is used.

``image_column`` and ``label_column`` name a top-level column exactly: a dotted name is never a
path into a struct (a Hugging Face Image struct is named as itself, and its ``bytes`` child is
found here). A column is read by the index of its Parquet leaf, never by pyarrow's ``columns=``,
which takes a name as a path prefix: "img.bytes" there is both a column of that name and the
child of a struct ``img``, and "label" takes in a column named "label.name" too.

No file is opened before a stat says it is a regular file, and the open itself is O_NONBLOCK:
a FIFO planted under a ``.parquet`` name would otherwise block its reader forever.
"""

from __future__ import annotations

import gc
import glob
import os
import stat
from collections import OrderedDict

import numpy as np

from prefetchd import stopsignals
from prefetchd.errors import ConfigError, DataError
from prefetchd.sources.index import NO_LABEL, PARQUET_ROW, SampleIndex, open_data_file
from prefetchd.sources.parquetpages import ColumnChunk, Damaged, Unsupported, column_leaf

CACHE_BYTES = 64 << 20  # decoded image columns of row groups kept per reader
OPEN_FILES = 32  # open ParquetFile objects kept per reader
# and at most this much of their footers (a few KB each, for real files): pyarrow holds ~8 times
# a footer's size, and 10**5 row groups of one row make a 25 MB footer (190 MB a file open).
FOOTER_BYTES = 4 << 20
_CHUNKS = 4096  # page tables kept per reader (a few hundred bytes each)
_IMAGE_TYPES = (
    "binary (large, view or dictionary-encoded too), or a struct with such a 'bytes' field (Hugging Face's Image)"
)


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
        if not _images_in(pa, image_type)[0]:
            raise DataError(
                f"{what}: image_column {image_column!r} is {image_type}, not {_IMAGE_TYPES}; "
                "set image_column to the column of encoded images"
            )
        if _image_leaf(pa, pf, image_column) is None:
            raise DataError(
                f"{what}: cannot tell which of its Parquet leaf columns holds image_column {image_column!r}"
            )
        label_type = _field(schema, label_column, "label_column", what).type
        if not pa.types.is_integer(label_type):
            raise DataError(
                f"{what}: label_column {label_column!r} is {label_type}, not an integer type; labels must be "
                "class indices 0..N-1 (map class names to integers first), or set label_column"
            )
        groups = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)
        leaf = column_leaf(pa, pf, label_column)
        if leaf is None:
            raise DataError(f"{what}: cannot tell which of its Parquet leaf columns is label_column {label_column!r}")
        try:
            table = pf.reader.read_all(column_indices=[leaf])
            column = table.column(0).combine_chunks()
        except _arrow_failures(pa) as exc:
            raise DataError(f"{what}: cannot read label_column {label_column!r}: {_first_line(exc)}") from None
        if table.schema.names != [label_column] or not pa.types.is_integer(column.type):
            raise DataError(
                f"{what}: label_column {label_column!r} read back as columns {table.schema.names!r} of "
                f"{[str(t) for t in table.schema.types]!r}, not one integer column"
            )
    if len(column) != groups.sum():
        raise DataError(f"{what}: its footer counts {groups.sum()} rows but the label column has {len(column)}")
    return groups, _labels(column, groups, what)


def _field(schema, name: str, key: str, what: str):
    if schema.get_field_index(name) < 0:  # missing, or there twice
        shown = ", ".join(repr(n) for n in schema.names[:20]) + (" ..." if len(schema.names) > 20 else "")
        raise DataError(
            f"{what} has no single column {name!r} (it has {shown}){_struct_field_hint(schema, name, key)}; "
            f"set {key} in [[source]]"
        )
    return schema.field(name)


def _struct_field_hint(schema, name: str, key: str) -> str:
    """Where ``name`` names a field of a struct column by its path, what to do instead."""
    pa, _ = _pyarrow()
    head, _, rest = name.rpartition(".")
    index = schema.get_field_index(head) if head else -1
    t = schema.field(index).type if index >= 0 else None
    if t is None or not pa.types.is_struct(t) or t.get_field_index(rest) < 0:
        return ""
    holds_images = key == "image_column" and _images_in(pa, t)[0]
    instead = f" (a struct of images is named as itself: {key} = {head!r})" if holds_images else ""
    return f": {name!r} is field {rest!r} of struct column {head!r}; only a top-level column is read{instead}"


def _images_in(pa, t) -> tuple[bool, str | None]:
    """Whether a column of type ``t`` holds encoded images, and in which struct field: the column
    itself, or only the ``bytes`` child of a Hugging Face Image struct (its ``path`` is never read)."""
    child = None
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        child, t = "bytes", t.field("bytes").type
    return _is_bytes(pa, t), child


def _is_bytes(pa, t) -> bool:
    """Whether an Arrow type is a binary layout pyarrow stores as a Parquet byte array (or a dictionary of one)."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    view = getattr(pa.types, "is_binary_view", lambda _: False)  # pyarrow 16 on
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or view(t)


def _image_leaf(pa, pf, column: str) -> int | None:
    """The leaf column of ``column``'s encoded images; None if there is none."""
    index = pf.schema_arrow.get_field_index(column)
    holds, child = _images_in(pa, pf.schema_arrow.field(index).type) if index >= 0 else (False, None)
    return column_leaf(pa, pf, column, child) if holds else None


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

    ``cached_bytes`` (row groups read whole, and what parquetpages holds: checked pages' row
    tables, decoded dictionaries) stays at most ``cache_bytes``, save when one row group alone is
    bigger: that one is kept on its own, since reading it again for each of its rows would cost
    far more.
    A file found changed (by its inode, size or mtime) when a row is read is opened again and
    its cached row groups dropped; until then, cached row groups serve what was read.

    What a row gets depends on the file alone, never on the rows read before it: a row of a page
    that parquetpages finds damaged is a bad sample (with pyarrow's words when pyarrow refuses
    its row group too), a row of a page it does not read comes from pyarrow's row group.
    """

    def __init__(self, cache_bytes: int = CACHE_BYTES, open_files: int = OPEN_FILES, pages: bool = True):
        """``pages``: read a row from its data page where parquetpages can (False: row groups only)."""
        self.cache_bytes, self.pages = cache_bytes, pages
        self.open_files = open_files
        self.cached_bytes = 0
        self._footer_bytes = self._closed_footer_bytes = 0  # serialized: the open files', and those closed since a gc
        self._groups: OrderedDict[tuple[str, str, int], object] = OrderedDict()  # -> a binary pyarrow Array
        # path -> (ParquetFile, identity, {column: its leaf, or None}, fd for parquetpages or None)
        self._files: OrderedDict[str, tuple] = OrderedDict()
        # (path, column, row group) -> its pages, or None: read the row group whole
        self._chunks: OrderedDict[tuple[str, str, int], ColumnChunk | None] = OrderedDict()
        # the chunks holding checked pages or a decoded dictionary (counted in cached_bytes), oldest first
        self._decoded: OrderedDict[tuple[str, str, int], ColumnChunk] = OrderedDict()
        # (path, column, row group) -> why pyarrow cannot read it: asked once, not once per row
        self._refused: OrderedDict[tuple[str, str, int], str] = OrderedDict()

    def read(self, path: str, row_group: int, row: int, column: str) -> bytes:
        """The encoded image in ``column`` at ``row`` of ``row_group``; ValueError if there is none.
        From its data page alone where parquetpages reads the column; else from its row group."""
        key = (path, column, row_group)
        chunk = self._chunk(path, row_group, column) if self.pages else None
        if chunk is not None:
            if not 0 <= row < chunk.rows:
                raise ValueError(
                    f"{_shown(path)}: row {row} is out of range: row group {row_group} has {chunk.rows} rows"
                )
            try:
                value = self._page_value(chunk, key, row)
            except Damaged as exc:
                raise self._refusal(path, row_group, row, column, exc) from None
            except Unsupported:
                pass  # a page parquetpages does not read: its row group is read whole, below
            except OSError as exc:
                raise ValueError(f"{_shown(path)}: cannot read row group {row_group}: {exc.strerror}") from None
            else:
                if value is None:
                    raise ValueError(
                        f"{_shown(path)}: null image in column {column!r} (row group {row_group}, row {row})"
                    )
                return value
        images = self._groups.get(key)
        if images is None:
            images = self._load(path, row_group, column)
        else:
            self._groups.move_to_end(key)
        if not 0 <= row < len(images):
            raise ValueError(f"{_shown(path)}: row {row} is out of range: row group {row_group} has {len(images)} rows")
        value = images[row].as_py()
        if value is None:
            raise ValueError(f"{_shown(path)}: null image in column {column!r} (row group {row_group}, row {row})")
        return value

    def _page_value(self, chunk: ColumnChunk, key: tuple, row: int) -> bytes | None:
        held = chunk.held_bytes
        try:
            return chunk.value(row)
        finally:
            if chunk.held_bytes != held:  # a page checked, a dictionary decoded: counted against the bound
                if self._decoded.pop(key, None) is not None:
                    self.cached_bytes -= held
                self._make_room(chunk.held_bytes)
                self._decoded[key] = chunk
                self.cached_bytes += chunk.held_bytes

    def _refusal(self, path: str, row_group: int, row: int, column: str, damage: Damaged) -> ValueError:
        """Why a row of a damaged page is a bad sample: pyarrow's words where it refuses the row
        group too; else parquetpages' own (pyarrow reads some damaged pages shifted, or cut)."""
        try:
            self._load(path, row_group, column)
        except ValueError as refused:
            return refused
        return ValueError(
            f"{_shown(path)}: damaged page of column {column!r} (row group {row_group}, row {row}): {damage}"
        )

    def _make_room(self, size: int) -> None:
        """Drop the least recently cached row groups, then checked pages and decoded dictionaries,
        until ``size`` fits."""
        while self.cached_bytes + size > self.cache_bytes and (self._groups or self._decoded):
            if self._groups:
                self.cached_bytes -= self._groups.popitem(last=False)[1].get_total_buffer_size()
            else:
                self._drop_decoded(next(iter(self._decoded)))

    def _drop_decoded(self, key: tuple) -> None:
        chunk = self._decoded.pop(key)
        self.cached_bytes -= chunk.held_bytes
        chunk.drop_decoded()

    def _leaf_of(self, pf, leaves: dict, column: str) -> int | None:
        if column not in leaves:
            leaves[column] = _image_leaf(_pyarrow()[0], pf, column)
        return leaves[column]

    def _chunk(self, path: str, row_group: int, column: str) -> ColumnChunk | None:
        """The page table of the image column in this row group; None where pages are not read."""
        key = (path, column, row_group)
        if key in self._chunks:
            self._chunks.move_to_end(key)
            self._file(path)  # a changed file drops its chunks (_forget)
            if key in self._chunks:
                return self._chunks[key]
        pf, _, leaves, fd = self._file(path)
        chunk = None
        if fd is not None and 0 <= row_group < pf.metadata.num_row_groups:
            leaf = self._leaf_of(pf, leaves, column)
            if leaf is not None:
                group = pf.metadata.row_group(row_group)
                try:
                    chunk = ColumnChunk(
                        fd, group.column(leaf), pf.schema.column(leaf).max_definition_level, group.num_rows
                    )
                except (Unsupported, OSError):
                    chunk = None
        self._chunks[key] = chunk
        if len(self._chunks) > _CHUNKS:
            old = next(iter(self._chunks))
            if old in self._decoded:
                self._drop_decoded(old)
            del self._chunks[old]
        return chunk

    def _load(self, path: str, row_group: int, column: str):
        pa, _ = _pyarrow()
        pf, _, leaves, _ = self._file(path)
        key = (path, column, row_group)
        if key in self._refused:
            raise ValueError(self._refused[key])
        groups = pf.metadata.num_row_groups
        if not 0 <= row_group < groups:
            raise ValueError(f"{_shown(path)}: row group {row_group} is out of range: the file has {groups} now")
        leaf = self._leaf_of(pf, leaves, column)
        if leaf is None:
            raise ValueError(f"{_shown(path)}: no image column {column!r} of {_IMAGE_TYPES} in it now")
        try:  # use_threads=False: one column, and a worker process has no cores to spare
            table = pf.reader.read_row_group(row_group, column_indices=[leaf], use_threads=False)
            images = table.column(0).combine_chunks()
        except _arrow_failures(pa) as exc:
            raise self._refuse(key, f"cannot read row group {row_group}: {_first_line(exc)}") from None
        if table.schema.names != [column]:  # _leaf checked the leaf's path: never, short of a pyarrow change
            raise ValueError(f"{_shown(path)}: column {column!r} read back as {table.schema.names}")
        rows = pf.metadata.row_group(row_group).num_rows
        if len(images) != rows:  # pyarrow reads some damaged page headers as fewer values, and says nothing
            raise self._refuse(
                key,
                f"cannot read row group {row_group}: pyarrow read {len(images)} values of {column!r} for {rows} rows",
            )
        if pa.types.is_struct(images.type):
            images = images.flatten()[0]  # flatten, not .field(): a null struct makes its bytes null too
        if not _is_bytes(pa, images.type):
            raise ValueError(f"{_shown(path)}: column {column!r} read back as {images.type}, not binary")
        size = images.get_total_buffer_size()
        self._make_room(size)
        self._groups[key] = images
        self.cached_bytes += size
        return images

    def _refuse(self, key: tuple, why: str) -> ValueError:
        """Keep why pyarrow cannot read the row group at ``key``, and return it as the error."""
        self._refused[key] = f"{_shown(key[0])}: {why}"
        if len(self._refused) > _CHUNKS:
            self._refused.popitem(last=False)
        return ValueError(self._refused[key])

    def _file(self, path: str) -> tuple:
        """The open file at ``path``, opened again when the file there is no longer the one that
        was opened (replaced, rewritten or truncated); a stat per row read."""
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
        self._footer_bytes += pf.metadata.serialized_size
        while len(self._files) > 1 and (len(self._files) > self.open_files or self._footer_bytes > FOOTER_BYTES):
            self._forget(next(iter(self._files)))  # the newest is kept, whatever its footer
        return entry

    def _forget(self, path: str) -> None:
        entry = self._files.pop(path, None)
        if entry is not None:
            size = entry[0].metadata.serialized_size
            self._footer_bytes, self._closed_footer_bytes = self._footer_bytes - size, self._closed_footer_bytes + size
            _close(entry)
        if self._closed_footer_bytes > FOOTER_BYTES:
            # pyarrow's FileMetaData and its ParquetSchema refer to each other: a closed file's
            # footer is freed by the cycle collector alone, which runs by counts of Python objects,
            # blind to the ~8x of a footer they hold (60 reopens of 685 KB footers: 1 GB held).
            self._closed_footer_bytes = 0
            gc.collect()
        for key in [k for k in self._groups if k[0] == path]:
            self.cached_bytes -= self._groups.pop(key).get_total_buffer_size()
        for key in [k for k in self._decoded if k[0] == path]:
            self._drop_decoded(key)
        for cache in (self._chunks, self._refused):
            for key in [k for k in cache if k[0] == path]:
                del cache[key]

    def close(self) -> None:
        """Close every open file and drop every cached row group."""
        while self._files:
            _close(self._files.popitem()[1])
        self._footer_bytes = 0
        self._groups.clear()
        self._chunks.clear()
        self._decoded.clear()
        self._refused.clear()
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
