"""--executor ray on a real Ray cluster on this machine (ray.cluster_utils.Cluster): a "trainer"
head node without CPUs for tasks and a "prep" node with them, tasks placed by a custom resource.

Batches made on Ray must equal, byte for byte, those of local workers; resume must be exact
across daemon restarts; a Ray worker killed mid-task must cost nothing; a node that decodes
otherwise is refused; a lost cluster degrades to local workers, or stops a daemon that has none.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import textwrap
import time

import psutil
import pytest

from prefetchd_client import PrefetchLoader
from prefetchd_client.errors import DaemonDied
from tests.batchdigest import digest
from tests.conftest import cli, daemon_family, start_job, wait_pids_gone, wait_until, write_config
from tests.daemon.data.test_container_sources import KINDS, parquet_files, shards, source_of  # noqa: F401 - fixtures
from tests.daemon.resume.test_resume import read
from tests.helpers import job_status

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

# One worker runs this module (--dist loadgroup, pyproject.toml): one cluster serves its tests.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray"), pytest.mark.heavy]
_STORE = 80 << 20  # each node's object store: small, and on /tmp, off the tmpfs the buffer uses
_NODE = {"object_store_memory": _STORE, "plasma_directory": "/tmp"}

# A [pipeline] callable slow enough to catch a Ray worker mid-task, and one that decodes
# "otherwise" on a node whose environment says so: a stand-in for another Pillow build.
_PIPELINES = """
import os, time
import numpy as np

def slow(source, rng):
    time.sleep(0.15)
    return {"pixels": np.full(8, source["index"], np.int16) + rng.integers(0, 100, 8).astype(np.int16)}

def skewed(source, rng):
    pixels = np.full(8, source["index"], np.int16) + rng.integers(0, 100, 8).astype(np.int16)
    return {"pixels": pixels + int(os.environ.get("PREFETCHD_TEST_SKEW", "0"))}
"""


def _start_cluster(pipelines_dir) -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"trainer": 1}, **_NODE})
    cluster.add_node(num_cpus=2, resources={"prep": 2}, **_NODE)
    return cluster


@pytest.fixture(scope="module")
def pipelines_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray-pipelines")
    (folder / "ray_pipelines.py").write_text(textwrap.dedent(_PIPELINES))
    # The module's clusters keep their session folders in a temp folder of their own, removed
    # afterwards, not in /tmp/ray (Ray's default, which they would be left in). Short: Ray's
    # socket paths under it must fit 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="pfd-ray-", dir="/tmp")
    # Daemons (`start`) and Ray's workers (they inherit the environment of the node that starts
    # them) import the callables from here.
    before = {name: os.environ.get(name) for name in ("PYTHONPATH", "RAY_TMPDIR")}
    os.environ["PYTHONPATH"] = f"{folder}{os.pathsep}{before['PYTHONPATH'] or ''}"
    os.environ["RAY_TMPDIR"] = ray_tmp
    yield folder
    for name, value in before.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(pipelines_dir):
    """One cluster for the module's tests that leave it whole."""
    cluster = _start_cluster(pipelines_dir)
    yield cluster
    cluster.shutdown()


def ray_flags(cluster: Cluster, *, workers: int = 0, ray_workers: int | str = 2) -> list[str]:
    return [
        "--executor", "ray", "--ray-address", cluster.address, "--ray-resources", "prep=1",
        "--workers", str(workers), "--ray-workers", str(ray_workers),
    ]  # fmt: skip


def pipeline_config(tmp_path, data, name: str, world_size: int = 1):
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[job]\nname = "{name}"\nbatch_size = 4\nworld_size = {world_size}\n[daemon]\nbuffer = "1M"\n'
        f'[[source]]\nkind = "image_folder"\nroot = "{data}"\n[pipeline]\ncallable = "ray_pipelines:{name}"\n'
    )
    return config


def local_reference(config, job: str) -> list:
    """The epoch a local worker makes: what every batch from Ray must equal."""
    start_job(config, "--workers", "1")
    reference = streams(job, 1, epochs=1)[0]
    assert cli("stop", job).returncode == 0
    return reference


def ray_lost(paths) -> dict | None:
    executor = job_status(paths)["executor"]
    return executor if executor["state"] == "lost" else None


def streams(job: str, world: int, epochs: int = 2) -> list[list]:
    return [read(job, rank, world, epochs=epochs)[0] for rank in range(world)]


def test_ray_batches_equal_local_ones(cluster, job_root, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=2, batch_size=4, buffer="2M")
    start_job(config, "--workers", "1")
    reference = streams("job", 2)
    assert cli("stop", "job").returncode == 0

    paths = start_job(config, *ray_flags(cluster))
    status = job_status(paths)
    assert status["executor"]["kind"] == "ray" and status["executor"]["state"] == "connected", status["executor"]
    assert status["executor"]["local_workers"] == 0  # every batch below is made on the "prep" node
    assert streams("job", 2) == reference, "batches made on Ray differ from local ones"
    buffer = job_status(paths)["buffer"]
    assert buffer["peak_bytes"] <= buffer["bound_bytes"]


@pytest.mark.long  # ~50 s on the Ray group's process: CI's quick tier keeps the Ray subset small
def test_ray_tasks_in_flight_follow_the_trainer_with_auto(cluster, job_root, jpeg_folder, tmp_path, serve):
    """--ray-workers auto: a slow trainer leaves the cluster's slots idle and they are parked (the
    cluster's CPUs free), a trainer that waits brings them back; the batches are a local worker's."""
    reference = streams_in_process(serve, write_config(tmp_path, jpeg_folder, name="ref", buffer="2M"), "ref")
    config = write_config(tmp_path, jpeg_folder, buffer="2M")
    paths = start_job(config, *ray_flags(cluster, ray_workers="auto"), "--max-ray-workers", "4")
    assert job_status(paths)["executor"]["auto"] == {"min": 1, "max": 4, "target": 4, "changes": 0}
    loader = PrefetchLoader("job", rank=0, world_size=1, as_tensors=False, timeout=60)
    seen = []

    batches = (batch for _ in range(1000) for batch in loader)

    def read_until(target, reads: int, step_s: float, what: str) -> None:
        """Read ``reads`` batches between looks at the status, ``step_s`` after each."""
        while job_status(paths)["executor"]["auto"]["target"] != target:
            assert len(seen) < 3000, f"no {what}: {job_status(paths)['executor']}"
            for _ in range(reads):
                seen.append(digest(next(batches)))
                time.sleep(step_s)

    read_until(1, 1, 0.2, "slots parked under a slow trainer")
    assert job_status(paths)["executor"]["in_flight"] <= 1
    read_until(4, 40, 0.0, "slots back for a waiting trainer")
    loader.close()
    assert seen[: len(reference)] == reference[: len(seen)], "batches under --ray-workers auto differ from local ones"
    assert "ray tasks in flight: 4 -> " in paths.log.read_text()  # each change logged


def streams_in_process(serve, config, job: str, epochs: int = 2) -> list:
    """The digests of ``epochs`` epochs of an in-process job with one local worker."""
    serve(config, {"workers": 1})
    loader = PrefetchLoader(job, rank=0, world_size=1, as_tensors=False, timeout=60)
    out = [digest(batch) for _ in range(epochs) for batch in loader]
    loader.close()
    return out


@pytest.mark.long
@pytest.mark.parametrize("kind", KINDS)
def test_samples_in_containers_made_on_ray_equal_files_made_locally(
    cluster, job_root, jpeg_folder, tmp_path, kind, request
):
    # The index (shard offsets, Parquet row groups) travels to the Ray node with the job; the
    # node reads the shards or files itself (one machine here: the same paths).
    start_job(write_config(tmp_path, jpeg_folder, name="files", world_size=2, seed=5), "--workers", "1")
    reference = streams("files", 2)
    assert cli("stop", "files").returncode == 0
    config = write_config(tmp_path, jpeg_folder, name="boxed", world_size=2, seed=5, source=source_of(kind, request))
    paths = start_job(config, *ray_flags(cluster))
    assert job_status(paths)["executor"]["local_workers"] == 0  # every batch below is made on the "prep" node
    assert streams("boxed", 2) == reference, f"{kind} batches made on Ray differ from local ones of the files"
    assert job_status(paths)["totals"]["bad_samples"] == 0


@pytest.mark.long
def test_ray_resume_grid(cluster, job_root, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=2, batch_size=4, buffer="2M")
    start_job(config, *ray_flags(cluster))
    reference = streams("job", 2)
    assert_resumes(config, cluster, reference, stop_points=(1, 6, 7, 11))  # mid-epoch, its end, past it


def assert_resumes(config, cluster, reference: list, stop_points: tuple) -> None:
    """Read to each stop point, restart the daemon on Ray, resume from the state: the reference stream."""
    for stop_after in stop_points:
        for rank in range(2):
            first, state = read("job", rank, 2, stop_after=stop_after)
            assert cli("stop", "job").returncode == 0
            start_job(config, *ray_flags(cluster))
            rest, _ = read("job", rank, 2, state=state)
            assert first + rest == reference[rank], f"rank {rank}: resume after {stop_after} differs"


@pytest.mark.long  # CI's 10 minutes: the always-on Ray subset is smaller
def test_batches_in_flight_on_ray_count_against_the_bound(cluster, job_root, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=1, batch_size=4, buffer="1M")
    paths = start_job(config, *ray_flags(cluster))
    reference = streams("job", 1)[0]
    batch_bytes = job_status(paths)["buffer"]["batch_bytes"]
    assert cli("stop", "job").returncode == 0
    # Room for 5 batches, and 8 may be in flight on Ray: the bound, not the slots, must hold them back.
    bound = 5 * batch_bytes
    paths = start_job(config, *ray_flags(cluster, ray_workers=8), "--buffer", str(bound))
    seen, loader = [], PrefetchLoader("job", rank=0, world_size=1, as_tensors=False, timeout=60)
    for epoch in range(2):
        for step, batch in enumerate(loader):
            seen.append((epoch, step, digest(batch)))
            buffer = job_status(paths)["buffer"]
            assert buffer["used_bytes"] <= bound and buffer["files_bytes"] <= bound, buffer
    loader.close()
    assert seen == reference
    assert job_status(paths)["buffer"]["peak_bytes"] <= bound


@pytest.mark.long  # CI's 10 minutes: the always-on Ray subset is smaller
def test_a_master_killed_while_ray_serves_restarts_warm(cluster, job_root, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=1, batch_size=4, buffer="1M")
    paths = start_job(config, *ray_flags(cluster))
    reference = streams("job", 1)[0]
    wait_until(lambda: job_status(paths)["ranks"][0]["ready"] >= 4, timeout_s=60, what="a warm buffer")
    family = daemon_family(paths)  # the master and its bridge
    os.kill(family[0], signal.SIGKILL)
    wait_pids_gone(family)  # the bridge dies with its master (PR_SET_PDEATHSIG)
    start_job(config, *ray_flags(cluster))
    assert "kept" in paths.log.read_text(), "the restarted daemon did not keep the published batches"
    assert streams("job", 1)[0] == reference


def _ray_task_pids(name: str) -> list[int]:
    """The Ray worker processes of this test's cluster (our descendants) running task ``name``."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline() and p.cmdline()[0].startswith(f"ray::{name}"):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.long  # 27 CPU-s; the quick tier keeps Ray's batches equal to local ones, and its trust tests
def test_a_ray_worker_killed_mid_task_costs_no_batch(cluster, job_root, jpeg_folder, tmp_path):
    config = pipeline_config(tmp_path, jpeg_folder, "slow")
    start_job(config, "--workers", "1")
    reference = streams("slow", 1, epochs=1)
    assert cli("stop", "slow").returncode == 0

    paths = start_job(config, *ray_flags(cluster))
    killed = []
    loader = PrefetchLoader("slow", rank=0, world_size=1, as_tensors=False, timeout=120)
    seen = []
    for step, batch in enumerate(loader):
        seen.append((0, step, digest(batch)))
        if step in (2, 6):  # twice: while tasks for later steps run on the "prep" node
            pids = wait_until(lambda: _ray_task_pids("make_batch"), timeout_s=30, what="a running Ray task")
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
    loader.close()
    assert seen == reference[0], "a kill on Ray changed, lost or repeated a batch"
    log = paths.log.read_text()
    assert log.count("on Ray:") >= 1, log[-3000:]  # the killed task failed, and its batch was made again
    assert job_status(paths)["executor"]["state"] == "connected"


@pytest.mark.long  # a node booted for it (~9 CPU-s); the quick tier's Ray start checks every node's fingerprint too
def test_a_node_that_decodes_otherwise_is_refused_when_it_joins(cluster, job_root, jpeg_folder, tmp_path):
    config = pipeline_config(tmp_path, jpeg_folder, "skewed")
    node = cluster.add_node(num_cpus=1, resources={"prep": 1}, env_vars={"PREFETCHD_TEST_SKEW": "1"}, **_NODE)
    try:
        result = cli("start", str(config), *ray_flags(cluster), timeout=180)
    finally:
        cluster.remove_node(node)
    assert result.returncode == 5, result.stderr  # WORKER_BOOT: the executor could not start
    assert "decodes and augments this job's samples into other bytes" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (job_root / "skewed" / "batches").exists(), "a refused start leaves no buffer behind"


@pytest.mark.long  # CI's 10 minutes: the always-on Ray subset is smaller
def test_a_lost_cluster_stops_a_daemon_without_local_workers(pipelines_dir, job_root, jpeg_folder, tmp_path):
    config = pipeline_config(tmp_path, jpeg_folder, "slow")
    cluster = _start_cluster(pipelines_dir)  # its own: this test takes its node away
    try:
        paths = start_job(config, *ray_flags(cluster, workers=0))
        cluster.remove_node(cluster.list_all_nodes()[1])
        wait_until(lambda: paths.stopped.exists(), timeout_s=90, what="the daemon to stop")
        stopped = json.loads(paths.stopped.read_text())
        assert stopped["exit_code"] == 10 and "Ray cluster is lost" in stopped["message"], stopped
        assert "no alive Ray node has CPU=1, prep=1" in stopped["message"], stopped
        with pytest.raises(DaemonDied, match="Ray cluster is lost"):
            PrefetchLoader("slow", rank=0, world_size=1, timeout=10)
    finally:
        cluster.shutdown()


@pytest.mark.long
def test_a_lost_cluster_degrades_to_local_workers_and_loses_no_batch(pipelines_dir, job_root, jpeg_folder, tmp_path):
    config = pipeline_config(tmp_path, jpeg_folder, "slow")
    reference = local_reference(config, "slow")

    cluster = _start_cluster(pipelines_dir)  # its own: this test takes its node away
    try:
        paths = start_job(config, *ray_flags(cluster, workers=1))
        loader = PrefetchLoader("slow", rank=0, world_size=1, as_tensors=False, timeout=120)
        seen = []
        for step, batch in enumerate(loader):
            seen.append((0, step, digest(batch)))
            if step == 1:
                cluster.remove_node(cluster.list_all_nodes()[1])
        loader.close()
        assert seen == reference
        executor = wait_until(lambda: ray_lost(paths), timeout_s=60, what="Ray lost")
        assert "no alive Ray node has CPU=1, prep=1" in executor["why"], executor
        assert [w["kind"] for w in job_status(paths)["workers"]["each"]] == ["local"]  # the bridge is gone
        shown = cli("status", "slow")
        assert "ray at" in shown.stdout and "lost (no alive Ray node" in shown.stdout, shown.stdout
    finally:
        cluster.shutdown()


@pytest.mark.long
def test_a_node_that_joins_later_decoding_otherwise_is_never_mixed_in(pipelines_dir, job_root, jpeg_folder, tmp_path):
    config = pipeline_config(tmp_path, jpeg_folder, "skewed")
    reference = local_reference(config, "skewed")

    cluster = _start_cluster(pipelines_dir)  # its own: its good node is taken away
    try:
        paths = start_job(config, *ray_flags(cluster, workers=1))
        good = cluster.list_all_nodes()[1]
        cluster.add_node(num_cpus=2, resources={"prep": 2}, env_vars={"PREFETCHD_TEST_SKEW": "1"}, **_NODE)
        cluster.remove_node(good)  # from now on, tasks can only run on the node that decodes otherwise
        assert streams("skewed", 1, epochs=1)[0] == reference, "a batch of the skewed node was published"
        executor = wait_until(lambda: ray_lost(paths), timeout_s=60, what="Ray lost")
        assert "into other bytes than this node" in executor["why"], executor
    finally:
        cluster.shutdown()
