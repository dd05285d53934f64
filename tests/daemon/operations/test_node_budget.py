"""The node's CPU budget with real daemons: two jobs of one root share --node-cpus (the leases never
add up to more, no daemon has more workers busy than its lease), a daemon killed with -9 gives its
share back, and lease files that are not ours are refused without stopping anything."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from prefetchd.master.leasefile import FOLDER
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli, start_job, wait_pids_gone, wait_until, write_config
from tests.helpers import job_status

pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]


def leases(root) -> dict:
    try:
        return json.loads((root / FOLDER / "leases.json").read_text())
    except FileNotFoundError:
        return {}


def read_epochs(name: str, epochs: int, out: list) -> None:
    loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=60)
    for _ in range(epochs):
        out.extend(int(b["index"][0]) for b in loader)
    loader.close()


def test_two_jobs_never_lease_more_than_the_budget_and_a_killed_one_gives_it_back(job_root, tmp_path, jpeg_folder):
    paths = {}
    for name in ("a", "b"):
        config = write_config(tmp_path, jpeg_folder, name=name, workers=2, buffer="1M", size=96)
        paths[name] = start_job(config, "--node-cpus", "1")
    read = {"a": [], "b": []}
    trainers = [threading.Thread(target=read_epochs, args=(n, 6, read[n])) for n in read]
    for t in trainers:
        t.start()
    seen = []
    while any(t.is_alive() for t in trainers):
        seen.append(sum(entry["lease"] for entry in leases(job_root).values()))
        for p in paths.values():
            workers = job_status(p)["workers"]
            assert workers["busy"] <= workers["budget"]["lease"] <= 1, workers
    for t in trainers:
        t.join()
    assert len(read["a"]) == len(read["b"]) == 6 * 12  # both served, whole epochs
    assert len(seen) > 20 and max(seen) <= 1 and 1 in seen

    # kill -9 of a daemon: its workers die with it, and its lease lapses at the other's next settle
    victim = read_manifest(paths["b"])["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_pids_gone([victim])
    survivor = read_manifest(paths["a"])["pid"]
    loader = PrefetchLoader("a", as_tensors=False, rank=0, world_size=1, timeout=60)
    batches = iter(loader)
    wait_until(lambda: next(batches) and all(e["pid"] == survivor for e in leases(job_root).values()), 10,
               what="the killed daemon's lease to lapse")
    assert job_status(paths["a"])["workers"]["budget"]["jobs"] == 1
    loader.close()
    assert cli("stop", "a").returncode == 0
    cli("stop", "b")  # removes the killed job's folder


@pytest.mark.parametrize("planted", ["symlink", "fifo", "garbage", "a lease of a process no job runs"])
def test_lease_files_that_are_not_ours_or_not_leases_stop_nothing(job_root, tmp_path, jpeg_folder, planted):
    folder = job_root / FOLDER
    folder.mkdir(mode=0o700)
    target = folder / "leases.json"
    if planted == "symlink":
        (tmp_path / "elsewhere.json").write_text("{}")
        target.symlink_to(tmp_path / "elsewhere.json")
    elif planted == "fifo":
        os.mkfifo(target, 0o600)
    elif planted == "garbage":
        target.write_bytes(b"\xff\xfe{" * 1000)
    else:  # pid 1, with its true start time: alive, but no daemon of a job here; its lease holds nothing back
        started = round(psutil.Process(1).create_time(), 3)
        entry = {"pid": 1, "started": started, "job": "x", "lease": 1, "busy": 1, "demand": 8, "runway_s": 0.0}
        entry |= {"at": time.time()}
        target.write_text(json.dumps({f"1-{started}": entry | {"weight": 0.001, "used": 0.0}}))
    config = write_config(tmp_path, jpeg_folder, name="planted", workers=1, buffer="256K", size=32)
    paths = start_job(config, "--node-cpus", "1")
    out = []
    read_epochs("planted", 2, out)
    assert len(out) == 24
    budget = job_status(paths)["workers"]["budget"]
    if planted in ("symlink", "fifo"):
        assert budget["refused"] and ("symlink" in budget["refused"] or "not a plain file" in budget["refused"])
        assert "the node's CPU budget cannot be settled" in paths.log.read_text()
        assert (tmp_path / "elsewhere.json").read_text() == "{}" if planted == "symlink" else True
    else:
        assert budget["refused"] is None
        mine = leases(job_root)
        assert [e["job"] for e in mine.values()] == ["planted"]  # the bad ones dropped, ours written
    assert cli("stop", "planted").returncode == 0
    if planted != "symlink" and planted != "fifo":
        wait_until(lambda: leases(job_root) == {}, 5, what="the stopped daemon's lease to be given back")


def test_more_hungry_jobs_than_cpus_take_turns(job_root, tmp_path, jpeg_folder):
    """Three jobs whose trainers all wait, one CPU: each gets it in turn, none is starved for good
    (a worker that finishes a batch does not keep the CPU its job's share no longer holds)."""
    for name in ("x", "y", "z"):
        config = write_config(tmp_path, jpeg_folder, name=name, workers='"auto"', buffer="1M", size=128)
        start_job(config, "--max-workers", "1", "--node-cpus", "1")
    read = {name: [] for name in ("x", "y", "z")}
    errors = []

    others_done = threading.Event()

    def trainer(name: str) -> None:
        try:
            loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=20)
            for _ in range(4):
                read[name].extend(int(b["index"][0]) for b in loader)
            while name == "x" and not others_done.is_set() and not errors:  # x goes on wanting the CPU
                read[name].extend(int(b["index"][0]) for b in loader)
            loader.close()
        except Exception as exc:  # noqa: BLE001 - a BatchTimeout: that job was starved
            errors.append(f"{name}: {exc}")

    trainers = {name: threading.Thread(target=trainer, args=(name,)) for name in read}
    trainers["x"].start()  # x holds the CPU first, busy batch after batch, when the others come
    wait_until(lambda: len(read["x"]) >= 6 or errors, 30, what="x's first batches")
    trainers["y"].start()
    trainers["z"].start()
    for name in ("y", "z"):
        trainers[name].join(100)
    others_done.set()
    trainers["x"].join(100)
    assert not errors and all(len(r) >= 4 * 12 for r in read.values()), errors
    for name in read:
        assert cli("stop", name).returncode == 0


def test_a_lock_held_for_good_or_a_folder_opened_to_others_for_a_while_stops_nothing(job_root, tmp_path, jpeg_folder):
    """A process that keeps the budget's lock (a daemon stopped mid-settle): a new daemon serves
    alone after a moment, and says why. Its folder made writable by others, then mended: refused
    meanwhile (what it had kept, never more), shared again after."""
    import fcntl

    folder = job_root / FOLDER
    folder.mkdir(mode=0o700)
    with open(folder / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        config = write_config(tmp_path, jpeg_folder, name="held", workers=1, buffer="256K", size=32)
        paths = start_job(config, "--node-cpus", "1")
        out = []
        read_epochs("held", 1, out)
        assert len(out) == 12
        assert "another process has held its lock" in job_status(paths)["workers"]["budget"]["refused"]
    settled = lambda: job_status(paths)["workers"]["budget"]["refused"] is None  # noqa: E731
    wait_until(settled, 5, what="shared once the lock is free")
    folder.chmod(0o777)
    wait_until(lambda: "writable by others" in (job_status(paths)["workers"]["budget"]["refused"] or ""), 5,
               what="the open folder refused")
    folder.chmod(0o700)
    wait_until(settled, 5, what="shared again")
    log = paths.log.read_text()
    assert log.count("cannot be settled") == 2 and log.count("shared again") == 2
    assert cli("stop", "held").returncode == 0


def test_a_newcomer_does_not_starve_a_job_that_ran_before_nor_a_stopped_daemon_keep_its_share(
    job_root, tmp_path, jpeg_folder
):
    """One CPU: a job that has held it for seconds and a new one take turns (what breaks ties is
    the last seconds' CPU time, not since the start); a daemon stopped with SIGSTOP while it holds
    the CPU loses it to the other within STALE_S, and takes turns again once continued."""
    from prefetchd.master.cpubudget import STALE_S

    counts = {"old": 0, "new": 0}
    errors, done = [], threading.Event()

    def trainer(name: str) -> None:
        try:
            loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=20)
            while not done.is_set():
                for _ in loader:
                    counts[name] += 1
                    if done.is_set():
                        break
            loader.close()
        except Exception as exc:  # noqa: BLE001 - a BatchTimeout: that job was starved
            errors.append(f"{name}: {exc}")

    for name in counts:
        start_job(write_config(tmp_path, jpeg_folder, name=name, workers=1, buffer="1M", size=128), "--node-cpus", "1")
    threads = {name: threading.Thread(target=trainer, args=(name,)) for name in counts}
    threads["old"].start()
    time.sleep(4)  # old holds the CPU alone, seconds of CPU time
    threads["new"].start()
    time.sleep(1)
    before = dict(counts)
    time.sleep(4)
    assert counts["old"] > before["old"] and counts["new"] > before["new"], (before, counts, errors)

    old = read_manifest(JobPaths.of("old"))["pid"]
    os.kill(old, signal.SIGSTOP)
    try:
        time.sleep(1)
        stalled = counts["new"]
        wait_until(lambda: counts["new"] > stalled + 3, STALE_S + 10, what="the stopped daemon's share to lapse")
    finally:
        os.kill(old, signal.SIGCONT)
    resumed = counts["old"]
    wait_until(lambda: counts["old"] > resumed, 10, what="the continued daemon to be served again")
    done.set()
    for t in threads.values():
        t.join(30)
    assert not errors, errors
    for name in counts:
        assert cli("stop", name).returncode == 0
