"""One value of a Parquet byte-array column, read from its data page alone.

pyarrow reads a column a row group at a time. For a shuffled epoch over image rows, every
sample would read its row group's whole image column: the Hub writes image datasets in
groups of 100 rows, several MB. A data page holds a few images (pyarrow's pages are 1 MB),
and its header says how many rows it holds. So the page headers of a column chunk are read
once (a few bytes each), and a row then costs the read and decoding of its one page.

This reads what writers produce for an image column: BYTE_ARRAY values, PLAIN or
dictionary-encoded, optional (nullable) levels, data pages v1 and v2, the codecs pyarrow can
decompress. Anything else (a repeated column, another encoding, Hadoop's LZ4, headers that do
not add up to the row group, a page of more than _MAX_PAGE_ROWS rows) raises Unsupported, and
the caller reads the row group through pyarrow instead.

A page serves no row before it is checked whole, once (the verdict is kept per page, so that
what a row gets never depends on which rows were read before it):

- its bytes lie inside its chunk and the file, match its header's CRC32 where it has one (the only
  check that reaches inside an image), and decompress to exactly the size its header says;
- its definition levels decode to exactly its ``num_values`` levels, none above the column's
  maximum (and a v2 page's ``num_nulls`` counts the levels below it);
- PLAIN: as many values as the levels say are present, whose 4-byte lengths take the values
  section exactly, to its last byte; dictionary: that many indices, each inside a dictionary
  whose own entries take its page exactly.

A page that fails raises Damaged for every row of it. The caller makes those rows bad samples:
pyarrow reads some such pages (a level that says null where a value is, a last length cut
short) shifted by a value or cut, which is a neighbour's image under this row's label, and so
it is asked only for its words when it refuses the page too. Nothing in a file can make this
read past the chunk, allocate without bound or loop.

``column_leaf`` finds the leaf column (the chunk) of a column named exactly, for this reader and
for pyarrow's reads by index alike.
"""

from __future__ import annotations

import bisect
import struct
import zlib
from dataclasses import dataclass, replace

import numpy as np

from prefetchd.sources.thriftcompact import CompactReader, Short, Unsupported

# The codecs whose output length is checked against the page's header: a page that claims more
# than it holds would otherwise come back padded with whatever memory was there (pyarrow's
# Codec.decompress returns the size asked for). Brotli and LZ4 pages are read by pyarrow.
_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd"}
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
_MAX_PAGE_BYTES = 64 << 20  # a page claiming more (one image bigger than this) is read by pyarrow
_MAX_DICTIONARY = 1 << 16  # entries: an image column's dictionary holds a few dozen
_MAX_HEADER_BYTES = 1 << 20  # statistics can make a header long; not this long
# A page's check decodes every level of it in Python: an image page holds a few dozen rows, and a
# run of nulls costs two bytes, so the rows a header may claim are bounded here, not by its size.
_MAX_PAGE_ROWS = 1 << 17
_CHECKED_PAGE_BYTES = 200  # what a checked page's row table costs beyond its arrays


class Damaged(Exception):
    """A page, or the dictionary it uses, whose structure does not vouch for its rows."""


@dataclass(frozen=True)
class _Rows:
    """A checked page's rows: where each value starts in the page's values section and its length
    (PLAIN), or its dictionary index (``sizes`` None); a slot of -1 is a null row."""

    slots: np.ndarray
    sizes: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes + (0 if self.sizes is None else self.sizes.nbytes) + _CHECKED_PAGE_BYTES


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
    nulls: int = -1  # v2: the header's num_nulls (v1 pages do not say)
    crc: int | None = None  # the CRC32 of its bytes as stored, where the header has one


class ColumnChunk:
    """The pages of one column chunk (a column in a row group): where each starts, and its rows."""

    def __init__(self, pread, meta, max_definition_level: int, rows: int):
        """``pread``: (size, offset) -> the file's bytes there (os.pread with the file's fd bound, or
        an object's ranged reads); ``meta``: pyarrow's ColumnChunkMetaData; ``rows``: the row
        group's rows."""
        if meta.physical_type != "BYTE_ARRAY":
            raise Unsupported(f"a {meta.physical_type} column")
        if meta.compression not in _CODECS:
            raise Unsupported(f"{meta.compression} compression")
        if meta.num_values != rows:  # a column that is not repeated has a value (or null) per row
            raise Unsupported(f"a chunk of {meta.num_values} values in a row group of {rows} rows")
        self.pread, self.max_def, self.rows = pread, max_definition_level, rows
        self.codec = _CODECS[meta.compression]
        start = meta.dictionary_page_offset if meta.has_dictionary_page and meta.dictionary_page_offset else None
        start = meta.data_page_offset if start is None else min(start, meta.data_page_offset)
        self.end = start + meta.total_compressed_size
        self.pages: list[_Page] = []
        self._dictionary_page: _Page | None = None
        self._dictionary: tuple[bytes, list[int]] | None = None
        self._dictionary_damage: str | None = None  # why the dictionary page does not vouch, once known
        # page number -> its checked rows, or (Damaged or Unsupported, why) for a page that failed
        self._checked: dict[int, _Rows | tuple[type, str]] = {}
        self._checked_bytes = 0
        offset, row = start, 0
        while row < rows:
            if offset >= self.end:
                raise Unsupported("the chunk ends before its rows do")
            header, body = self._header(offset)
            page = self._page(header, body, row)
            if type(header.get(4)) is int:  # the only check of bytes inside an image (parquet-mr writes it)
                page = replace(page, crc=header[4] & 0xFFFFFFFF)
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
            buf = self.pread(min(size, self.end - offset), offset)
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
            return _Page(
                body,
                compressed,
                uncompressed,
                first_row,
                rows,
                2,
                _enum(v2.get(4)),
                def_bytes,
                def_bytes,
                values_compressed,
                _count(v2.get(2)),
            )
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
        """The value at ``row`` of the row group (None: null); Damaged when its page, checked whole
        the first time one of its rows is read, does not vouch for its rows; Unsupported for a
        page this does not read."""
        number = bisect.bisect_right(self._firsts, row) - 1
        page = self.pages[number]
        rows, values = self._rows(number)
        k = row - page.first_row
        slot = int(rows.slots[k])
        if slot < 0:
            return None
        if rows.sizes is None:
            data, ends = self._dictionary_values()
            return _entry(data, ends, slot)
        size = int(rows.sizes[k])
        values = self._sections(page)[1] if values is None else values
        # The page is read again for each row. A file rewritten in place keeping its size and mtime
        # (the caller's identity check) is the only way its bytes differ from the checked ones: the
        # length before the value is the cheap proof that they do not.
        if slot + size > len(values) or int.from_bytes(values[slot - 4 : slot], "little") != size:
            raise Damaged("the page is not the one that was checked: the file was rewritten in place")
        return bytes(values[slot : slot + size])

    @property
    def held_bytes(self) -> int:
        """What the checked pages' row tables and the decoded dictionary hold in memory; the caller
        bounds it."""
        held = self._checked_bytes
        return held if self._dictionary is None else held + len(self._dictionary[0]) + 8 * len(self._dictionary[1])

    def drop_decoded(self) -> None:
        """Forget the decoded dictionary and the checked pages' row tables (checked again when
        read); a page's failure is kept: a few words."""
        self._dictionary = None
        self._checked = {n: v for n, v in self._checked.items() if not isinstance(v, _Rows)}
        self._checked_bytes = 0

    def _rows(self, number: int) -> tuple[_Rows, memoryview | None]:
        """The page's checked rows, and its values section if it was checked just now (so that the
        row which makes the check does not read and decompress the page twice)."""
        verdict, values = self._checked.get(number), None
        if verdict is None:
            try:
                verdict, values = self._check(self.pages[number])
                self._checked_bytes += verdict.nbytes
            except (Damaged, Unsupported) as exc:
                verdict = (type(exc), str(exc))
            self._checked[number] = verdict
        if isinstance(verdict, tuple):
            raise verdict[0](verdict[1])
        return verdict, values

    def _check(self, page: _Page) -> tuple[_Rows, memoryview]:
        """The page's rows, once its levels and values are found to add up (see the module's doc),
        and its values section."""
        if page.rows > _MAX_PAGE_ROWS:
            raise Unsupported(f"a page of {page.rows} rows")
        if page.encoding not in (_PLAIN, _PLAIN_DICTIONARY, _RLE_DICTIONARY):
            raise Unsupported(f"encoding {page.encoding}")
        levels, values = self._sections(page, check_crc=True)
        present = None
        if self.max_def:
            defs = np.array(_hybrid(levels, self.max_def.bit_length(), page.rows), np.int64)
            if defs.max() > self.max_def:
                raise Damaged(f"a definition level of {defs.max()}, above the column's {self.max_def}")
            present = defs == self.max_def
        elif len(levels):
            raise Damaged("definition levels in a page of a column that has none")
        count = page.rows if present is None else int(present.sum())
        if page.nulls >= 0 and page.nulls != page.rows - count:
            raise Damaged(f"its header counts {page.nulls} nulls, its definition levels {page.rows - count}")
        starts, sizes = (
            _plain_values(values, count) if page.encoding == _PLAIN else (self._indices(values, count), None)
        )
        slots = np.full(page.rows, -1, np.int64)
        lengths = None if sizes is None else np.zeros(page.rows, np.int64)
        where = slice(None) if present is None else present
        slots[where] = starts
        if lengths is not None:
            lengths[where] = sizes
        return _Rows(slots, lengths), values

    def _indices(self, values: memoryview, count: int) -> list[int]:
        """The page's ``count`` dictionary indices, each checked against its dictionary."""
        if not count:
            return []
        if not values:
            raise Damaged("dictionary indices missing")
        indices = _hybrid(values[1:], values[0], count)
        entries = len(self._dictionary_values()[1])
        if max(indices) >= entries:
            raise Damaged(f"a dictionary index of {max(indices)} in a dictionary of {entries} entries")
        return indices

    def _sections(self, page: _Page, check_crc: bool = False) -> tuple[memoryview, memoryview]:
        """The page's definition level bytes and its values section, decompressed."""
        raw = self._read(page, check_crc)
        if page.version == 1:
            data = memoryview(self._decompress(raw, page.uncompressed))
            if not self.max_def:
                return data[:0], data
            n = int.from_bytes(data[:4], "little") if len(data) >= 4 else -1
            if not 0 <= n <= len(data) - 4:
                raise Damaged("definition levels longer than their page")
            return data[4 : 4 + n], data[4 + n :]
        levels, rest = memoryview(raw)[: page.levels], raw[page.levels :]
        size = page.uncompressed - page.levels
        if page.values_compressed:
            return levels, memoryview(self._decompress(rest, size))
        if len(rest) != size:
            raise Damaged(f"an uncompressed v2 page of {len(rest)} bytes of values that says it has {size}")
        return levels, memoryview(rest)

    def _dictionary_values(self) -> tuple[bytes, list[int]]:
        """The dictionary page's bytes and where each entry ends (entry i: a 4-byte length, then it);
        Damaged unless its entries take the page exactly."""
        if self._dictionary is None:
            page = self._dictionary_page
            if page is None:
                raise Damaged("dictionary indices without a dictionary page")
            if self._dictionary_damage is not None:
                raise Damaged(self._dictionary_damage)
            try:
                data = self._decompress(self._read(page, check_crc=True), page.uncompressed)
                starts, sizes = _plain_values(memoryview(data), page.rows)
            except Damaged as exc:
                self._dictionary_damage = f"its dictionary page: {exc}"
                raise Damaged(self._dictionary_damage) from None
            self._dictionary = (data, [a + n for a, n in zip(starts, sizes)])
        return self._dictionary

    def _read(self, page: _Page, check_crc: bool) -> bytes:
        """The page's bytes as stored; their checksum checked when the page is (once: the CRC32 of a
        20 MB page, 200 images of 100 KB, costs more than its read)."""
        raw = self.pread(page.compressed, page.body)
        if len(raw) != page.compressed:
            raise Damaged("the file ends inside the page")
        if check_crc and page.crc is not None and zlib.crc32(raw) != page.crc:
            raise Damaged("its bytes do not match its header's checksum (CRC32)")
        return raw

    def _decompress(self, raw: bytes, size: int) -> bytes:
        """``raw`` decompressed, exactly ``size`` bytes long, or Damaged."""
        if self.codec is None:
            if len(raw) != size:
                raise Damaged(f"an uncompressed page of {len(raw)} bytes that says it has {size}")
            return raw
        if self.codec == "gzip":  # the standard library, which says how much it really produced
            inflate = zlib.decompressobj(wbits=47)  # a gzip or zlib header
            try:
                data = inflate.decompress(raw, size + 1)
            except zlib.error as exc:
                raise Damaged(f"a damaged gzip page: {exc}") from None
            if len(data) != size or not inflate.eof:
                raise Damaged(f"a gzip page that does not hold the {size} bytes it says")
            return data
        if self.codec == "snappy" and _snappy_length(raw) != size:  # snappy says its length first
            raise Damaged(f"a snappy page that does not hold the {size} bytes it says")
        import pyarrow as pa

        try:  # snappy checks its stream against that length; zstd its frame against the size asked
            return pa.Codec(self.codec).decompress(raw, decompressed_size=size).to_pybytes()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise Damaged(f"a damaged {self.codec} page: {exc}") from None


def _leaf_count(pa, t) -> int:
    """How many Parquet leaf columns the Arrow type of a column read from Parquet spans."""
    count, stack = 0, [t]
    while stack:  # not recursive: a file's schema may nest deeper than Python's stack
        t = stack.pop()
        t = t.storage_type if isinstance(t, pa.ExtensionType) else t
        if pa.types.is_struct(t):
            stack.extend(t.field(i).type for i in range(t.num_fields))
        elif pa.types.is_map(t):
            stack.extend((t.key_type, t.item_type))
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            stack.append(t.value_type)
        else:
            count += 1
    return count


def column_leaf(pa, pf, column: str, child: str | None = None) -> int | None:
    """The index of the Parquet leaf column that holds top-level ``column`` of ``pf`` (pyarrow's
    ParquetFile), or its struct field ``child``; None if there is no single such column, or no leaf
    of that path where it should be. Leaves come in the schema's order, each top-level column's
    together. The index, not a name: pyarrow's ``columns=`` takes a name as a path prefix."""
    schema = pf.schema_arrow
    index = schema.get_field_index(column)  # -1: missing, or there twice
    if index < 0:
        return None
    leaf = sum(_leaf_count(pa, schema.field(i).type) for i in range(index))
    t, path = schema.field(index).type, column
    if child is not None:
        at = t.get_field_index(child)
        if at < 0:
            return None
        leaf += sum(_leaf_count(pa, t.field(i).type) for i in range(at))
        t, path = t.field(at).type, f"{column}.{child}"
    if _leaf_count(pa, t) != 1 or leaf >= len(pf.schema):
        return None
    described = pf.schema.column(leaf)
    return leaf if described.path == path and described.max_repetition_level == 0 else None


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


def _plain_values(data: memoryview, count: int) -> tuple[list[int], list[int]]:
    """Where each of ``count`` PLAIN byte arrays (a 4-byte length, then the bytes) starts in
    ``data``, and its length; Damaged unless they take ``data`` exactly, to its last byte."""
    starts, sizes, pos, end = [], [], 0, len(data)
    unpack = struct.Struct("<I").unpack_from
    for i in range(count):
        size = unpack(data, pos)[0] if pos + 4 <= end else end
        if pos + 4 + size > end:
            raise Damaged(f"PLAIN value {i} of {count} goes past the end of the page")
        starts.append(pos + 4)
        sizes.append(size)
        pos += 4 + size
    if pos != end:
        raise Damaged(f"its {count} PLAIN values end at byte {pos} of its {end}")
    return starts, sizes


def _hybrid(data: bytes, bit_width: int, count: int) -> list[int]:
    """The first ``count`` values of Parquet's RLE / bit-packed hybrid encoding."""
    if not 0 <= bit_width <= 32:
        raise Damaged(f"a bit width of {bit_width}")
    out: list[int] = []
    pos, width, mask = 0, (bit_width + 7) // 8, (1 << bit_width) - 1
    while len(out) < count:
        header = shift = 0
        while True:
            if pos >= len(data) or shift > 35:
                raise Damaged("definition levels or dictionary indices cut short")
            b = data[pos]
            pos += 1
            header |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if header & 1:  # bit-packed groups of 8 values
            nbytes = (header >> 1) * bit_width
            if pos + nbytes > len(data) or not nbytes and bit_width:
                raise Damaged("bit-packed levels or indices cut short")
            base = pos
            pos += nbytes
            for v in range(min((header >> 1) * 8, count - len(out))):  # only the bytes each value spans
                bit = v * bit_width
                spanned = int.from_bytes(data[base + (bit >> 3) : base + ((bit + bit_width + 7) >> 3)], "little")
                out.append((spanned >> (bit & 7)) & mask)  # bit width 0: zeros
        else:
            run = header >> 1
            if run == 0 or pos + width > len(data):
                raise Damaged("a run of levels or indices cut short")
            value = int.from_bytes(data[pos : pos + width], "little")
            pos += width
            out.extend([value] * min(run, count - len(out)))
    return out[:count]
