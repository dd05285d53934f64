"""A sample's encoded image, wherever the index says it lies: a file of its own (read by the
image pipeline itself), a member of a tar shard, or a row of a Parquet file.

Containers are read only by the worker that makes the batch, each with its own open files
and caches; pyarrow is imported only when a Parquet sample is read.
"""

from __future__ import annotations

import os
import tarfile

import numpy as np

from prefetchd.sources.index import FILE, NO_LABEL, PARQUET_ROW, TAR_MEMBER, SampleIndex, open_data_file
from prefetchd.sources.shards import TarMembers

_TAR_NAME_BYTES = 100  # a ustar header's name field: a name that fills it may be cut (a pax or GNU long name)


class SampleReader:
    def __init__(
        self,
        index: SampleIndex,
        image_columns: list[str],
        source_sizes: tuple[int, ...],
        label_keys: list[str | None] | None = None,
    ):
        """``image_columns``: per source, a Parquet source's image column ("" for the others);
        ``label_keys``: per source, a WebDataset source's label_key (None: labels from .cls
        members), or None where unknown (a producer.json of an earlier prefetchd)."""
        self.index = index
        self._columns, self._source_ends = list(image_columns), np.cumsum(source_sizes)
        self._label_keys = label_keys
        self._tars = TarMembers()
        self._parquet = None  # a ParquetRows, made for the first Parquet sample

    def image_bytes(self, sid: int) -> bytes | None:
        """The encoded image of sample ``sid``; None for a sample that is a file of its own.
        ValueError (a bad sample) for one without a label or an image, or a damaged container."""
        kind = self.index.kind(sid)
        if kind == FILE:
            return None
        if self.index.labels[sid] == NO_LABEL:
            if kind == TAR_MEMBER:  # a sample refused at indexing (a key that repeats) says why, not "no label"
                self._tars.check_refused(self.index.path(sid), self.index.member(sid)[0])
            raise ValueError(self._why_no_label(sid, kind))
        a, b = self.index.member(sid)
        if kind == TAR_MEMBER:
            return self._tars.read(self.index.path(sid), a, b)
        if kind == PARQUET_ROW:
            if self._parquet is None:
                from prefetchd.sources.parquetsource import ParquetRows

                self._parquet = ParquetRows()
            return self._parquet.read(self.index.path(sid), a, b, self._columns[self._source(sid)])
        raise ValueError(f"unknown sample kind {kind} in the index")

    def read_ahead(self, ids: np.ndarray) -> None:
        """Ask for the coming samples' bytes now, all at once and in shard-offset order, so a cold
        page cache or a network file system reads them while the batch's first ones decode."""
        if self.index.kinds is None:
            return
        wanted = [int(i) for i in ids if self.index.kinds[i] == TAR_MEMBER]
        if wanted:
            self._tars.will_need([(self.index.path(i), *self.index.member(i)) for i in wanted])

    def _source(self, sid: int) -> int:
        return int(np.searchsorted(self._source_ends, sid, side="right"))

    def _why_no_label(self, sid: int, kind: int) -> str:
        """A sample without a label, in the words of its source's config: the index keeps only
        that the label is missing, the config says where it was looked for."""
        if kind == PARQUET_ROW:
            return "the sample has no label (its label is null)"
        source = self._source(sid)
        keys = self._label_keys
        if not isinstance(keys, list) or source >= len(keys) or not isinstance(keys[source], str | None):
            return "the sample has no label (no .cls member, or its .json has no such label key)"
        key = keys[source]
        if key is None:
            return (
                "the sample has no label: it has no .cls member, and label_key is not set in its [[source]]; "
                'if the shards hold labels in .json members, set label_key = "<the label\'s key in them>"'
            )
        return (
            f"the sample has no label: it has no .json member with an integer label under label_key {key!r} "
            "(the key absent, not an integer from 0, or the .json not JSON)"
        )

    def where(self, sid: int) -> str:
        """The sample's place, as a batch records it: the path of a file of its own; in a
        container, the container and where in it ("shard S member KEY", "Parquet file F row
        group G row R")."""
        path, kind = self.index.path(sid), self.index.kind(sid)
        if kind == TAR_MEMBER:
            offset, size = self.index.member(sid)
            if offset < 0:  # none, or one the index marked (a sparse member, a key that repeats)
                return f"shard {path}, {self._tars.place(path, offset, size)}"
            name = _member_name(path, offset, size)
            return f"shard {path} member {name}" if name else f"shard {path} member at byte {offset} ({size} bytes)"
        if kind == PARQUET_ROW:
            group, row = self.index.member(sid)
            return f"Parquet file {path} row group {group} row {row}"
        return path

    def place(self, sid: int) -> str:
        """The sample's place, for messages: ``where``, with a file of its own called one."""
        return f"file {self.index.path(sid)}" if self.index.kind(sid) == FILE else self.where(sid)

    def close(self) -> None:
        self._tars.close()
        if self._parquet is not None:
            self._parquet.close()


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
