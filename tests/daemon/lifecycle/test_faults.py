"""Faults: killed and stopped workers, a killed daemon, a full tmpfs. The stream a trainer
reads must stay byte-for-byte the fault-free one, with nothing lost or duplicated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from prefetchd import control
from prefetchd_client import PrefetchLoader
from tests.conftest import cli, daemon_family, start_job, wait_until, write_config
from tests.daemon.resume.test_resume import digest, read
from tests.helpers import workers_of

pytestmark = pytest.mark.timeout(240)


def reference_stream(tmp_path, jpeg_folder, **kw) -> list:
    start_job(write_config(tmp_path, jpeg_folder, name="ref", **kw))
    stream, _ = read("ref", 0, 1)
    assert cli("stop", "ref").returncode == 0
    return stream


@pytest.mark.parametrize(
    "epochs, min_kills", [(2, 10), pytest.param(7, 50, marks=pytest.mark.long)], ids=["short", "long"]
)
def test_killed_workers_are_replaced_and_nothing_is_lost_or_duplicated(
    tmp_path, jpeg_folder, job_root, epochs, min_kills
):
    kw = dict(batch_size=4, workers=2, seed=13, buffer="200K")
    start_job(write_config(tmp_path, jpeg_folder, name="ref", **kw))
    expected, _ = read("ref", 0, 1, epochs=epochs)
    assert cli("stop", "ref").returncode == 0
    paths = start_job(write_config(tmp_path, jpeg_folder, name="job", **kw), "--max-worker-restarts", "1000")
    rng = np.random.default_rng(0)
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    got, kills = [], 0
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            got.append((epoch, step, digest(batch)))
            live = workers_of(paths)
            if live and rng.random() < 0.9:  # kill -9 a random worker, mid-production
                try:
                    live[rng.integers(len(live))].kill()
                    kills += 1
                except psutil.NoSuchProcess:
                    pass  # one killed a moment ago, still exiting when listed, reaped since
    loader.close()
    assert kills >= min_kills
    assert got == expected
    print(
        f"\n[figure] {kills} worker kills during {epochs} epochs: {len(got)} batches, 0 lost, 0 duplicated, all equal"
    )
    status = control.request(paths.endpoint, {"op": "status"})
    assert status["workers"]["restarts"] >= 1 and status["workers"]["count"] == 2


def test_a_stopped_worker_is_detected_and_replaced(tmp_path, jpeg_folder, job_root):
    paths = start_job(
        write_config(tmp_path, jpeg_folder, batch_size=4, workers=1, buffer="100K"), "--worker-timeout", "2"
    )
    (worker,) = workers_of(paths)
    worker.suspend()  # SIGSTOP: alive, silent
    started = time.monotonic()
    stream, _ = read("job", 0, 1, epochs=1)
    assert len(stream) == 12
    wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, what="stopped worker gone")
    assert time.monotonic() - started < 30
    assert "silent for" in paths.log.read_text()
    took = time.monotonic() - started
    print(f"\n[figure] SIGSTOPped worker replaced; the epoch read in {took:.1f} s with --worker-timeout 2")
    assert control.request(paths.endpoint, {"op": "status"})["workers"]["restarts"] == 1


def test_a_killed_daemon_restarts_with_its_batches_and_a_waiting_client_carries_on(tmp_path, jpeg_folder, job_root):
    kw = dict(batch_size=4, workers=1, seed=17, buffer="400K")
    expected = reference_stream(tmp_path, jpeg_folder, **kw)
    config = write_config(tmp_path, jpeg_folder, name="job", **kw)
    paths = start_job(config)
    wait_until(lambda: len(os.listdir(paths.batch_dir)) >= 8, what="some batches")
    loader = PrefetchLoader("job", as_tensors=False, timeout=60, restart_grace=20)
    got = []
    for epoch in range(2):
        for step, batch in enumerate(loader):
            got.append((epoch, step, digest(batch)))
            if (epoch, step) == (0, 3):
                family = daemon_family(paths)
                for pid in family:  # kill -9 the master and its workers at once
                    os.kill(pid, signal.SIGKILL)
                kept_before = len(os.listdir(paths.batch_dir))
                restart = subprocess.Popen(["sleep", "1"])  # restart a moment later, while we wait
                restart.wait()
                start_job(config)
    loader.close()
    assert got == expected
    kept = [line for line in paths.log.read_text().splitlines() if "from a previous daemon" in line]
    assert kept_before > 0 and kept
    print(f"\n[figure] daemon + workers kill -9 at e0 s3, restart: {kept[-1].split(' INFO ')[-1]}; stream equal")


def test_a_full_tmpfs_makes_the_daemon_wait_not_crash(tmp_path, jpeg_folder, small_tmpfs, monkeypatch):
    monkeypatch.setenv("PREFETCHD_ROOT", str(small_tmpfs / "root"))
    # A 3 MiB bound on a 4 MiB tmpfs: while the daemon fills it, someone else takes the rest.
    paths = start_job(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="3M", size=32), "--retain", "0")
    filler = small_tmpfs / "filler"
    try:
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (16 << 10))
            except OSError:
                pass

        def backing_off():
            reply = control.request(paths.endpoint, {"op": "status"})
            assert reply is not None, "the daemon stopped answering while the tmpfs was full"
            return reply["backing_off_no_space"]

        wait_until(backing_off, what="back-off while full")
        assert not list(paths.tmp_dir.iterdir())  # no partial batch left behind
        filler.unlink()  # space returns
        wait_until(lambda: not backing_off(), what="recovery once space returns")
        stream, _ = read("job", 0, 1, epochs=2)
        assert [(e, k) for e, k, _ in stream] == [(e, k) for e in range(2) for k in range(12)]
        assert control.request(paths.endpoint, {"op": "status"})["buffer"]["peak_bytes"] <= 3 << 20
    finally:
        assert cli("stop", "job").returncode == 0


def test_worker_deaths_beyond_the_budget_stop_the_daemon(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder, workers=1), "--max-worker-restarts", "2")
    for _ in range(3):
        worker = wait_until(lambda: workers_of(paths), what="a live worker")[0]
        worker.kill()
        worker.wait(10)
    wait_until(lambda: "stopping instead of restarting forever" in paths.log.read_text(), what="budget stop")
    assert sorted(p.name for p in paths.dir.iterdir()) == ["daemon.lock", "daemon.log", "stopped.json"]
    assert cli("stop", "job").returncode == 0


@pytest.mark.parametrize("epochs, kills", [(3, 6), pytest.param(8, 24, marks=pytest.mark.long)], ids=["short", "long"])
def test_a_daemon_killed_at_random_points_never_serves_a_torn_batch(tmp_path, jpeg_folder, job_root, epochs, kills):
    # A small bound keeps the daemon writing, renaming and deleting all the time, so each kill
    # lands in the middle of one of them. The client checks every header and every byte.
    kw = dict(batch_size=4, workers=2, seed=19, buffer="120K")
    start_job(write_config(tmp_path, jpeg_folder, name="ref", **kw))
    expected, _ = read("ref", 0, 1, epochs=epochs)
    assert cli("stop", "ref").returncode == 0
    config = write_config(tmp_path, jpeg_folder, name="job", **kw)
    paths = start_job(config, "--retain", "0")
    rng = np.random.default_rng(7)
    kill_steps = set(rng.choice(np.arange(1, epochs * 12), size=kills, replace=False).tolist())
    restarts: list[threading.Thread] = []

    def kill_and_restart():
        for pid in daemon_family(paths):  # the master and its workers at once
            os.kill(pid, signal.SIGKILL)
        start_job(config, "--retain", "0")

    loader = PrefetchLoader("job", as_tensors=False, timeout=60, restart_grace=30, verify=True)
    got = []
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            got.append((epoch, step, digest(batch)))
            if epoch * 12 + step in kill_steps:
                for t in restarts:  # one daemon at a time: the previous restart has finished
                    t.join(60)
                # 0-30 ms after the position report: mid-deletion, mid-write or mid-rename.
                timer = threading.Timer(rng.uniform(0, 0.03), kill_and_restart)
                timer.start()
                restarts.append(timer)
    for t in restarts:
        t.join(60)
    loader.close()
    assert got == expected
    starts = paths.log.read_text().count("starting job")
    assert starts == kills + 1
    print(
        f"\n[figure] daemon kill -9 at {kills} random points over {epochs} epochs: {len(got)} batches verified, "
        f"0 torn, stream equal"
    )


# A trainer that checkpoints after every step: the records of the batches it trained on and
# the loader state, in one file replaced atomically (as a checkpoint is), so a kill -9 never
# separates the two. It prints each step it checkpointed; --hold-at S makes it wait on stdin
# after checkpointing step S (an exact kill point, like an epoch boundary).
TRAINER = textwrap.dedent("""
    import hashlib, json, os, sys
    import numpy as np
    from prefetchd_client import PrefetchLoader

    ckpt, epochs, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    loader = PrefetchLoader("job", rank=0, world_size=1, as_tensors=False, timeout=60)
    records = []
    if os.path.exists(ckpt):
        saved = json.load(open(ckpt))
        records = saved["records"]
        loader.load_state_dict(saved["state"])
    while loader.position[0] < epochs:
        epoch, first = loader.position
        for step, batch in enumerate(loader, start=first):
            h = hashlib.sha256()
            for name in sorted(batch):
                h.update(name.encode())
                h.update(np.ascontiguousarray(batch[name]).tobytes())
            records.append([epoch, step, h.hexdigest()])
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"records": records, "state": loader.state_dict()}, f)
            os.replace(ckpt + ".tmp", ckpt)
            print(len(records), flush=True)
            if len(records) == hold:
                sys.stdin.readline()
    loader.close()
""")


def run_trainer_until_killed(script, ckpt, epochs: int, kill_at: int, hold: bool) -> bool:
    """Run the trainer; kill -9 it once it has checkpointed ``kill_at`` steps (at once when it
    holds there, else wherever it has got to by then). False if it finished first."""
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt), str(epochs), str(kill_at if hold else -1)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if int(line) >= kill_at:
                proc.kill()
                break
        proc.wait(60)
        return proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.long  # 24 CPU-s of trainers; the quick tier resumes killed runs in tests/daemon/resume
def test_a_trainer_killed_at_random_steps_and_epoch_boundaries_resumes_the_same_stream(tmp_path, jpeg_folder, job_root):
    epochs, per_epoch = 3, 12
    kw = dict(batch_size=4, workers=1, seed=23, buffer="200K")
    start_job(write_config(tmp_path, jpeg_folder, name="ref3", **kw))
    expected, _ = read("ref3", 0, 1, epochs=epochs)
    assert cli("stop", "ref3").returncode == 0
    start_job(write_config(tmp_path, jpeg_folder, name="job", **kw))
    script, ckpt = tmp_path / "trainer.py", tmp_path / "ckpt.json"
    script.write_text(TRAINER)
    rng = np.random.default_rng(5)
    # Exact kills at both epoch boundaries, and free-running kills at random steps between.
    boundaries = [(per_epoch, True), (2 * per_epoch, True)]
    randoms = [(int(k), False) for k in rng.choice(np.arange(1, epochs * per_epoch - 1), size=4, replace=False)]
    kills = 0
    for kill_at, hold in sorted(boundaries + randoms):
        done = json.loads(ckpt.read_text())["records"] if ckpt.exists() else []
        if kill_at <= len(done):
            continue  # a free-running trainer got past this point before its kill landed
        kills += run_trainer_until_killed(script, ckpt, epochs, kill_at, hold)
    finish = subprocess.run(
        [sys.executable, str(script), str(ckpt), str(epochs), "-1"], capture_output=True, text=True, timeout=120
    )
    assert finish.returncode == 0, finish.stderr
    got = [tuple(r) for r in json.loads(ckpt.read_text())["records"]]
    assert kills >= 4
    assert got == expected
    print(f"\n[figure] trainer kill -9 {kills} times (2 at epoch boundaries) over {epochs} epochs: stream equal")
