"""--workers auto with a real daemon and a real trainer: a trainer slower than production leaves
workers idle and they end (their processes gone, no death counted), one that waits brings them
back, and the batches are those of a fixed count, byte for byte."""

from __future__ import annotations

import re
import time

import pytest

from prefetchd.cli.datagen import make_image_folder
from prefetchd.master.autoscale import SHRINK_WINDOW_S
from prefetchd_client import PrefetchLoader
from tests.batchdigest import digest
from tests.conftest import cli, start_job, wait_pids_gone, write_config
from tests.helpers import job_status

pytestmark = [pytest.mark.timeout(180), pytest.mark.heavy]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Images large enough that a worker takes a few ms a sample: a trainer that reads at once waits."""
    return make_image_folder(tmp_path_factory.mktemp("auto") / "train", classes=2, per_class=24, size=(300, 420))


def endless(loader):
    while True:
        yield from loader


def test_idle_workers_end_under_a_slow_trainer_and_come_back_when_it_waits(job_root, tmp_path, photos):
    config = write_config(tmp_path, photos, name="auto", workers='"auto"', buffer="1M", size=64)
    paths = start_job(config, "--min-workers", "1", "--max-workers", "3", "--node-cpus", "3")  # 3 on 2 cores
    first = job_status(paths)["workers"]
    assert first["count"] == 3 and first["auto"] == {"min": 1, "max": 3, "target": 3, "changes": 0}

    loader = PrefetchLoader("auto", as_tensors=False, rank=0, world_size=1, timeout=60)
    read = []
    batches = endless(loader)
    began = time.monotonic()
    while job_status(paths)["workers"]["count"] > 1:  # slow: a step of 0.2 s, the window stays full
        assert time.monotonic() - began < 6 * SHRINK_WINDOW_S, job_status(paths)["workers"]
        read.append(digest(next(batches)))
        time.sleep(0.2)
    slow = job_status(paths)["workers"]
    assert slow["auto"]["target"] == 1 and slow["restarts"] == 0  # stopped, not died
    retired = sorted(set(first["pids"]) - set(slow["pids"]))
    assert len(retired) == 2
    wait_pids_gone(retired)  # ended and reaped: their memory is the system's again

    began = time.monotonic()
    while job_status(paths)["workers"]["count"] < 3:  # fast: the trainer waits on one busy worker
        assert time.monotonic() - began < 30, job_status(paths)["workers"]
        read.append(digest(next(batches)))
    grown = job_status(paths)["workers"]
    assert grown["auto"]["target"] == 3 and grown["auto"]["changes"] >= 4 and grown["restarts"] == 0
    loader.close()

    log = paths.log.read_text()
    assert re.search(r"workers: 3 -> 2 \(\d worker\(s\) stayed idle for 5 s\)", log), log
    assert "workers: 1 -> 2 (a trainer waits" in log
    shown = cli("status", "auto")
    assert "3/3 busy" in shown.stdout or "busy (auto 1-3," in shown.stdout, shown.stdout
    assert cli("stop", "auto").returncode == 0

    # The same plan with one fixed worker: the same batches, in the same order.
    fixed = write_config(tmp_path, photos, name="fixed", workers=1, buffer="1M", size=64)
    start_job(fixed)
    loader = PrefetchLoader("fixed", as_tensors=False, rank=0, world_size=1, timeout=60)
    batches = endless(loader)
    assert [digest(next(batches)) for _ in read] == read
    loader.close()
    assert cli("stop", "fixed").returncode == 0
