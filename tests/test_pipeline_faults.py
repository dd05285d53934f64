"""A [pipeline] callable that misbehaves in ways beyond hanging (found by an attack run): it
crashes its worker every time, forks, drops a key, or is slow but progressing."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from prefetchd_client import DaemonDied, PrefetchLoader

from .conftest import cli, start_job, wait_until
from .helpers import job_status, read_epoch
from .test_worker_liveness import digests, pipeline_job

pytestmark = pytest.mark.timeout(180)

PIPELINE = """
import os
import signal
import time

import numpy as np

def make(source, rng):
    i = source["index"]
    {body}
    return {{"pixels": np.full(8, i, np.int16) + rng.integers(0, 100, 8).astype(np.int16),
             "aux": np.full(2, i, np.int32)}}
"""


def job_with(tmp_path, data, monkeypatch, body: str, name: str = "job"):
    return pipeline_job(tmp_path, data, monkeypatch, f"pipe_{name}", PIPELINE.format(body=body), name=name)


def test_a_sample_that_crashes_its_worker_every_time_stops_the_daemon_naming_the_batch(
    tmp_path, jpeg_folder, job_root, monkeypatch
):
    # Below any restart rate: only the deaths of one batch can stop this loop.
    config = job_with(tmp_path, jpeg_folder, monkeypatch, "if i == 5: os.kill(os.getpid(), signal.SIGSEGV)")
    start_job(config, "--max-worker-restarts", "1000")
    started = time.monotonic()
    with pytest.raises(DaemonDied, match="died 5 times"):
        read_epoch("job", timeout=60)
    print(f"\n[figure] a sample that crashes its worker: daemon stopped after {time.monotonic() - started:.1f} s")


def test_a_callable_that_forks_and_returns_in_both_processes_does_not_stop_the_daemon(
    tmp_path, jpeg_folder, job_root, monkeypatch
):
    forked = tmp_path / "forked-pid"
    body = (
        f"if i == 5 and not os.path.exists({str(forked)!r}):\n"
        f"        if os.fork() == 0:\n"
        f"            open({str(forked)!r}, 'w').write(str(os.getpid()))"
    )
    # The child shares its worker's pipe; it may take tasks, or block forever on a lock the
    # fork copied held (the heartbeat's): then the worker's task stops moving, and the worker
    # is replaced after --worker-timeout.
    paths = start_job(job_with(tmp_path, jpeg_folder, monkeypatch, body), "--worker-timeout", "3")
    try:
        got = digests(read_epoch("job", epochs=2, timeout=60))
        assert "internal error" not in paths.log.read_text()
        assert cli("stop", "job").returncode == 0
    finally:
        text = forked.read_text() if forked.exists() else ""
        if text.isdigit() and int(text) > 1:  # the callable's child: not the daemon's to stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGKILL)
    start_job(job_with(tmp_path, jpeg_folder, monkeypatch, "pass", name="ref"))
    assert got == digests(read_epoch("ref", epochs=2, timeout=40))


def test_a_key_left_out_by_a_later_sample_is_a_bad_sample_not_the_last_batchs_bytes(
    tmp_path, jpeg_folder, job_root, monkeypatch
):
    body = "if i == 5:\n        return {'pixels': np.zeros(8, np.int16)}"
    paths = start_job(job_with(tmp_path, jpeg_folder, monkeypatch, body))
    loader = PrefetchLoader("job", as_tensors=False, verify=True, timeout=40)
    try:
        batches = [b for b in loader]
    finally:
        loader.close()
    assert 5 not in {int(i) for b in batches for i in b["index"]}  # replaced
    # Logged by the master once it hears the batch's report, which may come after the trainer
    # read the batch (published first): waited for, not assumed.
    wait_until(lambda: "returned keys" in paths.log.read_text(), timeout_s=10, what="the bad sample logged")
    steps = len(batches)
    for step in range(steps):
        result = cli("verify", "job", "--epoch", "0", "--step", str(step))
        assert result.returncode in (0, 4), result.stderr  # 4: already consumed and deleted
        assert "differs" not in result.stderr


def test_a_slow_but_progressing_worker_is_not_killed(tmp_path, jpeg_folder, job_root, monkeypatch):
    # Each sample takes 80 % of --worker-timeout: progress is heard only once a heartbeat (1 s).
    config = job_with(tmp_path, jpeg_folder, monkeypatch, "if i < 12: time.sleep(1.6)")
    paths = start_job(config, "--worker-timeout", "2", "--batch-size", "2")
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    try:
        it = iter(loader)
        for _ in range(4):
            next(it)
    finally:
        loader.close()
    assert job_status(paths)["workers"]["restarts"] == 0, paths.log.read_text()
