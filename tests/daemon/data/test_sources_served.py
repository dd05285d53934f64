"""Each source kind served by a job end to end: the index the daemon built, the samples it read,
the bad ones replaced and recorded under their names (the parts are tested in tests/component)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefetchd.plan import Plan
from prefetchd.sources.index import SampleIndex
from tests.component.test_imagefolder import (  # the fixture too: torchvision's own folder.py
    NON_UTF8,
    imagenet_shaped_folder,
    torchvision_folder,  # noqa: F401
    write_jpeg,
)
from tests.component.test_parquet import jpegs
from tests.component.test_shards import good, jpeg, write_members, write_shard
from tests.component.test_shards_tar import gnu_tar, sparse_folder
from tests.conftest import cli, wait_until, write_config
from tests.helpers import read_epoch


def test_daemon_serves_an_epoch_whose_index_and_label_match_torchvision_samples(tmp_path, serve, torchvision_folder):  # noqa: F811
    root = imagenet_shaped_folder(tmp_path).resolve()  # as the config resolves it
    samples = torchvision_folder.ImageFolder(str(root)).samples
    job = serve(write_config(tmp_path, root, batch_size=2, buffer="2M"))
    paths = job.paths
    daemon_index = SampleIndex.load(paths.dir / "index")
    assert [(daemon_index.path(i), daemon_index.label(i)) for i in range(len(daemon_index))] == samples
    plan = Plan(len(samples), 1, 2, seed=0)
    batches = [(b.arrays, b.meta) for b in read_epoch("job", with_meta=True, timeout=120)]
    job.stop()
    assert len(batches) == plan.batches_per_epoch == 11
    for step, (batch, meta) in enumerate(batches):
        ids = plan.sample_ids(0, step, 0)
        assert batch["index"].tolist() == ids.tolist()
        assert batch["label"].tolist() == [samples[i][1] for i in ids]
        assert meta["replaced"] == [], "every file, the non-UTF-8 one included, decodes"
    served = {i for batch, _ in batches for i in batch["index"].tolist()}
    assert served == set(range(len(samples)))  # the non-UTF-8 name among them


def test_unreadable_sample_with_a_non_utf8_name_is_replaced_and_recorded_under_its_name(tmp_path, serve):
    root = tmp_path / "train"
    for i in range(7):
        write_jpeg(root / "cat" / f"{i}.jpg", i)
    bad = root / "cat" / NON_UTF8
    bad.write_bytes(b"\xff\xd8 not really a JPEG")
    job = serve(write_config(tmp_path, root, batch_size=2, buffer="2M"))
    paths = job.paths
    batches = [(b.arrays, b.meta) for b in read_epoch("job", with_meta=True, timeout=120)]
    # The master logs a bad sample when the worker reports, which may come after the reader saw it.
    wait_until(lambda: b"bad sample" in paths.log.read_bytes(), what="the bad sample's log line")
    log = paths.log.read_bytes()
    job.stop()
    replaced = [r for _, meta in batches for r in meta["replaced"]]
    assert [r["path"] for r in replaced] == [str(bad)]  # JSON carries the surrogate-escaped name
    # The log is UTF-8 text: the name's two bytes appear escaped, and the line is not lost.
    assert b"Logging error" not in log and b"bad sample 7 (" + os.fsencode(str(root)) in log
    assert b"/cat/\\xff\\xfe.jpg): " in log  # the name's two bytes as printable shows them


@pytest.mark.timeout(120)
def test_start_serves_the_label_column_of_that_name_beside_a_struct_of_the_same_path(tmp_path, serve):
    """issue 24 finding 6: `prefetchd start` exited 70 (an internal error, ArrowTypeError) for
    ``label_column = "y.z"`` beside a struct ``y{z}`` that came first in the file."""
    table = pa.table(
        {
            "image": pa.array(jpegs(8)),
            "y": pa.array([{"z": 100 + i} for i in range(8)]),
            "y.z": pa.array([i % 3 for i in range(8)]),
        }
    )
    data = tmp_path / "x.parquet"
    pq.write_table(table, data)
    source = f'kind = "parquet"\npath = "{data}"\nlabel_column = "y.z"'
    serve(write_config(tmp_path, tmp_path, batch_size=4, source=source))
    batches = read_epoch("job", batch_size=4)
    served = {int(i): int(y) for b in batches for i, y in zip(b.arrays["index"], b.arrays["label"])}
    assert served == {i: i % 3 for i in range(8)}
    wrong_source = f'kind = "parquet"\npath = "{data}"\nlabel_column = "y"'
    wrong = write_config(tmp_path, tmp_path, name="wrong", source=wrong_source)
    refused = cli("start", str(wrong))
    assert refused.returncode == 3, refused.stderr
    assert "label_column 'y' is struct<z: int64>, not an integer type" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_bad_samples_in_a_served_shard_are_replaced_and_recorded_without_shifting_ids(tmp_path, serve):
    samples = good(12)
    samples[2] = {"jpg": b"\xff\xd8 not a jpeg", "cls": b"1"}  # an image member that is no image
    samples[5] = {"jpg": jpeg(5)}  # no label
    samples[7] = {"txt": b"no image", "cls": b"0"}  # no image member
    shard = write_shard(tmp_path / "s.tar", samples)
    source = f'kind = "webdataset"\nurls = "{shard}"'
    serve(write_config(tmp_path, tmp_path, name="bad", batch_size=4, source=source))
    batches = read_epoch("bad", with_meta=True)
    replaced = {r["index"]: r for b in batches for r in b.meta["replaced"]}
    assert sorted(replaced) == [2, 5, 7]
    assert "no label" in replaced[5]["error"] and "no image member" in replaced[7]["error"]
    assert str(shard) in replaced[2]["path"]
    for b in batches:  # every other sample keeps its id and its label
        for i, label in zip(b.arrays["index"].tolist(), b.arrays["label"].tolist()):
            assert i not in (2, 5, 7) and label == i % 3


def test_a_job_serves_every_sparse_sample_and_replaces_a_repeated_key_naming_shard_and_key(tmp_path, serve):
    sparse_folder(tmp_path / "src", n=6)
    sparse = gnu_tar(tmp_path / "src", tmp_path / "sparse.tar", "posix", sorted(os.listdir(tmp_path / "src")))
    members = [
        (f"{i:06d}.{ext}", jpeg(i) if ext == "jpg" else str(i % 3).encode())
        for i in range(6, 12)
        for ext in ("jpg", "cls")
    ]
    members[4:4] = [("000008.jpg", jpeg(99)), ("000008.cls", b"1")]  # key 000008 twice, labels 2 then 1
    repeats = write_members(tmp_path / "repeats.tar", members)
    source = f'kind = "webdataset"\nurls = ["{sparse}", "{repeats}"]'
    serve(write_config(tmp_path, tmp_path, name="wds", batch_size=4, source=source))
    batches = read_epoch("wds", with_meta=True)
    replaced = {r["index"]: r for b in batches for r in b.meta["replaced"]}
    assert sorted(replaced) == [8]  # all 6 samples of the sparse shard are served, and 11 others
    assert str(repeats) in replaced[8]["path"]
    assert "key '000008' repeats" in replaced[8]["error"], replaced[8]
    served = {i: label for b in batches for i, label in zip(b.arrays["index"].tolist(), b.arrays["label"].tolist())}
    assert set(served) == set(range(12)) - {8} and all(label == i % 3 for i, label in served.items())
