"""parquetpages against pyarrow: every value of every row group, over the writer's options
(codecs, dictionary or not, page sizes, data page v1 and v2, nulls, Hub-style structs), and
damaged files: a value comes back right, or the reader falls back, or says ValueError."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from prefetchd.parquetpages import ColumnChunk, Unsupported  # noqa: E402
from prefetchd.parquetsource import ParquetRows  # noqa: E402

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
            chunk = ColumnChunk(fd, meta.column(ci), pf.schema.column(ci).max_definition_level, meta.num_rows)
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
            ColumnChunk(fd, pf.metadata.row_group(0).column(0), 1, 3)
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
