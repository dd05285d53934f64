"""A batch's page tables made on the client's read-ahead thread (prefetchd_client.pagetables):
the trainer's first touch of the pixels then takes no page faults, nothing is copied, and a
file cut short under the map costs the populate nothing worse than the faults it would save."""

from __future__ import annotations

import mmap
import os
import resource
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from prefetchd_client import PrefetchLoader, pagetables
from prefetchd_client.batchfile import BatchLayout, FieldSpec, map_batch
from prefetchd_client.batchwriter import BatchWriter
from tests.conftest import write_config

PAGE = 4096


@pytest.fixture
def shm_dir():
    folder = Path(tempfile.mkdtemp(prefix="prefetchd-test-pagetables-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def write_batch(path: Path, shape: tuple[int, ...]) -> None:
    layout = BatchLayout.plan([FieldSpec("image", "uint8", shape), FieldSpec("label", "int64", shape[:1])])
    writer = BatchWriter(path, layout)
    writer.arrays["image"][...] = 7
    writer.finish(0, 0, 0, {})


def faults_of_first_touch(image: np.ndarray) -> tuple[int, int]:
    """(minor page faults of this thread while it reads one byte of every page, pages read)."""
    flat = image.reshape(-1)
    pages = range(0, flat.size, PAGE)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for offset in pages:  # one element at a time: a temporary array's allocation would fault too
        int(flat[offset])
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before, len(pages)


def anonymous_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    raise AssertionError("no Anonymous line in smaps_rollup")


def test_populated_pages_take_no_faults_when_first_read_and_are_not_copied(shm_dir):
    path = shm_dir / "b.batch"
    write_batch(path, (32, 224, 224, 3))  # 4.8 MB: 1,176 pages
    _, plain = map_batch(path)
    unpopulated, pages = faults_of_first_touch(plain["image"])
    # Without populate the pages fault in, 16 at a time (the kernel's fault-around, 64 KiB).
    assert unpopulated >= 0.9 * pages / 16, "the check below would mean nothing"
    del plain

    anon_before = anonymous_kb()
    _, arrays = map_batch(path, populate=True)
    grew_kb = anonymous_kb() - anon_before
    faults, _ = faults_of_first_touch(arrays["image"])
    # A stray fault or two (the interpreter's own pages) under load; none of the batch's.
    assert faults <= 0.25 * unpopulated, f"{faults} faults for {pages} populated pages ({unpopulated} unpopulated)"
    # Read-only entries to the file's own pages: a copy-on-write copy would be 4,704 KB of anonymous memory.
    assert grew_kb < 1024, f"populate grew anonymous memory by {grew_kb} KB"
    arrays["image"][0, 0, 0, 0] = 9  # the map is still private: a write copies its page, not the file
    del arrays
    _, again = map_batch(path)
    assert int(again["image"][0, 0, 0, 0]) == 7


def test_a_file_cut_short_under_the_map_is_populated_without_error(shm_dir):
    """The populate stops at the file's new end (EFAULT) and says nothing: the reader learns
    what happened to its batch from the file, as without it."""
    path = shm_dir / "b.batch"
    path.write_bytes(b"\7" * (64 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(fd, 64 * PAGE, access=mmap.ACCESS_COPY)
    os.close(fd)
    os.truncate(path, PAGE)
    pagetables.populate(buf)
    assert pagetables._can_populate  # EFAULT is not taken for a kernel without the call
    assert buf[:PAGE] == b"\7" * PAGE  # what is left of the file reads as before
    buf.close()


def test_the_loader_hands_the_trainer_batches_whose_pages_are_mapped_already(tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, batch_size=16, size=224, buffer="16M"))  # 2.4 MB a batch
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    batches = iter(loader)
    for _ in range(3):
        batch = next(batches)
        faults, pages = faults_of_first_touch(batch["image"])
        # Faulted in, 16 pages at a time: pages / 16 faults. A stray fault or two under load.
        assert faults <= pages / 16 / 4, f"the trainer's thread took {faults} faults reading {pages} pages"
        del batch
    loader.close()
