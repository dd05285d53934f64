"""One value of a Parquet byte-array column, read from its data page alone.

pyarrow reads a column a row group at a time. For a shuffled epoch over image rows, every
sample would read its row group's whole image column: the Hub writes image datasets in
groups of 100 rows, several MB. A data page holds a few images (pyarrow's pages are 1 MB),
and its header says how many rows it holds. So the page headers of a column chunk are read
once (a few bytes each), and a row then costs the read and decoding of its one page.

This reads what writers produce for an image column: BYTE_ARRAY values, PLAIN or
dictionary-encoded, optional (nullable) levels, data pages v1 and v2, the codecs pyarrow can
decompress. Anything else (a repeated column, another encoding, Hadoop's LZ4, a header that
does not add up) raises Unsupported, and the caller reads the row group through pyarrow instead.
A page's bytes are checked against its header and the chunk's bounds before use; nothing in a
file can make it read past the chunk or loop.
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass

from .thriftcompact import CompactReader, Short, Unsupported

_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd", "BROTLI": "brotli",
           "LZ4_RAW": "lz4_raw", "LZ4": "lz4_hadoop"}
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
_MAX_PAGE_BYTES = 1 << 30
_MAX_HEADER_BYTES = 1 << 20  # statistics can make a header long; not this long


@dataclass(frozen=True)
class _Page:
    body: int  # file offset of the page's bytes after its header
    compressed: int
    uncompressed: int
    first_row: int
    rows: int
    version: int  # 1 or 2
    encoding: int
    levels: int = 0  # v2: the (uncompressed) repetition + definition level bytes before the values
    def_bytes: int = 0  # v2
    values_compressed: bool = True  # v2


class ColumnChunk:
    """The pages of one column chunk (a column in a row group): where each starts, and its rows."""

    def __init__(self, fd: int, meta, max_definition_level: int, rows: int):
        """``meta``: pyarrow's ColumnChunkMetaData; ``rows``: the row group's rows."""
        if meta.physical_type != "BYTE_ARRAY":
            raise Unsupported(f"a {meta.physical_type} column")
        if meta.compression not in _CODECS:
            raise Unsupported(f"{meta.compression} compression")
        self.fd, self.max_def, self.rows = fd, max_definition_level, rows
        self.codec = _CODECS[meta.compression]
        start = meta.dictionary_page_offset if meta.has_dictionary_page and meta.dictionary_page_offset else None
        start = meta.data_page_offset if start is None else min(start, meta.data_page_offset)
        self.end = start + meta.total_compressed_size
        self.pages: list[_Page] = []
        self._dictionary_page: _Page | None = None
        self._dictionary: list[bytes] | None = None
        offset, row = start, 0
        while row < rows:
            if offset >= self.end:
                raise Unsupported("the chunk ends before its rows do")
            header, body = self._header(offset)
            page = self._page(header, body, row)
            if body + page.compressed > self.end:
                raise Unsupported("a page goes past its chunk")
            if header.get(1) == _DICTIONARY_PAGE:
                if self._dictionary_page is not None or self.pages:
                    raise Unsupported("a dictionary page that is not the chunk's first")
                self._dictionary_page = page
            elif header.get(1) in (_DATA_PAGE, _DATA_PAGE_V2):
                if page.rows <= 0:
                    raise Unsupported("a data page of no rows")
                self.pages.append(page)
                row += page.rows
            offset = body + page.compressed
        if row != rows:
            raise Unsupported("the pages' rows do not add up to the row group's")
        self._firsts = [p.first_row for p in self.pages]

    def _header(self, offset: int) -> tuple[dict, int]:
        size = 256
        while True:
            buf = os.pread(self.fd, min(size, self.end - offset), offset)
            thrift = CompactReader(buf)
            try:
                return thrift.struct(), offset + thrift.pos
            except Short:
                if len(buf) < min(size, self.end - offset) or size >= _MAX_HEADER_BYTES or offset + size >= self.end:
                    raise Unsupported("a page header cut short") from None
                size *= 8

    def _page(self, header: dict, body: int, first_row: int) -> _Page:
        kind, uncompressed, compressed = header.get(1), header.get(2), header.get(3)
        if not all(type(v) is int and 0 <= v <= _MAX_PAGE_BYTES for v in (uncompressed, compressed)):
            raise Unsupported("a page of no size")
        if kind == _DATA_PAGE:
            v1 = header.get(5)
            if not isinstance(v1, dict) or (self.max_def and v1.get(3) != _RLE):
                raise Unsupported("a data page whose levels are not RLE")
            return _Page(body, compressed, uncompressed, first_row, _count(v1.get(1)), 1, v1.get(2))
        if kind == _DATA_PAGE_V2:
            v2 = header.get(8)
            if not isinstance(v2, dict) or v2.get(6, 0) != 0:
                raise Unsupported("a v2 data page with repetition levels")
            def_bytes = _count(v2.get(5, 0))
            if def_bytes > compressed:
                raise Unsupported("v2 levels longer than their page")
            return _Page(body, compressed, uncompressed, first_row, _count(v2.get(3)), 2, v2.get(4), def_bytes,
                         def_bytes, v2.get(7, True) is not False)
        if kind == _DICTIONARY_PAGE:
            d = header.get(7)
            if not isinstance(d, dict) or d.get(2) not in (_PLAIN, _PLAIN_DICTIONARY):
                raise Unsupported("a dictionary page that is not PLAIN")
            return _Page(body, compressed, uncompressed, 0, _count(d.get(1)), 1, _PLAIN)
        if kind == _INDEX_PAGE:
            return _Page(body, compressed, uncompressed, first_row, 0, 1, _PLAIN)
        raise Unsupported(f"page type {kind}")

    def value(self, row: int) -> bytes | None:
        """The value at ``row`` of the row group (None: null)."""
        page = self.pages[bisect.bisect_right(self._firsts, row) - 1]
        k = row - page.first_row
        raw = self._read(page)
        if page.version == 1:
            data = self._decompress(raw, page.uncompressed)
            if self.max_def:
                (n,) = struct.unpack_from("<I", data, 0) if len(data) >= 4 else (-1,)
                if not 0 <= n <= len(data) - 4:
                    raise Unsupported("definition levels longer than their page")
                levels, values = data[4 : 4 + n], data[4 + n :]
            else:
                levels, values = b"", data
        else:
            levels = raw[: page.levels]
            rest = raw[page.levels :]
            values = self._decompress(rest, page.uncompressed - page.levels) if page.values_compressed else rest
        index = k
        if self.max_def:
            defs = _hybrid(levels, self.max_def.bit_length(), k + 1)
            if defs[k] != self.max_def:
                return None
            index = sum(1 for d in defs[:k] if d == self.max_def)
        if page.encoding == _PLAIN:
            return _plain(values, index)
        if page.encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
            if not values:
                raise Unsupported("dictionary indices missing")
            (i,) = _hybrid(values[1:], values[0], index + 1)[index:]
            dictionary = self._dictionary_values()
            if i >= len(dictionary):
                raise Unsupported("a dictionary index past the dictionary")
            return dictionary[i]
        raise Unsupported(f"encoding {page.encoding}")

    def _dictionary_values(self) -> list[bytes]:
        if self._dictionary is None:
            page = self._dictionary_page
            if page is None:
                raise Unsupported("dictionary indices without a dictionary page")
            data = self._decompress(self._read(page), page.uncompressed)
            values, pos = [], 0
            for _ in range(page.rows):
                value, pos = _next_plain(data, pos)
                values.append(value)
            self._dictionary = values
        return self._dictionary

    def _read(self, page: _Page) -> bytes:
        raw = os.pread(self.fd, page.compressed, page.body)
        if len(raw) != page.compressed:
            raise ValueError("the file ends inside a page: truncated since indexing")
        return raw

    def _decompress(self, raw: bytes, size: int) -> bytes:
        if self.codec is None:
            return raw
        import pyarrow as pa

        try:
            if self.codec == "lz4_hadoop":
                return _lz4_hadoop(pa.Codec("lz4_raw"), raw, size)
            return pa.Codec(self.codec).decompress(raw, decompressed_size=size).to_pybytes()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ValueError(f"a damaged {self.codec} page: {exc}") from None


def _lz4_hadoop(codec, raw: bytes, size: int) -> bytes:
    """Parquet's old LZ4, as Arrow reads it: blocks framed Hadoop's way (big-endian decompressed
    and compressed sizes before each), else one raw LZ4 block (what Arrow writes)."""
    blocks, pos = [], 0
    while pos + 8 <= len(raw):
        plain, packed = struct.unpack_from(">II", raw, pos)
        if pos + 8 + packed > len(raw) or plain > size:
            break
        blocks.append((raw[pos + 8 : pos + 8 + packed], plain))
        pos += 8 + packed
    if blocks and pos == len(raw) and sum(plain for _, plain in blocks) == size:
        return b"".join(codec.decompress(block, decompressed_size=plain).to_pybytes() for block, plain in blocks)
    return codec.decompress(raw, decompressed_size=size).to_pybytes()


def _count(v: object) -> int:
    if type(v) is not int or not 0 <= v <= 1 << 31:
        raise Unsupported("a count that is not one")
    return v


def _next_plain(data: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(data):
        raise Unsupported("a PLAIN value past its page")
    (n,) = struct.unpack_from("<I", data, pos)
    if pos + 4 + n > len(data):
        raise Unsupported("a PLAIN value past its page")
    return data[pos + 4 : pos + 4 + n], pos + 4 + n


def _plain(data: bytes, index: int) -> bytes:
    """The ``index``-th of PLAIN byte arrays (a 4-byte length, then the bytes)."""
    pos = 0
    for _ in range(index):
        if pos + 4 > len(data):
            raise Unsupported("a PLAIN value past its page")
        pos += 4 + struct.unpack_from("<I", data, pos)[0]
    return _next_plain(data, pos)[0]


def _hybrid(data: bytes, bit_width: int, count: int) -> list[int]:
    """The first ``count`` values of Parquet's RLE / bit-packed hybrid encoding."""
    if not 0 <= bit_width <= 32:
        raise Unsupported(f"a bit width of {bit_width}")
    out: list[int] = []
    pos, width, mask = 0, (bit_width + 7) // 8, (1 << bit_width) - 1
    while len(out) < count:
        header = shift = 0
        while True:
            if pos >= len(data) or shift > 35:
                raise Unsupported("levels or indices cut short")
            b = data[pos]
            pos += 1
            header |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if header & 1:  # bit-packed groups of 8 values
            nbytes = (header >> 1) * bit_width
            if pos + nbytes > len(data) or not nbytes and bit_width:
                raise Unsupported("bit-packed values cut short")
            packed = int.from_bytes(data[pos : pos + nbytes], "little")
            pos += nbytes
            for v in range(min((header >> 1) * 8, count - len(out))):  # bit width 0: zeros
                out.append((packed >> (v * bit_width)) & mask)
        else:
            run = header >> 1
            if run == 0 or pos + width > len(data):
                raise Unsupported("a run cut short")
            value = int.from_bytes(data[pos : pos + width], "little")
            pos += width
            out.extend([value] * min(run, count - len(out)))
    return out[:count]
