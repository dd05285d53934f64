"""Parquet sources from real Parquet files of real JPEGs: the index, the reader and their errors."""

from __future__ import annotations

import gc
import io
import os
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from prefetchd.cli.datagen import make_image  # noqa: E402
from prefetchd.errors import ConfigError, DataError  # noqa: E402
from prefetchd.sources.index import NO_LABEL  # noqa: E402
from prefetchd.sources.parquetrows import ParquetRows  # noqa: E402
from prefetchd.sources.parquetsource import scan_parquet  # noqa: E402
from prefetchd.sources.places import PARQUET_ROW  # noqa: E402

pytestmark = pytest.mark.timeout(30)
WHERE = "[[source]] #1 (parquet)"
HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature


def jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct small real JPEGs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        make_image(rng, int(rng.integers(16, 40)), int(rng.integers(16, 40))).save(buf, "JPEG", quality=80)
        out.append(buf.getvalue())
    return out


def write(path, images, labels, image_type=pa.binary(), label_type=pa.int64(), row_group_size=None, **columns):
    if pa.types.is_struct(image_type):
        images = [None if b is None else {"bytes": b, "path": f"img{i}.jpg"} for i, b in enumerate(images)]
    table = pa.table({"image": pa.array(images, image_type), "label": pa.array(labels, label_type), **columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def source(path, image_column="image", label_column="label") -> dict:
    return {"path": str(path), "image_column": image_column, "label_column": label_column}


def read_all(index, reader: ParquetRows, order) -> dict[int, bytes]:
    return {int(i): reader.read(index.path(i), *index.member(i), "image") for i in order}


def test_binary_column_row_groups_read_back_in_random_order_with_bounded_cache(tmp_path):
    images, labels = jpegs(60), [i % 7 for i in range(60)]
    path = write(tmp_path / "train.parquet", images, labels, row_group_size=8)
    index = scan_parquet(source(path), WHERE)
    assert len(index) == 60 and index.labels.tolist() == labels
    assert set(index.kinds.tolist()) == {PARQUET_ROW}
    assert index.members.tolist() == [[i // 8, i % 8] for i in range(60)]
    assert {index.path(i) for i in range(60)} == {str(path)}
    bound = sum(len(b) for b in images[:20])  # room for about two row groups of eight
    reader = ParquetRows(cache_bytes=bound, pages=False)  # the row-group path and its cache
    seen_max = 0
    for i in np.random.default_rng(1).permutation(60):
        assert reader.read(index.path(i), *index.member(i), "image") == images[i]
        seen_max = max(seen_max, reader.cached_bytes)
    assert 0 < seen_max <= bound
    assert 1 <= len(reader._groups) < 8  # row groups were evicted, the most recent kept
    reader.close()
    assert reader.cached_bytes == 0


def test_hugging_face_image_struct_and_other_accepted_types(tmp_path):
    images = jpegs(10)
    path = write(tmp_path / "hf.parquet", images, list(range(10)), HF_IMAGE, pa.uint8(), row_group_size=4)
    index = scan_parquet(source(path), WHERE)
    assert index.labels.tolist() == list(range(10)) and index.labels.dtype == np.int64
    with_large = write(tmp_path / "large.parquet", images, [3] * 10, pa.large_binary(), pa.int8())
    reader = ParquetRows()
    assert read_all(index, reader, reversed(range(10))) == dict(enumerate(images))
    assert read_all(scan_parquet(source(with_large), WHERE), reader, range(10)) == dict(enumerate(images))
    reader.close()


def test_folder_and_glob_take_files_in_path_byte_order(tmp_path):
    images = jpegs(9)
    data = tmp_path / "data"
    data.mkdir()
    # "B" sorts before "a" by bytes; the .txt file and the hidden file are not part of the source
    for name, part in [("b.parquet", 0), ("B.parquet", 1), ("a.parquet", 2)]:
        write(data / name, images[3 * part : 3 * part + 3], [part] * 3, row_group_size=2)
    (data / "notes.txt").write_text("not data")
    write(data / ".hidden.parquet", images[:1], [9])
    write(data / "empty.parquet", [], [])  # no rows: adds nothing
    expected = [(data / n) for n in ("B.parquet", "a.parquet", "b.parquet")]
    for path in (data, data / "*.parquet", data / "[aBbe]*.parquet"):
        index = scan_parquet(source(path), WHERE)
        assert [index.path(i) for i in range(0, 9, 3)] == [str(p) for p in expected]
        assert index.labels.tolist() == [1, 1, 1, 2, 2, 2, 0, 0, 0]
        assert index.members[:3].tolist() == [[0, 0], [0, 1], [1, 0]]
        got = read_all(index, ParquetRows(), range(9))
        assert [got[i] for i in range(9)] == images[3:6] + images[6:9] + images[0:3]


def test_null_label_and_null_image(tmp_path):
    images = jpegs(4)
    path = write(tmp_path / "x.parquet", [images[0], None, images[2], images[3]], [0, 1, None, 2], HF_IMAGE)
    index = scan_parquet(source(path), WHERE)
    assert index.labels.tolist() == [0, 1, NO_LABEL, 2]
    reader = ParquetRows()
    assert reader.read(str(path), 0, 0, "image") == images[0]
    with pytest.raises(ValueError, match=r"null image in column 'image' \(row group 0, row 1\)"):
        reader.read(str(path), 0, 1, "image")
    plain = write(tmp_path / "plain.parquet", [None, images[1]], [0, 1])
    with pytest.raises(ValueError, match="null"):
        reader.read(str(plain), 0, 0, "image")
    assert reader.read(str(plain), 0, 1, "image") == images[1]


def test_out_of_range_places_and_wrong_column_at_read_are_value_errors(tmp_path):
    path = str(write(tmp_path / "x.parquet", jpegs(3), [0, 1, 2], row_group_size=2))
    reader = ParquetRows()
    for group, row, column, message in [
        (2, 0, "image", "row group 2 is out of range"),
        (-1, 0, "image", "row group -1 is out of range"),
        (1, 1, "image", "row 1 is out of range"),
        (0, 0, "label", "no image column 'label'"),
        (0, 0, "nope", "no image column 'nope'"),
    ]:
        with pytest.raises(ValueError, match=message):
            reader.read(path, group, row, column)


def test_oversize_row_group_is_kept_alone(tmp_path):
    images = jpegs(6)
    path = str(write(tmp_path / "x.parquet", images, [0] * 6, row_group_size=3))
    reader = ParquetRows(cache_bytes=100, pages=False)  # smaller than any row group
    assert [reader.read(path, i // 3, i % 3, "image") for i in range(6)] == images
    assert len(reader._groups) == 1 and reader.cached_bytes > 100


def _three_columns(folder):
    write(folder / "x.parquet", jpegs(2), [0, 1], other=pa.array(["a", "b"]))


def _error_cases():
    """(set up the folder, the source's path in it, column overrides, the message expected)."""
    struct_without_bytes = pa.struct([("path", pa.string())])
    return [
        (lambda p: None, "none.parquet", {}, "none.parquet does not exist"),
        (lambda p: None, "*.parquet", {}, r"no file matches .*\*\.parquet"),
        (lambda p: None, "", {}, r"has no \*.parquet file"),
        (_three_columns, "", {"image_column": "img"}, r"no single column 'img' \(it has 'image', 'label', 'other'\)"),
        (_three_columns, "x.parquet", {"label_column": "cls"}, r"no single column 'cls' .*set label_column"),
        (
            lambda p: write(p / "x.parquet", ["a", "b"], [0, 1], pa.string()),
            "x.parquet",
            {},
            "image_column 'image' is string, not binary",
        ),
        (
            lambda p: write(p / "x.parquet", [{"path": "a"}], [0], struct_without_bytes),
            "x.parquet",
            {},
            "image_column 'image' is struct<path: string>, not binary",
        ),
        (
            lambda p: write(p / "x.parquet", jpegs(2), ["cat", "dog"], label_type=pa.string()),
            "x.parquet",
            {},
            "label_column 'label' is string, not an integer type",
        ),
        (
            lambda p: write(p / "x.parquet", jpegs(2), [0.0, 1.0], label_type=pa.float32()),
            "x.parquet",
            {},
            "label_column 'label' is float, not an integer type",
        ),
        (
            lambda p: write(p / "x.parquet", jpegs(4), [0, 1, None, -3], row_group_size=2),
            "x.parquet",
            {},
            r"x.parquet: row 3 \(row group 1\) has label -3",
        ),
        (lambda p: write(p / "x.parquet", [], []), "", {}, "hold no rows"),
        (lambda p: (p / "x.parquet").write_bytes(b"\xff\xd8\xff\xe0 not parquet" * 20), "", {}, "x.parquet is not a"),
        (lambda p: (p / "x.parquet").write_bytes(b""), "*", {}, "x.parquet is not a readable Parquet file"),
        (
            lambda p: (p / "x.parquet").mkdir(),
            "",
            {},
            "x.parquet is a folder, not a regular file; remove it or fix path",
        ),
        (lambda p: os.symlink(p / "gone", p / "x.parquet"), "", {}, "symlink to nothing"),
    ]


@pytest.mark.parametrize("setup, name, overrides, message", _error_cases())
def test_data_errors_name_the_file_and_the_fix(tmp_path, setup, name, overrides, message):
    setup(tmp_path)
    with pytest.raises(DataError, match=message) as caught:
        scan_parquet({**source(tmp_path / name), **overrides}, WHERE)
    assert str(caught.value).startswith(WHERE) and "\n" not in str(caught.value)


def test_each_file_is_checked_against_the_columns(tmp_path):
    write(tmp_path / "a.parquet", jpegs(2), [0, 1])
    write(tmp_path / "b.parquet", jpegs(2), ["x", "y"], label_type=pa.string())
    with pytest.raises(DataError, match="b.parquet: label_column 'label' is string"):
        scan_parquet(source(tmp_path), WHERE)


@pytest.mark.timeout(5)
def test_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "x.parquet")  # nobody writes it: a blocking open would hang
    with pytest.raises(DataError, match="x.parquet is a FIFO"):
        scan_parquet(source(tmp_path / "x.parquet"), WHERE)
    with pytest.raises(DataError, match="x.parquet is a FIFO"):
        scan_parquet(source(tmp_path), WHERE)


def test_symlink_to_a_file_is_fine(tmp_path):
    images = jpegs(2)
    write(tmp_path / "real.parquet", images, [0, 1])
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "real.parquet", tmp_path / "data" / "x.parquet")
    index = scan_parquet(source(tmp_path / "data"), WHERE)
    assert read_all(index, ParquetRows(), range(2)) == dict(enumerate(images))


@pytest.mark.timeout(5)
def test_file_changed_after_indexing_is_a_bad_sample_not_a_crash(tmp_path):
    images = jpegs(8)
    path = write(tmp_path / "x.parquet", images, list(range(8)), row_group_size=2)
    index = scan_parquet(source(path), WHERE)
    reader = ParquetRows()
    assert reader.read(str(path), 0, 0, "image") == images[0]
    data = path.read_bytes()
    for broken in (data[: len(data) // 2], data[:-1], data[len(data) // 2 :]):
        path.with_suffix(".tmp").write_bytes(broken)
        os.replace(path.with_suffix(".tmp"), path)  # a new inode: the reader notices and opens it again
        with pytest.raises(ValueError, match="x.parquet"):
            reader.read(index.path(3), *index.member(3), "image")
    os.unlink(path)
    with pytest.raises(ValueError, match="x.parquet cannot be read .No such file"):
        reader.read(str(path), 1, 0, "image")
    os.mkfifo(path)  # put in place of the file: refused, never opened for a blocking read
    with pytest.raises(ValueError, match="not a regular file"):
        reader.read(str(path), 1, 0, "image")
    os.unlink(path)
    write(path, images[::-1], list(range(8)), row_group_size=2)
    assert reader.read(str(path), 0, 0, "image") == images[7]  # a new file there is read afresh
    reader.close()


def test_missing_pyarrow_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"pip install 'prefetchd\[parquet\]'"):
        scan_parquet(source(tmp_path / "x.parquet"), WHERE)


def _columns_in_order(columns: dict, struct_first: bool) -> dict:
    return dict(reversed(list(columns.items()))) if struct_first else columns


@pytest.mark.parametrize("struct_first", [False, True], ids=["flat-first", "struct-first"])
@pytest.mark.parametrize("pages", [True, False], ids=["pages", "row-groups"])
def test_a_dotted_image_column_is_the_column_of_that_name_never_a_struct_field(tmp_path, struct_first, pages):
    """issue 24 finding 6: beside a struct ``img{bytes}``, ``image_column = "img.bytes"`` served the
    struct's child, not the column named "img.bytes": pyarrow selects columns by path prefix."""
    flat, inner = jpegs(6, seed=1), jpegs(6, seed=2)
    columns = {
        "img.bytes": pa.array(flat),
        "img": pa.array([{"bytes": b, "path": None} for b in inner], HF_IMAGE),
    }
    table = pa.table({**_columns_in_order(columns, struct_first), "label": pa.array(range(6))})
    path = tmp_path / "x.parquet"
    pq.write_table(table, path, row_group_size=4)
    reader = ParquetRows(pages=pages)
    try:
        for column, images in (("img.bytes", flat), ("img", inner)):
            index = scan_parquet(source(path, image_column=column), WHERE)
            assert [reader.read(index.path(i), *index.member(i), column) for i in range(6)] == images, column
    finally:
        reader.close()


@pytest.mark.parametrize("struct_first", [False, True], ids=["flat-first", "struct-first"])
def test_a_dotted_label_column_is_the_column_of_that_name_never_a_struct_field(tmp_path, struct_first):
    """issue 24 finding 6: ``label_column = "y.z"`` beside a struct ``y{z}`` read the struct (an
    ArrowTypeError, exit 70) or its child, whichever came first; a column named "label.name" beside
    "label" was read for "label" the same way."""
    columns = {"y.z": pa.array([5, 6, 7, 8]), "y": pa.array([{"z": 1}, {"z": 2}, {"z": 3}, {"z": 4}])}
    names = {"label.name": pa.array(["cat", "dog", "cat", "eel"]), "label": pa.array([0, 1, 0, 2], pa.int8())}
    table = pa.table(
        {
            "image": pa.array(jpegs(4)),
            **_columns_in_order(columns, struct_first),
            **_columns_in_order(names, not struct_first),
        }
    )
    path = tmp_path / "x.parquet"
    pq.write_table(table, path)
    assert scan_parquet(source(path, label_column="y.z"), WHERE).labels.tolist() == [5, 6, 7, 8]
    assert scan_parquet(source(path, label_column="label"), WHERE).labels.tolist() == [0, 1, 0, 2]
    with pytest.raises(DataError, match=r"label_column 'y' is struct<z: int64>, not an integer type"):
        scan_parquet(source(path, label_column="y"), WHERE)
    with pytest.raises(DataError, match=r"label_column 'label.name' is string, not an integer type"):
        scan_parquet(source(path, label_column="label.name"), WHERE)


def test_a_struct_field_named_by_its_path_is_refused_saying_what_to_name(tmp_path):
    table = pa.table(
        {
            "img": pa.array([{"bytes": b, "path": None} for b in jpegs(2)], HF_IMAGE),
            "y": pa.array([{"z": 1}, {"z": 2}]),
        }
    )
    path = tmp_path / "x.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"'y.z' is field 'z' of struct column 'y'; only a top-level column"):
        scan_parquet(source(path, image_column="img", label_column="y.z"), WHERE)
    with pytest.raises(DataError, match=r"'img.bytes' is field 'bytes' of struct column 'img'; .*image_column = 'img'"):
        scan_parquet(source(path, image_column="img.bytes", label_column="y"), WHERE)


def _files_of_big_footers(folder, n: int) -> list[str]:
    """``n`` copies of a file of 5,000 row groups of one row (a footer of 685 KB)."""
    table = pa.table({"image": pa.array([b"i%d" % i for i in range(5000)]), "label": pa.array(np.arange(5000) % 10)})
    pq.write_table(table, folder / "f00.parquet", row_group_size=1, write_statistics=False)
    data = (folder / "f00.parquet").read_bytes()
    assert pq.ParquetFile(folder / "f00.parquet").metadata.serialized_size > 600_000
    for i in range(1, n):
        (folder / f"f{i:02d}.parquet").write_bytes(data)
    return [str(folder / f"f{i:02d}.parquet") for i in range(n)]


def test_files_of_huge_footers_are_not_all_kept_open(tmp_path):
    """A footer of thousands of row groups costs pyarrow ~8 times its size in memory (10**5 row
    groups of one row: a 25 MB footer, 190 MB a file): a reader kept 32 such files open, 6 GB."""
    _files_of_big_footers(tmp_path, 12)
    reader = ParquetRows()
    try:
        for n in range(12):
            assert reader.read(str(tmp_path / f"f{n:02d}.parquet"), 7 + n, 0, "image") == b"i%d" % (7 + n)
        held = _open_files_in(tmp_path)
        assert len(held) <= 2 * 6, f"{len(held)} fds held for 12 files of 685 KB footers"  # at most 4 MiB of footers
    finally:
        reader.close()
    assert _open_files_in(tmp_path) == []


def _open_files_in(folder) -> list[str]:
    """The files in ``folder`` this process holds open. By name, not a count of descriptors:
    another test's objects, freed meanwhile by the garbage collector, close theirs."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(f"{folder}/"):
            held.append(target)
    return held


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "row groups"])
@pytest.mark.parametrize("kind", ["binary_view", "dictionary", "dictionary of a struct's bytes"])
def test_image_columns_pyarrow_writes_as_plain_byte_arrays_are_read(tmp_path, kind, pages):
    """pyarrow stores a binary_view or a dictionary-encoded binary column as a Parquet byte array
    and says so in the file's Arrow schema: they were refused as "not binary"."""
    images = jpegs(12)
    image = {
        "binary_view": pa.array(images, pa.binary_view()),
        "dictionary": pa.array(images * 2).dictionary_encode(),
        "dictionary of a struct's bytes": pa.StructArray.from_arrays(
            [pa.array(images * 2).dictionary_encode(), pa.array(["p"] * 24)], ["bytes", "path"]
        ),
    }[kind]
    labels = list(range(len(image)))
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"image": image, "label": labels}), path, row_group_size=5)
    index = scan_parquet(source(path), WHERE)
    reader = ParquetRows(pages=pages)
    try:
        assert read_all(index, reader, reversed(labels)) == {i: images[i % 12] for i in labels}
    finally:
        reader.close()


def test_the_footers_of_closed_files_are_freed(tmp_path):
    """pyarrow's FileMetaData and its ParquetSchema refer to each other: a closed file's footer is
    freed by the cycle collector alone, which runs by counts of Python objects, blind to the
    memory they hold. A reader cycling over more files than it keeps open held them all: 60
    reopens of 685 KB footers, RSS +1 GB."""
    files = _files_of_big_footers(tmp_path, 4)
    reader = ParquetRows(open_files=2)
    gc.collect()
    gc.disable()  # as in a worker between its rare full collections: deterministic here
    try:
        for _ in range(5):
            for n, path in enumerate(files):
                assert reader.read(path, n, 0, "image") == b"i%d" % n
        held = sum(type(o).__name__ == "FileMetaData" for o in gc.get_objects())
    finally:
        gc.enable()
        reader.close()
    assert held <= 2 + 8, f"{held} footers held for 2 open files after 20 opens"  # 4 MiB of closed ones at most
