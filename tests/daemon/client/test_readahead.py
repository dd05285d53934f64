"""The loader's read-ahead thread: in order, one batch ahead, reporting only what the trainer
reached, errors raised at their step, and no thread left behind."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import threading
import time
import weakref

import pytest

from prefetchd_client import DaemonDied, PrefetchLoader
from prefetchd_client.readahead import ReadAhead
from tests.conftest import daemon_family, start_job, wait_pids_gone, wait_until, write_config

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


def test_a_left_epoch_stops_its_thread_and_close_leaves_none(tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="1M"))
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


def test_a_batch_the_trainer_drops_is_freed_at_once_not_inside_the_next_step(tmp_path, jpeg_folder, serve):
    """The loader keeps no reference to a batch it handed out: when the trainer drops it, its
    arrays die then (and the mapping goes to the unmapper thread), during the trainer's own
    step. A reference kept by the loader freed it inside the next next(): 1-3 ms there."""
    serve(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="1M"))
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    batches = iter(loader)
    for _ in range(3):
        batch = next(batches)
        image = weakref.ref(batch["image"])
        del batch
        assert image() is None
    loader.close()


def test_the_next_epochs_reader_starts_while_the_trainer_holds_the_last_batch():
    fetched, reports = [], []

    def fetch(epoch, step, reader):
        fetched.append((epoch, step))
        return (epoch, step)

    reader = ReadAhead(fetch, lambda e, s: reports.append((e, s)), 3, 5, 7, timeout_s=5)
    assert [reader.take(5), reader.take(6)] == [(3, 5), (3, 6)]
    wait_until(lambda: not reader._thread.is_alive(), what="epoch 4's reader started, and this one done")
    assert fetched[-1] == (4, 0) and len(readahead_threads()) == 1  # the next epoch's, waiting
    following = reader.hand_over()
    time.sleep(0.05)  # it reads no further while its first batch is not taken
    assert fetched[-1] == (4, 0) and {e for e, _ in reports} == {3}  # and reports nothing yet
    following.announce()  # the loader's word that the trainer left epoch 3: sent on its thread
    wait_until(lambda: reports[-1:] == [(4, 0)], what="epoch 4's start reported")
    assert following.take(0) == (4, 0)
    wait_until(lambda: fetched[-1:] == [(4, 1)], what="the next step mapped ahead")
    assert fetched.count((4, 0)) == 1  # handed over, not fetched again
    following.take(1)
    wait_until(lambda: reports[-1:] == [(4, 1)], what="the trainer's position in epoch 4")
    following.stop()
    assert not readahead_threads()


def test_nothing_is_handed_over_when_the_next_epochs_batch_failed():
    def fetch(epoch, step, reader):
        if epoch == 1:
            raise DaemonDied("gone")
        return step

    reader = ReadAhead(fetch, lambda e, s: None, 0, 0, 2, timeout_s=5)
    assert [reader.take(0), reader.take(1)] == [0, 1]
    wait_until(lambda: reader._slot is not None, what="the failed look-ahead in the slot")
    assert reader.hand_over() is None  # the next epoch's reader fetches it afresh, errors included
    assert not readahead_threads()


def locked_by_a_reader(path) -> bool:
    """A client maps a batch under a shared flock: an exclusive try fails while it is mapped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_new_epoch_starts_with_its_first_batch_already_mapped(tmp_path, jpeg_folder, job_root):
    """Proved by taking the file away at the epoch boundary (daemon killed, batch file deleted):
    the next epoch's first batch, mapped while the trainer held the last one, is still served."""
    paths = start_job(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="1M"))
    loader = PrefetchLoader("job", as_tensors=False, timeout=30, restart_grace=1, verify=True)
    epoch0 = iter(loader)
    for _ in range(len(loader)):
        batch = next(epoch0)  # the trainer holds the epoch's last batch in the end
    first_of_next = paths.batch(1, 0, 0)
    wait_until(lambda: not loader._readers.current._thread.is_alive(), what="epoch 1's reader started")
    assert locked_by_a_reader(first_of_next)  # its first batch mapped
    del batch
    with pytest.raises(StopIteration):
        next(epoch0)
    family = daemon_family(paths)
    for pid in family:
        os.kill(pid, signal.SIGKILL)
    wait_pids_gone(family)
    os.unlink(first_of_next)
    epoch1 = iter(loader)
    first = next(epoch1)  # verify=True: its header says epoch 1 step 0 of this job, bytes intact
    assert loader.position == (1, 1) and first["index"].shape == (4,)
    loader.close()
    assert not readahead_threads()


def test_the_timeout_counts_from_when_the_trainer_asks(tmp_path, jpeg_folder, serve):
    """A one-batch window: the next batch is made only once the trainer moves on. A step
    (an evaluation) longer than ``timeout`` is no time-out: the wait starts when it asks."""
    serve(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="20K", extra=""), {"retain": 0})
    loader = PrefetchLoader("job", as_tensors=False, timeout=1)
    batches = iter(loader)
    batch = next(batches)
    time.sleep(1.5)  # the trainer's long step, not a synchronisation
    del batch
    assert next(batches)["index"].shape == (4,)
    assert loader.position == (0, 2)
    loader.close()


def test_a_loader_dropped_between_epochs_is_collected_and_leaves_no_thread(tmp_path, jpeg_folder, serve):
    """The next epoch's reader runs between epochs; it holds the loader weakly, so dropping the
    loader still frees it (its trainer lock too) and stops that thread."""
    paths = serve(write_config(tmp_path, jpeg_folder, batch_size=4, buffer="1M")).paths
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    epoch0 = iter(loader)
    for _ in range(len(loader)):
        batch = next(epoch0)
    ending = loader._readers.current  # holds the loader weakly, as every reader does
    wait_until(lambda: not ending._thread.is_alive(), what="the next epoch's reader started")
    assert len(readahead_threads()) == 1 and locked_by_a_reader(paths.batch(1, 0, 0))
    del batch
    with pytest.raises(StopIteration):
        next(epoch0)
    assert len(readahead_threads()) == 1
    gone = weakref.ref(loader)
    del loader, epoch0
    gc.collect()
    assert gone() is None
    wait_until(lambda: not readahead_threads(), what="no read-ahead thread after the loader was collected")
    # Its mapping went with it, closed on the unmapper's thread a moment later (unmapper.py).
    wait_until(lambda: not locked_by_a_reader(paths.batch(1, 0, 0)), what="the mapping's lock to go")
