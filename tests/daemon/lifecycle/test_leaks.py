"""Nothing accumulates across restarts: descriptors, processes, files, shared memory.

A daemon beside a week-long run replaces many workers and may itself be restarted often;
a descriptor or a zombie leaked per restart would end that run days in.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import psutil
import pytest

from prefetchd_client import PrefetchLoader
from prefetchd_client.manifest import read_manifest
from tests.conftest import JOB_ROOT_PREFIX, SHM, cli, daemon_family, start_job, wait_pids_gone, wait_until, write_config
from tests.daemon.lifecycle.test_faults import workers_of

pytestmark = pytest.mark.timeout(600)

FD_SLACK = 4  # transient descriptors (a log rotation, an inotify event queue) are not leaks


def master_of(paths) -> psutil.Process:
    return psutil.Process(read_manifest(paths)["pid"])


@pytest.mark.parametrize("kills", [20, pytest.param(100, marks=pytest.mark.long)], ids=["short", "long"])
def test_worker_restarts_leak_no_descriptor_or_process(tmp_path, jpeg_folder, job_root, kills):
    config = write_config(tmp_path, jpeg_folder, batch_size=4, workers=2, buffer="200K")
    paths = start_job(config, "--max-worker-restarts", "1000")
    master = master_of(paths)
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    next(iter(loader))  # the daemon serves: its descriptors are all open now
    fds_before, threads_before = master.num_fds(), master.num_threads()
    children_before = len(master.children())  # the workers and multiprocessing's resource tracker
    rng, done = np.random.default_rng(3), 0
    while done < kills:
        for _ in loader:
            live = workers_of(paths)
            if live and done < kills:
                try:
                    live[rng.integers(len(live))].kill()
                except psutil.NoSuchProcess:  # it exited (killed before, reaped) since it was listed
                    continue
                done += 1
    loader.close()

    # Every replacement is up and the dead are reaped (no zombie children). One condition: a
    # worker killed in the last step is still running for a moment after kill(), so the
    # counts can match before it turns into a zombie that the master has yet to reap.
    def settled() -> bool:
        try:
            children = master.children()
            return (
                len(workers_of(paths)) == 2
                and len(children) == children_before
                and all(c.status() != psutil.STATUS_ZOMBIE for c in children)
            )
        except psutil.NoSuchProcess:  # reaped while we looked: look again
            return False

    wait_until(settled, what="two live workers, as many children as before, the dead reaped")
    children = master.children()
    assert all(c.status() != psutil.STATUS_ZOMBIE for c in children)
    fds_after, threads_after = master.num_fds(), master.num_threads()
    assert fds_after <= fds_before + FD_SLACK, f"{fds_before} descriptors before {kills} kills, {fds_after} after"
    assert threads_after <= threads_before
    print(
        f"\n[figure] {kills} worker kills: master descriptors {fds_before} -> {fds_after}, threads "
        f"{threads_before} -> {threads_after}, {children_before} children, 0 zombies"
    )


# Private folders that come and go with other tests running beside this one under pytest -n:
# the tests' own, those `prefetchd demo` and the benchmark make for themselves, and the Ray
# trust test's instance.
_OTHERS_ROOTS = (JOB_ROOT_PREFIX, "prefetchd-demo-", "prefetchd-bench-", "prefetchd-cold-", "pfd-rt-")


def shm_entries() -> set[str]:
    """What is in /dev/shm but other tests' roots: semaphores, shared memory, stray jobs."""
    return {name for name in os.listdir(SHM) if not name.startswith(_OTHERS_ROOTS)}


@pytest.mark.parametrize("restarts", [3, pytest.param(10, marks=pytest.mark.long)], ids=["short", "long"])
def test_daemon_restarts_leave_nothing_behind(tmp_path, jpeg_folder, job_root, restarts):
    shm_before = shm_entries()
    config = write_config(tmp_path, jpeg_folder, batch_size=4, workers=2, buffer="200K")
    paths = start_job(config)
    dead: list[int] = []
    for _ in range(restarts):
        loader = PrefetchLoader("job", as_tensors=False, timeout=60)
        next(iter(loader))
        family = daemon_family(paths)
        for pid in family:  # kill -9: no chance to clean up
            os.kill(pid, signal.SIGKILL)
        wait_pids_gone(family)
        dead += family
        loader.close()
        start_job(config)
    family = daemon_family(paths)
    assert len(family) == len(dead) // restarts and not set(family) & set(dead)
    entries = sorted(os.listdir(paths.dir))
    assert entries == sorted(
        [
            "batches",
            "daemon.lock",
            "daemon.log",
            "daemon.sock",
            "index",
            "manifest.json",
            "producer.json",
            "progress",
            "retired",
            "tmp",
            "trainers",
        ]
    ), entries
    assert not os.listdir(paths.retired_dir)  # nothing maps them any more: freed at start-up
    assert cli("stop", "job").returncode == 0
    wait_pids_gone(family)
    assert not paths.dir.exists()
    assert shm_entries() - shm_before == set()  # what went was another test's
    print(
        f"\n[figure] {restarts} daemon kill -9 + restarts: {len(dead)} processes ended, none left; the job "
        "directory held only its own entries; nothing left in /dev/shm after stop"
    )
