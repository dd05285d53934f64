"""Parquet files as a source: one sample per row, its image the encoded bytes in a column.

The index is built from each file's footer and its label column alone, never its images, so
indexing costs a read of the labels; a worker reads a row's image through parquetrows. pyarrow
is an optional extra, imported only here (and by parquetpages to decompress) and only when a
Parquet source is used.

``image_column`` and ``label_column`` name a top-level column exactly: a dotted name is never a
path into a struct (a Hugging Face Image struct is named as itself, and its ``bytes`` child is
found here). A column is read by the index of its Parquet leaf, never by pyarrow's ``columns=``,
which takes a name as a path prefix: "img.bytes" there is both a column of that name and the
child of a struct ``img``, and "label" takes in a column named "label.name" too.

No file is opened before a stat says it is a regular file, and the open itself is O_NONBLOCK:
a FIFO planted under a ``.parquet`` name would otherwise block its reader forever.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import stat

import numpy as np

from prefetchd import stopsignals
from prefetchd.errors import ConfigError, DataError
from prefetchd.sources import objects
from prefetchd.sources.index import NO_LABEL, SampleIndex
from prefetchd.sources.objectfile import ObjectFile
from prefetchd.sources.parquetpages import column_leaf
from prefetchd.sources.places import PARQUET_ROW
from prefetchd.sources.progress import IndexingProgress

log = logging.getLogger(__name__)

_OBJECT_CHUNK = 1 << 20  # a Parquet object is read in ranges of this (its footer, page headers), more at once
IMAGE_TYPES = (
    "binary (large, view or dictionary-encoded too), or a struct with such a 'bytes' field (Hugging Face's Image)"
)


def pyarrow_modules():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "[[source]] kind = \"parquet\" needs pyarrow, which is not installed: pip install 'prefetchd[parquet]'"
        ) from None
    return pa, pq


def arrow_failures(pa) -> tuple:
    # What a damaged file makes pyarrow raise: any ArrowException, an OSError (a footer it cannot
    # deserialize) or a UnicodeDecodeError (a column name that is not UTF-8).
    return pa.ArrowException, OSError, ValueError


def shown(path: str) -> str:
    if objects.is_url(path):
        return objects.shown(path)
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


class Unreadable(Exception):
    """Why a file cannot be opened as Parquet, worded to follow its path."""


def open_parquet(path: str):
    """(ParquetFile, identity) of ``path``, or Unreadable.

    The fd opened here is fstat'ed again (the file may have been swapped since the stat) and
    pyarrow opens that very inode through /proc/self/fd. Without /proc it opens the path, checked
    a moment before: a race only a hostile writer could win.
    """
    pa, pq = pyarrow_modules()
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
            raise Unreadable(f"is {kind}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Unreadable("does not exist (or is a symlink to nothing)") from None
    except OSError as exc:
        raise Unreadable(f"cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("is not a regular file")
        via_fd = f"/proc/self/fd/{fd}"
        try:
            pf = pq.ParquetFile(via_fd if os.path.exists(via_fd) else path)
            pf.schema_arrow  # noqa: B018 -- parsed now, so that a damaged schema fails here
        except arrow_failures(pa) as exc:
            raise Unreadable(f"is not a readable Parquet file ({first_line(exc)})") from None
        return pf, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


def open_parquet_object(store: objects.Objects, url: str, info: objects.ObjectInfo):
    """(ParquetFile, its ObjectFile) of an object in a store, or Unreadable. pyarrow reads it
    through range requests (the footer first); a store's fault raised inside pyarrow's read comes
    out of it as itself (StoreUnreachable, ObjectChanged), never as a damaged file."""
    pa, pq = pyarrow_modules()
    f = ObjectFile(store, url, info, chunk=_OBJECT_CHUNK)
    try:
        pf = pq.ParquetFile(f)
        pf.schema_arrow  # noqa: B018 -- parsed now, so that a damaged schema fails here
    except arrow_failures(pa) as exc:
        if isinstance(exc, objects.ObjectError):
            raise Unreadable(str(exc)) from None
        raise Unreadable(f"is not a readable Parquet file ({first_line(exc)})") from None
    return pf, f


def parquet_files(path: str, where: str) -> list[str]:
    """The files ``path`` names: itself, a folder's ``*.parquet`` (not recursive), or a glob's
    matches; in the order of their path bytes. Hidden names are skipped, as a glob ``*`` skips them.
    A URL names objects in a store: one, or those of a brace pattern (``part-{00000..00127}.parquet``)."""
    if "://" in path:
        from prefetchd.sources.shards import expand_urls  # brace patterns and URL checks, as for shards

        try:
            return list(expand_urls(path))
        except DataError as exc:
            raise DataError(f"{where}: path {exc}") from None
    if os.path.isdir(path):
        files = glob.glob(os.path.join(glob.escape(path), "*.parquet"))
        if not files:
            raise DataError(f"{where}: folder {shown(path)} has no *.parquet file; set path to a file, folder or glob")
    elif os.path.lexists(path) or not glob.has_magic(path):
        files = [path]  # a name with [ in it that exists is that file, not a pattern
    else:
        files = glob.glob(path)
        if not files:
            raise DataError(f"{where}: no file matches {shown(path)}; set path to a file, folder or glob")
    return sorted(files, key=os.fsencode)


def scan_parquet(src: dict, where: str) -> SampleIndex:
    """Index a ``kind = "parquet"`` source: every row of every file, files in path order."""
    paths = parquet_files(src["path"], where)
    store = objects.Objects() if any(objects.is_url(p) for p in paths) else None
    try:
        return _scan_files(paths, src, where, store)
    finally:
        if store is not None:
            store.close()


def parquet_class_names(src: dict) -> list[str] | None:
    """The names of label_column's classes where the first file says them, as a Hugging Face
    ``ClassLabel`` does in the schema's ``huggingface`` metadata; else None (a file in a store: not read)."""
    paths = parquet_files(src["path"], "parquet")
    if not paths or objects.is_url(paths[0]):
        return None
    try:
        pf, _ = open_parquet(paths[0])
    except Unreadable:
        return None
    with pf:
        metadata = pf.schema_arrow.metadata or {}
    try:
        feature = json.loads(metadata.get(b"huggingface", b"{}"))["info"]["features"][src["label_column"]]
        names = feature["names"] if feature.get("_type") == "ClassLabel" else None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def _scan_files(paths: list[str], src: dict, where: str, store: objects.Objects | None) -> SampleIndex:
    """scan_parquet's work over the files ``paths`` (objects in ``store``, where it is one)."""
    image_column, label_column = src["image_column"], src["label_column"]
    files, counts, members, labels = [], [], [], []
    found: dict[str, list] = {}
    progress = IndexingProgress(len(paths), where, "Parquet files")
    for path in paths:
        stopsignals.check_starting()  # a stop during a long indexing need not wait for its end
        progress.done_one()
        what = f"{where}: {shown(path)}"
        if store is not None and objects.is_url(path):
            try:
                info = store.head(path)
                found[path] = info.to_json()
                groups, file_labels = _scan_file(path, image_column, label_column, what, store, info)
            except objects.StoreUnreachable as exc:
                raise DataError(f"{where}: cannot reach the store: {exc}; check the endpoint and the network") from None
            except objects.ObjectChanged:
                raise DataError(f"{what} changed while it was indexed; start again once it is written") from None
            except objects.ObjectError as exc:
                raise DataError(f"{where}: {exc}") from None
        else:
            groups, file_labels = _scan_file(path, image_column, label_column, what)
        if len(file_labels):
            files.append(path)
            counts.append(len(file_labels))
            # (row group, row within it) for every row, without a Python loop over the rows
            group_of_row = np.repeat(np.arange(len(groups), dtype=np.int64), groups)
            first_row = (np.cumsum(groups) - groups)[group_of_row]
            members.append(np.stack([group_of_row, np.arange(len(file_labels)) - first_row], axis=1))
            labels.append(file_labels)
    if not files:
        raise DataError(f"{where}: the Parquet file(s) at {shown(src['path'])} hold no rows; point path at the data")
    in_store = {path: found[path] for path in files if path in found}
    return SampleIndex.in_containers(
        files, counts, PARQUET_ROW, np.concatenate(members), np.concatenate(labels), in_store
    )


def _scan_file(
    path: str, image_column: str, label_column: str, what: str, store=None, info=None
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of each row group and every row's label (NO_LABEL for a null one). ``store`` and
    ``info``: the object's store and identity, for a URL."""
    pa, _ = pyarrow_modules()
    try:
        pf, _ = open_parquet(path) if store is None else open_parquet_object(store, path, info)
    except Unreadable as exc:
        raise DataError(f"{what} {exc}; remove it or fix path in [[source]]") from None
    with pf:
        schema, meta = pf.schema_arrow, pf.metadata
        image_type = _field(schema, image_column, "image_column", what).type
        if not _images_in(pa, image_type)[0]:
            raise DataError(
                f"{what}: image_column {image_column!r} is {image_type}, not {IMAGE_TYPES}; "
                "set image_column to the column of encoded images"
            )
        leaf = image_leaf(pa, pf, image_column)
        if leaf is None:
            raise DataError(
                f"{what}: cannot tell which of its Parquet leaf columns holds image_column {image_column!r}"
            )
        missing = _null_count(meta, leaf)
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
        except arrow_failures(pa) as exc:
            raise DataError(f"{what}: cannot read label_column {label_column!r}: {first_line(exc)}") from None
        if table.schema.names != [label_column] or not pa.types.is_integer(column.type):
            raise DataError(
                f"{what}: label_column {label_column!r} read back as columns {table.schema.names!r} of "
                f"{[str(t) for t in table.schema.types]!r}, not one integer column"
            )
    if len(column) != groups.sum():
        raise DataError(f"{what}: its footer counts {groups.sum()} rows but the label column has {len(column)}")
    if missing and missing >= len(column):
        raise DataError(_no_images(what, image_column, _images_in(pa, image_type)[1], len(column)))
    if missing:
        log.warning("%s: %d of its %d rows have no image in %r: bad samples", what, missing, len(column), image_column)
    return groups, _labels(column, groups, what, label_column)


def _null_count(meta, leaf: int) -> int | None:
    """The null values of leaf column ``leaf`` in every row group, as the footer's statistics
    count them (a struct's own nulls among them); None where some row group has none."""
    nulls = 0
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(leaf).statistics
        if stats is None or not stats.has_null_count:
            return None
        nulls += stats.null_count
    return nulls


def _no_images(what: str, column: str, child: str | None, rows: int) -> str:
    """Why a file whose image column is null in every row is refused, and how to fill it."""
    if child is None:
        return f"{what}: image_column {column!r} is null in all its {rows} rows; set image_column to the images' column"
    return (
        f"{what}: image_column {column!r} has no image bytes in any of its {rows} rows: its {child!r} field is "
        "null, as a Hugging Face Image column made from file paths leaves it (only 'path' is set, and prefetchd "
        "reads the bytes, never a path). Embed the images before writing the file: with datasets, "
        "`from datasets.table import embed_table_storage; ds = ds.with_format('arrow').map(embed_table_storage, "
        "batched=True).with_format(None)`, then `ds.to_parquet(...)`"
    )


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
    pa, _ = pyarrow_modules()
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
    return is_bytes(pa, t), child


def is_bytes(pa, t) -> bool:
    """Whether an Arrow type is a binary layout pyarrow stores as a Parquet byte array (or a dictionary of one)."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    view = getattr(pa.types, "is_binary_view", lambda _: False)  # pyarrow 16 on
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or view(t)


def image_leaf(pa, pf, column: str) -> int | None:
    """The leaf column of ``column``'s encoded images; None if there is none."""
    index = pf.schema_arrow.get_field_index(column)
    holds, child = _images_in(pa, pf.schema_arrow.field(index).type) if index >= 0 else (False, None)
    return column_leaf(pa, pf, column, child) if holds else None


def _labels(column, groups: np.ndarray, what: str, name: str) -> np.ndarray:
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    if len(nulls) and nulls.all():  # every row a bad sample: the daemon would stop in its first second
        raise DataError(
            f"{what}: label_column {name!r} is null in all its {len(nulls)} rows; set label_column to "
            "the column of class indices"
        )
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
