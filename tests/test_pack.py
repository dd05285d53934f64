"""`prefetchd pack` through the real command, its shards read by the real webdataset library."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefetchd.datagen import make_image, make_image_folder
from prefetchd.errors import ExitCode
from prefetchd.sources import scan_image_folder

from .conftest import cli

wds = pytest.importorskip("webdataset")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """3 classes x 10 JPEGs of 64-160 px."""
    return make_image_folder(tmp_path_factory.mktemp("data") / "train", classes=3, per_class=10, size=(64, 160))


def pack(source: Path | str, out: Path, *flags: str):
    return cli("pack", str(source), str(out), *flags)


def packed(source: Path | str, out: Path, *flags: str) -> dict:
    result = pack(source, out, *flags)
    assert result.returncode == 0, result.stderr
    return json.loads((out / "pack.json").read_text())


def read_shards(out: Path, manifest: dict) -> list[dict]:
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    return list(wds.WebDataset(urls, shardshuffle=False))


def shard_hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


def assert_clean_failure(result, code: ExitCode, *phrases: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


def test_webdataset_reads_every_sample_in_id_order_with_its_label(folder, tmp_path):
    manifest = packed(folder, tmp_path / "out")
    index = scan_image_folder(str(folder), "test")
    samples = read_shards(tmp_path / "out", manifest)
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(len(index))]
    assert [int(s["cls"]) for s in samples] == [index.label(i) for i in range(len(index))]
    # not resized: the very bytes of each file
    assert all(s["jpg"] == Path(index.path(i)).read_bytes() for i, s in enumerate(samples))
    assert manifest["classes"] == ["class_00", "class_01", "class_02"]
    assert manifest["samples"] == manifest["indexed"] == len(index) and manifest["skipped"] == []
    assert sorted(os.listdir(tmp_path / "out")) == ["pack.json", "shard-000000.tar"]


def test_shard_size_splits_into_shards_none_over_the_bound(folder, tmp_path):
    manifest = packed(folder, tmp_path / "out", "--shard-size", "64K")
    assert len(manifest["shards"]) > 2
    assert [s["name"] for s in manifest["shards"]] == [f"shard-{i:06d}.tar" for i in range(len(manifest["shards"]))]
    for shard in manifest["shards"]:
        assert shard["bytes"] == (tmp_path / "out" / shard["name"]).stat().st_size <= 64 * 1024
    samples = read_shards(tmp_path / "out", manifest)
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(30)]
    assert sum(s["samples"] for s in manifest["shards"]) == 30


def test_same_bytes_on_a_rerun_and_with_any_worker_count(folder, tmp_path):
    runs = [
        shard_hashes(tmp_path / name)
        for name, workers in (("a", "1"), ("b", "1"), ("c", "2"))
        if packed(folder, tmp_path / name, "--workers", workers, "--shard-size", "100K", "--max-short-side", "100")
    ]
    assert len(runs[0]) > 2 and runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("length", ["short", "too long for a socket path"])
def test_pack_leaves_no_temporary_folder(folder, tmp_path, length):
    # Its workers come from a fork server, whose socket folder (pymp-*) lives in $TMPDIR, unless
    # that is too long for a socket's path (a batch scheduler's per-job folder): then in /tmp.
    temp = Path(tempfile.mkdtemp(dir="/dev/shm")) if length == "short" else tmp_path / ("t" * 80)
    temp.mkdir(exist_ok=True)
    try:
        result = cli("pack", str(folder), str(tmp_path / "out"), "--workers", "2", env={"TMPDIR": str(temp)})
        assert result.returncode == 0, result.stderr
        assert list(temp.iterdir()) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_max_short_side_shrinks_big_images_and_keeps_jpeg(tmp_path):
    data = make_image_folder(tmp_path / "big", classes=2, per_class=3, size=(120, 300))
    manifest = packed(data, tmp_path / "out", "--max-short-side", "100", "--quality", "80")
    index = scan_image_folder(str(data), "test")
    originals = [Image.open(index.path(i)).size for i in range(len(index))]
    assert manifest["resized"] == sum(min(size) > 100 for size in originals) > 0
    for sample, size in zip(read_shards(tmp_path / "out", manifest), originals):
        image = Image.open(io.BytesIO(sample["jpg"]))
        assert image.format == "JPEG"
        assert min(image.size) == min(min(size), 100)
        if min(size) > 100:  # the aspect ratio kept, to the pixel
            assert abs(max(image.size) - round(max(size) * 100 / min(size))) <= 1


def test_png_passes_through_or_is_resized_as_png(tmp_path):
    data = tmp_path / "png" / "only"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    make_image(rng, 200, 150).save(data / "big.png")
    make_image(rng, 60, 40).save(data / "small.png")
    manifest = packed(data.parent, tmp_path / "out", "--max-short-side", "100")
    big, small = read_shards(tmp_path / "out", manifest)
    assert Image.open(io.BytesIO(big["png"])).size == (133, 100) and "jpg" not in big
    assert small["png"] == (data / "small.png").read_bytes()


def test_missing_folder_is_a_data_error(tmp_path):
    assert_clean_failure(pack(tmp_path / "nowhere", tmp_path / "out"), ExitCode.DATA, "does not exist")
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_holds_files_is_refused_and_left_alone(folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert_clean_failure(pack(folder, out), ExitCode.USER, "not empty")
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (("--shard-size", "lots"), "--shard-size"),
        (("--shard-size", "1K"), "below one tar record"),
        (("--quality", "0"), "--quality"),
        (("--workers", "0"), "--workers"),
        (("--max-short-side", "0"), "--max-short-side"),
    ],
)
def test_bad_flags_are_config_errors(folder, tmp_path, flags, phrase):
    assert_clean_failure(pack(folder, tmp_path / "out", *flags), ExitCode.CONFIG, phrase)
    assert not (tmp_path / "out").exists()


def test_unreadable_samples_are_skipped_and_recorded_and_a_fifo_never_blocks(folder, tmp_path):
    files = sorted(str(p) for p in folder.rglob("*.jpg"))[:3]
    (tmp_path / "junk.jpg").write_bytes(b"not a jpeg at all")
    os.mkfifo(tmp_path / "pipe.jpg")  # nobody writes it: a blocking open would hang
    lines = [f"{files[0]},0", "junk.jpg,1", "pipe.jpg,1", f"{files[1]},2", "gone.jpg,0", f"{files[2]},1"]
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    manifest = packed(tmp_path / "list.txt", tmp_path / "out", "--workers", "2")
    reasons = {s["id"]: s["reason"] for s in manifest["skipped"]}
    assert sorted(reasons) == [1, 2, 4]
    assert "not an image" in reasons[1] and "not a regular file" in reasons[2] and "cannot open" in reasons[4]
    samples = read_shards(tmp_path / "out", manifest)
    assert [(s["__key__"], int(s["cls"])) for s in samples] == [("000000000", 0), ("000000003", 2), ("000000005", 1)]
    assert manifest["classes"] is None and manifest["samples"] == 3 and manifest["indexed"] == 6


def test_no_readable_sample_fails_and_leaves_nothing(tmp_path):
    (tmp_path / "junk.jpg").write_bytes(b"junk")
    (tmp_path / "list.txt").write_text("junk.jpg,0\n")
    (tmp_path / "empty").mkdir()
    for out, kept in ((tmp_path / "new", False), (tmp_path / "empty", True)):
        assert_clean_failure(pack(tmp_path / "list.txt", out), ExitCode.DATA, "none of its 1 samples")
        assert out.exists() == kept and (not kept or os.listdir(out) == [])
