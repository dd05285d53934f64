"""The loader's read-ahead thread: in order, one batch ahead, reporting only what the trainer
reached, errors raised at their step, and no thread left behind."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from prefetchd_client import DaemonDied, PrefetchLoader
from prefetchd_client.readahead import ReadAhead

from .conftest import start_job, wait_until, write_config

pytestmark = pytest.mark.timeout(60)


def readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "prefetchd-readahead" and t.is_alive()]


class Recorder:
    """A fetch that returns the step at once and remembers how far it got; reports recorded."""

    def __init__(self, fail_at: int | None = None):
        self.fetched, self.reports, self.fail_at = [], [], fail_at

    def fetch(self, epoch, step, reader):
        if step == self.fail_at:
            raise DaemonDied(f"gone at step {step}")
        self.fetched.append(step)
        return step

    def report(self, epoch, step):
        self.reports.append((epoch, step))


def test_reads_one_ahead_and_reports_only_what_the_trainer_took():
    rec = Recorder()
    reader = ReadAhead(rec.fetch, rec.report, 3, 2, 7, timeout_s=5)
    assert reader.take(2) == 2
    wait_until(lambda: rec.fetched == [2, 3], what="the next batch mapped ahead")
    time.sleep(0.05)  # it goes no further while the trainer holds step 2
    assert rec.fetched == [2, 3] and rec.reports == [(3, 2)]
    for step in range(3, 7):
        assert reader.take(step) == step
    wait_until(lambda: rec.reports[-1] == (3, 6), what="the last position")
    assert rec.reports == sorted(rec.reports) and all(s <= 6 for _, s in rec.reports)
    reader.stop()
    assert not readahead_threads()


def test_an_error_is_raised_at_its_step_on_the_trainers_thread():
    rec = Recorder(fail_at=2)
    reader = ReadAhead(rec.fetch, rec.report, 0, 0, 5, timeout_s=5)
    assert [reader.take(0), reader.take(1)] == [0, 1]
    with pytest.raises(DaemonDied, match="gone at step 2"):
        reader.take(2)
    reader.stop()
    assert not readahead_threads()


def test_a_left_epoch_stops_its_thread_and_close_leaves_none(tmp_path, jpeg_folder, job_root):
    start_job(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="1M"))
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    first = iter(loader)
    next(first), next(first)
    assert len(readahead_threads()) == 1
    second = iter(loader)  # as Lightning does: a new iterator goes on from the position
    batch = next(second)
    assert loader.position == (0, 3) and batch["index"].shape == (4,)
    wait_until(lambda: len(readahead_threads()) == 1, what="the first iterator's thread gone")
    loader.close()
    wait_until(lambda: not readahead_threads(), what="no read-ahead thread after close()")


def test_a_batch_the_trainer_drops_is_freed_at_once_not_inside_the_next_step(tmp_path, jpeg_folder, job_root):
    """The loader keeps no reference to a batch it handed out: when the trainer drops it, its
    arrays die then (and the mapping goes to the unmapper thread), during the trainer's own
    step. A reference kept by the loader freed it inside the next next(): 1-3 ms there."""
    start_job(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="1M"))
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    batches = iter(loader)
    for _ in range(3):
        batch = next(batches)
        image = weakref.ref(batch["image"])
        del batch
        assert image() is None
    loader.close()
