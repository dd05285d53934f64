"""What the client and the CLI read from a job folder is peer input too: a folder someone else
can change above the root, hostile manifest values, planted FIFOs and locks, hostile states.
Each case is a clear error (or no effect), never a traceback, a hang or another's data."""

from __future__ import annotations

import fcntl
import json
import os
import threading

import pytest
import zmq

from prefetchd.workers.spec import SPEC_VERSION
from prefetchd_client import (
    BatchLayout,
    BatchWriter,
    FieldSpec,
    JobNotRunning,
    PlanMismatch,
    PrefetchLoader,
    UnsafeFolder,
)
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import MANIFEST_VERSION
from tests.conftest import cli

pytestmark = pytest.mark.timeout(60)

MANIFEST = {
    "manifest_version": MANIFEST_VERSION,
    "format_version": 2,
    "job": "job",
    "config_hash": "0123456789abcdef",
    "plan_digest": "fedcba9876543210",
    "config": {"seed": 0},
    "num_samples": 48,
    "batches_per_epoch": 6,
    "world_size": 2,
    "ranks": [0, 1],
    "batch_size": 4,
    "global_batch": 8,
    "drop_last": True,
    "fields": [],
    "batch_bytes": 4096,
    "buffer_bytes": 1 << 20,
    "window_per_rank": 4,
    "retain": 2,
    "workers": 1,
    "pid": os.getpid(),
    "curve_public_key": None,
    "started_at": 0.0,
}


@pytest.fixture
def fake_job(job_root):
    """A job folder whose lock this test holds: to the client, a live daemon's folder."""
    paths = JobPaths(job_root / "job")
    for folder in (paths.dir, paths.trainers_dir, paths.batch_dir):
        folder.mkdir(mode=0o700)
    lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)

    def write_manifest(**changes) -> JobPaths:
        paths.manifest.write_text(json.dumps({**MANIFEST, "endpoint": paths.endpoint, **changes}))
        return paths

    yield write_manifest
    os.close(lock)


def test_a_root_under_a_folder_others_can_change_is_refused(tmp_path, jpeg_folder):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could rename the root away and put theirs there
    root = shared / "root"
    result = cli("start", "--data", str(jpeg_folder), "--root", str(root), "--buffer", "1M", "--workers", "1")
    assert result.returncode == 4, result.stderr
    assert "another user can change" in result.stderr and "Traceback" not in result.stderr
    assert not root.exists()
    root.mkdir(mode=0o700)
    with pytest.raises(UnsafeFolder, match="another user can change"):
        PrefetchLoader("job", root=root)


@pytest.mark.parametrize(
    "changes",
    [
        {"batches_per_epoch": 2**70},
        {"world_size": 10**5},
        {"pid": 2**40},
        {"endpoint": "tcp://*:5555"},
        {"global_batch": -8},
    ],
    ids=["huge-steps", "huge-world", "huge-pid", "bind-address", "negative"],
)
def test_manifest_values_outside_what_a_daemon_writes_are_refused(fake_job, changes):
    paths = fake_job(**changes)
    with pytest.raises(JobNotRunning, match="no usable manifest"):
        PrefetchLoader("job", rank=0, world_size=2, root=paths.dir.parent)


def test_a_folder_named_manifest_is_no_manifest(fake_job):
    paths = fake_job()
    paths.manifest.unlink()
    paths.manifest.mkdir()
    with pytest.raises(JobNotRunning):
        PrefetchLoader("job", rank=0, world_size=2, root=paths.dir.parent)


def test_a_fifo_as_the_log_of_a_stopped_job_does_not_block_the_loader(job_root):
    paths = JobPaths(job_root / "job")
    paths.dir.mkdir(mode=0o700)
    os.mkfifo(paths.log)  # the loader reads the log of a stopped daemon to say why it stopped
    with pytest.raises(JobNotRunning):
        PrefetchLoader("job", root=job_root)


def test_a_trainer_lock_held_exclusively_by_another_process_does_not_hang_the_loader(fake_job):
    paths = fake_job()
    fd = os.open(paths.trainer_lock(0), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: conflicts like another process's lock
    try:
        loader = PrefetchLoader("job", rank=0, world_size=2, root=paths.dir.parent, as_tensors=False)
        loader.close()
    finally:
        os.close(fd)


def loader_of(fake_job) -> PrefetchLoader:
    paths = fake_job()
    return PrefetchLoader("job", rank=0, world_size=2, root=paths.dir.parent, as_tensors=False)


@pytest.mark.parametrize("config", [["seed"], "seed", 3, None])
def test_a_state_whose_config_is_not_an_object_is_a_plan_mismatch(fake_job, config):
    loader = loader_of(fake_job)
    try:
        state = {**loader.state_dict(), "config_hash": "another", "config": config}
        with pytest.raises(PlanMismatch, match="another config"):
            loader.load_state_dict(state)
    finally:
        loader.close()


def test_positions_outside_every_plan_are_refused_at_once(fake_job):
    loader = loader_of(fake_job)
    try:
        for epoch in (-1, 10**6):
            with pytest.raises(ValueError, match="epochs are 0"):
                loader.set_epoch(epoch)
        with pytest.raises(PlanMismatch, match="bad position"):
            loader.load_state_dict({**loader.state_dict(), "epoch": 10**6})
    finally:
        loader.close()


def test_a_state_saved_right_after_an_elastic_load_keeps_the_exact_offset(fake_job):
    loader = loader_of(fake_job)  # global batch 8
    try:
        loader.load_state_dict({**loader.state_dict(), "epoch": 1, "samples_consumed": 12})
        assert loader.position == (1, 1)  # the step holding sample 12
        # Saved again before reading on (a checkpoint at once): still 12, not 8, so a chain of
        # elastic resumes does not repeat a global batch each time.
        assert loader.state_dict()["samples_consumed"] == 12
        loader.set_epoch(0)
        assert loader.state_dict()["samples_consumed"] == 0
    finally:
        loader.close()


def test_set_epoch_before_loading_a_finished_state_does_not_replay_the_next_epoch(fake_job):
    """A loop that sets its epoch, then restores the loader from a state saved after that
    epoch's last batch, reads nothing more of it; then the next epoch, once."""
    loader = loader_of(fake_job)
    try:
        loader.set_epoch(1)
        loader.load_state_dict({**loader.state_dict(), "epoch": 2, "samples_consumed": 0})
        assert list(loader) == []  # epoch 1's rest: nothing; no batch is waited for
        loader.set_epoch(2)
        assert loader.position == (2, 0)
    finally:
        loader.close()


def test_status_of_a_daemon_with_an_unexpected_reply_is_no_traceback(fake_job):
    paths = fake_job()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(paths.endpoint)
    stop = threading.Event()

    def answer_nonsense():
        while not stop.is_set():
            if router.poll(50):
                peer, _ = router.recv_multipart()
                router.send_multipart([peer, b"{}"])

    thread = threading.Thread(target=answer_nonsense)
    thread.start()
    try:
        result = cli("status", "job", env={"PREFETCHD_ROOT": str(paths.dir.parent)}, timeout=30)
    finally:
        stop.set()
        thread.join()
        router.close(0)
        context.term()
    assert "Traceback" not in result.stderr and "not what prefetchd sends" in result.stdout


@pytest.mark.parametrize("spec", ["[]", '{"job_dir": 1}', "[" * 50000, None], ids=["list", "fields", "nested", "fifo"])
def test_verify_of_a_hostile_producer_spec_is_a_clear_error(fake_job, spec):
    paths = fake_job()
    target = paths.dir / "producer.json"
    if spec is None:
        os.mkfifo(target)
    else:
        target.write_text(spec)
    env = {"PREFETCHD_ROOT": str(paths.dir.parent)}
    result = cli("verify", "job", "--epoch", "0", "--step", "0", env=env, timeout=30)
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr and "producer.json" in result.stderr


def test_verify_with_a_missing_index_is_a_clear_error(fake_job):
    paths = fake_job()
    spec = {"job_dir": str(paths.dir), "plan": {"num_samples": 48, "world_size": 2, "batch_size": 4}}
    (paths.dir / "producer.json").write_text(
        json.dumps(
            spec
            | {"source_names": ["s"], "transforms": [], "pipeline": None, "config_hash": "x", "version": SPEC_VERSION}
        )
    )
    layout = BatchLayout.plan([FieldSpec("index", "int64", (4,))])
    writer = BatchWriter(paths.batch(0, 0, 0), layout)
    writer.finish(0, 0, 0, {"config_hash": "x"})
    result = cli("verify", "job", "--epoch", "0", "--step", "0", env={"PREFETCHD_ROOT": str(paths.dir.parent)})
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    assert "cannot remake" in result.stderr
