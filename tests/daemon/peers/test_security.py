"""Closed by default: private files, refused planted paths, schema-checked JSON on the socket."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys

import pytest
import zmq

from prefetchd import control
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli, start_job, wait_until, write_config

pytestmark = pytest.mark.timeout(120)


def test_job_directory_is_private(tmp_path, jpeg_folder, job_root):
    # A real daemon: the modes of the files it and its workers make rest on its own umask.
    paths = start_job(write_config(tmp_path, jpeg_folder))
    next(iter(PrefetchLoader("job", as_tensors=False)))
    for folder, _, files in os.walk(paths.dir):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
        for name in files:
            path = os.path.join(folder, name)
            try:
                # One stat per file: tmp/ files are renamed or removed by the workers while
                # this walks, and a file gone between listing and stat has nothing to check.
                info = os.stat(path)
            except FileNotFoundError:
                continue
            assert stat.S_IMODE(info.st_mode) & 0o077 == 0, path
            assert info.st_uid == os.getuid()


@pytest.mark.parametrize(
    "plant, message",
    [
        (lambda job: os.symlink("/tmp", job), "is a symlink"),
        (lambda job: (job.mkdir(), job.chmod(0o777)), "writable by others"),
        (lambda job: (job.mkdir(), os.chown(job, 65534, 65534)), "belongs to uid 65534"),
    ],
)
def test_planted_job_paths_are_refused(tmp_path, jpeg_folder, job_root, plant, message):
    if "uid" in message and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    plant(job_root / "job")
    result = cli("start", str(write_config(tmp_path, jpeg_folder)))
    assert result.returncode == 4 and message in result.stderr and "Traceback" not in result.stderr
    assert not (job_root / "job" / "daemon.lock").exists() or os.path.islink(job_root / "job")


def test_pickle_and_malformed_messages_are_dropped_without_effect(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)  # deliver them all before closing
    sock.connect(paths.endpoint)
    payloads = [
        pickle.dumps(Exploit()),
        b"\xff\xfe not utf-8",
        b"[1, 2, 3]",
        b'{"op": "position", "rank": 0, "epoch": -1, "step": 0}',
        b'{"op": "position", "rank": 99, "epoch": 0, "step": 0}',
        b'{"op": "position", "rank": "0", "epoch": 0, "step": 0}',
        b'{"op": "stop", "keep": "yes"}',
        b'{"op": "exec", "code": "print(1)"}',
        b"x" * (control.MAX_MESSAGE_BYTES + 1),  # zmq drops it before it is read
    ]
    for payload in payloads:
        sock.send(payload)
    sock.close()
    context.term()

    def counted():
        status = control.request(paths.endpoint, {"op": "status"})
        assert status is not None and status["pid"] == read_manifest(paths)["pid"]
        # Refused as malformed, or (the rank-99 position) as outside the plan.
        return status if sum(status["totals"]["refused"].values()) >= len(payloads) - 1 else None

    status = wait_until(counted, what="malformed messages counted")  # the oversized one never arrives
    assert not marker.exists()
    assert [r["epoch"] for r in status["ranks"]] == [0]
    assert job.exit_code is None  # the stop with a bad "keep" stopped nothing


def test_two_daemons_racing_for_one_job_one_wins(tmp_path, jpeg_folder, job_root):
    config = write_config(tmp_path, jpeg_folder)
    starts = [
        subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "start", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=60), *p.communicate()) for p in starts]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 4], results
    loser = next(err for code, _, err in results if code == 4)
    assert "already running" in loser
    paths = JobPaths(job_root / "job")
    assert control.request(paths.endpoint, {"op": "ping"})["pid"] == read_manifest(paths)["pid"]
