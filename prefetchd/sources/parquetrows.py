"""A worker's reads of Parquet rows (``kind = "parquet"``; indexed by parquetsource).

pyarrow reads no less than a row group: a row is read from its data page instead where
parquetpages can (nearly every image column), and otherwise the row group's image column is
read whole (for a Hugging Face ``Image`` struct only its ``bytes`` child), recent ones kept in a
byte-bounded LRU. A column is read by the index of its Parquet leaf (parquetsource.image_leaf),
never by a name pyarrow would take as a path prefix.
"""

from __future__ import annotations

import functools
import gc
import os
from collections import OrderedDict

from prefetchd.sources import objects
from prefetchd.sources.index import SampleBytes, open_data_file
from prefetchd.sources.parquetpages import ColumnChunk, Damaged, Unsupported
from prefetchd.sources.parquetsource import (
    IMAGE_TYPES,
    Unreadable,
    arrow_failures,
    first_line,
    image_leaf,
    is_bytes,
    open_parquet,
    open_parquet_object,
    pyarrow_modules,
    shown,
)

CACHE_BYTES = 64 << 20  # decoded image columns of row groups kept per reader
OPEN_FILES = 32  # open ParquetFile objects kept per reader
# and at most this much of their footers (a few KB each, for real files): pyarrow holds ~8 times
# a footer's size, and 10**5 row groups of one row make a 25 MB footer (190 MB a file open).
FOOTER_BYTES = 4 << 20
_CHUNKS = 4096  # page tables kept per reader (a few hundred bytes each)

class ParquetRows(SampleBytes):
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
        # path -> (ParquetFile, identity, {column: its leaf, or None}, parquetpages' pread or None,
        # what to close besides: the fd behind that pread, or an object's ObjectFile)
        self._files: OrderedDict[str, tuple] = OrderedDict()
        # (path, column, row group) -> its pages, or None: read the row group whole
        self._chunks: OrderedDict[tuple[str, str, int], ColumnChunk | None] = OrderedDict()
        # the chunks holding checked pages or a decoded dictionary (counted in cached_bytes), oldest first
        self._decoded: OrderedDict[tuple[str, str, int], ColumnChunk] = OrderedDict()
        # (path, column, row group) -> why pyarrow cannot read it: asked once, not once per row
        self._refused: OrderedDict[tuple[str, str, int], str] = OrderedDict()
        self._store: objects.Objects | None = None  # Parquet objects in a store, read by range

    def read_sample(self, path: str, a: int, b: int, options: dict) -> bytes:
        return self.read(path, a, b, options["image_column"])

    def where(self, path: str, a: int, b: int) -> str:
        return f"Parquet file {path} row group {a} row {b}"

    def why_no_label(self, path: str, a: int, b: int, options: dict) -> str:
        return "the sample has no label (its label is null)"

    def read(self, path: str, row_group: int, row: int, column: str) -> bytes:
        """The encoded image in ``column`` at ``row`` of ``row_group``; ValueError if there is none.
        From its data page alone where parquetpages reads the column; else from its row group."""
        key = (path, column, row_group)
        chunk = self._chunk(path, row_group, column) if self.pages else None
        if chunk is not None:
            if not 0 <= row < chunk.rows:
                raise ValueError(
                    f"{shown(path)}: row {row} is out of range: row group {row_group} has {chunk.rows} rows"
                )
            try:
                value = self._page_value(chunk, key, row)
            except Damaged as exc:
                raise self._refusal(path, row_group, row, column, exc) from None
            except Unsupported:
                pass  # a page parquetpages does not read: its row group is read whole, below
            except OSError as exc:
                raise ValueError(f"{shown(path)}: cannot read row group {row_group}: {exc.strerror}") from None
            else:
                if value is None:
                    raise ValueError(
                        f"{shown(path)}: null image in column {column!r} (row group {row_group}, row {row})"
                    )
                return value
        images = self._groups.get(key)
        if images is None:
            images = self._load(path, row_group, column)
        else:
            self._groups.move_to_end(key)
        if not 0 <= row < len(images):
            raise ValueError(f"{shown(path)}: row {row} is out of range: row group {row_group} has {len(images)} rows")
        value = images[row].as_py()
        if value is None:
            raise ValueError(f"{shown(path)}: null image in column {column!r} (row group {row_group}, row {row})")
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
            f"{shown(path)}: damaged page of column {column!r} (row group {row_group}, row {row}): {damage}"
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
            leaves[column] = image_leaf(pyarrow_modules()[0], pf, column)
        return leaves[column]

    def _chunk(self, path: str, row_group: int, column: str) -> ColumnChunk | None:
        """The page table of the image column in this row group; None where pages are not read."""
        key = (path, column, row_group)
        if key in self._chunks:
            self._chunks.move_to_end(key)
            self._file(path)  # a changed file drops its chunks (_forget)
            if key in self._chunks:
                return self._chunks[key]
        pf, _, leaves, pread, _ = self._file(path)
        chunk = None
        if pread is not None and 0 <= row_group < pf.metadata.num_row_groups:
            leaf = self._leaf_of(pf, leaves, column)
            if leaf is not None:
                group = pf.metadata.row_group(row_group)
                try:
                    chunk = ColumnChunk(
                        pread, group.column(leaf), pf.schema.column(leaf).max_definition_level, group.num_rows
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
        pa, _ = pyarrow_modules()
        pf, _, leaves, _, _ = self._file(path)
        key = (path, column, row_group)
        if key in self._refused:
            raise ValueError(self._refused[key])
        groups = pf.metadata.num_row_groups
        if not 0 <= row_group < groups:
            raise ValueError(f"{shown(path)}: row group {row_group} is out of range: the file has {groups} now")
        leaf = self._leaf_of(pf, leaves, column)
        if leaf is None:
            raise ValueError(f"{shown(path)}: no image column {column!r} of {IMAGE_TYPES} in it now")
        try:  # use_threads=False: one column, and a worker process has no cores to spare
            table = pf.reader.read_row_group(row_group, column_indices=[leaf], use_threads=False)
            images = table.column(0).combine_chunks()
        except arrow_failures(pa) as exc:
            raise self._refuse(key, f"cannot read row group {row_group}: {first_line(exc)}") from None
        if table.schema.names != [column]:  # _leaf checked the leaf's path: never, short of a pyarrow change
            raise ValueError(f"{shown(path)}: column {column!r} read back as {table.schema.names}")
        rows = pf.metadata.row_group(row_group).num_rows
        if len(images) != rows:  # pyarrow reads some damaged page headers as fewer values, and says nothing
            raise self._refuse(
                key,
                f"cannot read row group {row_group}: pyarrow read {len(images)} values of {column!r} for {rows} rows",
            )
        if pa.types.is_struct(images.type):
            images = images.flatten()[0]  # flatten, not .field(): a null struct makes its bytes null too
        if not is_bytes(pa, images.type):
            raise ValueError(f"{shown(path)}: column {column!r} read back as {images.type}, not binary")
        size = images.get_total_buffer_size()
        self._make_room(size)
        self._groups[key] = images
        self.cached_bytes += size
        return images

    def _refuse(self, key: tuple, why: str) -> ValueError:
        """Keep why pyarrow cannot read the row group at ``key``, and return it as the error."""
        self._refused[key] = f"{shown(key[0])}: {why}"
        if len(self._refused) > _CHUNKS:
            self._refused.popitem(last=False)
        return ValueError(self._refused[key])

    def _file(self, path: str) -> tuple:
        """The open file at ``path``, opened again when the file there is no longer the one that
        was opened (replaced, rewritten or truncated); a stat per row read. An object in a store
        is opened once: each of its reads checks it is the one indexed (sources.objects)."""
        if objects.is_url(path):
            return self._object(path)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ValueError(f"{shown(path)} cannot be read ({exc.strerror}); it changed since indexing") from None
        entry = self._files.get(path)
        if entry is not None and entry[1] == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
            self._files.move_to_end(path)
            return entry
        self._forget(path)
        try:
            pf, identity = open_parquet(path)
        except Unreadable as exc:
            raise ValueError(f"{shown(path)} {exc}; it changed since indexing") from None
        fd = _page_fd(path, identity)
        self._keep(path, (pf, identity, {}, None if fd is None else functools.partial(os.pread, fd), fd))
        return self._files[path]

    def _object(self, path: str) -> tuple:
        entry = self._files.get(path)
        if entry is not None:
            self._files.move_to_end(path)
            return entry
        identity = self.objects_indexed.get(path)
        if identity is None:
            raise ValueError(f"{objects.shown(path)} is not among the objects the job indexed")
        if self._store is None:
            self._store = objects.Objects()
        info = objects.ObjectInfo.from_json(identity)
        try:
            pf, f = open_parquet_object(self._store, path, info)
        except Unreadable as exc:
            raise ValueError(f"{shown(path)} {exc}") from None
        self._keep(path, (pf, tuple(identity), {}, f.pread, f))
        return self._files[path]

    def _keep(self, path: str, entry: tuple) -> None:
        self._files[path] = entry
        self._footer_bytes += entry[0].metadata.serialized_size
        while len(self._files) > 1 and (len(self._files) > self.open_files or self._footer_bytes > FOOTER_BYTES):
            self._forget(next(iter(self._files)))  # the newest is kept, whatever its footer

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

    def io_totals(self) -> dict[str, list]:
        return {} if self._store is None else self._store.totals()

    def close(self) -> None:
        """Close every open file and drop every cached row group."""
        while self._files:
            _close(self._files.popitem()[1])
        if self._store is not None:
            self._store.close()
            self._store = None
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
    if isinstance(entry[4], int):
        os.close(entry[4])
    elif entry[4] is not None:
        entry[4].close()
