"""Other users on the same node (issue 11, items 12, 14 and 15).

A GPU node is often shared. Another local user (mallory) can create alice's default root
``/dev/shm/prefetchd-<alice's uid>`` before alice's first job, fill it with a job of her own,
or plant a symlink there. Every entry point of alice's refuses what is not hers, signals only
the process proven to hold a job's lock, deletes nothing through a path that is not hers, and
says what she can do instead. The cross-user tests run as two real unprivileged users, created
when the tests run as root (as in CI), and are skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from prefetchd_client.layout import JobPaths
from tests.conftest import SHM, cli, daemon_family, wait_pids_gone, wait_until, write_config
from tests.crossusers import ALICE, MALLORY, no_traceback, read_line
from tests.helpers import free_port

# One xdist worker for all of them: they share the two users and alice's default root.
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("cross_user")]

# mallory's side: a job in alice's (future) default root, readable by alice, whose manifest
# names mallory's socket and an unrelated process of alice's, with a batch (labels all 3,
# white images) and the lock held. Prints "ready", answers every request as a daemon would,
# and on EOF on stdin prints how many messages reached her socket.
_PLANT_JOB = r"""
import fcntl, json, os, sys
import zmq
from prefetchd_client.batchfile import BatchLayout, FieldSpec
from prefetchd_client.batchwriter import BatchWriter

root, alice_pid = sys.argv[1], int(sys.argv[2])
job = os.path.join(root, "job")
os.umask(0o022)
for folder in (root, job, os.path.join(job, "batches")):
    os.mkdir(folder, 0o755)
fields = [
    FieldSpec("image", "uint8", (2, 8, 8, 3)), FieldSpec("label", "int64", (2,)), FieldSpec("index", "int64", (2,))
]
layout = BatchLayout.plan(fields)
batch = os.path.join(job, "batches", "e000000-s00000000-r0000.batch")
writer = BatchWriter(batch, layout)
writer.arrays["image"][:] = 255
writer.arrays["label"][:] = 3
writer.arrays["index"][:] = [0, 1]
writer.finish(0, 0, 0, {"config_hash": "mallory"})
os.chmod(batch, 0o644)
context = zmq.Context()
sock = context.socket(zmq.ROUTER)
endpoint = "ipc://" + os.path.join(job, "daemon.sock")
sock.bind(endpoint)
os.chmod(os.path.join(job, "daemon.sock"), 0o777)
manifest = {
    "format_version": 2, "job": "job", "config_hash": "mallory", "config": {}, "num_samples": 2,
    "batches_per_epoch": 1, "world_size": 1, "batch_size": 2, "global_batch": 2, "drop_last": True,
    "fields": [f.to_json() for f in fields], "batch_bytes": layout.size, "buffer_bytes": 1 << 20,
    "window_per_rank": 1, "retain": 0, "workers": 1, "pid": alice_pid, "endpoint": endpoint,
    "curve_public_key": None, "started_at": 0,
}
with open(os.path.join(job, "manifest.json"), "w") as f:
    json.dump(manifest, f)
lock = os.open(os.path.join(job, "daemon.lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(lock, fcntl.LOCK_EX)
print("ready", flush=True)
poller = zmq.Poller()
poller.register(sock, zmq.POLLIN)
poller.register(0, zmq.POLLIN)
received = 0
while True:
    events = dict(poller.poll(100_000))
    if not events or 0 in events:
        break
    identity, *_ = sock.recv_multipart()
    received += 1
    sock.send_multipart([identity, json.dumps({"ok": True, "pid": alice_pid}).encode()])
print("received", received, flush=True)
"""

_READ_ONE_BATCH = r"""
from prefetchd_client import PrefetchError, PrefetchLoader
try:
    loader = PrefetchLoader("job", as_tensors=False, timeout=10, restart_grace=2)
    batch = next(iter(loader))
    print("READ", batch["label"].tolist())
    loader.close()
except PrefetchError as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


def test_a_job_prepared_by_another_user_is_refused_by_every_entry_point(users, alice_root, processes):
    alice, mallory = users[ALICE], users[MALLORY]
    bystander = alice.popen(shutil.which("sleep"), "300")  # any process of alice's
    processes.append(bystander)
    plant = mallory.popen(mallory.python, "-c", _PLANT_JOB, str(alice_root), str(bystander.pid))
    processes.append(plant)
    assert read_line(plant) == "ready"
    planted = sorted(str(p) for p in alice_root.rglob("*"))
    whose = f"belongs to uid {mallory.uid}"

    # The loader refuses before it reads her manifest or batch, or connects to her socket.
    loaded = alice.run(alice.python, "-c", _READ_ONE_BATCH)
    assert loaded.returncode == 0 and no_traceback(loaded), loaded.stderr
    assert loaded.stdout.startswith("REFUSED UnsafeFolder") and whose in loaded.stdout, loaded.stdout
    assert "PREFETCHD_ROOT=DIR" in loaded.stdout and "administrator" in loaded.stdout

    # stop signals no one (not the process of alice's that the manifest names) and deletes nothing.
    stopped = alice.prefetchd("stop", "job", "--timeout", "1")
    assert stopped.returncode == 4 and whose in stopped.stderr and no_traceback(stopped), stopped.stderr
    assert "Nothing was signalled or removed" in stopped.stderr
    assert bystander.poll() is None, "stop signalled the pid named by another user's manifest"

    # status and verify: the same clear refusal, exit 4, never a traceback.
    for args in (["status", "job"], ["status"], ["status", "--json"], ["verify", "job", "--epoch", "0", "--step", "0"]):
        result = alice.prefetchd(*args)
        assert result.returncode == 4 and whose in result.stderr and no_traceback(result), (args, result)

    assert sorted(str(p) for p in alice_root.rglob("*")) == planted  # nothing was deleted
    plant.stdin.close()
    assert read_line(plant) == "received 0"  # nothing of alice's ever reached mallory's socket


def test_stop_through_a_symlinked_root_deletes_nothing(users, alice_root):
    alice, mallory = users[ALICE], users[MALLORY]
    runs = Path(tempfile.mkdtemp(prefix="pfd-alice-runs-", dir="/tmp"))
    try:
        checkpoint = runs / "job" / "checkpoint.pt"
        checkpoint.parent.mkdir()
        checkpoint.write_bytes(b"weeks of training")
        for path in (runs, checkpoint.parent, checkpoint):
            os.chown(path, alice.uid, alice.gid)
        linked = mallory.run(shutil.which("ln"), "-s", str(runs), str(alice_root))
        assert linked.returncode == 0, linked.stderr

        stopped = alice.prefetchd("stop", "job")
        assert stopped.returncode == 4 and no_traceback(stopped), stopped.stderr
        assert f"job root {alice_root} is a symlink (of uid {mallory.uid})" in stopped.stderr
        assert checkpoint.read_bytes() == b"weeks of training" and alice_root.is_symlink()
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def test_a_squatted_default_root_fails_start_with_advice_that_works(users, alice_root, shared_data):
    alice, mallory = users[ALICE], users[MALLORY]
    made = mallory.run(shutil.which("mkdir"), "-m", "755", str(alice_root))
    assert made.returncode == 0, made.stderr

    refused = alice.prefetchd("start", str(shared_data))
    assert refused.returncode == 4 and no_traceback(refused), refused.stderr
    assert f"job root {alice_root} belongs to uid {mallory.uid}" in refused.stderr
    # Advice alice can follow: she cannot remove another user's folder from the sticky /dev/shm.
    assert "--root DIR" in refused.stderr and "PREFETCHD_ROOT=DIR" in refused.stderr
    assert "administrator" in refused.stderr and "remove it or" not in refused.stderr

    # Following it works: a root of her own, for the daemon and the trainer alike.
    own_root = Path(SHM) / f"pfd-alice-own-{uuid.uuid4().hex[:8]}"
    try:
        started = alice.prefetchd("start", str(shared_data), "--root", str(own_root))
        assert started.returncode == 0, started.stderr
        loaded = alice.run(alice.python, "-c", _READ_ONE_BATCH, env={"PREFETCHD_ROOT": str(own_root)})
        assert loaded.stdout.startswith("READ"), loaded.stdout + loaded.stderr
        stopped = alice.prefetchd("stop", "job", "--root", str(own_root))
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        assert not (own_root / "job").exists()
    finally:
        _stop_what_alice_left(own_root / "job")
        shutil.rmtree(own_root, ignore_errors=True)


def _stop_what_alice_left(job_dir: Path) -> None:
    """Teardown after a failure: end alice's daemon and workers, by their pids."""
    pids = daemon_family(JobPaths(job_dir)) if job_dir.exists() else []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    wait_pids_gone(pids)


# -- item 14: a TCP endpoint without CURVE trusts every local user, and says so -----------------


def test_a_loopback_tcp_endpoint_without_curve_is_said_to_be_open_to_every_local_user(tmp_path, jpeg_folder, job_root):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    result = cli("start", str(write_config(tmp_path, jpeg_folder)), "--endpoint", endpoint)
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stderr and "every user of this node can connect" in result.stderr
    paths = JobPaths(job_root / "job")
    log = paths.log.read_text()
    assert "WARNING" in log and "every user of this node can connect" in log
    assert "ipc" in log and "CURVE" in log
    assert cli("stop", "job").returncode == 0


# -- a hostile manifest in a folder of one's own (the same user): clear, and no bystander hit ----

_HOLD_LOCK = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(
    "manifest",
    [
        pytest.param(lambda pid: "[" * 50_000 + "]" * 50_000, id="50000-nested-brackets"),
        pytest.param(lambda pid: json.dumps({"pid": pid}), id="missing-keys"),
        pytest.param(
            lambda pid: json.dumps({"pid": pid, "endpoint": "tcp://[", "curve_public_key": 7, "world_size": "1"}),
            id="wrong-types",
        ),
    ],
)
def test_status_and_stop_of_a_job_with_a_hostile_manifest_are_clear_and_signal_only_the_lock_holder(
    job_root, processes, manifest
):
    job = job_root / "job"
    job.mkdir(mode=0o700)
    bystander = subprocess.Popen([shutil.which("sleep"), "300"])  # the pid the manifest names
    processes.append(bystander)
    (job / "manifest.json").write_text(manifest(bystander.pid))
    hold = [sys.executable, "-c", _HOLD_LOCK, str(job / "daemon.lock")]
    holder = subprocess.Popen(hold, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    processes.append(holder)
    assert read_line(holder) == "locked"

    status = cli("status", "job")
    assert status.returncode == 0 and no_traceback(status), status.stderr
    assert "not responding" in status.stdout

    stopped = cli("stop", "job", "--timeout", "5")
    assert stopped.returncode == 0 and no_traceback(stopped), stopped.stderr
    assert bystander.poll() is None, "stop signalled the pid in the manifest, not the lock holder"
    assert wait_until(lambda: holder.poll() is not None, what="the lock holder to get SIGTERM")
