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
import zlib
from dataclasses import dataclass

from .thriftcompact import CompactReader, Short, Unsupported

# The codecs whose output length is checked against the page's header: a page that claims more
# than it holds would otherwise come back padded with whatever memory was there (pyarrow's
# Codec.decompress returns the size asked for). Brotli and LZ4 pages are read by pyarrow.
_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd"}
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
_MAX_PAGE_BYTES = 64 << 20  # a page claiming more (one image bigger than this) is read by pyarrow
_MAX_DICTIONARY = 1 << 16  # entries: an image column's dictionary holds a few dozen
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
            raise Unsupported("a page of no size, or of more than 64 MiB")
        if kind == _DATA_PAGE and type(kind) is int:
            v1 = _struct(header.get(5))
            if self.max_def and _enum(v1.get(3)) != _RLE:
                raise Unsupported("a data page whose levels are not RLE")
            return _Page(body, compressed, uncompressed, first_row, _count(v1.get(1)), 1, _enum(v1.get(2)))
        if kind == _DATA_PAGE_V2 and type(kind) is int:
            v2 = _struct(header.get(8))
            rows = _count(v2.get(1))
            if _count(v2.get(6, 0)) != 0 or _count(v2.get(3)) != rows:
                raise Unsupported("a v2 data page with repetition levels, or rows that are not its values")
            def_bytes = _count(v2.get(5, 0))
            if def_bytes > min(compressed, uncompressed):
                raise Unsupported("v2 levels longer than their page")
            values_compressed = v2.get(7, True)
            if type(values_compressed) is not bool:
                raise Unsupported("a v2 page's is_compressed that is not a boolean")
            return _Page(body, compressed, uncompressed, first_row, rows, 2, _enum(v2.get(4)), def_bytes, def_bytes,
                         values_compressed)
        if kind == _DICTIONARY_PAGE and type(kind) is int:
            d = _struct(header.get(7))
            entries = _count(d.get(1))
            if _enum(d.get(2)) not in (_PLAIN, _PLAIN_DICTIONARY) or entries > _MAX_DICTIONARY:
                raise Unsupported("a dictionary page that is not PLAIN, or of too many entries")
            return _Page(body, compressed, uncompressed, 0, entries, 1, _PLAIN)
        if kind == _INDEX_PAGE and type(kind) is int:
            return _Page(body, compressed, uncompressed, first_row, 0, 1, _PLAIN)
        raise Unsupported(f"page type {kind!r}")

    def value(self, row: int) -> bytes | None:
        """The value at ``row`` of the row group (None: null)."""
        page = self.pages[bisect.bisect_right(self._firsts, row) - 1]
        k = row - page.first_row
        raw = self._read(page)
        if page.version == 1:
            data = memoryview(self._decompress(raw, page.uncompressed))
            if self.max_def:
                (n,) = struct.unpack_from("<I", data, 0) if len(data) >= 4 else (-1,)
                if not 0 <= n <= len(data) - 4:
                    raise Unsupported("definition levels longer than their page")
                levels, values = data[4 : 4 + n], data[4 + n :]
            else:
                levels, values = data[:0], data
        else:
            levels = memoryview(raw)[: page.levels]
            rest = raw[page.levels :]
            values = memoryview(
                self._decompress(rest, page.uncompressed - page.levels) if page.values_compressed else rest
            )
        index = k
        if self.max_def:
            defs = _hybrid(levels, self.max_def.bit_length(), k + 1)
            if max(defs) > self.max_def:
                raise Unsupported("a definition level above the column's")
            if defs[k] != self.max_def:
                return None
            index = defs[:k].count(self.max_def)
        if page.encoding == _PLAIN:
            return bytes(_plain(values, index))
        if page.encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
            if not values:
                raise Unsupported("dictionary indices missing")
            (i,) = _hybrid(values[1:], values[0], index + 1)[index:]
            data, ends = self._dictionary_values()
            if i >= len(ends):
                raise Unsupported("a dictionary index past the dictionary")
            return _entry(data, ends, i)
        raise Unsupported(f"encoding {page.encoding}")

    @property
    def dictionary_bytes(self) -> int:
        """What the decoded dictionary holds in memory (0: not decoded); the caller bounds it."""
        return 0 if self._dictionary is None else len(self._dictionary[0]) + 8 * len(self._dictionary[1])

    def drop_dictionary(self) -> None:
        self._dictionary = None

    def _dictionary_values(self) -> tuple[bytes, list[int]]:
        """The dictionary page's bytes and where each entry ends (entry i: a 4-byte length, then it)."""
        if self._dictionary is None:
            page = self._dictionary_page
            if page is None:
                raise Unsupported("dictionary indices without a dictionary page")
            data = self._decompress(self._read(page), page.uncompressed)
            ends, pos = [], 0
            for _ in range(page.rows):
                pos = _next_plain(data, pos)[1]
                ends.append(pos)
            self._dictionary = (data, ends)
        return self._dictionary

    def _read(self, page: _Page) -> bytes:
        raw = os.pread(self.fd, page.compressed, page.body)
        if len(raw) != page.compressed:
            raise ValueError("the file ends inside a page: truncated since indexing")
        return raw

    def _decompress(self, raw: bytes, size: int) -> bytes:
        """``raw`` decompressed, exactly ``size`` bytes long, or ValueError (a damaged page)."""
        if self.codec is None:
            if len(raw) != size:
                raise ValueError(f"an uncompressed page of {len(raw)} bytes that says it has {size}")
            return raw
        if self.codec == "gzip":  # the standard library, which says how much it really produced
            inflate = zlib.decompressobj(wbits=47)  # a gzip or zlib header
            try:
                data = inflate.decompress(raw, size + 1)
            except zlib.error as exc:
                raise ValueError(f"a damaged gzip page: {exc}") from None
            if len(data) != size or not inflate.eof:
                raise ValueError(f"a gzip page that does not hold the {size} bytes it says")
            return data
        if self.codec == "snappy" and _snappy_length(raw) != size:  # snappy says its length first
            raise ValueError(f"a snappy page that does not hold the {size} bytes it says")
        import pyarrow as pa

        try:  # snappy checks its stream against that length; zstd its frame against the size asked
            return pa.Codec(self.codec).decompress(raw, decompressed_size=size).to_pybytes()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ValueError(f"a damaged {self.codec} page: {exc}") from None


def _entry(data: bytes, ends: list[int], i: int) -> bytes:
    start = ends[i - 1] if i else 0
    return bytes(data[start + 4 : ends[i]])


def _snappy_length(raw: bytes) -> int:
    """The uncompressed length a snappy block begins with (a varint); -1 if it has none."""
    length = shift = 0
    for b in raw[:5]:
        length |= (b & 0x7F) << shift
        if not b & 0x80:
            return length
        shift += 7
    return -1


def _struct(v: object) -> dict:
    if not isinstance(v, dict):
        raise Unsupported("a page header without its page's header")
    return v


def _enum(v: object) -> int:
    if type(v) is not int:  # a boolean, or nothing, where an encoding belongs
        raise Unsupported(f"an encoding that is not one: {v!r}")
    return v


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
            base = pos
            pos += nbytes
            for v in range(min((header >> 1) * 8, count - len(out))):  # only the bytes each value spans
                bit = v * bit_width
                spanned = int.from_bytes(data[base + (bit >> 3) : base + ((bit + bit_width + 7) >> 3)], "little")
                out.append((spanned >> (bit & 7)) & mask)  # bit width 0: zeros
        else:
            run = header >> 1
            if run == 0 or pos + width > len(data):
                raise Unsupported("a run cut short")
            value = int.from_bytes(data[pos : pos + width], "little")
            pos += width
            out.extend([value] * min(run, count - len(out)))
    return out[:count]
