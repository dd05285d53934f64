"""Exact resume, in the style of torchdata's resume tests: one helper compares an
uninterrupted run with an interrupted-and-resumed one, byte for byte, over a grid of stop
points, worker counts, world sizes and daemon restarts; elastic resume checks coverage."""

from __future__ import annotations

import json

import pytest

from prefetchd.plan import Plan
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import parse_batch_name
from tests.batchdigest import digest
from tests.conftest import write_config

pytestmark = pytest.mark.timeout(300)
EPOCHS = 2
SAMPLES = 48  # the jpeg_folder fixture


def read(job: str, rank: int, world: int, *, state=None, stop_after=None, epochs=EPOCHS):
    """(list of (epoch, step, digest) per batch, state after the last one read)."""
    loader = PrefetchLoader(job, rank=rank, world_size=world, as_tensors=False, timeout=60)
    if state is not None:
        loader.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would carry it
    seen = []
    while len(seen) != stop_after and loader.position[0] < epochs:
        epoch, first = loader.position
        for step, batch in enumerate(loader, start=first):
            seen.append((epoch, step, digest(batch)))
            if len(seen) == stop_after:
                break
    state = loader.state_dict()
    loader.close()
    return seen, state


def assert_resume_matches(job: str, world: int, stop_after: int, restart=None) -> None:
    """``restart()``, when given, stops the job's master and starts a new one between the two reads."""
    for rank in range(world):
        reference, _ = read(job, rank, world)
        first, state = read(job, rank, world, stop_after=stop_after)
        if restart is not None:
            restart()
        rest, _ = read(job, rank, world, state=state)
        assert first + rest == reference, f"rank {rank}: resumed stream differs (stop after {stop_after})"


@pytest.mark.parametrize("workers, world", [(1, 1), (3, 2)])
def test_resume_is_exact_over_stop_points(tmp_path, jpeg_folder, serve, workers, world):
    serve(write_config(tmp_path, jpeg_folder, name="grid", world_size=world, workers=workers, batch_size=4, seed=3))
    per_epoch = SAMPLES // (4 * world)
    for stop_after in sorted({0, 1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch - 1}):
        assert_resume_matches("grid", world, stop_after)


@pytest.mark.parametrize("workers, world", [(3, 1), (1, 2)])
def test_resume_is_exact_across_a_daemon_restart(tmp_path, jpeg_folder, serve, workers, world):
    config = write_config(tmp_path, jpeg_folder, name="grid", world_size=world, workers=workers, batch_size=4, seed=3)
    jobs = [serve(config)]

    def restart():  # as `prefetchd stop` then `prefetchd start`: the job folder goes, a new master builds it
        jobs[-1].stop()
        jobs.append(serve(config))

    per_epoch = SAMPLES // (4 * world)
    for stop_after in (per_epoch // 2, per_epoch):  # mid-epoch, and exactly at the boundary
        assert_resume_matches("grid", world, stop_after, restart)


def test_worker_count_does_not_change_a_byte(tmp_path, jpeg_folder, serve):
    streams = []
    for workers in (1, 3):
        serve(write_config(tmp_path, jpeg_folder, name=f"w{workers}", workers=workers, seed=9))
        streams.append(read(f"w{workers}", 0, 1, epochs=1)[0])
    assert streams[0] == streams[1]


def test_state_is_rank_invariant_and_tiny(tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, name="ri", world_size=2, batch_size=4))
    states = [read("ri", rank, 2, stop_after=3)[1] for rank in range(2)]
    assert states[0] == states[1]
    assert len(json.dumps(states[0])) < 400


def consumed_ids(job, world, rank, state=None, stop_after=None):
    """Sample ids this rank read, per batch."""
    loader = PrefetchLoader(job, rank=rank, world_size=world, as_tensors=False, timeout=60)
    if state:
        loader.load_state_dict(state)
    ids = []
    for batch in loader:
        ids.append(batch["index"].tolist())
        if len(ids) == stop_after:
            break
    state = loader.state_dict()
    loader.close()
    return ids, state


@pytest.mark.parametrize("new_world, new_batch", [(2, 4), (4, 2)])
def test_elastic_resume_with_the_same_global_batch_loses_and_repeats_nothing(
    tmp_path, jpeg_folder, serve, new_world, new_batch
):
    job = serve(write_config(tmp_path, jpeg_folder, name="e1", world_size=1, batch_size=8, seed=4))
    before, state = consumed_ids("e1", 1, 0, stop_after=2)  # 16 of 48 samples of epoch 0
    job.stop()
    serve(write_config(tmp_path, jpeg_folder, name="e1", world_size=new_world, batch_size=new_batch, seed=4))
    after = [consumed_ids("e1", new_world, r, state=state)[0] for r in range(new_world)]
    epoch0 = sum(before, []) + sum((sum(a, []) for a in after), [])
    assert sorted(epoch0) == list(range(SAMPLES)), "a sample was lost or repeated across the change"
    assert {len(a) for a in after} == {(SAMPLES - 16) // (new_world * new_batch)}  # ranks stay equal
    # and it is the same permutation, continued at the same offset
    perm = Plan(SAMPLES, 1, 8, seed=4).epoch_order(0)[0]
    assert sum(before, []) == perm[:16].tolist()


def test_elastic_resume_with_another_global_batch_repeats_less_than_one_global_batch(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder, name="e2", world_size=1, batch_size=4, seed=4))
    before, state = consumed_ids("e2", 1, 0, stop_after=3)  # 12 samples
    job.stop()
    serve(write_config(tmp_path, jpeg_folder, name="e2", world_size=2, batch_size=5, seed=4))  # global 10
    after = [consumed_ids("e2", 2, r, state=state)[0] for r in range(2)]
    seen = sum(before, []) + sum((sum(a, []) for a in after), [])
    repeated = len(seen) - len(set(seen))
    assert 0 < repeated < 10  # resumes at step 1 (samples 10..): samples 10 and 11 come twice
    assert set(seen) >= set(Plan(SAMPLES, 2, 5, seed=4).epoch_order(0)[0][: 10 * 4].tolist())


def test_warm_restart_finds_retained_batches_ready(tmp_path, jpeg_folder, serve):
    """A trainer that restarts from a checkpoint two steps back finds those batches in the buffer."""
    paths = serve(write_config(tmp_path, jpeg_folder, name="warm", batch_size=4, seed=2)).paths
    _, checkpoint = consumed_ids("warm", 1, 0, stop_after=4)
    consumed_ids("warm", 1, 0, state=checkpoint, stop_after=2)  # the "crashed" run got 2 steps further
    names = {parse_batch_name(p.name)[:2] for p in paths.batch_dir.iterdir()}
    assert {(0, 4), (0, 5)} <= names, "the two retained batches behind the crash point were deleted"
