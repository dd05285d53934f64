"""The index's files: written part by part, read by row, and refused when they are not what
an index writes."""

import hashlib
import os
import tracemalloc

import numpy as np
import pytest

from prefetchd.sources.index import SampleIndex
from prefetchd.sources.indexfiles import ColumnFile, IndexWriter
from prefetchd.sources.places import FILE, PARQUET_ROW, TAR_MEMBER


def files(*names, label=0):
    return SampleIndex.from_lists([f"/data/{n}.jpg" for n in names], [label] * len(names))


def shard(name, rows, kind=TAR_MEMBER, objects=None):
    members = np.asarray([[512 * (j + 1), 100 + j] for j in range(rows)], np.int64).reshape(rows, 2)
    return SampleIndex.in_containers([name], [rows], kind, members, np.arange(rows) + 10, objects)


def written(tmp_path, parts):
    tmp_path.mkdir(exist_ok=True)
    writer = IndexWriter(tmp_path / "index")
    for part in parts:
        writer.add(part)
    writer.finish()
    return SampleIndex.load(tmp_path / "index")


def samples(index):
    return [
        (index.path(i), index.kind(i), index.label(i), index.kind(i) and index.member(i)) for i in range(len(index))
    ]


def test_files_then_shards_then_files_read_back_sample_by_sample(tmp_path):
    parts = [files("a", "b", label=3), shard("s3://b/x.tar", 3), shard("/d/empty.tar", 0)]
    parts += [shard("/d/y.pq", 2, PARQUET_ROW), files("c", label=4)]
    index = written(tmp_path, parts)
    assert samples(index) == [
        ("/data/a.jpg", FILE, 3, 0),
        ("/data/b.jpg", FILE, 3, 0),
        ("s3://b/x.tar", TAR_MEMBER, 10, (512, 100)),
        ("s3://b/x.tar", TAR_MEMBER, 11, (1024, 101)),
        ("s3://b/x.tar", TAR_MEMBER, 12, (1536, 102)),
        ("/d/y.pq", PARQUET_ROW, 10, (512, 100)),  # the empty shard between holds no sample
        ("/d/y.pq", PARQUET_ROW, 11, (1024, 101)),
        ("/data/c.jpg", FILE, 4, 0),
    ]
    assert samples(index.in_memory()) == samples(index)
    assert len(index.offsets) == 7 and len(index.starts) == 7  # a shard's path is kept once, not once a sample


def test_a_files_only_index_keeps_its_layout_and_fingerprint(tmp_path):
    part = files("a", "ü", "c")
    index = written(tmp_path, [part])
    assert sorted(os.listdir(tmp_path / "index")) == ["labels.npy", "offsets.npy", "paths.npy"]
    # what the fingerprint was before the index was written in parts: a resume state keeps matching it
    before = hashlib.sha256(b"".join(a.tobytes() for a in (part.paths, part.offsets, part.labels)))
    assert index.fingerprint() == part.fingerprint() == before.hexdigest()[:16]
    for name in ("paths", "offsets", "labels"):  # a file np.load reads as the array it was
        assert np.array_equal(np.load(tmp_path / "index" / f"{name}.npy"), getattr(part, name))


def test_the_fingerprint_tells_shards_apart_and_counts_identities(tmp_path):
    a = written(tmp_path / "a", [shard("/d/x.tar", 3)])
    b = written(tmp_path / "b", [shard("/d/x.tar", 3, objects={"/d/x.tar": [9, "e", ""]})])
    c = written(tmp_path / "c", [shard("/d/x.tar", 2), shard("/d/y.tar", 1)])
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3
    assert a.fingerprint() == shard("/d/x.tar", 3).fingerprint()


def test_writing_an_index_holds_one_part_at_a_time(tmp_path):
    writer = IndexWriter(tmp_path / "index")
    part = shard("/d/x.tar", 100_000)  # 2.4 MB of rows
    tracemalloc.start()
    for _ in range(20):
        writer.add(part)
    writer.finish()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20, peak  # 20 parts: 48 MB written
    index = SampleIndex.load(tmp_path / "index")
    assert len(index) == 2_000_000 and index.member(1_999_999) == (512 * 100_000, 100 + 99_999)


def test_a_column_reads_rows_slices_and_whole(tmp_path):
    index = written(tmp_path, [shard("/d/x.tar", 5)])
    members = index.members
    assert isinstance(members, ColumnFile)
    assert members[0] == (512, 100) and members[-1] == (2560, 104) and members[np.int64(2)] == (1536, 102)
    assert members[1:3].tolist() == [[1024, 101], [1536, 102]] and members[4:99].shape == (1, 2)
    assert np.asarray(members).shape == (5, 2) and index.labels[3] == 13
    for bad in (5, -6):
        with pytest.raises(IndexError):
            members[bad]


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda p: (p.unlink(), os.mkfifo(p)), id="fifo"),
        pytest.param(lambda p: np.save(p, np.zeros(3, np.float64)), id="floats"),
        pytest.param(lambda p: np.save(p, np.zeros((2, 2, 2), np.int64)), id="three-dimensions"),
        pytest.param(lambda p: np.save(p, np.asfortranarray(np.zeros((3, 2), np.int64))), id="fortran"),
        pytest.param(lambda p: os.truncate(p, os.path.getsize(p) - 8), id="cut-short"),
        pytest.param(lambda p: p.write_bytes(b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 70000), id="huge-header"),
        pytest.param(lambda p: p.write_bytes(b"not an npy file at all"), id="not-npy"),
    ],
)
def test_a_column_that_is_not_what_an_index_writes_is_refused(tmp_path, plant):
    written(tmp_path, [shard("/d/x.tar", 3)])
    plant(tmp_path / "index" / "members.npy")
    with pytest.raises(ValueError):
        SampleIndex.load(tmp_path / "index")
