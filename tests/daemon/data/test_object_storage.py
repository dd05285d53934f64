"""A real daemon serving WebDataset shards from object storage: a moto S3 bucket and a plain HTTP
server with byte ranges, both on loopback in this process (tests/objectstores.py), the daemon and
its workers in their own processes configured by the S3 tools' environment. The batches are
those of the same shards on disk, byte for byte; an outage of the store loses and mixes nothing;
an object rewritten under the job stops it naming the object."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from prefetchd.cli import statusview
from prefetchd.errors import ExitCode
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import read_stopped
from tests.conftest import cli, wait_until, write_config
from tests.daemon.resume.test_resume import SAMPLES
from tests.helpers import read_epoch
from tests.objectstores import MotoS3, RangeServer

pytestmark = pytest.mark.timeout(180)
BATCH = 8


@pytest.fixture(scope="module")
def packed(jpeg_folder, tmp_path_factory) -> Path:
    """The jpeg_folder packed into shards of ~40 KB, each with its index object."""
    out = tmp_path_factory.mktemp("shards")
    result = cli("pack", str(jpeg_folder), str(out), "--shard-size", "40K")
    assert result.returncode == 0, result.stderr
    return out


def shard_names(packed: Path) -> list[str]:
    return [s["name"] for s in json.loads((packed / "pack.json").read_text())["shards"]]


def shard_objects(packed: Path) -> dict[str, bytes]:
    """The packed shards as a RangeServer serves them, under /wds/."""
    return {f"/wds/{name}": (packed / name).read_bytes() for name in shard_names(packed)}


def urls_of(base: str, packed: Path) -> str:
    return f"{base}/shard-{{000000..{len(shard_names(packed)) - 1:06d}}}.tar"


def start(tmp_path: Path, name: str, source: str, env: dict, *flags: str, extra: str = "") -> JobPaths:
    config = write_config(tmp_path, "", name=name, batch_size=BATCH, seed=7, buffer="256K", source=source, extra=extra)
    result = cli("start", str(config), *flags, env=env)
    assert result.returncode == 0, result.stderr
    return JobPaths.of(name)


def status(name: str, env: dict) -> dict:
    result = cli("status", name, "--json", env=env)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def local_batches(tmp_path: Path, packed: Path, job_root) -> list:
    start(tmp_path, "local", f'kind = "webdataset"\nurls = "{urls_of(str(packed), packed)}"', {})
    try:
        return read_epoch("local", epochs=2)
    finally:
        cli("stop", "local")


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b) == 2 * SAMPLES // BATCH
    for x, y in zip(a, b):
        for field in ("index", "label", "image"):
            np.testing.assert_array_equal(x.arrays[field], y.arrays[field])


def test_shards_in_a_bucket_make_the_batches_of_the_same_shards_on_disk(tmp_path, packed, job_root):
    expected = local_batches(tmp_path, packed, job_root)
    with MotoS3() as s3:
        for name in shard_names(packed):
            s3.put(f"wds/{name}", (packed / name).read_bytes())
            s3.put(f"wds/{name}.idx", (packed / f"{name}.idx").read_bytes())
        s3.reset_counts()
        start(tmp_path, "s3", f'kind = "webdataset"\nurls = "{urls_of(s3.url("wds"), packed)}"', s3.env)
        try:
            assert_same(expected, read_epoch("s3", epochs=2))
            assert not any(path.endswith(".tar") and rng is None for path, rng in s3.ranges)  # ranges only
            bucket = f"s3://{s3.bucket}"
            shown = wait_until(  # what the workers' heartbeats carry, once a second
                lambda: (store := status("s3", s3.env)["store"])["stores"].get(bucket) and store,
                timeout_s=10,
                what="the bucket's counters in status",
            )
            assert (shown["unreachable_s"], shown["error"], shown["outages"]) == (None, None, 0)
            io = shown["stores"][bucket]
            assert io["requests"] > 0 and io["bytes"] > 0 and io["errors"] == 0 and io["seconds"] > 0
        finally:
            cli("stop", "s3", env=s3.env)
    log = (job_root / "s3" / "daemon.log").read_text() if (job_root / "s3").exists() else ""
    assert s3.SECRET_ACCESS_KEY not in log


@pytest.mark.parametrize("outage_s", [pytest.param(3.0, id="3s"), pytest.param(10.0, id="10s", marks=pytest.mark.long)])
def test_an_outage_of_the_store_mid_epoch_loses_and_mixes_nothing(tmp_path, packed, job_root, outage_s):
    """The store goes down after the first batches, with a window of three batches: the trainer
    waits through the outage, status says why meanwhile, the batches are those of an
    uninterrupted run, and the first one after the store is back comes within 2 s."""
    expected = local_batches(tmp_path, packed, job_root)
    objects = shard_objects(packed)
    with RangeServer(objects) as server:
        env = {"AWS_ALLOW_HTTP": "true"}
        source = f'kind = "webdataset"\nurls = "{urls_of(server.url("wds"), packed)}"'
        start(tmp_path, "web", source, env, "--buffer", "96K", "--retain", "0")  # a batch is 32 KiB: 3 ahead
        shown: list[dict] = []
        try:
            got, arrivals, back = [], [], None
            loader = PrefetchLoader("web", timeout=60, as_tensors=False)
            for epoch in range(2):
                for batch in loader:
                    got.append(type(expected[0])(epoch, len(got), {k: v.copy() for k, v in batch.items()}, None))
                    arrivals.append(time.monotonic())
                    if len(got) == 2:
                        server.down_for(outage_s)
                        back = time.monotonic() + outage_s
                        watcher = threading.Thread(target=_watch_store, args=(env, back, shown), daemon=True)
                        watcher.start()
            watcher.join(30)
            assert_same(expected, got)
            after = [t for t in arrivals if t > back]
            assert max(t for t in arrivals if t <= back) < back - outage_s / 2, "the trainer did not wait"
            assert after and after[0] - back < 2.0, after[0] - back  # the client backs off at most 1 s a try
            down = [s for s in shown if s["store"]["unreachable_s"] is not None and "wds/" in s["store"]["error"]]
            assert down
            console = Console(file=io.StringIO(), width=200)
            console.print(statusview.render({**down[-1], "state": "serving"}))  # what `prefetchd status` shows
            text = console.file.getvalue()
            assert "STORE UNREACHABLE" in text and f"http://127.0.0.1:{server.port}: " in text, text
            final = status("web", env)["store"]
            assert final["outages"] == 1 and final["unreachable_s"] is None
        finally:
            cli("stop", "web", env=env)


def _watch_store(env: dict, until: float, shown: list) -> None:
    """What status says, until the outage ends."""
    while time.monotonic() < until:
        reply = status("web", env)
        if reply.get("store"):
            shown.append(reply)
        time.sleep(0.3)


def test_an_object_rewritten_under_the_job_stops_it_naming_the_object(tmp_path, packed, job_root):
    objects = shard_objects(packed)
    with RangeServer(objects) as server:
        env = {"AWS_ALLOW_HTTP": "true"}
        paths = start(tmp_path, "moved", f'kind = "webdataset"\nurls = "{urls_of(server.url("wds"), packed)}"', env)
        for path in list(server.objects):  # every shard: whichever the next batch reads has changed
            server.objects[path] = server.objects[path][::-1]
        with pytest.raises(Exception, match="stopped|not running|changed"):
            read_epoch("moved", epochs=3, timeout=30)
        stopped = wait_until(lambda: read_stopped(paths), timeout_s=30, what="stopped.json")
        assert stopped["exit_code"] == ExitCode.SAMPLE_ERROR, stopped
        assert "changed under the running job" in stopped["message"] and server.url("wds") in stopped["message"]


def test_a_store_down_past_store_timeout_stops_the_daemon_with_its_own_exit(tmp_path, packed, job_root):
    objects = shard_objects(packed)
    with RangeServer(objects) as server:
        env = {"AWS_ALLOW_HTTP": "true"}
        source = f'kind = "webdataset"\nurls = "{urls_of(server.url("wds"), packed)}"'
        paths = start(tmp_path, "gone", source, env, "--store-timeout", "2")
        server.stop()
        with pytest.raises(Exception, match="stopped|not running|store"):
            read_epoch("gone", epochs=3, timeout=40)
        stopped = wait_until(lambda: read_stopped(paths), timeout_s=40, what="stopped.json")
        assert stopped["exit_code"] == ExitCode.STORE_UNREACHABLE, stopped
        assert "has not answered" in stopped["message"] and server.url("wds") in stopped["message"]


def test_parquet_in_a_bucket_makes_the_batches_of_the_same_file_on_disk(tmp_path, jpeg_folder, job_root):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from prefetchd.sources.index import scan_image_folder

    index = scan_image_folder(str(jpeg_folder), "test")
    images = [Path(index.path(i)).read_bytes() for i in range(len(index))]
    table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(index.labels.tolist())})
    pq.write_table(table.slice(0, 40), tmp_path / "part-0.parquet", row_group_size=10)
    pq.write_table(table.slice(40), tmp_path / "part-1.parquet", row_group_size=10)
    start(tmp_path, "local", f'kind = "parquet"\npath = "{tmp_path}/part-*.parquet"', {})
    try:
        expected = read_epoch("local", epochs=2)
    finally:
        cli("stop", "local")
    with MotoS3() as s3:
        for part in range(2):
            s3.put(f"pq/part-{part}.parquet", (tmp_path / f"part-{part}.parquet").read_bytes())
        start(tmp_path, "pq", f'kind = "parquet"\npath = "{s3.url("pq/part-{0..1}.parquet")}"', s3.env)
        try:
            assert_same(expected, read_epoch("pq", epochs=2))
        finally:
            cli("stop", "pq", env=s3.env)


def test_resume_is_exact_across_a_daemon_restart_while_the_store_is_down(tmp_path, packed, job_root):
    """The daemon stops, the store goes down, the daemon starts again: it serves with the index of
    the start before (the trainer waiting for the store), and the batches from the trainer's
    state_dict on are those of an uninterrupted run."""
    expected = local_batches(tmp_path, packed, job_root)
    objects = shard_objects(packed)
    with RangeServer(objects) as server:
        env = {"AWS_ALLOW_HTTP": "true"}
        source = f'kind = "webdataset"\nurls = "{urls_of(server.url("wds"), packed)}"'
        paths = start(tmp_path, "web", source, env)
        loader = PrefetchLoader("web", timeout=60, as_tensors=False)
        got = []
        for batch in loader:
            got.append({k: v.copy() for k, v in batch.items()})
            if len(got) == 3:
                break
        state = loader.state_dict()
        loader.close()
        assert cli("stop", "web", env=env).returncode == 0
        server.stop()
        restarted = cli("start", str(tmp_path / "web.toml"), env=env)
        assert restarted.returncode == 0, restarted.stderr
        assert "does not answer" in paths.log.read_text()
        threading.Timer(3.0, server.start).start()
        try:
            loader = PrefetchLoader("web", timeout=60, as_tensors=False)
            loader.load_state_dict(state)
            for _ in range(2):  # the rest of epoch 0, then epoch 1
                got.extend({k: v.copy() for k, v in batch.items()} for batch in loader)
        finally:
            cli("stop", "web", env=env)
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        for field in ("index", "label", "image"):
            np.testing.assert_array_equal(mine[field], theirs.arrays[field])


def test_with_a_local_cache_the_second_epoch_reads_from_it(tmp_path, packed, job_root):
    """A cache the dataset fits in: after the first epoch the store is not asked again (--retain 0
    and a small window: the second epoch's batches are made after the first's are read)."""
    objects = shard_objects(packed)
    with RangeServer(objects) as server:
        env = {"AWS_ALLOW_HTTP": "true"}
        cache = tmp_path / "member-cache"
        source = (
            f'kind = "webdataset"\nurls = "{urls_of(server.url("wds"), packed)}"\n'
            f'cache = "{cache}"\ncache_size = "64M"'
        )
        start(tmp_path, "cached", source, env, "--buffer", "96K", "--retain", "0")
        try:
            loader = PrefetchLoader("cached", timeout=60, as_tensors=False)
            first = [batch["index"].copy() for batch in loader]
            gets_before = server.gets
            second = [batch["index"].copy() for batch in loader]
            assert len(first) == len(second) == SAMPLES // BATCH
            stores = wait_until(
                lambda: (s := status("cached", env)["store"]["stores"]).get(f"cache:{cache}") and s,
                timeout_s=10,
                what="the cache's hits in status",
            )
            hits = stores[f"cache:{cache}"]["requests"]
            assert hits >= len(second) * BATCH * 0.99, stores
            # the store was asked again only for what the window held ahead at the epoch's turn
            assert server.gets - gets_before <= 3 * BATCH, (server.gets, gets_before)
        finally:
            cli("stop", "cached", env=env)
