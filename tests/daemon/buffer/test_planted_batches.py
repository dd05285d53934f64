"""Batch files planted by a process of the same user (issue 11, item 16): every one is refused
with BatchFormatError, at once, by the client and by a daemon that restarts over it; the one
thing the format cannot stop (truncating a mapped batch) is documented, and proved to be so."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from prefetchd_client import PrefetchLoader, batchfile
from prefetchd_client.batchfile import (
    MAGIC,
    PREAMBLE,
    VERSION,
    BatchFormatError,
    BatchLayout,
    FieldSpec,
    map_batch,
)
from prefetchd_client.batchwriter import BatchWriter
from prefetchd_client.layout import batch_name
from tests.conftest import wait_until, write_config

pytestmark = pytest.mark.timeout(120)
FIELDS = [FieldSpec("image", "uint8", (2, 4, 4, 3)), FieldSpec("label", "int64", (2,))]
NESTED = b"[" * 50_000  # well under the 1 MiB header cap; json's C parser recurses per level


def good_batch(path: Path) -> Path:
    writer = BatchWriter(path, BatchLayout.plan(FIELDS))
    writer.arrays["image"][:] = 7
    writer.arrays["label"][:] = [1, 2]
    writer.finish(0, 0, 0, {})
    return path


def crafted_batch(path: Path, table: bytes, meta: bytes = b"{}", size: int = 8192) -> Path:
    """A batch file with this field table and meta, the preamble valid, zero-padded to ``size``."""
    head = PREAMBLE.pack(MAGIC, VERSION, len(table), len(meta), 0, 0, 0, 0) + table + meta
    path.write_bytes(head + bytes(max(0, size - len(head))))
    return path


def field_table(shape: list, offset: int = 4096) -> bytes:
    return json.dumps([{"name": "image", "dtype": "uint8", "shape": shape, "offset": offset}]).encode()


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**40, 2**40], [2**63, 0]], ids=str)
def test_an_empty_field_with_dimensions_numpy_refuses_raises_only_batch_format_error(tmp_path, shape):
    path = crafted_batch(tmp_path / "b", field_table(shape))
    with pytest.raises(BatchFormatError, match="runs past the end"):
        map_batch(path, pin=False)


def test_a_field_table_nested_too_deep_raises_batch_format_error(tmp_path):
    path = crafted_batch(tmp_path / "b", NESTED + b"]" * 50_000, size=120_000)
    with pytest.raises(BatchFormatError, match="RecursionError"):
        map_batch(path, pin=False)


def test_a_meta_object_nested_too_deep_raises_batch_format_error(tmp_path):
    table = field_table([2, 4, 4, 3], offset=64 * 1024)  # past the 50 KB meta
    header, _ = map_batch(crafted_batch(tmp_path / "b", table, NESTED, size=72 * 1024), pin=False)
    with pytest.raises(BatchFormatError, match="RecursionError"):
        header["meta"]


def test_a_symlink_named_like_a_batch_is_refused_not_followed(tmp_path):
    link = tmp_path / batch_name(0, 0, 0)
    link.symlink_to(good_batch(tmp_path / "elsewhere"))
    with pytest.raises(BatchFormatError, match="symbolic link"):
        map_batch(link)


def test_a_fifo_named_like_a_batch_fails_the_read_at_once_and_leaves_no_thread_stuck(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, seed=11)).paths
    fifo = paths.batch(20, 0, 0)  # far ahead: the daemon has not made it, and takes it as made
    os.mkfifo(fifo, 0o600)
    threads_before = set(_readahead_threads())
    loader = PrefetchLoader("job", as_tensors=False, timeout=3)
    try:
        loader.load_state_dict({**loader.state_dict(), "epoch": 20, "samples_consumed": 0})
        started = time.monotonic()
        with pytest.raises(BatchFormatError, match="not a regular file"):
            next(iter(loader))
        assert time.monotonic() - started < 3, "the read waited instead of refusing the FIFO"
        loader.close()
        wait_until(lambda: set(_readahead_threads()) <= threads_before, timeout_s=10, what="its reader to end")
    finally:
        _release_a_reader_blocked_on(fifo)  # the unfixed reader blocks in open() until a writer comes
        loader.close()


def _readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "prefetchd-readahead" and t.is_alive()]


def _release_a_reader_blocked_on(fifo: Path) -> None:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waits (ENXIO), or the FIFO is gone


def test_a_restarted_daemon_drops_a_leftover_batch_nested_too_deep(tmp_path, jpeg_folder, serve):
    config = write_config(tmp_path, jpeg_folder, seed=12)
    job = serve(config)
    paths = job.paths
    wait_until(lambda: paths.batch(0, 1, 0).exists(), timeout_s=60, what="batch e0 s1 published")
    job.stop(keep=True)
    planted = crafted_batch(paths.batch(0, 1, 0), NESTED, size=120_000)
    serve(config)  # the master reads the leftover: a RecursionError would stop it
    assert "deleted 1" in paths.log.read_text()
    wait_until(lambda: _is_a_real_batch(planted), timeout_s=60, what="batch e0 s1 made again")


def _is_a_real_batch(path: Path) -> bool:
    try:
        header, _ = map_batch(path, pin=False)
    except (FileNotFoundError, BatchFormatError):
        return False
    return (header["epoch"], header["step"], header["rank"]) == (0, 1, 0)


def test_truncating_a_mapped_batch_kills_the_reader_with_sigbus_as_documented(tmp_path):
    """What the module docstring says a same-user process can do, and why nothing cheap stops it."""
    assert "SIGBUS" in batchfile.__doc__ and "F_ADD_SEALS" in batchfile.__doc__
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="prefetchd-test-seal-")
    try:  # a tmpfs file cannot be sealed against shrinking: only memfd files can
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    finally:
        os.close(fd)
        os.unlink(name)
    path = good_batch(tmp_path / "victim")
    reader = (
        "import os, sys\n"
        "from prefetchd_client.batchfile import map_batch\n"
        "_, arrays = map_batch(sys.argv[1])\n"
        "os.truncate(sys.argv[1], 0)\n"
        "print(int(arrays['image'].sum()))\n"
    )
    result = subprocess.run([sys.executable, "-c", reader, str(path)], capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-300:])
