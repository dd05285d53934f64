"""Trainer stall accounting: the client's waits in next(), carried with its position reports,
summed per rank by the daemon (prefetchd.ops.stalls), shown by `prefetchd status` (text, --json and
the live --watch view, driven in a real terminal through tmux)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd import control
from prefetchd.ops.stalls import WINDOW_S, BadWaits, StallLedger
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from tests.conftest import cli, wait_until, write_config
from tests.helpers import job_status

pytestmark = pytest.mark.timeout(120)

# ---------------------------------------------------------------- the ledger, pure


def test_a_rank_sums_the_growth_of_each_loader_and_a_new_loader_adds_to_it():
    ledger = StallLedger()
    ledger.note((0, ""), loader=1, wait_s=2.0, waited_steps=3, steps=10, now=100.0)
    ledger.note((0, ""), loader=1, wait_s=5.0, waited_steps=4, steps=20, now=101.0)
    ledger.note((0, ""), loader=2, wait_s=1.5, waited_steps=1, steps=5, now=102.0)  # a restarted trainer
    snap = ledger.snapshot((0, ""), 102.0)
    assert (snap["seconds_total"], snap["waited_steps_total"], snap["steps_total"]) == (6.5, 5, 25)
    assert ledger.snapshot((1, ""), 102.0) is None  # never reported: unknown, not 0


@pytest.mark.parametrize(
    "report, why",
    [
        ((1, 4.9, 4, 20), "backwards"),  # the same loader's wait shrank
        ((1, 5.0, 3, 20), "backwards"),
        ((1, 5.0, 4, 19), "backwards"),
        ((1, 2e9, 4, 20), "out of range"),
        ((1, 5.0, 2**60, 2**60), "out of range"),
        ((2**60, 5.0, 4, 20), "out of range"),
    ],
)
def test_totals_no_loader_sends_are_refused_and_change_nothing(report, why):
    ledger = StallLedger()
    ledger.note((0, ""), 1, 5.0, 4, 20, now=10.0)
    before = ledger.snapshot((0, ""), 11.0)
    loader, wait_s, waited, steps = report
    with pytest.raises(BadWaits, match=why):
        ledger.note((0, ""), loader, wait_s, waited, steps, now=11.0)
    assert ledger.snapshot((0, ""), 11.0) == before


def test_the_last_minute_share_is_the_wait_over_wall_time_and_decays_when_no_wait_comes():
    ledger = StallLedger()
    ledger.note((0, ""), 7, 0.0, 0, 0, now=0.0)
    for t in range(1, 121):  # two minutes: the first waits 30 s of 60, the second waits nothing
        wait = min(t, 60) * 0.5
        ledger.note((0, ""), 7, wait, 0, t, now=float(t))
        if t == 60:
            assert ledger.snapshot((0, ""), 60.0)["last_minute_share"] == pytest.approx(0.5, abs=0.01)
        if t == 90:  # half a minute of waiting half the time, half a minute of none
            assert ledger.snapshot((0, ""), 90.0)["last_minute_share"] == pytest.approx(0.25, abs=0.02)
    assert ledger.snapshot((0, ""), 120.0)["last_minute_share"] == pytest.approx(0.0, abs=0.01)
    # A first report carrying a long wait from before it (a daemon restarted beside a running
    # trainer): in the totals, not in the last minute's share; what comes after it is.
    ledger.note((1, ""), 8, 500.0, 9, 10, now=5.0)
    assert ledger.snapshot((1, ""), 5.5)["seconds_total"] == 500.0
    assert ledger.snapshot((1, ""), 5.5)["last_minute_share"] == 0.0
    ledger.note((1, ""), 8, 505.0, 10, 20, now=15.0)
    assert ledger.snapshot((1, ""), 15.0)["last_minute_share"] == pytest.approx(0.5, abs=1e-3)
    ledger.note((1, ""), 9, 1.0, 1, 1, now=16.0)  # a restarted trainer: its first report too
    assert ledger.snapshot((1, ""), 16.0)["seconds_total"] == 506.0
    assert ledger.snapshot((1, ""), 16.0)["last_minute_share"] == pytest.approx(5 / 11, abs=1e-3)
    assert ledger.snapshot((1, ""), 5.0 + 10 * WINDOW_S)["last_minute_share"] == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 5), st.integers(0, 3), st.integers(0, 3)), max_size=60))
def test_totals_are_the_sum_of_each_loaders_last_report(steps):
    """Loaders 0..3 of one rank report growing totals in any interleaving: the rank's totals are
    the sum of each loader's last report, as long as a loader's reports are not interleaved with
    another's (a loader that comes back after another is a new one to the ledger: its totals
    count again from zero, which is what a new trainer process looks like)."""
    ledger, totals, last, current = StallLedger(), {}, None, None
    expected = [0.0, 0, 0]
    for t, (loader, dw, dn, ds) in enumerate(steps):
        w, n, s = totals.get(loader, (0.0, 0, 0)) if loader == current else (0.0, 0, 0)
        w, n, s = w + dw, n + dn, s + ds
        ledger.note((0, ""), loader, w, n, s, now=float(t))
        before = totals.get(loader, (0.0, 0, 0)) if loader == current else (0.0, 0, 0)
        expected = [expected[0] + w - before[0], expected[1] + n - before[1], expected[2] + s - before[2]]
        totals[loader], current, last = (w, n, s), loader, loader
    if last is not None:
        snap = ledger.snapshot((0, ""), float(len(steps)))
        assert snap["seconds_total"] == pytest.approx(expected[0], abs=1e-5)
        assert (snap["waited_steps_total"], snap["steps_total"]) == (expected[1], expected[2])


# ---------------------------------------------------------------- the wire


@pytest.mark.parametrize(
    "fields",
    [
        '"wait_s": NaN, "waited_steps": 0, "steps": 1, "loader": 3',
        '"wait_s": Infinity, "waited_steps": 0, "steps": 1, "loader": 3',
        '"wait_s": 1e400, "waited_steps": 0, "steps": 1, "loader": 3',
        '"wait_s": -0.5, "waited_steps": 0, "steps": 1, "loader": 3',
        '"wait_s": true, "waited_steps": 0, "steps": 1, "loader": 3',
        '"wait_s": "1", "waited_steps": 0, "steps": 1, "loader": 3',
        '"wait_s": 1.0, "waited_steps": -1, "steps": 1, "loader": 3',
        '"wait_s": 1.0, "waited_steps": 0.5, "steps": 1, "loader": 3',
        '"wait_s": 1.0, "waited_steps": 0, "steps": 1, "loader": [3]',
        '"wait_s": 1.0',  # the four come together
        '"wait_s": 1.0, "waited_steps": 0, "steps": 1',
    ],
)
def test_a_position_with_bad_wait_fields_is_a_bad_message(fields):
    data = ('{"op": "position", "rank": 0, "epoch": 0, "step": 1, ' + fields + "}").encode()
    with pytest.raises(control.BadMessage):
        control.decode_message(data)


def test_wait_fields_may_be_whole_numbers_and_may_be_left_out():
    msg = control.decode_message(
        b'{"op": "position", "rank": 0, "epoch": 0, "step": 1, "wait_s": 2, "waited_steps": 0, "steps": 1, "loader": 3}'
    )
    assert msg["wait_s"] == 2
    assert "wait_s" not in control.decode_message(b'{"op": "position", "rank": 0, "epoch": 0, "step": 1}')


# ---------------------------------------------------------------- a job's master

SLOW_SAMPLE_S = 0.02  # 4 samples a batch: ~80 ms a batch from the one worker


def slow_make(source, rng):
    """The [pipeline] of the throttled trainer's job. Its workers import this module by name: the
    in-process worker server has this test process's sys.path, which holds the tests package (a
    module under tmp_path, found through PYTHONPATH, would not reach it)."""
    time.sleep(SLOW_SAMPLE_S)
    return {"x": np.full(4, source["index"], np.int32)}


def stuck_make(source, rng):
    """The [pipeline] of the stuck trainer's job: sample 20 takes 30 s."""
    time.sleep(30 if source["index"] == 20 else 0)
    return {"x": np.full(4, source["index"], np.int32)}


def pipeline_config(tmp_path, data, make) -> Path:
    """A job config whose samples come from ``make``, a function of this module."""
    config = tmp_path / "job.toml"
    config.write_text(
        f'[job]\nname = "job"\nbatch_size = 4\n[daemon]\nworkers = 1\n'
        f'[[source]]\nkind = "image_folder"\nroot = "{data}"\n[pipeline]\ncallable = "{__name__}:{make.__name__}"\n'
    )
    return config


def _ranks(paths: JobPaths) -> list[dict]:
    return job_status(paths)["ranks"]


def test_a_throttled_trainer_waits_as_long_in_status_as_it_measured_itself(tmp_path, jpeg_folder, serve):
    paths = serve(pipeline_config(tmp_path, jpeg_folder, slow_make), {"buffer": "64K"}).paths
    measured, steps, waited = 0.0, 0, 0
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    try:
        it = iter(loader)
        while True:  # the trainer's own clock, around next(): no compute, so it waits on production
            t0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            wait = time.perf_counter() - t0
            measured, steps, waited = measured + wait, steps + 1, waited + (wait > 0.001)
        own = loader.wait_stats
    finally:
        loader.close()
    # The report that ends the epoch carries the last step's wait.
    rank = wait_until(
        lambda: next((r for r in _ranks(paths) if (r["wait"] or {}).get("steps_total") == steps), None),
        timeout_s=10,
        what="the epoch's waits in status",
    )
    shown = rank["wait"]["seconds_total"]
    print(
        f"\n[figure] throttled trainer: status shows {shown:.3f} s of wait, the trainer measured {measured:.3f} s "
        f"around next() ({steps} steps, {waited} waited > 1 ms; status {rank['wait']['waited_steps_total']}); "
        f"share of the last minute {rank['wait']['last_minute_share']:.1%}"
    )
    assert shown == pytest.approx(own["wait_s"], abs=1e-5)  # what the loader sent is what status sums
    assert shown <= measured and shown == pytest.approx(measured, rel=0.05, abs=0.02)
    assert measured > 0.3  # it did wait: the test can tell a wait from none
    assert rank["wait"]["waited_steps_total"] == own["waited_steps"]  # exact: what the loader sent
    assert abs(own["waited_steps"] - waited) <= 2  # the trainer's clock also holds the generator's step
    assert rank["wait"]["last_minute_share"] > 0.3
    text = cli("status", "job").stdout
    assert f"{shown:.2f} s" in text and f"{own['waited_steps']}/{steps}" in text

    # A second trainer of the rank (a restart) adds to the totals; a stuck one shows its wait growing.
    # (A step's wait travels with the next report; close() sends one more, so both steps count.)
    loader = PrefetchLoader("job", as_tensors=False, timeout=30)
    try:
        for step, _ in enumerate(loader):
            if step == 1:
                break
    finally:
        loader.close()
    wait_until(lambda: _ranks(paths)[0]["wait"]["steps_total"] == steps + 2, timeout_s=10, what="the second loader")


def test_a_trainer_stuck_on_a_batch_shows_its_wait_growing(tmp_path, jpeg_folder, serve):
    paths = serve(pipeline_config(tmp_path, jpeg_folder, stuck_make), {"worker_timeout": 60}).paths
    script = (
        "from prefetchd_client import PrefetchLoader\n"
        "for batch in PrefetchLoader('job', as_tensors=False, timeout=60):\n"
        "    pass\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until(
            lambda: (_ranks(paths)[0]["wait"] or {}).get("seconds_total", 0) > 1.5,
            timeout_s=20,
            what="the wait in progress counted",
        )  # reported every ~0.5 s while it waits
        assert _ranks(paths)[0]["wait"]["last_minute_share"] > 0.2
    finally:
        trainer.kill()
        trainer.wait(10)


def test_a_progress_file_trainer_shows_its_wait_as_unknown(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder)).paths
    progress = paths.progress(0)
    tmp = progress.with_name(progress.name + ".tmp")
    tmp.write_text("0 3")
    os.replace(tmp, progress)
    wait_until(lambda: _ranks(paths)[0]["step"] == 3, timeout_s=10, what="the progress file read")
    assert _ranks(paths)[0]["wait"] is None
    assert "unknown" in cli("status", "job").stdout


def test_hostile_wait_reports_are_refused_and_the_daemon_serves_on(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder)).paths
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(paths.endpoint)
    good = {
        "op": "position",
        "rank": 0,
        "epoch": 0,
        "step": 1,
        "wait_s": 5.0,
        "waited_steps": 2,
        "steps": 1,
        "loader": 9,
    }
    try:
        sock.send(json.dumps(good).encode())
        sock.send(json.dumps(good | {"step": 2, "wait_s": 4.0}).encode())  # backwards: refused, position kept
        sock.send(json.dumps(good | {"step": 2, "waited_steps": 2**62}).encode())
        sock.send(
            b'{"op": "position", "rank": 0, "epoch": 0, "step": 2, "wait_s": NaN, "waited_steps": 0, '
            b'"steps": 1, "loader": 9}'
        )
        for i in range(200):  # a flood of fresh loader ids: totals stay finite and the loop serves
            sock.send(json.dumps(good | {"loader": 1000 + i, "wait_s": 1e8}).encode())

        def all_read():  # the flood is read in turns, status requests between them
            s = job_status(paths)
            wait = s["ranks"][0]["wait"] or {}
            return s if s["totals"]["refused"].get("waits") == 2 and wait.get("steps_total") == 201 else None

        s = wait_until(all_read, timeout_s=10, what="two refused wait reports and the flood read")
    finally:
        sock.close()
        context.term()
    assert s["totals"]["refused"]["message"] == 1  # the NaN
    assert s["ranks"][0]["step"] == 1
    wait = s["ranks"][0]["wait"]
    assert wait["seconds_total"] == pytest.approx(5.0 + 200 * 1e8) and wait["steps_total"] == 201
    assert cli("status", "job").returncode == 0


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_status_watch_is_live_in_a_real_terminal_and_ctrl_c_exits_0(tmp_path, jpeg_folder, job_root, serve):
    serve(write_config(tmp_path, jpeg_folder))
    session = f"prefetchd-watch-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "exit-code"
    command = f"PREFETCHD_ROOT={job_root} {sys.executable} -m prefetchd status job --watch; echo $? > {done}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMUX")}
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "40", command], check=True, env=env)
    # A tmux server that was running already may size the window by its own defaults.
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "150", "-y", "40"], capture_output=True)
    try:

        def screen() -> str:
            return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

        try:
            first = wait_until(lambda: (lambda s: s if "waited" in s and "worker pid" in s else None)(screen()), 20)
        except AssertionError:
            raise AssertionError(f"no live view within 20 s; the terminal shows:\n{screen()}") from None
        assert "job: serving" in first and "refreshed every 1 s" in first
        stamp = next(line for line in first.splitlines() if "refreshed every" in line)
        wait_until(lambda: stamp not in screen(), timeout_s=5, what="a refresh")  # the clock moved: it is live
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        # The shell creates the file, then writes the code: wait for the code itself.
        wait_until(lambda: done.exists() and done.read_text().strip(), timeout_s=10, what="--watch to exit on Ctrl-C")
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "Traceback" not in first


def test_watch_and_json_together_are_refused(job_root):
    result = cli("status", "--watch", "--json")
    assert result.returncode == 1 and "--json and --watch" in result.stderr
