"""The node's CPU budget with real daemons: two jobs of one root share --node-cpus (the leases never
add up to more, no daemon has more workers busy than its lease), a daemon killed with -9 gives its
share back, and lease files that are not ours are refused without stopping anything."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from prefetchd.master.leasefile import FOLDER
from prefetchd_client import PrefetchLoader
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


@pytest.mark.parametrize("planted", ["symlink", "fifo", "garbage", "a dead daemon's lease"])
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
    else:  # pid 1 never started at that time: not alive, its lease holds nothing back
        target.write_text(json.dumps({"1-12.0": {"pid": 1, "started": 12.0, "job": "x", "lease": 8, "busy": 8,
                                                  "demand": 8, "starving": True}}))
    config = write_config(tmp_path, jpeg_folder, name="planted", workers=1, buffer="256K", size=32)
    paths = start_job(config, "--node-cpus", "1")
    out = []
    read_epochs("planted", 2, out)
    assert len(out) == 24
    budget = job_status(paths)["workers"]["budget"]
    if planted in ("symlink", "fifo"):
        assert budget["refused"] and ("symlink" in budget["refused"] or "not a plain file" in budget["refused"])
        assert "the node's CPU budget is not shared" in paths.log.read_text()
        assert (tmp_path / "elsewhere.json").read_text() == "{}" if planted == "symlink" else True
    else:
        assert budget["refused"] is None
        mine = leases(job_root)
        assert [e["job"] for e in mine.values()] == ["planted"]  # the bad ones dropped, ours written
    assert cli("stop", "planted").returncode == 0
    if planted != "symlink" and planted != "fifo":
        wait_until(lambda: leases(job_root) == {}, 5, what="the stopped daemon's lease to be given back")
