"""One job, several trainers (a consumer each: PrefetchLoader(job, consumer=...)) with real
daemons and real loaders: every batch made once for all of them and freed once they all passed
it, a consumer far behind served on demand without holding the others back, the bound held,
resume per consumer exact, a killed consumer's place freed after --consumer-timeout while the
others go on, status showing each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import MAX_CONSUMERS, parse_batch_name, write_progress
from prefetchd_client.manifest import read_manifest
from tests.batchdigest import digest
from tests.conftest import wait_until, write_config
from tests.daemon.peers.test_intake import send_raw
from tests.helpers import job_status

pytestmark = pytest.mark.timeout(120)

STEPS = 12  # the jpeg_folder's 48 images in batches of 4
BUFFER = "160K"  # ~9 batches of 4 x 32 x 32 x 3: windows far shorter than the run, so batches are deleted


def batch_indices(paths) -> list[int]:
    """Linear indices (epoch * STEPS + step) of the published batches of rank 0."""
    names = filter(None, map(parse_batch_name, os.listdir(paths.batch_dir)))
    return sorted(e * STEPS + s for e, s, r in names if r == 0)


def consumers(paths) -> dict[str, dict]:
    return {c["consumer"]: c for c in job_status(paths)["ranks"][0]["consumers"]}


def test_two_trainers_in_step_share_every_batch_made_once(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, buffer=BUFFER)).paths
    bound = job_status(paths)["buffer"]["bound_bytes"]
    a = PrefetchLoader("job", as_tensors=False, consumer="a", timeout=30)
    b = PrefetchLoader("job", as_tensors=False, consumer="b", timeout=30)
    read = {"a": [], "b": []}
    for _ in range(3):  # three epochs, b a step behind a
        batches_a, batches_b = iter(a), iter(b)
        read["a"].append(digest(next(batches_a)))
        for batch_a in batches_a:
            read["b"].append(digest(next(batches_b)))
            read["a"].append(digest(batch_a))
        read["b"].append(digest(next(batches_b)))
        assert next(batches_b, None) is None
    assert read["a"] == read["b"] and len(read["a"]) == 3 * STEPS
    at_end = {"a": (3, 0, False), "b": (3, 0, False)}
    wait_until(
        lambda: {k: (v["epoch"], v["step"], v["lagging"]) for k, v in consumers(paths).items()} == at_end,
        what="both consumers seen at the end, neither lagging",
    )

    def made_once():  # those read, and those of the window ahead: none remade
        produced = job_status(paths)["totals"]["produced"]
        return produced == 3 * STEPS + len([i for i in batch_indices(paths) if i >= 3 * STEPS])

    wait_until(made_once, what="every batch made once")  # a batch published, not yet counted: not equal for a moment
    status = job_status(paths)
    assert status["ranks"][0]["consumed"] == 2 * 3 * STEPS  # read by each
    assert status["buffer"]["peak_bytes"] <= bound
    a.close()
    b.close()


def test_a_consumer_far_behind_is_served_on_demand_and_the_leader_is_not_held_back(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, buffer=BUFFER)).paths
    window = read_manifest(paths)["window_per_rank"]
    lead = PrefetchLoader("job", as_tensors=False, consumer="lead", timeout=30)
    first = [digest(batch) for batch in lead]  # a whole epoch: far past the window
    late = PrefetchLoader("job", as_tensors=False, consumer="late", timeout=30)
    late_batches = iter(late)
    assert digest(next(late_batches)) == first[0]  # remade on demand
    wait_until(lambda: consumers(paths)["late"]["lagging"], what="the late consumer seen lagging")
    # The leader's window is its own: it reads a whole epoch more while the late one stays put.
    lead_batches = iter(lead)
    for _ in range(STEPS):
        next(lead_batches)
    wait_until(lambda: len([i for i in batch_indices(paths) if i >= 2 * STEPS]) >= window - 3, what="lead refilled")
    kept_for_late = [i for i in batch_indices(paths) if i < STEPS]
    assert kept_for_late and max(kept_for_late) <= 2, kept_for_late  # its next two at most, not a window
    assert [digest(batch) for batch in late_batches] == first[1:]  # the same batches, made again
    buffer = job_status(paths)["buffer"]
    assert buffer["peak_bytes"] <= buffer["bound_bytes"]
    lead.close()
    late.close()


def test_resume_per_consumer_is_exact(tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, buffer=BUFFER))
    whole = PrefetchLoader("job", as_tensors=False, consumer="whole", timeout=30)
    reference = [digest(batch) for _ in range(2) for batch in whole]  # two epochs, uninterrupted
    first = PrefetchLoader("job", as_tensors=False, consumer="resumed", timeout=30)
    batches = iter(first)
    head = [digest(next(batches)) for _ in range(7)]
    state = first.state_dict()
    first.close()
    again = PrefetchLoader("job", as_tensors=False, consumer="resumed", timeout=30)
    again.load_state_dict(state)
    rest = [digest(batch) for _ in range(2) for batch in again][: 2 * STEPS - 7]
    assert head + rest == reference
    whole.close()
    again.close()


KILLED_TRAINER = textwrap.dedent("""\
    import sys, time
    from prefetchd_client import PrefetchLoader
    loader = PrefetchLoader("job", as_tensors=False, consumer="killed", timeout=30)
    batches = iter(loader)
    next(batches)
    print("read", flush=True)
    time.sleep(600)
""")


def test_a_killed_consumer_is_freed_after_its_timeout_while_the_others_go_on(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder, buffer=BUFFER), {"consumer_timeout": 2})
    paths = job.paths
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "read"
        wait_until(lambda: consumers(paths).get("killed", {}).get("trainer") == "alive", what="killed seen alive")
        survivor = PrefetchLoader("job", as_tensors=False, consumer="survivor", timeout=30)
        survived = iter(survivor)
        next(survived)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: consumers(paths)["killed"]["trainer"] == "gone", what="killed seen gone")
        assert sum(1 for _ in survived) == STEPS - 1  # the other goes on meanwhile
        # after --consumer-timeout its place is released and its name forgotten (on_trainer_exit keep)
        wait_until(lambda: "killed" not in consumers(paths), timeout_s=10, what="the killed consumer forgotten")
        assert all(i >= STEPS - 2 for i in batch_indices(paths))  # nothing kept for it at step 1
        assert "the trainer of rank 0 of consumer 'killed' is gone (keep its window)" in paths.log.read_text()
        survivor.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_consumer_names_are_checked_and_their_number_bounded(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, buffer=BUFFER)).paths
    for bad in ("a.b", "../x", "x" * 33, "é", "-a", 5):
        with pytest.raises(ValueError, match="invalid consumer name"):
            PrefetchLoader("job", as_tensors=False, consumer=bad)
    # A peer that names consumers by the dozen: the first MAX_CONSUMERS are kept, the rest refused.
    position = {"op": "position", "rank": 0, "epoch": 0, "step": 0}
    named = [json.dumps({**position, "consumer": f"c{i}"}).encode() for i in range(MAX_CONSUMERS + 20)]
    send_raw(paths, *named, json.dumps({**position, "consumer": "../../etc"}).encode())
    wait_until(lambda: job_status(paths)["totals"]["refused"].get("position", 0) >= 20, what="the excess refused")
    status = job_status(paths)
    assert len(status["ranks"][0]["consumers"]) == MAX_CONSUMERS
    assert status["totals"]["refused"].get("message", 0) >= 1  # the bad name
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)  # the default consumer is never refused
    assert sum(1 for _ in loader) == STEPS
    loader.close()


def test_a_progress_file_names_its_consumer_and_a_silent_one_is_forgotten(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, buffer=BUFFER), {"consumer_timeout": 2}).paths
    write_progress(paths.progress(0, "eval"), 0, 3)
    wait_until(lambda: consumers(paths).get("eval", {}).get("step") == 3, what="the file's consumer seen")
    assert consumers(paths)["eval"]["trainer"] == "never"  # no lock: a trainer in any language
    write_progress(paths.progress(0, "eval"), 0, 5)  # reports keep it
    wait_until(lambda: consumers(paths)["eval"]["step"] == 5, what="its next report")
    wait_until(lambda: "eval" not in consumers(paths), timeout_s=10, what="the silent consumer forgotten")
    (paths.progress_dir / "rank-0.no.dots").write_text("0 1\n")  # not a consumer's name: ignored
    (paths.progress_dir / "rank-0.x").symlink_to("/etc/passwd")  # planted: refused, nothing else
    wait_until(lambda: job_status(paths)["totals"]["refused"].get("progress_file"), what="the symlink refused")
    assert set(consumers(paths)) <= {""}
