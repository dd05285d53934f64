"""Consumed batches' files are overwritten by later batches (spares), never under a reader.

A batch written into pages a file already has costs a quarter of one written into new tmpfs
pages, so the master keeps freed files as spares (prefetchd.master.retire) and hands each to
the next task. These tests run real workers over a real tmpfs: the files are reused, every
batch read is still whole and exact, and a batch a trainer holds is never written over.
"""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest

from prefetchd import control
from prefetchd.master.retire import SPARE_IDLE_S, SPARE_PREFIX
from prefetchd_client import PrefetchLoader
from prefetchd_client.manifest import read_manifest
from tests.conftest import wait_until, write_config

pytestmark = pytest.mark.timeout(120)

EPOCHS = 4


def _watch_inodes(paths, seen: set, done: threading.Event) -> threading.Thread:
    """Note the inode of every file that appears in batches/ while the test reads."""

    def run():
        while not done.is_set():
            with os.scandir(paths.batch_dir) as entries:
                for entry in entries:
                    try:
                        seen.add(entry.inode())
                    except FileNotFoundError:
                        pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_later_batches_overwrite_consumed_files_and_read_exact(tmp_path, jpeg_folder, serve):
    # 48 images, batches of 4: 12 an epoch; a 128 KiB bound holds 7 batches of ~16 KiB.
    job = serve(write_config(tmp_path, jpeg_folder, buffer="128K", size=32, workers=2), {"retain": 0})
    paths = job.paths
    manifest = read_manifest(paths)
    slots = manifest["buffer_bytes"] // manifest["batch_bytes"]
    inodes, done = set(), threading.Event()
    watcher = _watch_inodes(paths, inodes, done)
    # verify: every batch's name, config hash and the digest of its bytes, made before the write
    loader = PrefetchLoader("job", as_tensors=False, verify=True, timeout=60)
    try:
        read = 0
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for batch in loader:
                assert batch["image"].shape == (4, 32, 32, 3)
                read += 1
    finally:
        done.set()
        watcher.join(10)
        loader.close()
    status = control.request(paths.endpoint, {"op": "status"})
    made = status["totals"]["produced"]
    # Each batch written into a new file would show one inode per batch made; reused files show
    # at most the bound's slots, the spares, and the files of batches being written.
    assert read == EPOCHS * 12 and made >= read
    assert len(inodes) <= slots + 2 * 2 + 2, f"{len(inodes)} files for {made} batches: consumed files not reused"
    assert status["buffer"]["spare_batches"] <= 2  # one per worker
    assert status["buffer"]["used_bytes"] <= manifest["buffer_bytes"]
    print(f"\n[figure] {read} batches read through {len(inodes)} files ({slots} slots of the bound)")


def test_a_batch_a_trainer_holds_is_never_written_over(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder, buffer="128K", size=32, workers=2), {"retain": 0})
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    held, copies = [], []
    try:
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for step, batch in enumerate(loader):
                if epoch == 0 and step < 3:  # kept across three more epochs of reuse
                    held.append(batch)
                    copies.append({k: v.copy() for k, v in batch.items()})
        status = control.request(job.paths.endpoint, {"op": "status"})
        assert status["buffer"]["pinned_batches"] >= 3  # still mapped, so never a spare
        for batch, copy in zip(held, copies):
            for name in copy:
                np.testing.assert_array_equal(batch[name], copy[name])
    finally:
        del held, batch
        loader.close()
        gc.collect()
    # Let go, the files are freed (kept as spares or unlinked) and the ledger agrees with the folder.
    wait_until(
        lambda: control.request(job.paths.endpoint, {"op": "status"})["buffer"]["pinned_batches"] == 0,
        what="the released batches to be freed",
    )


def _read_and_leave(job) -> None:
    """Read an epoch as a trainer the daemon has seen alive (it looks every second), then leave."""
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    for batch in loader:
        del batch
    wait_until(lambda: job.master.intake.trainers.get((0, "")) == "alive", what="the daemon to see the trainer")
    loader.close()


def _spare_files(paths) -> list[str]:
    return [name for name in os.listdir(paths.tmp_dir) if name.startswith(SPARE_PREFIX)]


def test_spares_no_task_takes_give_their_memory_back(tmp_path, jpeg_folder, serve):
    """A trainer that leaves releases its batches (on_trainer_exit "release"): their files
    become spares, which nobody takes while no trainer reads, and are unlinked after SPARE_IDLE_S."""
    overrides = {"retain": 0, "on_trainer_exit": "release"}
    job = serve(write_config(tmp_path, jpeg_folder, buffer="128K", size=32, workers=2), overrides)
    _read_and_leave(job)
    status = lambda: control.request(job.paths.endpoint, {"op": "status"})["buffer"]  # noqa: E731
    wait_until(
        lambda: status()["spare_batches"] > 0 and _spare_files(job.paths), what="the released batches to become spares"
    )
    wait_until(lambda: status()["spare_batches"] == 0, timeout_s=SPARE_IDLE_S + 5, what="idle spares to be freed")
    assert _spare_files(job.paths) == []
    # The ledger agrees with the folder again (a late report of the leaving loader may bring a
    # window back: its batches, not spares).
    wait_until(lambda: (b := status())["files_bytes"] == b["used_bytes"] and b, what="the files to match")


def test_a_daemon_stopped_with_keep_keeps_batches_not_spares(tmp_path, jpeg_folder, serve):
    overrides = {"retain": 0, "on_trainer_exit": "release"}
    job = serve(write_config(tmp_path, jpeg_folder, buffer="128K", size=32, workers=2), overrides)
    _read_and_leave(job)
    wait_until(lambda: _spare_files(job.paths), what="spares")
    job.stop(keep=True)
    assert _spare_files(job.paths) == []
