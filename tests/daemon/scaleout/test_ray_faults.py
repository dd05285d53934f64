"""Attacks on --executor ray: starts that must fail fast and clearly, processes that must not
outlive the daemon, and a stopped Ray worker that must not stall the trainer.

A real Ray cluster on this machine where one is needed (ray.cluster_utils.Cluster, as in
tests/daemon/scaleout/test_ray.py); never --ray-address auto, which would join whatever cluster runs here.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from prefetchd_client import PrefetchLoader
from tests.batchdigest import digest
from tests.conftest import cli, start_job, wait_until
from tests.daemon.scaleout.test_ray import _ray_task_pids, cluster, pipeline_config, pipelines_dir, ray_flags, streams  # noqa: F401  (module fixtures: one cluster here too)
from tests.helpers import free_port, job_status

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray"), pytest.mark.heavy]


def _session_of(pid: int) -> list[psutil.Process]:
    """Every process of ``pid``'s session (the daemon is a session leader: its bridge and a
    private Ray instance's processes stay in it, wherever they are reparented)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != pid and os.getsid(p.pid) == pid:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def _master_pid(paths) -> int:
    from prefetchd_client.manifest import read_manifest

    return read_manifest(paths)["pid"]


@pytest.mark.long  # 45 s of waiting for the connect deadline
def test_an_unreachable_ray_address_fails_the_start_fast(job_root, jpeg_folder, tmp_path):
    """Ray's own connect retries a refused GCS port forever: the start must not wait out the
    120 s boot deadline and then blame "no worker"."""
    from tests.conftest import write_config

    config = write_config(tmp_path, jpeg_folder, workers=0)
    began = time.monotonic()
    result = cli(
        "start", str(config), "--executor", "ray", "--ray-address", f"127.0.0.1:{free_port()}", "--ray-workers", "1",
        timeout=150,
    )  # fmt: skip
    took = time.monotonic() - began
    assert result.returncode == 5, (result.returncode, result.stderr)  # WORKER_BOOT
    assert "cannot connect to the Ray cluster at 127.0.0.1" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert took < 75, f"the start took {took:.0f} s"


@pytest.mark.long  # CI's 10 minutes: the always-on Ray subset is smaller
def test_a_failed_local_ray_start_leaves_no_ray_process(job_root, jpeg_folder, tmp_path):
    from tests.conftest import write_config

    config = write_config(tmp_path, jpeg_folder, workers=0)
    before = {p.pid for p in psutil.process_iter()}
    result = cli(
        "start", str(config), "--executor", "ray", "--ray-address", "local", "--ray-resources", "nosuch=1",
        "--ray-workers", "1", timeout=150,
    )  # fmt: skip
    assert result.returncode == 5, result.stderr
    assert "no alive node of the Ray cluster (local) has" in result.stderr, result.stderr

    def ours_left():
        left = []
        for p in psutil.process_iter():
            try:
                if p.pid not in before and p.ppid() in (1, *before) and "ray" in " ".join(p.cmdline()[:2]).lower():
                    if os.getsid(p.pid) != os.getsid(0):  # not a sibling test's (same session as pytest)
                        left.append(p)
            except psutil.Error:
                continue
        return left

    wait_until(lambda: not ours_left(), timeout_s=15, what="the private Ray instance's processes to end")


@pytest.mark.long  # 18 CPU-s of a private Ray instance booted and killed
def test_a_master_killed_with_a_local_ray_leaves_no_process(job_root, jpeg_folder, tmp_path):
    """kill -9 of the master: the bridge dies with it, and so must the private Ray instance
    (its agents otherwise wait a minute on the dead GCS before they exit)."""
    from tests.conftest import write_config

    config = write_config(tmp_path, jpeg_folder, workers=0)
    paths = start_job(config, "--executor", "ray", "--ray-address", "local", "--ray-workers", "1")
    master = _master_pid(paths)
    assert job_status(paths)["executor"]["state"] == "connected"
    os.kill(master, signal.SIGKILL)
    gone = psutil.wait_procs([psutil.Process(master)], timeout=10)
    assert gone
    try:
        wait_until(lambda: not _session_of(master), timeout_s=15, what="the daemon's processes to end")
    finally:
        for p in _session_of(master):  # what the test started, by pid
            p.kill()


@pytest.mark.long  # CI's 10 minutes: the always-on Ray subset is smaller
def test_a_stopped_ray_worker_does_not_stall_the_trainer(cluster, job_root, jpeg_folder, tmp_path):  # noqa: F811
    """SIGSTOP of a Ray worker mid-task stops its watchdog thread too: liveness is progress, so
    its batch must be made again within about --worker-timeout, not after the whole batch's
    deadline (worker_timeout x batch_size + 60 s)."""
    config = pipeline_config(tmp_path, jpeg_folder, "slow")
    start_job(config, "--workers", "1")
    reference = streams("slow", 1, epochs=1)[0]
    assert cli("stop", "slow").returncode == 0

    start_job(config, *ray_flags(cluster), "--worker-timeout", "3")
    loader = PrefetchLoader("slow", rank=0, world_size=1, as_tensors=False, timeout=40)
    seen, stopped = [], []
    try:
        for step, batch in enumerate(loader):
            seen.append((0, step, digest(batch)))
            if step == 2:
                pids = wait_until(lambda: _ray_task_pids("make_batch"), timeout_s=30, what="a running Ray task")
                os.kill(pids[0], signal.SIGSTOP)
                stopped.append(pids[0])
    finally:
        loader.close()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert seen == reference, "a stopped Ray worker changed, lost or repeated a batch"
