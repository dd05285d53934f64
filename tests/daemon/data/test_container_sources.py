"""Samples inside containers: WebDataset shards written by `prefetchd pack` and Parquet files
written by pyarrow, served by masters run in the test's process. The same images as files make the same batches,
byte for byte; resume and determinism hold as for a folder of files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefetchd.sources.index import scan_image_folder
from tests.conftest import cli, write_config
from tests.daemon.resume.test_resume import SAMPLES, read
from tests.helpers import read_epoch

pytestmark = pytest.mark.timeout(300)
KINDS = ("webdataset", "parquet")


@pytest.fixture(scope="module")
def shards(jpeg_folder, tmp_path_factory) -> Path:
    """The jpeg_folder packed into 4 shards (id order kept: the ImageFolder's ids are the keys)."""
    out = tmp_path_factory.mktemp("shards")
    result = cli("pack", str(jpeg_folder), str(out), "--shard-size", "40K")
    assert result.returncode == 0, result.stderr
    assert len(json.loads((out / "pack.json").read_text())["shards"]) >= 3
    return out


@pytest.fixture(scope="module")
def parquet_files(jpeg_folder, tmp_path_factory) -> Path:
    """The jpeg_folder's images as a Hub-style image column (struct<bytes, path>), in two files
    of row groups of 5 rows, in ImageFolder id order."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    index = scan_image_folder(str(jpeg_folder), "test")
    rows = [(Path(index.path(i)).read_bytes(), index.label(i)) for i in range(len(index))]
    out = tmp_path_factory.mktemp("parquet")
    for part, chunk in enumerate((rows[:30], rows[30:])):
        table = pa.table(
            {
                "image": pa.array(
                    [{"bytes": b, "path": None} for b, _ in chunk],
                    pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
                ),
                "label": pa.array([label for _, label in chunk], pa.int64()),
            }
        )
        pq.write_table(table, out / f"part-{part}.parquet", row_group_size=5)
    return out


def source_of(kind: str, request) -> str:
    if kind == "webdataset":
        shards = request.getfixturevalue("shards")
        count = len(list(shards.glob("*.tar")))
        return f'kind = "webdataset"\nurls = "{shards}/shard-{{000000..{count - 1:06d}}}.tar"'
    files = request.getfixturevalue("parquet_files")
    return f'kind = "parquet"\npath = "{files}/*.parquet"'


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_images_in_containers_make_the_same_batches_as_files(tmp_path, jpeg_folder, serve, kind, request):
    serve(write_config(tmp_path, jpeg_folder, name="files", world_size=2, seed=5))
    serve(write_config(tmp_path, jpeg_folder, name="boxed", world_size=2, seed=5, source=source_of(kind, request)))
    for rank in range(2):
        files = read_epoch("files", rank=rank, world_size=2, epochs=2)
        boxed = read_epoch("boxed", rank=rank, world_size=2, epochs=2)
        assert len(files) == len(boxed) == 2 * SAMPLES // 8
        for a, b in zip(files, boxed):
            for field in ("index", "label", "image"):
                np.testing.assert_array_equal(a.arrays[field], b.arrays[field])


@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_exact_across_a_daemon_restart(tmp_path, jpeg_folder, serve, kind, request):
    config = write_config(
        tmp_path, jpeg_folder, name="grid", world_size=2, workers=2, seed=3, source=source_of(kind, request)
    )
    job = serve(config)
    per_epoch = SAMPLES // 8
    for stop_after in (per_epoch // 2, per_epoch + 1):
        for rank in range(2):  # as test_resume.assert_resume_matches, the master restarted in between
            reference, _ = read("grid", rank, 2)
            first, state = read("grid", rank, 2, stop_after=stop_after)
            job.stop()
            job = serve(config)
            rest, _ = read("grid", rank, 2, state=state)
            assert first + rest == reference, f"rank {rank}: resumed stream differs (stop after {stop_after})"


@pytest.mark.parametrize("kind", KINDS)
def test_worker_count_does_not_change_a_byte(tmp_path, jpeg_folder, serve, kind, request):
    streams = []
    for workers in (1, 2):
        name = f"w{workers}"
        serve(write_config(tmp_path, jpeg_folder, name=name, workers=workers, seed=9, source=source_of(kind, request)))
        streams.append(read(name, 0, 1, epochs=1)[0])
    assert streams[0] == streams[1]
