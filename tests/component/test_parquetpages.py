"""parquetpages against pyarrow: every value of every row group, over the writer's options
(codecs, dictionary or not, page sizes, data page v1 and v2, nulls, Hub-style structs), and
damaged files: a value comes back right, or the reader falls back, or says ValueError."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from prefetchd.sources.parquetpages import ColumnChunk, Unsupported  # noqa: E402
from prefetchd.sources.parquetrows import ParquetRows  # noqa: E402

_HUB_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@st.composite
def tables(draw):
    n = draw(st.integers(1, 120))
    sizes = draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = [None if rng.random() < 0.1 else rng.bytes(size) for size in sizes]
    if draw(st.booleans()):  # repeated values: a dictionary that pays
        values = [v if v is None else values[i % 3] or b"x" for i, v in enumerate(values)]
    if draw(st.booleans()):
        column = pa.array(
            [None if v is None and i % 2 else {"bytes": v, "path": "p"} for i, v in enumerate(values)], _HUB_IMAGE
        )
        return pa.table({"image": column}), "image.bytes"
    return pa.table({"image": pa.array(values, draw(st.sampled_from([pa.binary(), pa.large_binary()])))}), "image"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    table=tables(),
    compression=st.sampled_from(["none", "snappy", "gzip", "zstd"]),
    dictionary=st.booleans(),
    page_size=st.sampled_from([512, 4096, 1 << 20]),
    version=st.sampled_from(["1.0", "2.0"]),
    group=st.integers(1, 200),
    statistics=st.booleans(),
)
def test_every_value_is_pyarrows(tmp_path, table, compression, dictionary, page_size, version, group, statistics):
    table, leaf = table
    path = tmp_path / f"t{os.getpid()}.parquet"
    pq.write_table(
        table,
        path,
        compression=compression,
        use_dictionary=dictionary,
        data_page_size=page_size,
        data_page_version=version,
        row_group_size=group,
        write_statistics=statistics,
    )
    pf = pq.ParquetFile(path)
    (ci,) = [i for i in range(len(pf.schema)) if pf.schema.column(i).path == leaf]
    fd = os.open(path, os.O_RDONLY)
    try:
        for g in range(pf.metadata.num_row_groups):
            meta = pf.metadata.row_group(g)
            expected = pf.read_row_group(g, columns=[leaf]).column(0).combine_chunks()
            if pa.types.is_struct(expected.type):
                expected = expected.flatten()[0]
            pread = functools.partial(os.pread, fd)
            chunk = ColumnChunk(pread, meta.column(ci), pf.schema.column(ci).max_definition_level, meta.num_rows)
            assert [chunk.value(r) for r in range(meta.num_rows)] == expected.to_pylist()
    finally:
        os.close(fd)
        pf.close()


def test_rows_are_read_from_their_pages_not_their_row_groups(tmp_path):
    images = [os.urandom(20_000) for _ in range(200)]
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"image": images}), path, row_group_size=100, data_page_size=64 << 10)
    reader = ParquetRows()
    try:
        order = np.random.default_rng(0).permutation(200).tolist()
        assert [reader.read(str(path), i // 100, i % 100, "image") for i in order] == [images[i] for i in order]
        assert not reader._groups and reader.cached_bytes <= reader.cache_bytes  # no row group read whole
    finally:
        reader.close()


@pytest.mark.timeout(120)
def test_damaged_pages_give_a_value_or_a_value_error_never_anything_else(tmp_path):
    rng = np.random.default_rng(7)
    images = [rng.bytes(int(rng.integers(100, 5000))) for _ in range(60)]
    clean = tmp_path / "clean.parquet"
    pq.write_table(
        pa.table({"image": images}),
        clean,
        row_group_size=20,
        data_page_size=4096,
        compression="snappy",
        use_dictionary=False,
    )
    data = clean.read_bytes()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # leave the footer: indexing reads it
    outcomes = {"right": 0, "ValueError": 0, "wrong": 0}
    for trial in range(300):
        damaged = bytearray(data)
        for at in rng.integers(4, footer, size=int(rng.integers(1, 8))):
            damaged[at] = int(rng.integers(0, 256))
        path = tmp_path / f"d{trial}.parquet"
        path.write_bytes(bytes(damaged))
        reader = ParquetRows()
        try:
            for i in rng.permutation(60)[:10].tolist():
                try:
                    got = reader.read(str(path), i // 20, i % 20, "image")
                except ValueError:
                    outcomes["ValueError"] += 1
                    continue
                outcomes["right" if got == images[i] else "wrong"] += 1
        finally:
            reader.close()
            path.unlink()
    # A flipped byte inside an image's own bytes is read back as it is, by pyarrow too (no
    # checksums by default): the decoder then makes it a bad sample. What matters here is that
    # nothing but a value or a ValueError comes out, and nothing hangs.
    assert outcomes["right"] > 0 and outcomes["ValueError"] > 0, outcomes


@pytest.mark.parametrize("compression", ["lz4", "brotli"])
def test_codecs_whose_length_is_not_checked_are_read_by_pyarrow(tmp_path, compression):
    # pyarrow's Codec.decompress pads a page that holds less than it claims with stale memory.
    images = [os.urandom(3000) for _ in range(30)]
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"image": images}), path, compression=compression, row_group_size=10)
    reader = ParquetRows()
    try:
        assert [reader.read(str(path), i // 10, i % 10, "image") for i in range(30)] == images
        assert reader._groups, "read a row group at a time"
    finally:
        reader.close()


def test_an_unsupported_chunk_falls_back_to_the_row_group(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"image": pa.array([1, 2, 3])}), path)
    pf = pq.ParquetFile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(Unsupported, match="INT64"):
            ColumnChunk(functools.partial(os.pread, fd), pf.metadata.row_group(0).column(0), 1, 3)
    finally:
        os.close(fd)


def test_decoded_dictionaries_count_against_the_cache_bound(tmp_path):
    # pyarrow's defaults dictionary-encode a row group's first images (a page of several MB):
    # kept for the group's other rows, but within the reader's bound.
    images = [os.urandom(50_000) for _ in range(400)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"image": images}), path, row_group_size=40)
    reader = ParquetRows(cache_bytes=4 << 20)
    try:
        for i in range(0, 400, 40):
            assert reader.read(str(path), i // 40, 0, "image") == images[i]
            assert reader.read(str(path), i // 40, 1, "image") == images[i + 1]
            assert 0 < reader.cached_bytes <= 4 << 20 and not reader._groups
    finally:
        reader.close()
    assert reader.cached_bytes == 0


def _prefix_at(data: bytes, value: bytes) -> int:
    """Where the 4-byte PLAIN length before ``value`` lies in an uncompressed file written without
    statistics (which would hold the smallest and largest value too); values are unique."""
    at = data.index(value) - 4
    assert int.from_bytes(data[at : at + 4], "little") == len(value)
    return at


def _write_uncompressed(path, images: list[bytes], **options) -> None:
    """``images`` labelled 0, 1, ...: uncompressed PLAIN pages without statistics, so that each
    value's bytes lie in the file as they are."""
    table = pa.table({"image": images, "label": list(range(len(images)))})
    pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False, **options)


def _outcomes(path, order) -> dict[int, bytes | str]:
    """Each row's bytes, or the text of the ValueError its read raised, read in ``order`` by a new reader."""
    reader = ParquetRows()
    out: dict[int, bytes | str] = {}
    try:
        for i in order:
            try:
                out[i] = reader.read(str(path), 0, i, "image")
            except ValueError as exc:
                out[i] = str(exc)
    finally:
        reader.close()
    return out


@pytest.mark.parametrize("page_size", [1 << 20, 1024], ids=["one-page", "pages"])
def test_a_damaged_length_prefix_never_serves_a_neighbours_image(tmp_path, page_size):
    """issue 24 finding 5: one PLAIN length prefix made to take in the next value too. The reader
    read prefixes only up to row k: it served row 2's image for row 1, row 3's for row 2, ... (94
    of 96 rows, all as valid), where pyarrow refuses the page; what a row got depended on the order
    of the reads."""
    images = [f"image {i:03d};".encode() * (8 + i % 5) for i in range(96)]
    path = tmp_path / "x.parquet"
    _write_uncompressed(path, images, data_page_size=page_size, write_batch_size=8)
    data = bytearray(path.read_bytes())
    at = _prefix_at(data, images[1])
    data[at : at + 4] = (len(images[1]) + 4 + len(images[2])).to_bytes(4, "little")
    path.write_bytes(data)
    with pytest.raises(pa.ArrowInvalid, match="Invalid or truncated PLAIN-encoded BYTE_ARRAY data"):
        pq.read_table(path)
    orders = [range(96), range(95, -1, -1), np.random.default_rng(3).permutation(96).tolist()]
    runs = [_outcomes(path, order) for order in orders]
    assert runs[0] == runs[1] == runs[2], "what a row gets does not depend on the order of the reads"
    outcome = runs[0]
    wrong = [i for i, got in outcome.items() if isinstance(got, bytes) and got != images[i]]
    refused = sorted(i for i, got in outcome.items() if isinstance(got, str))
    assert wrong == []
    assert {1, 2} <= set(refused)
    for i in refused:
        assert outcome[i] == f"{path}: cannot read row group 0: Invalid or truncated PLAIN-encoded BYTE_ARRAY data"
    if page_size == 1 << 20:
        assert refused == list(range(96))
    else:  # the pages that the damage does not touch vouch for their own rows
        assert 0 < len(refused) < 40, refused
    print(f"\n[figure] one prefix changed, {page_size}-byte pages: {len(wrong)} wrong, {len(refused)}/96 refused")


def _nullable_page(tmp_path):
    """(path, file bytes, images, where the definition levels' bit-packed bytes start): 40 rows,
    every fifth one null, one uncompressed PLAIN page."""
    images = [None if i % 5 == 1 else f"image {i:03d};".encode() * 3 for i in range(40)]
    path = tmp_path / "n.parquet"
    table = pa.table({"image": pa.array(images, pa.binary())})
    pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False)
    pf = pq.ParquetFile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        (page,) = ColumnChunk(functools.partial(os.pread, fd), pf.metadata.row_group(0).column(0), 1, 40).pages
    finally:
        os.close(fd)
        pf.close()
    data = path.read_bytes()
    levels = page.body + 4  # a v1 page: a 4-byte length, then the RLE / bit-packed hybrid levels
    assert data[levels] == (5 << 1) | 1, "pyarrow bit-packs these 40 levels as 5 groups of 8"
    return path, bytearray(data), images, levels + 1


def _set_bit(data: bytearray, at: int, bit: int, value: bool) -> None:
    data[at + bit // 8] = data[at + bit // 8] | (1 << bit % 8) if value else data[at + bit // 8] & ~(1 << bit % 8)


@pytest.mark.parametrize(
    "damage, pyarrow_says",
    [
        ("a null row's level says it has a value", "Invalid or truncated PLAIN-encoded BYTE_ARRAY data"),
        ("a row's level says it is null", None),  # pyarrow reads the page: its values shifted by one
        ("the last value's length is two bytes short", None),  # pyarrow reads a truncated last value
    ],
)
def test_levels_and_lengths_that_do_not_add_up_to_the_page_refuse_its_rows(tmp_path, damage, pyarrow_says):
    """The definition levels say how many values a page holds; its PLAIN lengths must sum to its
    values exactly. Where they do not, pyarrow refuses the page or reads it shifted; neither is a
    row's image."""
    path, data, images, bits = _nullable_page(tmp_path)
    if damage.startswith("a null"):
        _set_bit(data, bits, 1, True)
    elif damage.startswith("a row's"):
        _set_bit(data, bits, 2, False)
    else:
        at = _prefix_at(data, images[39])
        data[at : at + 4] = (len(images[39]) - 2).to_bytes(4, "little")
    path.write_bytes(data)
    if pyarrow_says is None:
        assert pq.read_table(path).column(0).to_pylist() != images  # pyarrow serves what it guessed
    else:
        with pytest.raises(pa.ArrowInvalid, match=pyarrow_says):
            pq.read_table(path)
    outcome = _outcomes(path, range(40))
    assert sorted(outcome) == list(range(40))
    for i, got in outcome.items():
        assert isinstance(got, str), f"row {i}: served {got!r}"
        if pyarrow_says is None:
            assert got.startswith(f"{path}: damaged page of column 'image' (row group 0, row {i}): "), got
        else:
            assert got == f"{path}: cannot read row group 0: {pyarrow_says}"


def test_a_page_is_checked_once_not_per_row(tmp_path):
    images = [os.urandom(3000) for _ in range(60)]
    path = tmp_path / "x.parquet"
    # pyarrow cuts pages only between write batches
    pq.write_table(pa.table({"image": images}), path, use_dictionary=False, data_page_size=8192, write_batch_size=4)
    reader = ParquetRows()
    try:
        assert [reader.read(str(path), 0, i, "image") for i in range(60)] == images
        chunk = reader._chunks[(str(path), "image", 0)]
        checks = dict(chunk._checked)
        assert len(chunk.pages) > 3 and sorted(checks) == list(range(len(chunk.pages)))
        assert [reader.read(str(path), 0, i, "image") for i in range(59, -1, -1)] == images[::-1]
        assert all(chunk._checked[p] is checks[p] for p in checks), "no page was checked again"
    finally:
        reader.close()


def test_a_row_group_that_pyarrow_reads_short_is_refused_not_shifted(tmp_path):
    """Found by tests/component/test_parquetrows_fuzz.py: a page header whose value count says 7 where its page
    holds 8 makes pyarrow read 31 values for a row group of 32, without a word. The chunk's pages
    no longer add up, so the row group was read through pyarrow, and rows 15-30 were served their
    next row's image."""
    images = [f"image {i:03d};".encode() * 4 for i in range(32)]
    path = tmp_path / "x.parquet"
    pq.write_table(
        pa.table({"image": images}),
        path,
        compression="none",
        use_dictionary=False,
        write_batch_size=8,
        data_page_size=64,
        write_statistics=False,
    )
    data = bytearray(path.read_bytes())
    # A v1 data page header: field 5 (a struct) whose num_values is 8 (zigzag 0x10), encoding PLAIN,
    # RLE levels: one per page of 8 rows; the second page's count becomes 7 (zigzag 0x0e).
    header = b"\x2c\x15\x10\x15\x00\x15\x06\x15\x06"
    assert data.count(header) == 4
    data[data.index(header, data.index(header) + 1) + 2] = 0x0E
    path.write_bytes(data)
    assert len(pq.ParquetFile(path).read_row_group(0).column(0)) == 31
    outcome = _outcomes(path, range(32))
    assert outcome == {
        i: f"{path}: cannot read row group 0: pyarrow read 31 values of 'image' for 32 rows" for i in range(32)
    }


def test_a_page_whose_checksum_does_not_match_serves_none_of_its_rows(tmp_path):
    """A page header may carry the CRC32 of the page (parquet-mr writes it by default, pyarrow with
    write_page_checksum): one byte changed inside an image leaves every length in place, so only
    the checksum says the page is damaged; pyarrow serves the damaged image unless asked to check."""
    images = [f"image {i:03d};".encode() * 20 for i in range(30)]
    path = tmp_path / "x.parquet"
    _write_uncompressed(path, images, write_page_checksum=True)
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata.row_group(0).column(0)
    at = meta.data_page_offset + meta.total_compressed_size - 7  # in the page body, past its header
    data[at] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.read_table(path, page_checksum_verification=True)
    outcome = _outcomes(path, range(30))
    wrong = [i for i, got in outcome.items() if isinstance(got, bytes) and got != images[i]]
    assert wrong == [] and all("checksum" in got for got in outcome.values()), outcome
