"""Spares: a consumed batch's file, taken back under the exclusive lock and overwritten by a later
batch (prefetchd.master.retire, prefetchd_client.batchwriter), on real files and real locks."""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np
import pytest

from prefetchd.master.retire import SPARE_IDLE_S, SPARE_PREFIX, RetiredBatches
from prefetchd_client import batchfile
from prefetchd_client.batchfile import BatchLayout, FieldSpec, map_batch
from prefetchd_client.batchwriter import BatchBuffer, BatchWriter, open_spare
from prefetchd_client.layout import JobPaths

FIELDS = [FieldSpec("image", "uint8", (2, 64, 64, 3)), FieldSpec("label", "int64", (2,))]
LAYOUT = BatchLayout.plan(FIELDS)


@pytest.fixture
def paths(tmp_path) -> JobPaths:
    paths = JobPaths.of("job", tmp_path)
    for folder in (paths.batch_dir, paths.tmp_dir, paths.retired_dir):
        folder.mkdir(parents=True)
    return paths


def publish(paths: JobPaths, step: int, fill: int, spare: bool = False, meta: dict | None = None) -> str:
    """Write batch (0, step, 0) as a worker does (over the spare at its path when ``spare``) and link it."""
    tmp = paths.tmp_file(0, step, 0, os.getpid())
    writer = BatchWriter(tmp, LAYOUT, BatchBuffer(LAYOUT), spare=spare)
    writer.arrays["image"][:] = fill
    writer.arrays["label"][:] = step
    writer.finish(0, step, 0, meta)
    os.link(tmp, paths.batch_file(0, step, 0))
    os.unlink(tmp)
    return paths.batch_file(0, step, 0)


def test_a_freed_file_becomes_the_next_batch_in_place(paths):
    retired = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size)
    first = publish(paths, 0, fill=200, meta={"note": "x" * 900})
    inode = os.stat(first).st_ino
    assert retired.retire(first)
    assert retired.spares == 1 and os.listdir(paths.tmp_dir)[0].startswith(SPARE_PREFIX)
    assert os.listdir(paths.retired_dir) == []
    assert retired.take_spare(paths.tmp_file(0, 1, 0, os.getpid())) and retired.spares == 0
    second = publish(paths, 1, fill=9, spare=True, meta={})
    assert os.stat(second).st_ino == inode  # the same pages, overwritten
    header, arrays = map_batch(second)
    assert (header["step"], header["meta"]) == (1, {})  # no tail of the longer header before it
    assert set(arrays["image"].reshape(-1).tolist()) == {9} and arrays["label"].tolist() == [1, 1]
    assert not retired.take_spare(paths.tmp_file(0, 2, 0, os.getpid()))  # none left: the writer makes a file


def test_spares_no_task_takes_are_unlinked(paths):
    retired = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size)
    for step in range(3):
        assert retired.retire(publish(paths, step, fill=step))
    assert retired.spares == 3 and len(os.listdir(paths.tmp_dir)) == 3
    retired.drop_spare()
    assert retired.spares == 2 and len(os.listdir(paths.tmp_dir)) == 2
    retired.drop_idle_spares(time.monotonic())  # freed just now: kept
    assert retired.spares == 2
    retired.drop_idle_spares(time.monotonic() + SPARE_IDLE_S + 0.1)
    assert retired.spares == 0 and os.listdir(paths.tmp_dir) == []
    unkept = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size + 1)  # no file of that size: none kept
    assert unkept.retire(publish(paths, 5, fill=5))
    assert unkept.spares == 0 and os.listdir(paths.tmp_dir) == [] and os.listdir(paths.retired_dir) == []


def test_a_mapped_batch_is_never_made_a_spare(paths):
    retired = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size)
    path = publish(paths, 0, fill=77)
    _, arrays = map_batch(path)  # the shared lock lives with the map
    assert retired.retire(path)
    assert retired.spares == 0 and len(retired.pinned) == 1
    retired.retry_pinned()
    assert retired.spares == 0
    assert set(arrays["image"].reshape(-1).tolist()) == {77}
    del arrays
    retired.retry_pinned()
    assert retired.spares == 1 and retired.pinned == {}


def test_a_reader_that_opened_the_name_before_the_file_was_taken_back_finds_it_gone(paths, monkeypatch):
    """The race a spare opens: a reader opens batches/X, the daemon retires X and (no lock held
    yet) makes its file a spare, a worker starts writing another batch into it; then the reader's
    shared lock succeeds on a file with one link. It must see the name leads elsewhere."""
    retired = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size)
    path = publish(paths, 0, fill=5)
    real_flock = batchfile.fcntl.flock
    taken = []

    def daemon_acts_between_open_and_lock(fd, op):
        if op & fcntl.LOCK_SH and not taken:  # the reader's lock (the daemon's own is exclusive)
            taken.append(retired.retire(path))
            retired.take_spare(paths.tmp_file(0, 1, 0, os.getpid()))
        return real_flock(fd, op)

    monkeypatch.setattr(batchfile.fcntl, "flock", daemon_acts_between_open_and_lock)
    with pytest.raises(FileNotFoundError, match="retired"):
        map_batch(path)
    assert taken == [True]
    # Published again under its own name, the file is a batch again, and reads as one.
    monkeypatch.setattr(batchfile.fcntl, "flock", real_flock)
    again = publish(paths, 1, fill=6, spare=True)
    assert map_batch(again)[0]["step"] == 1


@pytest.mark.parametrize("what", ["symlink", "fifo", "folder", "hard link", "short", "long"])
def test_what_is_planted_in_retired_is_removed_never_made_a_spare(paths, tmp_path, what):
    """A daemon's start sweeps a dead one's retired/: a name there may be anything. None stops
    the daemon, hangs it, or becomes a spare a worker would write through (a hard link to a file
    outside the job folder would carry a batch there)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * LAYOUT.size)
    planted = paths.retired_dir / "e000000-s00000000-r0000.batch.1"
    if what == "symlink":
        planted.symlink_to(victim)
    elif what == "fifo":
        os.mkfifo(planted)  # a plain open() would wait for a writer for ever
    elif what == "folder":
        planted.mkdir()
        (planted / "inside").symlink_to(victim)
    elif what == "hard link":
        os.link(victim, planted)
    else:
        planted.write_bytes(b"x" * (LAYOUT.size // 2 if what == "short" else LAYOUT.size * 2))
    retired = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size)
    assert retired.sweep() == 0
    assert retired.spares == 0 and os.listdir(paths.retired_dir) == [] and os.listdir(paths.tmp_dir) == []
    assert victim.read_bytes() == b"v" * LAYOUT.size


def test_a_name_taken_where_a_spare_goes_costs_the_spare_not_the_daemon(paths):
    retired = RetiredBatches(paths.retired_dir, paths.tmp_dir, LAYOUT.size)
    retired._sequence = iter([1, 7, 2, 8])  # names in retired/ and spare names, in turn
    os.mkdir(paths.tmp_dir / f"{SPARE_PREFIX}7")
    assert retired.retire(publish(paths, 0, fill=1))  # unlinked instead: no spare name to be had
    assert retired.spares == 0 and os.listdir(paths.retired_dir) == []
    assert retired.retire(publish(paths, 1, fill=1)) and retired.spares == 1
    dest = paths.tmp_file(0, 2, 0, os.getpid())
    os.mkdir(dest)  # planted where the next writer writes: its own create fails on it, as before spares
    assert not retired.take_spare(dest)
    assert retired.spares == 0
    assert sorted(os.listdir(paths.tmp_dir)) == sorted([f"{SPARE_PREFIX}7", os.path.basename(dest)])


def test_a_spare_with_a_second_name_is_not_written_through(paths, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * LAYOUT.size)
    path = paths.tmp_file(0, 0, 0, os.getpid())
    os.link(victim, path)
    fd = open_spare(path, LAYOUT.size)
    try:
        os.pwrite(fd, b"\1" * LAYOUT.size, 0)
    finally:
        os.close(fd)
    assert victim.read_bytes() == b"v" * LAYOUT.size and os.stat(path).st_nlink == 1


@pytest.mark.parametrize("what", ["missing", "short", "symlink", "fifo"])
def test_a_spare_that_is_not_one_is_replaced_by_a_new_file(paths, what, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep me")
    path = paths.tmp_file(0, 0, 0, os.getpid())
    if what == "short":
        with open(path, "wb") as f:
            f.write(b"x" * 100)
    elif what == "symlink":
        os.symlink(target, path)
    elif what == "fifo":
        os.mkfifo(path)  # opened without blocking: no reader will come
    fd = open_spare(path, LAYOUT.size)
    try:
        os.pwrite(fd, b"\1" * LAYOUT.size, 0)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    assert os.path.isfile(path) and not os.path.islink(path) and st.st_size == LAYOUT.size
    assert target.read_bytes() == b"keep me"
    assert np.fromfile(path, np.uint8).min() == 1


@pytest.mark.parametrize("swap", ["symlink", "another file"])
def test_the_file_written_is_the_file_published_whatever_stands_at_its_name(paths, tmp_path, swap):
    """Found by the second attack of spares: a process that swapped a symlink in at a worker's
    temporary name between its write and its link got the symlink published (the trainer then
    stopped on it). The worker links the file it holds open, not the name."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * LAYOUT.size)
    tmp = paths.tmp_file(0, 0, 0, os.getpid())
    writer = BatchWriter(tmp, LAYOUT, BatchBuffer(LAYOUT))
    writer.arrays["image"][:] = 3
    writer.arrays["label"][:] = 0
    os.rename(tmp, f"{tmp}.moved")  # the written file keeps its pages under another name
    if swap == "symlink":
        os.symlink(victim, tmp)
    else:
        os.link(victim, tmp)
    dst = paths.batch_file(0, 0, 0)
    assert writer.finish(0, 0, 0, publish_as=dst)
    header, arrays = map_batch(dst)  # a regular file, the batch: a symlink would raise here
    assert header["step"] == 0 and set(arrays["image"].reshape(-1).tolist()) == {3}
    assert victim.read_bytes() == b"v" * LAYOUT.size
    assert os.stat(dst).st_ino == os.stat(f"{tmp}.moved").st_ino
