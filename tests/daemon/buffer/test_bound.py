"""The byte bound counts what the filesystem holds, including consumed batches a client still maps.

Unlinking a mapped tmpfs file frees nothing until the map goes, so a ledger of names would
undercount. These tests run the job on a tmpfs of its own and read its statvfs: every page
the job holds is counted there, visible in a folder or not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from prefetchd import control
from prefetchd_client.manifest import read_manifest
from tests.conftest import wait_until, write_config

pytestmark = pytest.mark.timeout(120)

HELD = 3
# Reads two epochs keeping its first HELD batches alive (a trainer that logs a few batches,
# or leaks them); lets go of them when told, and stays alive so only the unmap frees them.
HOLDER = textwrap.dedent(f"""
    import gc, sys
    from prefetchd_client import PrefetchLoader
    loader = PrefetchLoader("job", timeout=60, as_tensors=False)
    held = []
    for epoch in range(2):
        for step, batch in enumerate(loader):
            if epoch == 0 and step < {HELD}:
                held.append(batch)
    del batch
    print("holding", flush=True)
    sys.stdin.readline()
    held.clear()
    gc.collect()
    print("released", flush=True)
    sys.stdin.readline()
    loader.close()
""")


def batch_pages(mount, paths) -> int:
    """Bytes the tmpfs holds for batches: all it holds, less the job's other files (index, log)."""
    st = os.statvfs(mount)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    other = 0
    for folder, _, files in os.walk(paths.dir):
        if folder.startswith((str(paths.batch_dir), str(paths.tmp_dir), str(paths.retired_dir))):
            continue
        for name in files:
            try:
                other += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return used - other


def test_batches_a_client_still_maps_count_against_the_bound(tmp_path, jpeg_folder, small_tmpfs, serve, monkeypatch):
    monkeypatch.setenv("PREFETCHD_ROOT", str(small_tmpfs / "root"))  # the job's, and the holder's
    # ~16 KiB batches, a 128 KiB bound: 7 slots for 12 batches an epoch, 3 of them pinned.
    job = serve(write_config(tmp_path, jpeg_folder, buffer="128K", size=32), {"retain": 0})
    paths = job.paths
    bound = read_manifest(paths)["buffer_bytes"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()

    def sample():  # as often as it can while the holder reads
        while not done.is_set():
            peak[0] = max(peak[0], batch_pages(small_tmpfs, paths))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert holder.stdout.readline().strip() == "holding", "the holder did not read its two epochs"
        done.set()
        sampler.join(10)
        # Batches freed by the holder as it went are retried a few times a second: settle first.
        buffer = wait_until(
            lambda: (b := control.request(paths.endpoint, {"op": "status"})["buffer"])["pinned_batches"] == HELD and b,
            what=f"{HELD} pinned batches",
        )
        assert len(os.listdir(paths.retired_dir)) == HELD
        # 4 KiB of slack: the log may grow between the statvfs and the walk of the other files.
        assert 0 < peak[0] <= bound + 4096, f"tmpfs held {peak[0]} bytes of batches, bound {bound}"
        assert buffer["peak_bytes"] <= bound
        assert "still mapped by a trainer" in paths.log.read_text()  # the operator is told why
        print(
            f"\n[figure] {HELD} consumed batches held by a client: tmpfs peak {peak[0]} B of batches for a "
            f"{bound} B bound; {buffer['pinned_batches']} pinned ({buffer['pinned_bytes']} B)"
        )

        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        wait_until(lambda: not os.listdir(paths.retired_dir), what="the released batches to be freed")
        wait_until(
            lambda: control.request(paths.endpoint, {"op": "status"})["buffer"]["pinned_batches"] == 0,
            what="status to show nothing pinned",
        )

        # The freed slots are refilled at once. A batch being written counts in full in the
        # ledger but holds only the pages written so far (pwrite, no fallocate): the two agree
        # once the window is full again.
        def quiet_and_equal():
            buffer = control.request(paths.endpoint, {"op": "status"})["buffer"]
            return buffer["pinned_batches"] == 0 and buffer["used_bytes"] == buffer["files_bytes"]

        wait_until(quiet_and_equal, what="the ledger to equal the filesystem once the window is full")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
    finally:
        done.set()
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        job.stop()
