"""Corrupt, truncated, empty, non-image, oversized or vanished files: replaced or fatal, by policy;
counted exactly; never a change in the number of batches per rank."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefetchd import control
from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.launch import stop_job
from prefetchd.errors import UserError
from prefetchd_client import DaemonDied, PrefetchLoader
from prefetchd_client.batchfile import map_batch
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive
from tests.component.test_parquet import HF_IMAGE, jpegs, pa, pq
from tests.component.test_shards import write_shard
from tests.conftest import cli, wait_until, write_config
from tests.helpers import read_epoch

pytestmark = pytest.mark.timeout(180)


def spoil(folder, rng, fraction: float) -> set[str]:
    """Damage a fraction of the JPEGs in as many ways as a real dataset offers; returns their paths."""
    files = sorted(folder.rglob("*.jpg"))
    chosen = rng.choice(len(files), size=max(1, round(fraction * len(files))), replace=False)
    damages = [
        lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 3]),  # truncated
        lambda p: p.write_bytes(b""),  # empty
        lambda p: p.write_text("not an image at all"),  # not an image
        lambda p: p.write_bytes(b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 256, 500, dtype=np.uint8))),  # garbage
        lambda p: Image.new("RGB", (8, 8)).save(p, "GIF"),  # a format not on the allow-list
        lambda p: p.unlink(),  # vanished after indexing
        lambda p: (p.unlink(), os.mkfifo(p)),  # a FIFO in its place after indexing: a plain open would block
    ]
    for n, i in enumerate(chosen):
        damages[n % len(damages)](files[i])
    return {str(files[i]) for i in chosen}


# 0.1 % needs 1,000 files for one bad one; 50 batches per epoch in every case.
@pytest.mark.parametrize("fraction, images", [(0.001, 1000), (0.01, 200), (0.1, 200)])
def test_bad_samples_are_replaced_counted_and_identical_across_runs(tmp_path, serve, fraction, images):
    batch = images // 50
    data = make_image_folder(tmp_path / "data", classes=4, per_class=images // 4, size=(24, 48), seed=7)
    # A file list, indexed without looking at the files, so a vanished file is still a sample.
    files = sorted(data.rglob("*.jpg"))
    (tmp_path / "train.txt").write_text("".join(f"{p},{i % 4}\n" for i, p in enumerate(files)))
    bad = spoil(data, np.random.default_rng(1), fraction)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'[job]\nname = "job"\nbatch_size = {batch}\n[daemon]\nworkers = 2\nbuffer = "8M"\n'
        '[[source]]\nkind = "file_list"\npath = "train.txt"\n[[transform]]\nop = "random_resized_crop"\nsize = 16\n'
    )
    runs = []
    for _ in range(2):
        job = serve(cfg)
        paths = job.paths
        batches = read_epoch("job", batch_size=batch, with_meta=True, timeout=120)
        headers, pixels = [b.meta for b in batches], [b.arrays["image"] for b in batches]
        # A trainer may read the last batch before its worker's report reaches the master: the
        # count of bad samples is awaited, not read once.
        status = wait_until(
            lambda at=paths.endpoint: (st := control.request(at, {"op": "status"}))
            and st["totals"]["bad_samples"] >= len(bad)
            and st,
            what="every bad sample counted",
        )
        job.stop()
        runs.append((headers, pixels, status))
        log_text = paths.log.read_text() if paths.log.exists() else ""
        assert log_text == ""  # stop removed the job directory, log included
    (headers, pixels, status), (headers2, pixels2, _) = runs
    assert len(headers) == 50  # the number of batches never changes
    replaced = [r for h in headers for r in h["replaced"]]
    assert {r["path"] for r in replaced} == bad, "every bad file is replaced, and only those"
    assert all(r["replacement"] != r["index"] for r in replaced)
    assert status["totals"]["bad_samples"] >= len(bad)  # produced batches may run past the epoch
    assert headers == headers2 and all(np.array_equal(a, b) for a, b in zip(pixels, pixels2))
    print(f"\n[figure] {fraction:.1%} bad ({len(bad)} of {images}): all replaced, 50 batches, runs identical")


def test_on_error_fail_stops_naming_the_file(tmp_path, serve):
    data = make_image_folder(tmp_path / "data", classes=2, per_class=8, size=(40, 60), seed=3)
    victim = sorted(data.rglob("*.jpg"))[0]
    victim.write_bytes(b"garbage")
    cfg = write_config(tmp_path, data, batch_size=16, size=16)
    job = serve(cfg, {"on_error": "fail"})
    paths = job.paths
    # A trainer that connects after the daemon stopped is told why, as one that waited is.
    wait_until(lambda: "ERROR stopped" in paths.log.read_text(), timeout_s=30, what="daemon stopped")
    with pytest.raises(DaemonDied, match=f"cannot read a sample: sample \\d+ \\(file {victim}\\): UnidentifiedImage"):
        next(iter(PrefetchLoader("job", as_tensors=False, timeout=30)))
    # The tmpfs is freed; the log that says why stays until `prefetchd stop` clears it.
    assert sorted(p.name for p in paths.dir.iterdir()) == ["daemon.lock", "daemon.log", "stopped.json"]
    assert str(victim) in paths.log.read_text()
    job.wait_stopped(10)
    clear_stopped(paths)


def test_a_dataset_that_is_mostly_broken_stops_the_daemon(tmp_path, serve):
    data = make_image_folder(tmp_path / "data", classes=1, per_class=80, size=(40, 60), seed=4)
    for p in sorted(data.rglob("*.jpg"))[:70]:
        p.write_bytes(b"")
    cfg = write_config(tmp_path, data, batch_size=64, size=16)
    serve(cfg)
    # Whether the trainer connects before the daemon stops or after, it is told why.
    with pytest.raises(DaemonDied, match="unreadable (samples in a row|and so were 10 replacements)"):
        next(iter(PrefetchLoader("job", as_tensors=False, timeout=30)))


def test_decompression_bombs_are_bad_samples(tmp_path, serve):
    data = make_image_folder(tmp_path / "data", classes=1, per_class=8, size=(40, 60), seed=5)
    bomb = sorted(data.rglob("*.jpg"))[2]
    Image.new("L", (12000, 12000)).save(bomb, "PNG")  # 144 Mpx > Pillow's 89 Mpx limit; ~140 KB on disk
    bomb.rename(bomb.with_suffix(".png"))
    paths = serve(write_config(tmp_path, data, batch_size=8, size=16)).paths
    loader = PrefetchLoader("job", as_tensors=False)
    next(iter(loader))
    meta = map_batch(paths.batch(0, 0, 0))[0]["meta"]
    assert [r["path"] for r in meta["replaced"]] == [str(bomb.with_suffix(".png"))]
    assert "DecompressionBomb" in meta["replaced"][0]["error"]
    loader.close()
    assert json.dumps(meta)  # the header stays small JSON


def test_many_bad_samples_with_long_paths_fit_the_header(tmp_path, serve):
    """11 of 48 files spoilt, paths of ~500 characters, 2 batches of 24: one batch holds 6 or
    more, whose full records (path, error) outgrow the header area. The batch keeps its size
    and records every replacement in the short form; the paths are in the daemon's log."""
    data = make_image_folder(tmp_path / ("d" * 200) / "train", classes=2, per_class=24, size=(24, 48), seed=3)
    for p in sorted(data.rglob("*.jpg")):
        p.rename(p.with_name("x" * 200 + p.name))
    files = sorted(data.rglob("*.jpg"))
    (tmp_path / "train.txt").write_text("".join(f"{p},{i % 2}\n" for i, p in enumerate(files)))
    bad = spoil(data, np.random.default_rng(2), 11 / 48)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        '[job]\nname = "job"\nbatch_size = 24\n[daemon]\nbuffer = "8M"\n'
        '[[source]]\nkind = "file_list"\npath = "train.txt"\n[[transform]]\nop = "random_resized_crop"\nsize = 16\n'
    )
    paths = serve(cfg).paths
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    metas = []
    for epoch in range(2):
        for step, batch in enumerate(loader):
            assert len(batch["index"]) == 24
            metas.append(map_batch(paths.batch(epoch, step, 0))[0]["meta"])
    log = paths.log.read_text()
    loader.close()
    assert len(metas) == 4
    short = [m for m in metas if m.get("replaced_details") == "daemon.log"]
    assert short and all(set(r) == {"slot", "index", "replacement"} for m in short for r in m["replaced"])
    for epoch in range(2):  # every bad file replaced in each epoch, and only those
        replaced = {str(files[r["index"]]) for m in metas[2 * epoch : 2 * epoch + 2] for r in m["replaced"]}
        assert replaced == bad
    assert all(path in log for path in bad)


def stopped_job(serve, config: Path, name: str = "job") -> tuple[str, JobPaths]:
    """Start a job whose master stops on its own soon; its stop reason, as the start raised it
    (the master stopped during start-up) or as stopped.json has it (it stopped after)."""
    paths = JobPaths.of(name)
    try:
        job = serve(config)
    except UserError as exc:
        return str(exc), paths
    job.wait_stopped(30)
    return json.loads(paths.stopped.read_text())["message"], paths


def clear_stopped(paths: JobPaths) -> None:
    """What `prefetchd stop` does with a job whose master stopped on its own: it removes the
    folder. Called in this process only once no process holds the job's lock (the master here
    is this test's, and stop signals whoever holds it)."""
    assert not daemon_alive(paths), "the master still holds the job"
    assert stop_job(paths) == "not running; removed its stale directory" and not paths.dir.exists()


def hf_parquet(path: Path, images: list[bytes | None]) -> Path:
    """A Hugging Face Image column as `datasets` writes it; a None image is a struct whose bytes
    are null and whose path is set, as ``Dataset.from_dict({"image": paths}).cast_column("image",
    Image())`` leaves it without embedding the files."""
    rows = [{"bytes": b, "path": f"/home/me/img{i}.jpg"} for i, b in enumerate(images)]
    table = pa.table({"image": pa.array(rows, HF_IMAGE), "label": pa.array([i % 3 for i in range(len(rows))])})
    pq.write_table(table, path)
    return path


def test_a_parquet_file_of_unembedded_images_stops_with_the_readers_words_and_the_rows_place(tmp_path, serve):
    """issue 24 finding 4: the daemon stopped with "is the data folder readable?"; what the reader
    said (a null image) was swallowed by the replacement loop, and nowhere to be read. (One row
    has its image: a file with none fails `start` already, below.)"""
    data = hf_parquet(tmp_path / "train.parquet", [None] * 40 + jpegs(1))
    config = write_config(tmp_path, tmp_path, batch_size=8, source=f'kind = "parquet"\npath = "{data}"')
    message, paths = stopped_job(serve, config)
    cause = re.compile(rf"ValueError: {re.escape(str(data))}: null image in column 'image' \(row group 0, row \d+\)")
    place = re.compile(rf"sample \d+ \(Parquet file {re.escape(str(data))} row group 0 row \d+\)")
    assert cause.search(message) and place.search(message), message
    assert "data folder readable" not in message
    stopped = json.loads(paths.stopped.read_text())
    assert stopped["exit_code"] == 6 and cause.search(stopped["message"]) and place.search(stopped["message"])
    log = paths.log.read_text()
    assert cause.search(log) and place.search(log), log
    with pytest.raises(DaemonDied, match=r"null image in column 'image'"):
        next(iter(PrefetchLoader("job", as_tensors=False, timeout=30)))
    # The ten replacements' causes are told once each, not ten times: they differ only by row.
    assert message.count("null image") <= 3, message
    assert len(message) < 2000
    print(f"\n[figure] 40 null images: stop message of {len(message)} chars: {message[:400]}")
    clear_stopped(paths)


def test_a_few_null_images_among_good_rows_are_recorded_each_with_its_cause(tmp_path, serve):
    images = jpegs(24, seed=3)
    bad = {3, 10, 17}
    data = hf_parquet(tmp_path / "train.parquet", [None if i in bad else b for i, b in enumerate(images)])
    config = write_config(tmp_path, tmp_path, batch_size=4, source=f'kind = "parquet"\npath = "{data}"')
    paths = serve(config).paths
    batches = read_epoch("job", with_meta=True, batch_size=4)
    replaced = {r["index"]: r for b in batches for r in b.meta["replaced"]}
    assert sorted(replaced) == sorted(bad)
    lines = []
    for i, record in replaced.items():
        assert record["error"] == f"ValueError: {data}: null image in column 'image' (row group 0, row {i})"
        assert record["path"] == f"Parquet file {data} row group 0 row {i}"
        lines.append(f"(Parquet file {data} row group 0 row {i}): {record['error']}")
    # The master logs a batch's bad samples when its worker reports it, which may be after a
    # trainer has read the published batch.
    wait_until(lambda: all(line in paths.log.read_text() for line in lines), what="each cause in daemon.log")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("hf-paths-only", id="hf-parquet-of-paths"),
        pytest.param("null-labels", id="parquet-without-labels"),
        pytest.param("json-labels", id="shards-labelled-by-json"),
        pytest.param("no-labels", id="shards-without-labels"),
        pytest.param("wrong-label-key", id="shards-with-another-label-key"),
    ],
)
def test_data_whose_every_sample_would_be_bad_fails_start_with_the_fix(tmp_path, job_root, case):
    """issue 27: what the index already knows fails `start` (exit 3) with the fix, instead of a
    daemon that says "serving" and stops in its first second."""
    images = jpegs(12, seed=5)
    if case == "hf-paths-only":  # Dataset.from_dict({"image": paths}).cast_column("image", Image()).to_parquet()
        data = hf_parquet(tmp_path / "train.parquet", [None] * len(images))
        source, fix = f'kind = "parquet"\npath = "{data}"', "embed_table_storage"
    elif case == "null-labels":
        data = tmp_path / "train.parquet"
        pq.write_table(pa.table({"image": pa.array(images), "label": pa.array([None] * 12, pa.int64())}), data)
        source, fix = f'kind = "parquet"\npath = "{data}"', "set label_column"
    else:
        label = {"json-labels": "json", "no-labels": "txt", "wrong-label-key": "json"}[case]
        samples = [{"jpg": image, label: json.dumps({"label": i % 2}).encode()} for i, image in enumerate(images)]
        data = write_shard(tmp_path / "s.tar", samples)
        source = f'kind = "webdataset"\nurls = "{data}"'
        source += '\nlabel_key = "class"' if case == "wrong-label-key" else ""
        fix = {"json-labels": "set label_key", "no-labels": ".cls member", "wrong-label-key": "'class'"}[case]
    config = write_config(tmp_path, tmp_path, batch_size=4, source=source)
    result = cli("start", str(config))
    assert result.returncode == 3, result.stderr
    assert str(data) in result.stderr and fix in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not list(job_root.iterdir())  # nothing left behind
