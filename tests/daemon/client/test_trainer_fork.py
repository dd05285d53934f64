"""A trainer that forks (DataLoader workers, a subprocess started by fork) passes its open files
to the child; the child must not keep a killed trainer's rank looking alive."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from prefetchd import control
from tests.conftest import start_job, wait_until, write_config

pytestmark = pytest.mark.timeout(120)

_FORKING_TRAINER = textwrap.dedent("""
    import os, sys, time
    from prefetchd_client import PrefetchLoader
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    batch = next(iter(loader))  # a batch mapped, a read-ahead running: both inherited by the child
    child = os.fork()
    if child == 0:
        time.sleep(60)  # outlives its parent
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
""")


def trainer_of_rank_0(paths) -> str:
    status = control.request(paths.endpoint, {"op": "status"}, timeout_s=10)
    assert status is not None
    return status["ranks"][0]["trainer"]


def test_a_child_forked_by_a_killed_trainer_does_not_keep_its_rank_alive(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder))
    trainer = subprocess.Popen([sys.executable, "-c", _FORKING_TRAINER], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(trainer.stdout.readline()))
        wait_until(lambda: trainer_of_rank_0(paths) == "alive", timeout_s=20, what="the trainer seen alive")
        trainer.kill()
        trainer.wait(timeout=10)
        assert child.is_running()
        wait_until(lambda: trainer_of_rank_0(paths) == "gone", timeout_s=20, what="the rank seen gone")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=10)
        if child is not None and child.is_running():
            child.send_signal(signal.SIGKILL)
            psutil.wait_procs([child], timeout=10)
