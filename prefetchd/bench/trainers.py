"""The trainer rows: a steady trainer asking for 80 % of the production capacity, and a bursty
one (blocks of fast steps after a pause), each against every system, fresh; their waits per
step, the epoch boundary's, and prefetchd's buffer meanwhile (for the timeline)."""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from prefetchd.bench.common import SYSTEMS, Settings, rotated
from prefetchd.bench.consumer import Batches, BufferSampler, consume
from prefetchd.bench.run import Run, open_system


def capacity(results: dict, batch_size: int) -> dict:
    """Seconds per batch the slower system sustains on random-resized-crop: the trainers are
    set against it, so "below capacity" holds for every system."""
    rates = {sy: statistics.median(x["images_per_s"] for x in results["throughput"]["rrc"][sy]) for sy in SYSTEMS}
    return {"images_per_s": rates, "batch_s": batch_size / min(rates.values())}


def trainer_plans(s: Settings, batch_s: float) -> dict:
    """The two trainers, as (pause, work) per step, with their parameters for the report."""
    steady = batch_s / s.steady_load
    burst = batch_s / s.burst_speed
    # The pause that brings K burst steps plus the pause to K batches at `burst_load` of capacity.
    pause = max(0.0, s.burst_every * batch_s / s.burst_load - s.burst_every * burst)
    return {
        "steady": {"work_s": steady},
        "bursty": {"work_s": burst, "pause_s": pause, "every": s.burst_every, "steps": s.burst_every * s.burst_blocks},
    }


def trainer_run(run: Run, system: str, kind: str, plan: dict) -> dict:
    """One trainer against one fresh system on random-resized-crop; prefetchd's buffer is
    sampled meanwhile. The steady trainer runs `epochs` epochs; the bursty one K x blocks
    steps, with its pause before every block, the first too: both systems get the same head
    start (a DataLoader's workers start at iter(), before the pause)."""
    s = run.s
    per_epoch = s.images // s.batch_size
    if kind == "steady":
        steps, epochs = None, s.epochs

        def schedule(i):
            return 0.0, plan["work_s"]
    else:
        steps = plan["steps"]
        epochs = math.ceil(steps / per_epoch) + 1

        def schedule(i):
            return (plan["pause_s"] if i % plan["every"] == 0 else 0.0), plan["work_s"]

    with open_system(run, system, "rrc", kind) as (loader, paths, pid):
        t0 = time.perf_counter()  # one clock for the steps and the buffer samples
        sampler = BufferSampler(paths, t0) if paths else None
        if sampler:
            sampler.start()
        batches = Batches(loader, epochs)

        def ready(i: int) -> bool:  # step i of the stream is batch (i // per_epoch, i % per_epoch)
            return paths.batch(i // per_epoch, i % per_epoch, 0).exists()

        try:
            records = consume(batches, steps, schedule, t0, ready if paths else None)
        finally:
            batches.close()
            samples = sampler.halt() if sampler else []
    return {"steps": records, "buffer": samples}


def wait_stats(steps: list[dict]) -> dict:
    """Total wait, per-step median, p95 and max, leaving out the very first batch (start-up,
    which the restart row measures); the waits at each new epoch's first batch, and the p95
    of the other steps (what taking a batch costs when the boundary is nothing special)."""
    waits = [r["wait"] for r in steps[1:]]
    ordinary = [r["wait"] for r in steps[1:] if r["step"] > 0]
    boundary = [r for r in steps if r["epoch"] > 0 and r["step"] == 0]
    return {
        "ordinary_p95_s": float(np.percentile(ordinary, 95)),
        # prefetchd only (None for DataLoader, whose queue cannot be looked into)
        "ready_when_asked": None if steps[0]["ready"] is None else sum(bool(r["ready"]) for r in steps[1:]),
        "boundary_ready_when_asked": None if steps[0]["ready"] is None else all(r["ready"] for r in boundary),
        "first_batch_s": steps[0]["wait"],
        "total_s": float(sum(waits)),
        "median_s": float(np.median(waits)),
        "p95_s": float(np.percentile(waits, 95)),
        "max_s": float(max(waits)),
        "epoch_boundary_s": [r["wait"] for r in boundary],
        "steps": len(steps),
    }


def measure_trainers(run: Run, results: dict) -> None:
    s = run.s
    cap = results["capacity"] = capacity(results, s.batch_size)
    plans = results["trainer_plans"] = trainer_plans(s, cap["batch_s"])
    for kind in ("steady", "bursty"):
        results[kind] = {sy: [] for sy in SYSTEMS}
    for r in range(s.repeats):
        for system in rotated(SYSTEMS, r):
            for kind in ("steady", "bursty"):
                raw = trainer_run(run, system, kind, plans[kind])
                stats = wait_stats(raw["steps"])
                results[kind][system].append({**stats, "timeline": raw})
                run.log(f"{kind} trainer #{r}: {system} waited {stats['total_s']:.3f} s over {stats['steps']} steps")
