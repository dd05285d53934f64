"""The daemon's two intakes — progress files and control messages — are peer input: whatever
arrives is validated before it acts, refused input is counted, and nothing ends the loop."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

import pytest
import zmq

from prefetchd import control
from prefetchd.ops.status import Rates
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths, write_progress
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest
from tests.conftest import wait_until, write_config
from tests.helpers import free_port, job_status

pytestmark = pytest.mark.timeout(120)


def send_raw(paths: JobPaths, *payloads: bytes, endpoint: str | None = None) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)  # deliver them all before closing
    sock.connect(endpoint or paths.endpoint)
    for payload in payloads:
        sock.send(payload)
    sock.close()
    context.term()


def refused(paths: JobPaths, kind: str, at_least: int = 1, endpoint: str | None = None):
    def check():
        s = job_status(paths, endpoint=endpoint)
        return s if s["totals"].get("refused", {}).get(kind, 0) >= at_least else None

    return wait_until(check, timeout_s=20, what=f"{at_least} refused {kind}")


def read_batches(n: int, **kwargs) -> list[list[int]]:
    loader = PrefetchLoader("job", as_tensors=False, timeout=30, **kwargs)
    batches = []
    try:
        while len(batches) < n:  # across epochs: each iter() is one
            for batch in loader:
                batches.append(batch["index"].tolist())
                if len(batches) == n:
                    break
        return batches
    finally:
        loader.close()


def test_out_of_range_progress_file_is_refused_and_counted(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    (paths.progress_dir / "rank-0").write_text("99999999999999999999999 3\n")
    status = refused(paths, "position")
    assert [(r["epoch"], r["step"]) for r in status["ranks"]] == [(0, 0)]
    assert len(read_batches(3)) == 3 and job.exit_code is None


@pytest.mark.parametrize("epoch", [2**64, 2**63, 10**6])
def test_out_of_range_control_position_is_refused_and_counted(tmp_path, jpeg_folder, serve, epoch):
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    send_raw(paths, f'{{"op": "position", "rank": 0, "epoch": {epoch}, "step": 0}}'.encode())
    status = refused(paths, "position")
    assert [(r["epoch"], r["step"]) for r in status["ranks"]] == [(0, 0)]
    assert len(read_batches(3)) == 3 and job.exit_code is None


def test_deeply_nested_control_message_is_dropped_and_counted(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    payload = b"[" * 30000 + b"]" * 30000
    assert len(payload) < control.MAX_MESSAGE_BYTES
    send_raw(paths, payload, b'{"op": "status", "x": ' + b"[" * 20000 + b"]" * 20000 + b"}")
    refused(paths, "message", at_least=2)
    assert len(read_batches(3)) == 3 and job.exit_code is None


def test_planted_fifo_and_symlinks_do_not_block_or_stop_the_master(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.symlink(fifo, paths.progress_dir / "rank-0")  # open() of it would block until a writer came
    refused(paths, "progress_file")
    os.unlink(paths.progress_dir / "rank-0")
    os.mkfifo(paths.progress_dir / "rank-0")  # a FIFO itself
    refused(paths, "progress_file", at_least=2)
    os.unlink(paths.progress_dir / "rank-0")
    os.symlink("/etc/passwd", paths.trainer_lock(0))
    refused(paths, "trainer_lock")
    os.unlink(paths.trainer_lock(0))
    assert len(read_batches(3)) == 3 and job.exit_code is None


def test_repeated_bad_progress_files_cannot_grow_the_log(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    for i in range(40):  # one at a time: the master reads a rank's file once per change it sees
        write_progress(paths.progress(0), 10**7 + i, 0)
        refused(paths, "position", at_least=i + 1)
    lines = [line for line in paths.log.read_text().splitlines() if "refused" in line]
    assert 1 <= len(lines) <= 12, lines  # the first 10, then a summary a minute
    assert job.exit_code is None


def test_a_flood_of_malformed_messages_does_not_starve_the_trainer(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, buffer="256K")).paths  # a small window: it must keep refilling
    send_raw(paths, *([b"\xff not json"] * 20000))
    batches = read_batches(24)  # two epochs through a window of a few batches, during the flood
    assert len(batches) == 24
    refused(paths, "message", at_least=5000)  # ZeroMQ's queues drop the rest when full


def test_rates_stay_bounded_when_nobody_asks_for_status():
    rates = Rates()
    for i in range(100_000):  # 100,000 batches at 1,000 a second: 100 s
        rates.add(i / 1000)
    assert len(rates.events) <= 10_001  # the 10 s window, not the whole run


def test_idle_tcp_connections_cannot_exhaust_the_daemons_descriptors(tmp_path, jpeg_folder, job_root):
    """Connections that never handshake are closed by ZeroMQ after HANDSHAKE_TIMEOUT_MS; until
    then EMFILE pauses the master instead of stopping it."""
    # A real daemon: the limit is its process's own, and the connections below are this process's.
    limit = 96  # the daemon's hard limit on open files: a few hundred connections exceed it
    config = write_config(tmp_path, jpeg_folder, buffer="256K")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config), "--endpoint", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
    )
    assert result.returncode == 0, result.stderr
    paths = JobPaths(job_root / "job")
    host, port = "127.0.0.1", int(endpoint.rsplit(":", 1)[1])
    held = []
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    try:
        try:
            for _ in range(3 * limit):
                held.append(socket.create_connection((host, port), timeout=5))
            # The trainer reads on while they are held: consumed batches must be retired (an
            # open() each), new ones assigned.
            taken = 0
            while taken < 16:  # across epochs: each iter() is one
                for _ in loader:
                    taken += 1
                    if taken == 16:
                        break
            assert daemon_alive(paths)
        finally:
            for s in held:
                s.close()
        # Its reports, queued while the daemon could accept no connection, arrive once it can
        # (under load that can be after the flood: the loader is still open to send them).
        reached = lambda: job_status(paths, endpoint=endpoint)["ranks"][0]["epoch"] >= 1  # noqa: E731
        wait_until(reached, timeout_s=20, what="the trainer's position in epoch 1")
    finally:
        loader.close()
    assert "internal error" not in paths.log.read_text()
    # A batch retired while open() failed with EMFILE is retried, not left outside the bound.
    bound = read_manifest(paths)["buffer_bytes"]
    within = lambda: job_status(paths, endpoint=endpoint)["buffer"]["files_bytes"] <= bound  # noqa: E731
    wait_until(within, timeout_s=20, what="the files within the bound")


@pytest.mark.parametrize("op", ['["position"]', '{"a": 1}', "1", "null", "true"])
def test_an_op_that_is_not_a_string_is_a_bad_message(op):
    """Found by the fuzz test: a list as op made the schema lookup raise TypeError."""
    with pytest.raises(control.BadMessage):
        control.decode_message(f'{{"op": {op}, "rank": 0}}'.encode())
