"""A sample's encoded image, wherever the index says it lies: a file of its own (read by the
image pipeline itself), a member of a tar shard, or a row of a Parquet file.

Containers are read only by the worker that makes the batch, each with its own open files
and caches; pyarrow is imported only when a Parquet sample is read.
"""

from __future__ import annotations

import numpy as np

from .shards import TarMembers
from .sources import FILE, NO_LABEL, PARQUET_ROW, TAR_MEMBER, SampleIndex


class SampleReader:
    def __init__(self, index: SampleIndex, image_columns: list[str], source_sizes: tuple[int, ...]):
        """``image_columns``: per source, a Parquet source's image column ("" for the others)."""
        self.index = index
        self._columns, self._source_ends = list(image_columns), np.cumsum(source_sizes)
        self._tars = TarMembers()
        self._parquet = None  # a ParquetRows, made for the first Parquet sample

    def image_bytes(self, sid: int) -> bytes | None:
        """The encoded image of sample ``sid``; None for a sample that is a file of its own.
        ValueError (a bad sample) for one without a label or an image, or a damaged container."""
        kind = self.index.kind(sid)
        if kind == FILE:
            return None
        if self.index.labels[sid] == NO_LABEL:
            raise ValueError(
                "the sample has no label (its label is null)" if kind == PARQUET_ROW
                else "the sample has no label (no .cls member, or its .json has no such label key)"
            )
        a, b = self.index.member(sid)
        if kind == TAR_MEMBER:
            return self._tars.read(self.index.path(sid), a, b)
        if kind == PARQUET_ROW:
            if self._parquet is None:
                from .parquetsource import ParquetRows

                self._parquet = ParquetRows()
            column = self._columns[int(np.searchsorted(self._source_ends, sid, side="right"))]
            return self._parquet.read(self.index.path(sid), a, b, column)
        raise ValueError(f"unknown sample kind {kind} in the index")

    def read_ahead(self, ids: np.ndarray) -> None:
        """Ask for the coming samples' bytes now, all at once and in shard-offset order, so a cold
        page cache or a network file system reads them while the batch's first ones decode."""
        if self.index.kinds is None:
            return
        wanted = [int(i) for i in ids if self.index.kinds[i] == TAR_MEMBER]
        if wanted:
            self._tars.will_need([(self.index.path(i), *self.index.member(i)) for i in wanted])

    def where(self, sid: int) -> str:
        """The sample's place, for messages: its path, and in a container where in it."""
        path, kind = self.index.path(sid), self.index.kind(sid)
        if kind == TAR_MEMBER:
            offset, size = self.index.member(sid)
            return f"{path} (member at byte {offset}, {size} bytes)" if offset >= 0 else f"{path} (no image member)"
        if kind == PARQUET_ROW:
            group, row = self.index.member(sid)
            return f"{path} (row group {group}, row {row})"
        return path

    def close(self) -> None:
        self._tars.close()
        if self._parquet is not None:
            self._parquet.close()
