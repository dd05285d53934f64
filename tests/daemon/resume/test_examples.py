"""The examples, run as real subprocesses against a real daemon, resume at the exact batch.

For each example: run A trains 2 epochs uninterrupted and records the sample ids of every
step and rank; run B "crashes" mid-epoch after K steps (checkpoint at that point), run C
resumes from B and stops exactly at the epoch boundary (checkpoint), run D resumes from C to
the end. B + C + D must equal A, per rank, step for step. Lightning also resumes from the
end-of-epoch checkpoint that its ModelCheckpoint wrote during C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from prefetchd.plan import Plan
from tests.conftest import REPO, start_job, wait_until, write_config

EXAMPLES = REPO / "examples"
IMAGES, BATCH, EPOCHS = 48, 4, 2  # the jpeg_folder fixture holds 48 images
# ~7 batches of 4 x 32 x 32 x 3: less than an epoch, so the daemon deletes what a run consumed
# and regenerates it when the next run goes back; and it idles (no CPU) once the window is full.
BUFFER = "128K"

# name: (script, world size = the example's ranks, K = the mid-epoch stop)
CASES = {
    "plain_pytorch": ("plain_pytorch.py", 1, 5),
    "lightning": ("lightning_ddp.py", 1, 5),
    "lightning_ddp": ("lightning_ddp.py", 2, 4),
    "fabric_loop": ("fabric_loop.py", 2, 4),
}
# Each run of a Lightning or Fabric example on two ranks costs ~18 CPU-s (two ranks importing
# torch and the framework, DDP's set-up): run A, the uninterrupted reference, is made once, by
# the plain loop, whose run also makes the daemon regenerate what A consumed; the frameworks'
# B + C + D are held to the plan itself. The quick tier runs Lightning's Trainer on one device
# (its checkpoints, its loops, its calls into the loader: what resume rests on); two DDP ranks
# with a resume from ModelCheckpoint's end-of-epoch file, and Fabric (Lightning's loop by hand),
# run in the long tier. Every rank its own data is the
# client's and the daemon's (tests/daemon/lifecycle/test_daemon.py, two ranks and their bound).
WITH_RUN_A = {"plain_pytorch"}


def run_example(script: str, *args: str, timeout: float = 150) -> str:
    """Run an example to its end in its own process group, and prove nothing of it is left."""
    env = os.environ.copy()  # PREFETCHD_ROOT from the job_root fixture
    env["OMP_NUM_THREADS"] = "1"  # 2 cores: the ranks and the daemon's worker share them
    command = f"{script} {' '.join(args)}"
    started = time.monotonic()
    # Its own session: the DDP ranks that Lightning or Fabric launch join the group, and a
    # timeout kills all of them; their inherited pipes keep communicate() until they exit.
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{command} ran past {timeout} s:\n{out}\n{err[-6000:]}") from None
    finally:
        left = wait_group_gone(proc.pid)
    assert proc.returncode == 0, f"{command} failed:\n{out}\n{err[-6000:]}"
    assert not left, f"{command} left processes behind: {left}"
    print(f"{command}: {time.monotonic() - started:.1f} s")
    return out


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> list[int]:
    """Wait for every live process of group ``pgid`` to exit; kill and return any that do not."""
    deadline = time.monotonic() + timeout_s
    while True:
        members = []
        for proc in psutil.process_iter(["status"]):
            try:
                if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    members.append(proc.pid)
            except (ProcessLookupError, psutil.Error):
                pass
        if not members:
            return []
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return members
        time.sleep(0.05)


def records(path: Path) -> dict[int, list[dict]]:
    """The recorded steps of each rank, in the order that rank wrote them."""
    by_rank: dict[int, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_rank.setdefault(rec["rank"], []).append(rec)
    return by_rank


def planned(world: int) -> dict[int, list[dict]]:
    """What an uninterrupted 2-epoch run must see: the daemon's plan, step by step."""
    plan = Plan(IMAGES, world, BATCH, seed=0)
    n = plan.batches_per_epoch
    return {
        r: [
            {"epoch": e, "step": k, "rank": r, "global_step": e * n + k, "index": plan.sample_ids(e, k, r).tolist()}
            for e in range(EPOCHS)
            for k in range(n)
        ]
        for r in range(world)
    }


def saved_loader_state(script: str, ckpt: Path) -> dict:
    state = torch.load(ckpt, weights_only=False)
    if script == "lightning_ddp.py":  # Lightning keeps it with the fit loop's state
        (loader_state,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        return loader_state
    return state["loader"]


@pytest.mark.heavy
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    [*WITH_RUN_A, "lightning", *(pytest.param(n, marks=pytest.mark.long) for n in ("lightning_ddp", "fabric_loop"))],
)
def test_example_resumes_at_the_exact_batch(name, tmp_path, jpeg_folder, job_root):
    script, world, k = CASES[name]
    paths = start_job(write_config(tmp_path, jpeg_folder, world_size=world, batch_size=BATCH, size=32, buffer=BUFFER))
    n = IMAGES // (world * BATCH)  # steps per epoch = len(loader)
    assert 0 < k < n
    common = ["job", "--epochs", str(EPOCHS), "--num-classes", "4", "--timeout", "60"]
    if script != "plain_pytorch.py":
        common += ["--devices", str(world)]
    a, bcd = tmp_path / "a.jsonl", tmp_path / "bcd.jsonl"
    ckpt_b, ckpt_c = tmp_path / "b.ckpt", tmp_path / "c.ckpt"

    if name in WITH_RUN_A:  # A: uninterrupted, 2 epochs.
        run_example(script, *common, "--record", str(a))
        assert records(a) == planned(world)
        # The daemon deleted what A consumed: B, C and D ask for batches it must regenerate.
        wait_until(lambda: not any(paths.batch(0, 0, r).exists() for r in range(world)), what="epoch 0 deleted")
    else:
        a.write_text("".join(json.dumps(step) + "\n" for steps in planned(world).values() for step in steps))

    # B: stops after K steps, mid-epoch; the loader state counts exactly the K batches trained on.
    run_example(script, *common, "--record", str(bcd), "--max-steps", str(k), "--ckpt", str(ckpt_b))
    assert [len(v) for v in records(bcd).values()] == [k] * world
    state_b = saved_loader_state(script, ckpt_b)
    assert (state_b["epoch"], state_b["samples_consumed"]) == (0, k * world * BATCH)

    # C: resumes from B, stops exactly at the epoch boundary (K = len(loader)).
    extra = ["--ckpt-dir", str(tmp_path / "mc")] if name == "lightning_ddp" else []
    c_args = ["--resume", str(ckpt_b), "--max-steps", str(n), "--ckpt", str(ckpt_c), *extra]
    run_example(script, *common, "--record", str(bcd), *c_args)
    assert [len(v) for v in records(bcd).values()] == [n] * world
    state_c = saved_loader_state(script, ckpt_c)
    assert (state_c["epoch"], state_c["samples_consumed"]) == (1, 0)  # the whole of epoch 0 was trained on
    before_d = bcd.read_text()

    # D: resumes from C to the end of epoch 1.
    run_example(script, *common, "--record", str(bcd), "--resume", str(ckpt_c))
    assert records(bcd) == records(a), "B + C + D differ from the uninterrupted run"

    if name == "lightning_ddp":  # a fifth run of Lightning (~8 CPU-s): the long tier's
        # ModelCheckpoint's end-of-epoch checkpoint from C: Lightning does not load the loader
        # state from it (the run is not "restarting"); Lightning calls loader.sampler.set_epoch, which gets it right.
        (epoch_end,) = (tmp_path / "mc").iterdir()
        assert epoch_end.name == f"epoch=0-step={n}.ckpt"
        d2 = tmp_path / "bc-epoch-end.jsonl"
        d2.write_text(before_d)
        run_example(script, *common, "--record", str(d2), "--resume", str(epoch_end))
        assert records(d2) == records(a), "resumed from the end-of-epoch checkpoint, the data differ"
