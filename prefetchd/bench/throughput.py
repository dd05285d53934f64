"""The throughput rows: images/s each system delivers to a consumer that only touches every page,
on both recipes; the scaling rows' yardstick (one in-process loop of the same pipeline, and N of
them at once); one loop per installed decoder, for the partial-decode row; and the CPU the
daemon's master and workers spend, for the daemon-cost row."""

from __future__ import annotations

import contextlib
import multiprocessing
import time

import numpy as np
import psutil

from prefetchd import control
from prefetchd.bench.common import OTHER, RECIPES, SYSTEMS, installed_decoders, rotated
from prefetchd.bench.consumer import Batches, consume
from prefetchd.bench.run import Run, open_system
from prefetchd.sources.index import read_image_file
from prefetchd.workers.transforms import ImagePipeline
from prefetchd_client.layout import JobPaths


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _workers_of(status: dict) -> list[psutil.Process]:
    """The daemon's live worker processes, by the pids its status reports."""
    found = []
    for pid in status.get("workers", {}).get("pids", []):
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def cpu_snapshot(paths: JobPaths | None, pid: int | None) -> dict:
    """CPU seconds so far of this (consumer) process, of the daemon's master and of its live
    workers, and what the daemon has produced (from its status). DataLoader: its workers are
    this process's children."""
    me = psutil.Process()
    snap = {"consumer_s": _cpu_s(me)}
    if pid is None:
        workers = 0.0
        for child in me.children():
            # DataLoader's forked workers share our command line; a daemon master does not.
            with contextlib.suppress(psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE and child.cmdline() == me.cmdline():
                    workers += _cpu_s(child)
        snap["workers_s"] = workers
        return snap
    status = control.request_job(paths, {"op": "status"}) or {}
    snap["master_s"] = _cpu_s(psutil.Process(pid))
    snap["workers_s"] = sum(_cpu_s(w) for w in _workers_of(status))
    snap["produced_batches"] = status.get("totals", {}).get("produced")
    return snap


def throughput_run(run: Run, system: str, recipe: str, source: dict | None = None) -> dict:
    """Deliver `epochs` epochs as fast as the system can; images/s from the first batch to the
    last (both systems start their workers together, so neither gets a head start). `source`:
    prefetchd's [[source]] table, where not the run's image folder."""
    s = run.s
    with open_system(run, system, recipe, f"tp-{recipe}", source) as (loader, paths, pid):
        before = cpu_snapshot(paths, pid)
        batches = Batches(loader, s.epochs)
        try:
            steps = consume(batches, None, lambda i: (0.0, 0.0))
            after = cpu_snapshot(paths, pid)  # before the workers stop and take their CPU with them
        finally:
            batches.close()
    done = [r["done"] for r in steps]
    images = s.batch_size * (len(done) - 1)
    result = {
        "batches": len(done),
        "seconds": done[-1] - done[0],
        "images_per_s": images / (done[-1] - done[0]),
        "consumer_cpu_s_per_batch": (after["consumer_s"] - before["consumer_s"]) / len(done),
        "first_batch_s": steps[0]["wait"],
    }
    if pid is not None:
        produced = after["produced_batches"] - before["produced_batches"]
        result |= {
            "master_cpu_s": after["master_s"] - before["master_s"],
            "workers_cpu_s": after["workers_s"] - before["workers_s"],
            "produced_batches": produced,
            "master_cpu_s_per_1000_batches": 1000 * (after["master_s"] - before["master_s"]) / produced,
            "worker_cpu_ms_per_image": 1000 * (after["workers_s"] - before["workers_s"]) / (produced * s.batch_size),
        }
    elif system == "dataloader_persistent":  # the workers lived the whole run: all their CPU is here
        result["worker_cpu_ms_per_image"] = 1000 * after["workers_s"] / (len(done) * s.batch_size)
    return result


def pipeline_loop(files: list[str], recipe: str, decoder: str) -> float:
    """prefetchd's ImagePipeline on `files`, one image at a time into one output array (no batch
    file, no digest, no IPC): a worker's upper bound. Returns images/s."""
    pipeline = ImagePipeline(RECIPES[recipe], decoder)
    out = np.empty(pipeline.output_shape, np.uint8)
    start = time.perf_counter()
    for i, path in enumerate(files):
        pipeline.apply(path, np.random.default_rng(i), out, read_image_file(path))
    return len(files) / (time.perf_counter() - start)


def _loop_in_child(files: list[str], recipe: str, decoder: str, results) -> None:
    results.put(pipeline_loop(files, recipe, decoder))


def inprocess_run(run: Run, recipe: str) -> dict:
    """The scaling row's yardstick: one loop in this process over every image the daemon
    serves (the first 300 alone ran 2-3 % slower than all 1,500, which flattered the row by as
    much). Beside it, N such loops at once in N forked processes: what this machine gives N
    busy cores with no loader at all (its cores share caches, memory bandwidth and a
    hypervisor), to tell the machine's share of a scaling shortfall from the loader's."""
    s = run.s
    files = [path for path, _ in run.files]
    one = pipeline_loop(files, recipe, s.decoder)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_loop_in_child, args=(files, recipe, s.decoder, results)) for _ in range(s.workers)]
    try:
        for proc in procs:
            proc.start()
        rates = [results.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(10)  # it has sent its figure and is flushing its queue; killed only if stuck
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return {"images": len(files), "images_per_s": one, "parallel_images_per_s": sum(rates), "parallel": rates}


def measure_throughput(run: Run, results: dict) -> None:
    others = tuple(OTHER + d for d in installed_decoders() if d != run.s.decoder)
    tp = results["throughput"] = {rc: {sy: [] for sy in (*SYSTEMS, *others)} for rc in RECIPES}
    ip = results["inprocess"] = {rc: [] for rc in RECIPES}
    # One in-process loop per decoder, alternating: the partial decode row's gain without a loader.
    loops = results["decoder_loops"] = {rc: {d: [] for d in installed_decoders()} for rc in RECIPES}
    files = [path for path, _ in run.files[: run.s.inprocess_images]]
    for r in range(run.s.repeats):
        for recipe in RECIPES:
            for system in rotated((*SYSTEMS, *others, "inprocess", "loops"), r):
                if system == "loops":
                    for decoder in rotated(tuple(loops[recipe]), r):
                        loops[recipe][decoder].append(pipeline_loop(files, recipe, decoder))
                    run.log(f"loops {recipe} #{r}: " + ", ".join(f"{d} {v[-1]:.0f}" for d, v in loops[recipe].items()))
                    continue
                if system == "inprocess":
                    ip[recipe].append(inprocess_run(run, recipe))
                    got = ip[recipe][-1]
                else:
                    tp[recipe][system].append(throughput_run(run, system, recipe))
                    got = tp[recipe][system][-1]
                run.log(f"throughput {recipe} #{r}: {system} {got['images_per_s']:.0f} img/s")
