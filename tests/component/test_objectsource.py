"""WebDataset shards in object storage, indexed and read in this process against real servers on
loopback (tests/objectstores.py): an S3 bucket (moto) and a plain HTTP server with byte ranges
and faults. The daemon's side (outages, a changed object, batches equal to local shards) is in
tests/daemon/data/test_object_storage.py."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time

import numpy as np
import pytest
from PIL import Image

from prefetchd.errors import DataError
from prefetchd.sources import objects, shards, tarformat
from prefetchd.sources.tarmembers import TarMembers
from tests.objectstores import MotoS3, RangeServer

pytestmark = pytest.mark.timeout(90)


def jpeg(seed: int, side: int = 48) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 255, (side, side + 8, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def shard_bytes(first: int, samples: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(first, first + samples):
            for ext, data in (("cls", str(i % 5).encode()), ("jpg", jpeg(i))):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture
def shard_set(tmp_path) -> dict[str, bytes]:
    """Three shards of 12 samples, also written to tmp_path/local/."""
    (tmp_path / "local").mkdir()
    made = {f"train-{j:03d}.tar": shard_bytes(12 * j, 12) for j in range(3)}
    for name, data in made.items():
        (tmp_path / "local" / name).write_bytes(data)
    return made


@pytest.fixture
def s3(monkeypatch, tmp_path):
    with MotoS3() as store:
        for key, value in store.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
        yield store


def reader_for(index) -> TarMembers:
    reader = TarMembers()
    reader.objects_indexed = index.objects
    return reader


def test_shards_in_a_bucket_are_the_same_samples_as_on_disk(s3, shard_set, tmp_path):
    for name, data in shard_set.items():
        s3.put(f"wds/{name}", data)
    remote = shards.scan_webdataset({"urls": s3.url("wds/train-{000..002}.tar")}, "src")
    local = shards.scan_webdataset({"urls": str(tmp_path / "local" / "train-{000..002}.tar")}, "src")
    assert (remote.labels == local.labels).all() and (remote.members == local.members).all()
    assert list(remote.objects) == [s3.url(f"wds/{name}") for name in shard_set]  # their size and ETag
    assert all(size == len(shard_set[url.rsplit("/", 1)[1]]) for url, (size, _, _) in remote.objects.items())
    remote_reader, local_reader = reader_for(remote), TarMembers()
    for i in range(len(remote)):
        assert remote_reader.read(remote.path(i), *remote.member(i)) == local_reader.read(
            local.path(i), *local.member(i)
        )
    assert (
        remote_reader.where(remote.path(5), *remote.member(5))
        == f"shard {s3.url('wds/train-000.tar')} member 000005.jpg"
    )
    remote_reader.close()
    local_reader.close()


def test_a_second_start_reads_the_cache_and_an_index_object_spares_the_shard(s3, shard_set, tmp_path):
    for name, data in shard_set.items():
        s3.put(f"wds/{name}", data)
    urls = {"urls": s3.url("wds/train-{000..002}.tar")}
    first = shards.scan_webdataset(urls, "src")
    shard_gets = sum(1 for path, _ in s3.ranges if path.endswith(".tar"))
    assert shard_gets >= 3  # each shard streamed once
    s3.reset_counts()
    assert shards.scan_webdataset(urls, "src").fingerprint() == first.fingerprint()
    assert not any(path.endswith(".tar") for path, _ in s3.ranges)  # cached by URL, ETag and size
    # an index object beside each shard, as `prefetchd pack` writes it: used with no cache at all
    for name, data in shard_set.items():
        local = tmp_path / "local" / name
        with open(local, "rb") as f:
            table = tarformat.index_tar(f, lambda n, at, f=f: os.pread(f.fileno(), n, at), name, None)
        s3.put(f"wds/{name}.idx", shards.index_object_bytes(table, len(data), hashlib.md5(data).hexdigest()))
    for cached in (tmp_path / "cache").iterdir():
        cached.unlink()
    s3.reset_counts()
    assert shards.scan_webdataset(urls, "src").fingerprint() == first.fingerprint()
    assert not any(path.endswith(".tar") for path, _ in s3.ranges)
    assert sum(1 for path, _ in s3.ranges if path.endswith(".idx")) == 3


def test_a_batch_of_neighbours_is_one_request_fetching_little_more_than_its_samples(s3, shard_set):
    for name, data in shard_set.items():
        s3.put(f"wds/{name}", data)
    index = shards.scan_webdataset({"urls": s3.url("wds/train-{000..002}.tar")}, "src")
    reader = reader_for(index)
    batch = list(range(2, 10)) + list(range(14, 18))  # two runs of neighbours in two shards
    s3.reset_counts()
    reader.will_need([(index.path(i), *index.member(i)) for i in batch])
    images = [reader.read(index.path(i), *index.member(i)) for i in batch]
    reader.close()
    assert s3.gets == 2, s3.ranges
    # each run: its first image's header, then every member up to its last image (the .cls between)
    samples = sum(len(image) + 512 for image in images)
    assert samples <= s3.bytes_sent <= samples + 2 * 1024 * len(batch), (samples, s3.bytes_sent)


def test_a_missing_shard_is_one_line_at_start(s3, shard_set):
    s3.put("wds/train-000.tar", shard_set["train-000.tar"])
    with pytest.raises(DataError, match=r"train-001\.tar does not exist in the store; check the URL") as caught:
        shards.scan_webdataset({"urls": s3.url("wds/train-{000..001}.tar")}, "src")
    assert "\n" not in str(caught.value)


def test_a_store_that_refuses_access_is_one_line_without_the_secret(http_shards, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    http_shards.fault("403")
    with pytest.raises(DataError, match="refuses access|answers 403") as caught:
        shards.scan_webdataset({"urls": http_shards.url("wds/train-000.tar")}, "src")
    assert "wrong-secret-value" not in str(caught.value) and "\n" not in str(caught.value)


def test_urls_with_credentials_or_a_query_are_refused_without_showing_them():
    for url, why in (
        ("https://alice:hunter2@example.com/a.tar", "credentials in a URL are not accepted"),
        ("https://example.com/a.tar?X-Amz-Signature=hunter2", "a query or fragment"),
        ("s3://bucket-only/", "no object"),
    ):
        with pytest.raises(DataError, match=why) as caught:
            list(shards.expand_urls(url))
        assert "hunter2" not in str(caught.value)
    assert objects.shown("https://alice:hunter2@example.com:8443/x.tar?sig=hunter2") == "https://example.com:8443/x.tar"


def test_an_object_rewritten_under_the_job_is_never_mixed_with_its_old_index(s3, shard_set):
    s3.put("wds/train-000.tar", shard_set["train-000.tar"])
    index = shards.scan_webdataset({"urls": s3.url("wds/train-000.tar")}, "src")
    s3.put("wds/train-000.tar", shard_set["train-001.tar"])  # same size, other images
    reader = reader_for(index)
    with pytest.raises(objects.ObjectChanged, match="changed under the running job"):
        reader.read(index.path(0), *index.member(0))
    reader.will_need([(index.path(i), *index.member(i)) for i in range(4)])
    with pytest.raises(objects.ObjectChanged):
        reader.read(index.path(1), *index.member(1))
    reader.close()


@pytest.fixture
def http_shards(shard_set, monkeypatch, tmp_path):
    monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
    with RangeServer({f"/wds/{name}": data for name, data in shard_set.items()}) as server:
        yield server


def test_an_http_server_with_ranges_serves_as_a_bucket_does(http_shards, shard_set, tmp_path):
    index = shards.scan_webdataset({"urls": http_shards.url("wds/train-{000..002}.tar")}, "src")
    local = shards.scan_webdataset({"urls": str(tmp_path / "local" / "train-{000..002}.tar")}, "src")
    assert (index.members == local.members).all() and (index.labels == local.labels).all()
    reader = reader_for(index)
    assert reader.read(index.path(20), *index.member(20)) == jpeg(20)
    reader.close()


@pytest.mark.parametrize("fault", ["503", "429", "reset", "truncate"])
def test_a_short_storm_of_faults_is_retried_through(http_shards, fault):
    index = shards.scan_webdataset({"urls": http_shards.url("wds/train-000.tar")}, "src")
    reader = reader_for(index)
    http_shards.fault(fault, 2)
    assert reader.read(index.path(3), *index.member(3)) == jpeg(3)
    reader.close()


def test_a_store_that_stays_down_is_unreachable_not_a_bad_sample(http_shards):
    index = shards.scan_webdataset({"urls": http_shards.url("wds/train-000.tar")}, "src")
    reader = reader_for(index)
    http_shards.stop()
    began = time.monotonic()
    with pytest.raises(objects.StoreUnreachable, match=r"train-000\.tar"):
        reader.read(index.path(3), *index.member(3))
    assert time.monotonic() - began < 15  # obstore's retries are bounded (objects._RETRY)
    http_shards.start()
    assert reader.read(index.path(3), *index.member(3)) == jpeg(3)  # and it comes back by itself
    reader.close()


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("redirect_loop", r"train-000\.tar"),
        ("huge_header", r"train-000\.tar"),
        ("etag_changes", r"ETag|changed"),
    ],
)
def test_a_hostile_store_at_start_is_a_data_error_naming_the_shard(http_shards, fault, words):
    http_shards.fault(fault)
    began = time.monotonic()
    with pytest.raises(DataError, match=words) as caught:
        shards.scan_webdataset({"urls": http_shards.url("wds/train-000.tar")}, "src")
    assert time.monotonic() - began < 30 and "\n" not in str(caught.value)


def test_an_object_that_is_not_a_tar_is_named_at_start(http_shards):
    http_shards.objects["/wds/fake.tar"] = b"<html>not found</html>" * 100
    with pytest.raises(DataError, match=r"fake\.tar is not a readable tar file"):
        shards.scan_webdataset({"urls": http_shards.url("wds/fake.tar")}, "src")


@pytest.mark.long
@pytest.mark.parametrize("fault", ["endless", "lying_length"])
def test_a_body_that_never_ends_is_abandoned_within_the_request_timeout(http_shards, fault):
    index = shards.scan_webdataset({"urls": http_shards.url("wds/train-000.tar")}, "src")
    reader = reader_for(index)
    http_shards.fault(fault)
    began = time.monotonic()
    with pytest.raises((objects.StoreUnreachable, objects.ObjectError, ValueError)):
        reader.read(index.path(3), *index.member(3))
    assert time.monotonic() - began < 60  # below --worker-timeout's default
    reader.close()


def test_index_objects_that_lie_are_not_used(s3, shard_set, caplog):
    s3.put("wds/train-000.tar", shard_set["train-000.tar"])
    s3.put("wds/train-000.tar.idx", b"\x93NUMPY" + b"\xff" * 200)  # a header that says nothing sane
    index = shards.scan_webdataset({"urls": s3.url("wds/train-000.tar")}, "src")
    assert len(index) == 12 and "not used" in caplog.text
    lying = shards.index_object_bytes(np.asarray([[10**9, 10, 0]]), len(shard_set["train-000.tar"]), "0" * 32)
    assert shards.parse_index_object(lying, len(shard_set["train-000.tar"])) is None  # an image past the end


def test_indexing_progress_goes_to_the_log_and_a_waiting_start_shows_it(http_shards, tmp_path, monkeypatch, capsys):
    import logging

    from prefetchd.cli import launch
    from prefetchd.sources import progress

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # a line per shard, as a long indexing gets one per 5 s
    log = tmp_path / "daemon.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("prefetchd").addHandler(handler)
    logging.getLogger("prefetchd").setLevel(logging.INFO)
    try:
        shards.scan_webdataset({"urls": http_shards.url("wds/train-{000..002}.tar")}, "[[source]] #1")
    finally:
        logging.getLogger("prefetchd").removeHandler(handler)
        handler.close()
    assert "[[source]] #1: indexed 2 of 3 shards" in log.read_text()
    echo = launch._ProgressEcho(log)
    echo.show_new()
    shown = capsys.readouterr().err.splitlines()
    assert shown and all(line.startswith("[[source]] #1: indexed ") for line in shown), shown
    echo.next_look = 0.0
    echo.show_new()  # nothing new: nothing shown twice
    assert capsys.readouterr().err == ""


def test_a_store_that_is_down_at_start_fails_it_once_not_once_a_shard(http_shards, shard_set):
    many = {f"/wds/many-{i:03d}.tar": shard_set["train-000.tar"] for i in range(200)}
    http_shards.objects.update(many)
    http_shards.stop()
    began = time.monotonic()
    with pytest.raises(DataError, match="cannot reach the store"):
        shards.scan_webdataset({"urls": http_shards.url("wds/many-{000..199}.tar")}, "src")
    assert time.monotonic() - began < 30  # 8 shards at a time, ~10 s of retries each: not 200 / 8 rounds


def parquet_bytes(rows: int, group: int) -> bytes:
    """A Hub-style image column (struct<bytes, path>) and labels, in row groups of ``group``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = pa.array(
        [{"bytes": jpeg(i, side=300), "path": None} for i in range(rows)],  # ~90 KB each: several ranges
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    out = io.BytesIO()
    pq.write_table(
        pa.table({"image": images, "label": pa.array([i % 7 for i in range(rows)])}), out, row_group_size=group
    )
    return out.getvalue()


def test_parquet_in_a_bucket_is_the_same_rows_as_on_disk_and_an_outage_is_not_a_bad_row(s3, tmp_path):
    pytest.importorskip("pyarrow")
    from prefetchd.sources import parquetsource
    from prefetchd.sources.parquetrows import ParquetRows

    data = parquet_bytes(40, 8)
    (tmp_path / "local.parquet").write_bytes(data)
    s3.put("pq/train.parquet", data)
    keys = {"image_column": "image", "label_column": "label"}
    remote = parquetsource.scan_parquet({"path": s3.url("pq/train.parquet"), **keys}, "src")
    local = parquetsource.scan_parquet({"path": str(tmp_path / "local.parquet"), **keys}, "src")
    assert (remote.labels == local.labels).all() and (remote.members == local.members).all()
    assert list(remote.objects) == [s3.url("pq/train.parquet")]
    reader = ParquetRows()
    reader.objects_indexed = remote.objects
    for i in range(16):  # row groups 0 and 1 of 5
        assert reader.read(remote.path(i), *remote.member(i), "image") == jpeg(i, side=300)
    assert reader.io_totals()[f"s3://{s3.bucket}"][0] > 0  # requests counted
    s3.stop()
    with pytest.raises(objects.StoreUnreachable):  # a row group never read: the store is asked
        reader.read(remote.path(26), *remote.member(26), "image")
    s3.restart()
    assert reader.read(remote.path(26), *remote.member(26), "image") == jpeg(26, side=300)
    s3.put("pq/train.parquet", parquet_bytes(40, 10))  # rewritten: another ETag
    fresh = ParquetRows()
    fresh.objects_indexed = remote.objects
    with pytest.raises(objects.ObjectChanged):
        fresh.read(remote.path(0), *remote.member(0), "image")
    reader.close()
    fresh.close()


def test_a_member_cache_serves_later_epochs_locally_within_its_bound(http_shards, tmp_path):
    index = shards.scan_webdataset({"urls": http_shards.url("wds/train-{000..002}.tar")}, "src")
    options = {"cache": str(tmp_path / "mc"), "cache_size": "10M"}

    def epoch(reader) -> list[bytes]:
        images = []
        for first in range(0, len(index), 8):
            ids = range(first, min(first + 8, len(index)))
            reader.will_need([(index.path(i), *index.member(i), options) for i in ids])
            images += [reader.read_sample(index.path(i), *index.member(i), options) for i in ids]
        return images

    first, second = reader_for(index), reader_for(index)  # two workers, one after the other
    http_shards.reset_counts()
    assert epoch(first) == [jpeg(i) for i in range(len(index))]
    assert http_shards.gets > 0
    http_shards.reset_counts()
    assert epoch(second) == [jpeg(i) for i in range(len(index))]
    assert http_shards.gets == 0  # every read from the cache
    assert second.io_totals()[f"cache:{tmp_path / 'mc'}"][0] == len(index)
    # a bound of three samples' reads: the entries never take more
    small = {"cache": str(tmp_path / "small"), "cache_size": str(3 * (len(jpeg(0)) + 600))}
    third = reader_for(index)
    for i in range(len(index)):
        third.read_sample(index.path(i), *index.member(i), small)
    held = sum(p.stat().st_size for p in (tmp_path / "small").iterdir() if not p.name.startswith("."))
    assert 0 < held <= 3 * (len(jpeg(0)) + 600)
    # an entry another hand made writable by others, or swapped for a symlink, is not used
    entry = next(p for p in (tmp_path / "mc").iterdir() if not p.name.startswith("."))
    entry.chmod(0o666)
    http_shards.reset_counts()
    assert epoch(reader_for(index)) == [jpeg(i) for i in range(len(index))]
    assert http_shards.gets >= 1
    for reader in (first, second, third):
        reader.close()


def test_a_member_cache_is_configured_whole_or_not_at_all(http_shards):
    from prefetchd.errors import ConfigError

    urls = http_shards.url("wds/train-000.tar")
    for keys, words in (
        ({"cache": "/tmp/x"}, "go together"),
        ({"cache": "relative/x", "cache_size": "1G"}, "absolute"),
        ({"cache": "/tmp/x", "cache_size": "lots"}, "cache_size"),
    ):
        with pytest.raises(ConfigError, match=words):
            shards.scan_webdataset({"urls": urls, **keys}, "src")
