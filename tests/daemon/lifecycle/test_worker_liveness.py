"""Liveness is progress, and a killed worker leaves nothing outside the bound.

A worker blocked in a call that releases the GIL (a read on a hung network mount) keeps
beating from its heartbeat thread: the master must judge it by the samples it finishes, kill
it and reissue its batch, and stop with a clear message when the batch hangs every time. A
worker killed with SIGKILL never runs its own clean-up: the master sweeps its temporary file
and counts a batch it published but never reported, so the files on the tmpfs never hold
more than ``--buffer``.
"""

from __future__ import annotations

import os
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from prefetchd.errors import ExitCode
from prefetchd_client import DaemonDied, PrefetchLoader
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest
from tests.conftest import wait_until, write_config
from tests.daemon.resume.test_resume import digest
from tests.helpers import ReadBatch, job_status, read_epoch, workers_of

pytestmark = pytest.mark.timeout(180)

WORKER_TIMEOUT_S = 3
HANG_SAMPLE = 5  # not sample 0: a worker runs the callable on sample 0 when it boots
# As a read on a hung NFS mount: blocked in a call that releases the GIL, the heartbeat beats on.
RELEASES_THE_GIL = "time.sleep(3600)"
# Catastrophic backtracking: C code that never lets the GIL go, so no heartbeat at all.
HOLDS_THE_GIL = 're.match(r"(a+)+$", "a" * 64 + "b")'

# A [pipeline] callable that blocks on one sample, once or every time.
HANGING_PIPELINE = """
import re
import time
from pathlib import Path

import numpy as np

MARKER = Path(__file__).with_name("hung-once")

def make(source, rng):
    if source["index"] == {sample} and ({always} or not MARKER.exists()):
        MARKER.touch()
        {block}
    return {{"pixels": np.full(8, source["index"], np.int16) + rng.integers(0, 100, 8).astype(np.int16)}}
"""

# Kills its own worker (SIGKILL) once, at the one point where a batch is published and not yet
# reported: producer.produce links tmp/<batch>.<pid> into batches/, then removes the tmp name in
# its `finally`, then the worker sends "done". The audit hook runs just before that removal.
KILLED_AFTER_LINK_PIPELINE = """
import os
import signal
import sys
from pathlib import Path

import numpy as np

JOB_DIR = Path({job_dir!r})
MARKER = Path(__file__).with_name("killed-after-link")

def _kill_between_link_and_report(event, args):
    if event != "os.remove" or MARKER.exists():
        return
    name, _, pid = os.path.basename(os.fsdecode(args[0])).rpartition(".")
    if pid == str(os.getpid()) and (JOB_DIR / "batches" / name).exists():
        MARKER.write_text(name)
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(_kill_between_link_and_report)

def make(source, rng):
    return {{"pixels": np.full(8, source["index"], np.int16) + rng.integers(0, 100, 8).astype(np.int16)}}
"""


def pipeline_job(tmp_path, data, monkeypatch, module: str, code: str, name: str = "job"):
    """A job config whose samples come from ``module:make``, written into tmp_path, where the
    workers import it from: a daemon's through PYTHONPATH, which reaches it through `start`; an
    in-process master's through this process's sys.path, which multiprocessing hands each worker
    it forks (the worker server's own environment was fixed when it first started)."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(code))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[job]\nname = "{name}"\nbatch_size = 4\n[daemon]\nworkers = 1\n'
        f'[[source]]\nkind = "image_folder"\nroot = "{data}"\n[pipeline]\ncallable = "{module}:make"\n'
    )
    return config


def digests(batches: list[ReadBatch]) -> list[tuple[int, int, str]]:
    """(epoch, step, digest) per batch: two streams are equal when their batches' bytes are."""
    return [(b.epoch, b.step, digest(b.arrays)) for b in batches]


def file_bytes(paths) -> int:
    """Bytes the job's files hold on the tmpfs: the blocks of each distinct inode in batches/,
    tmp/ and retired/ (a batch linked from tmp/ into batches/ is one inode, counted once)."""
    blocks = {}
    for folder in (paths.batch_dir, paths.tmp_dir, paths.retired_dir):
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            blocks[st.st_ino] = st.st_blocks * 512
    return sum(blocks.values())


class FileBytesSampler:
    """Samples ``file_bytes`` every few milliseconds in a thread, for as long as it is entered."""

    def __init__(self, paths, interval_s: float = 0.005):
        self.paths, self.interval_s = paths, interval_s
        self.peak, self.samples = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="file-bytes-sampler")

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, file_bytes(self.paths))
            self.samples += 1

    def __enter__(self) -> FileBytesSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def wait_buffer_full(paths) -> dict:
    """The status once the daemon has filled the bound and has nothing in flight."""

    def full():
        s = job_status(paths)
        buf = s["buffer"]
        return s if s["workers"]["busy"] == 0 and buf["used_bytes"] + buf["batch_bytes"] > buf["bound_bytes"] else None

    return wait_until(full, timeout_s=30, what="the buffer full and no batch in flight")


def files_of_pids(paths, pids) -> list[str]:
    suffixes = tuple(f".{pid}" for pid in pids)
    return [name for name in os.listdir(paths.tmp_dir) if name.endswith(suffixes)] if suffixes else []


@pytest.mark.parametrize(
    "block, killed_as",
    [
        (RELEASES_THE_GIL, ["finished no sample of batch e0 s", f"(last seen at sample {HANG_SAMPLE}, "]),
        (HOLDS_THE_GIL, ["silent for"]),  # as before liveness meant progress
    ],
    ids=["releasing-the-gil", "holding-the-gil"],
)
def test_a_worker_blocked_on_a_sample_is_killed_and_its_batch_reissued_to_the_trainer(
    tmp_path, jpeg_folder, serve, monkeypatch, block, killed_as
):
    code = HANGING_PIPELINE.format(sample=HANG_SAMPLE, always=False, block=block)
    config = pipeline_job(tmp_path, jpeg_folder, monkeypatch, "hangs_once", code)
    job = serve(config, {"worker_timeout": float(WORKER_TIMEOUT_S)})
    paths = job.paths
    started = time.monotonic()
    got = digests(read_epoch("job", timeout=40))
    took = time.monotonic() - started
    assert (tmp_path / "hung-once").exists(), "the callable never blocked: the test proved nothing"
    log = paths.log.read_text()
    assert all(words in log for words in killed_as), log
    assert job_status(paths)["workers"]["restarts"] == 1
    job.stop()
    # The same job with nothing blocking (the marker exists now): the trainer got every batch, equal.
    serve(pipeline_job(tmp_path, jpeg_folder, monkeypatch, "hangs_once", code, name="ref"))
    assert got == digests(read_epoch("ref", timeout=40))
    print(f"\n[figure] a sample blocked ({block}), --worker-timeout {WORKER_TIMEOUT_S}: epoch read in {took:.1f} s")


def test_a_sample_that_blocks_every_time_stops_the_daemon_with_a_message_naming_the_batch(
    tmp_path, jpeg_folder, serve, monkeypatch
):
    code = HANGING_PIPELINE.format(sample=HANG_SAMPLE, always=True, block=RELEASES_THE_GIL)
    config = pipeline_job(tmp_path, jpeg_folder, monkeypatch, "hangs_always", code)
    job = serve(config, {"worker_timeout": float(WORKER_TIMEOUT_S)})
    paths = job.paths
    started = time.monotonic()
    with pytest.raises(DaemonDied) as stopped:
        read_epoch("job", timeout=50)  # the trainer must hear why, long before its own timeout
    took = time.monotonic() - started
    message = str(stopped.value)
    assert f"made no progress within --worker-timeout {WORKER_TIMEOUT_S} s, 3 times" in message
    assert f"(last seen at sample {HANG_SAMPLE}, {jpeg_folder}" in message and "raise --worker-timeout" in message
    assert took < 40
    stop = job.wait_stopped(10)  # the master stopped itself, for the reason the trainer heard
    assert stop.exit_code == ExitCode.TASK_ERROR and str(stop) in message
    assert not daemon_alive(paths)
    assert sorted(p.name for p in paths.dir.iterdir()) == ["daemon.lock", "daemon.log", "stopped.json"]
    assert "Traceback" not in paths.log.read_text()
    print(f"\n[figure] a sample that always blocks: the daemon stopped after 3 attempts, {took:.1f} s")


def test_killed_workers_leave_no_temporary_file_and_the_files_never_exceed_the_bound(tmp_path, jpeg_folder, serve):
    config = write_config(tmp_path, jpeg_folder, batch_size=4, workers=2, buffer="200K", seed=5)
    paths = serve(config, {"max_worker_restarts": 1000}).paths
    rng = np.random.default_rng(1)
    killed: list[int] = []
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    with FileBytesSampler(paths) as sampler:
        # Epochs until the sampler has watched long enough: workers forked from the worker
        # server are replaced in milliseconds, so two epochs can pass in well under a second.
        for epoch in range(50):
            if epoch >= 2 and sampler.samples > 100 and len(killed) >= 10:
                break
            for _batch in loader:
                live = workers_of(paths)
                if live:  # kill -9 a worker, most likely mid-batch
                    victim = live[rng.integers(len(live))]
                    try:
                        victim.kill()
                        killed.append(victim.pid)
                    except psutil.NoSuchProcess:
                        pass
        wait_until(lambda: not files_of_pids(paths, killed), what="the killed workers' tmp files swept")
        final = wait_buffer_full(paths)
    loader.close()
    bound = final["buffer"]["bound_bytes"]
    assert len(killed) >= 10
    assert sampler.samples > 100 and sampler.peak <= bound
    assert final["buffer"]["files_bytes"] <= bound
    assert file_bytes(paths) <= final["buffer"]["used_bytes"]  # nothing on the tmpfs the ledger misses
    print(
        f"\n[figure] {len(killed)} worker kill -9s: 0 stray tmp files, peak {sampler.peak} of {bound} bytes "
        f"over {sampler.samples} samples"
    )


def test_a_batch_published_by_a_worker_killed_before_reporting_it_is_counted_not_orphaned(
    tmp_path, jpeg_folder, job_root, serve, monkeypatch
):
    code = KILLED_AFTER_LINK_PIPELINE.format(job_dir=str(job_root / "job"))
    ref = serve(pipeline_job(tmp_path, jpeg_folder, monkeypatch, "killed_after_link", code, name="ref"))
    batch_bytes = read_manifest(ref.paths)["batch_bytes"]
    expected = digests(read_epoch("ref", epochs=2, timeout=40))
    ref.stop()
    # A bound of exactly ten batches: a single batch that the ledger misses is over it.
    bound = 10 * batch_bytes
    config = pipeline_job(tmp_path, jpeg_folder, monkeypatch, "killed_after_link", code)
    paths = serve(config, {"buffer": str(bound)}).paths
    with FileBytesSampler(paths) as sampler:
        got = digests(read_epoch("job", epochs=2, timeout=40))
        final = wait_buffer_full(paths)
    killed_after = (tmp_path / "killed-after-link").read_text()  # the kill did land in the window
    assert got == expected  # the batch reached the trainer once, nothing lost or repeated
    assert sampler.peak <= bound and file_bytes(paths) <= final["buffer"]["used_bytes"]
    assert final["buffer"]["files_bytes"] <= bound
    assert os.listdir(paths.tmp_dir) == []  # its tmp name, a second link to the batch, is swept
    assert "but died before reporting it" in paths.log.read_text()
    print(f"\n[figure] worker killed between publishing {killed_after} and its report; peak {sampler.peak} <= {bound}")
