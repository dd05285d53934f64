"""A daemon per node: each serves its node's ranks (--ranks) of one global plan. Two daemons
under two roots stand for two nodes; four trainer processes read through them. Their streams
must equal, byte for byte, those of one daemon serving all four ranks, and a checkpoint of the
two-node run must resume exactly on one node."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from prefetchd.settings import parse_resources
from prefetchd_client import PrefetchLoader
from prefetchd_client.errors import PlanMismatch
from prefetchd_client.layout import JobPaths
from prefetchd_client.ranks import format_ranks, parse_ranks
from tests.conftest import REPO, cli, start_job, write_config
from tests.daemon.peers.test_intake import refused, send_raw
from tests.helpers import job_status

pytestmark = pytest.mark.timeout(300)
WORLD = 4
EPOCHS = 2

# One trainer rank, in its own process: its (epoch, step, digest) stream and its state_dict.
_TRAINER = textwrap.dedent("""
    import json, sys
    from prefetchd_client import PrefetchLoader
    from tests.batchdigest import digest  # the trainer runs in the repository's folder, as pytest does

    job, root, rank, world, stop_after, epochs, state = json.loads(sys.argv[1])
    loader = PrefetchLoader(job, root=root, rank=rank, world_size=world, as_tensors=False, timeout=60)
    if state is not None:
        loader.load_state_dict(state)
    seen = []
    while len(seen) != stop_after and loader.position[0] < epochs:
        epoch, first = loader.position
        for step, batch in enumerate(loader, start=first):
            seen.append([epoch, step, digest(batch)])
            if len(seen) == stop_after:
                break
    print(json.dumps({"seen": seen, "state": loader.state_dict()}))
    loader.close()
""")


def run_trainers(job: str, root_of_rank, *, stop_after=None, state=None) -> list[dict]:
    """Every rank's trainer at once, each a process reading through the daemon of its node."""
    args = lambda r: json.dumps([job, str(root_of_rank(r)), r, WORLD, stop_after, EPOCHS, state])  # noqa: E731
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TRAINER, args(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,  # where `tests.daemon.resume.test_resume` imports from
        )
        for r in range(WORLD)
    ]
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"trainer of rank {rank} failed:\n{err}"
        results.append(json.loads(out))
    return results


@pytest.mark.heavy
def test_two_nodes_make_the_batches_one_node_makes_and_resume_on_one(node_roots, jpeg_folder, tmp_path, serve):
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2, workers=1, buffer="2M")
    one, two = node_roots
    # One node serving all four ranks: the reference streams, and where the checkpoint resumes.
    single = serve(config)
    reference = [r["seen"] for r in run_trainers("job", lambda r: one)]
    assert all(len(seen) == EPOCHS * 6 for seen in reference)  # 48 samples / (4 ranks x 2) per epoch
    single.stop()

    # Two nodes: ranks 0-1 under one root, 2-3 under the other; the same config otherwise.
    jobs = serve(config, {"ranks": "0-1"}), serve(config, {"ranks": "2,3"}, root=two)
    node_a, node_b = (job.paths for job in jobs)
    for paths, served in ((node_a, "0-1"), (node_b, "2-3")):
        status = job_status(paths)
        assert status["served_ranks"] == served and [r["rank"] for r in status["ranks"]] == [
            int(r) for r in served.replace("-", ",").split(",")
        ]
    root_of = lambda r: one if r < 2 else two  # noqa: E731
    first = run_trainers("job", root_of, stop_after=5)
    states = [r["state"] for r in first]
    assert all(s == states[0] for s in states), "state_dict() must be the same on every rank"
    rest = run_trainers("job", root_of, state=states[0])
    for rank in range(WORLD):
        assert first[rank]["seen"] + rest[rank]["seen"] == reference[rank], f"rank {rank} differs from one node"
    # Each node made only its own ranks' batches.
    for paths, mine in ((node_a, {0, 1}), (node_b, {2, 3})):
        produced = {int(name.split("-r")[1][:4]) for name in (p.name for p in paths.batch_dir.iterdir())}
        assert produced <= mine, f"{paths.dir} made batches of ranks {produced - mine}"

    # The checkpoint of the two-node run, resumed on one node serving all four ranks.
    for job in jobs:
        job.stop()
    serve(config)
    resumed = run_trainers("job", lambda r: one, state=states[0])
    for rank in range(WORLD):
        assert first[rank]["seen"] + resumed[rank]["seen"] == reference[rank], f"rank {rank}: resume on one node"


def test_a_rank_another_node_serves_is_told_which_ranks_this_node_serves(job_root, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2)
    start_job(config, "--ranks", "2-3")
    with pytest.raises(PlanMismatch, match=r"rank 0 is not served .* it serves ranks 2-3 of 4 \(--ranks\)"):
        PrefetchLoader("job", rank=0, world_size=WORLD, timeout=10)
    loader = PrefetchLoader("job", rank=3, world_size=WORLD, timeout=30, as_tensors=False)
    assert next(iter(loader))["index"].shape == (2,)
    loader.close()
    # A position for a rank this node does not serve, by message or progress file: refused and counted.
    paths = JobPaths.of("job")
    send_raw(paths, b'{"op": "position", "rank": 0, "epoch": 0, "step": 3}')
    refused(paths, "position")
    (paths.progress_dir / "rank-1").write_text("0 2")
    status = refused(paths, "position", at_least=2)
    assert [r["rank"] for r in status["ranks"]] == [2, 3]
    shown = cli("status", "job")
    assert shown.returncode == 0 and "ranks 2-3 of 4" in shown.stdout, shown.stdout


@pytest.mark.parametrize(
    "ranks, why",
    [
        ("0-4", "goes past the world: world_size is 4"),
        ("3-1", "runs backwards"),
        ("1,1", "given twice"),
        ("a-b", "expected a range A-B or a comma list"),
        ("", "expected a range A-B or a comma list"),
        ("0-99999999999", "expected a range"),
    ],
)
def test_bad_ranks_are_refused_with_the_flag_named(ranks, why, job_root, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD)
    result = cli("start", str(config), "--ranks", ranks)
    assert result.returncode == 2, result.stderr
    assert "--ranks" in result.stderr and why in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not any(job_root.iterdir()), "a refused start leaves nothing behind"


@pytest.mark.parametrize(
    "value, expected",
    [("8-15", tuple(range(8, 16))), ("0,2,5", (0, 2, 5)), ("0-3, 8-9", (0, 1, 2, 3, 8, 9)), ([3, 1], (1, 3))],
)
def test_ranks_forms(value, expected):
    assert parse_ranks(value) == expected
    assert parse_ranks(format_ranks(expected)) == expected


@pytest.mark.parametrize(
    "value",
    ["", ",", "1,,2", "0--3", "-1", "3-1", "1,1", "²", "٣", "0-" + "9" * 5000, [True], [1.0], [[1]], [], {"a": 1}],
)
def test_ranks_that_are_not_ranks_are_refused(value):
    with pytest.raises(ValueError):
        parse_ranks(value)


@pytest.mark.parametrize(
    "value, why",
    [
        ("prep", "NAME=AMOUNT"),
        ("=1", "NAME=AMOUNT"),
        ("prep=x", "not a number"),
        ("prep=nan", "positive number"),
        ("prep=-1", "positive number"),
        ("prep=1.5", "whole number"),
        ("CPU=1", "not a custom resource"),
        ({"prep": {"nested": 1}}, "positive number"),
        ({"prep": True}, "positive number"),
    ],
)
def test_ray_resources_ray_would_refuse_are_refused_first(value, why):
    with pytest.raises(ValueError, match=why):
        parse_resources(value)
