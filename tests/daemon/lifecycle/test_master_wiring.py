"""Behaviours of main before the Master was split (issue 12) that the split changed by accident:
each test fails on the split as it first landed and passes on main before it."""

from __future__ import annotations

import re
import time

import pytest

from prefetchd_client.manifest import read_manifest
from tests.conftest import write_config
from tests.daemon.lifecycle.test_worker_liveness import pipeline_job
from tests.helpers import job_status, read_epoch

pytestmark = pytest.mark.timeout(120)

# Sends, once, a message only the master sends down the worker's own pipe while the worker holds
# a task: what a [pipeline] callable that reaches the pipe (or a fork that garbles it) can do.
PIPELINE = """
import gc
import multiprocessing.connection
import os

import numpy as np

def make(source, rng):
    i = source["index"]
    if i == 5 and not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        conn = next(o for o in gc.get_objects() if isinstance(o, multiprocessing.connection.Connection))
        conn.send_bytes({message!r})
    return {{"pixels": np.full(8, i, np.int16)}}
"""

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO starting job ", re.MULTILINE)


@pytest.mark.parametrize(
    "message", [b'{"op": "stop"}', b'{"op": "produce", "epoch": 0, "step": 0, "rank": 0}'], ids=["stop", "produce"]
)
def test_a_worker_that_sends_a_masters_message_does_not_stop_the_daemon(
    tmp_path, jpeg_folder, serve, monkeypatch, message
):
    # Main before the split ignored an op a worker never sends; the split read .task off it
    # and stopped the daemon with an internal error (exit 70).
    code = PIPELINE.format(marker=str(tmp_path / "sent"), message=message)
    job = serve(pipeline_job(tmp_path, jpeg_folder, monkeypatch, "pipe_master_op", code))
    paths = job.paths
    batches = read_epoch("job", timeout=60)
    assert (tmp_path / "sent").exists(), "the callable never sent its message: the test proves nothing"
    assert len(batches) == read_manifest(paths)["batches_per_epoch"]
    assert "internal error" not in paths.log.read_text()
    assert job.exit_code is None  # still serving


def test_uptime_and_started_at_count_from_the_start_not_from_serving(tmp_path, jpeg_folder, serve):
    # Main before the split took started_at when the master was made, before the lock, the
    # index and the workers' boot; the split took it once the job served.
    job = serve(write_config(tmp_path, jpeg_folder))
    paths = job.paths
    found = _LOG_TIME.search(paths.log.read_text())
    assert found, "no 'starting job' line in the log"
    logged = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S")) + int(found[2]) / 1000
    started_at = read_manifest(paths)["started_at"]
    assert started_at <= logged + 0.002, f"started_at is {started_at - logged:.3f} s after the 'starting job' line"
    asked = time.time()  # before the request: the status is made after it, however long the reply takes
    uptime = job_status(paths)["uptime_s"]
    # (rounded to 0.1 s: 0.05 of slack)
    assert uptime + 0.05 >= asked - logged - 0.002, f"uptime {uptime} s is shorter than the time since the start"
    job.stop()  # a clean stop: nothing in the loop's turns failed
    assert job.exit_code == 0
