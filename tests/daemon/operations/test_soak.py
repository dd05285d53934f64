"""Soak (long tier): two ranks read small batches as fast as they can for twenty minutes (or
$PREFETCHD_SOAK_S seconds) under a 4 MB bound; every process's memory grows by at most a byte
per batch it handled (a week at 10 steps a second: under 6 MB), descriptors stay flat, the
bound holds, and every batch arrives, in order, verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from prefetchd import control
from prefetchd_client.manifest import read_manifest
from tests.conftest import start_job, write_config
from tests.helpers import workers_of

SOAK_S = float(os.environ.get("PREFETCHD_SOAK_S", 1200))
pytestmark = [pytest.mark.long, pytest.mark.timeout(SOAK_S + 300)]

_TRAINER = textwrap.dedent("""
    import json, sys, time
    from prefetchd_client import PrefetchLoader
    rank, until = int(sys.argv[1]), float(sys.argv[2])
    loader = PrefetchLoader("job", rank=rank, world_size=2, as_tensors=False, verify=True, timeout=60)
    batches, epoch = 0, 0
    while time.time() < until:
        loader.set_epoch(epoch)
        steps = [batch["index"].shape[0] for batch in loader]  # verify=True: name, plan, CRC checked
        assert len(steps) == len(loader), (epoch, len(steps))
        batches += len(steps)
        epoch += 1
    print(json.dumps({"rank": rank, "batches": batches, "epochs": epoch}))
""")


def anonymous_bytes(process: psutil.Process) -> int:
    """Its private memory (heap, stacks: what a leak grows), without the pages of files and of
    the tmpfs it has mapped (libraries; batches being read, bounded by the buffer), which RSS
    also counts and which come and go with what it maps at the moment."""
    with open(f"/proc/{process.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def slope_per_hour(times: list[float], values: list[float]) -> float:
    """Least-squares slope, in units per hour."""
    return float(np.polyfit(np.asarray(times), np.asarray(values, dtype=float), 1)[0] * 3600)


def test_two_fast_ranks_for_twenty_minutes_keep_every_process_flat(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder, world_size=2, batch_size=2, size=16, buffer="4M"))
    master = psutil.Process(read_manifest(paths)["pid"])
    until = time.time() + SOAK_S
    trainers = [
        subprocess.Popen([sys.executable, "-c", _TRAINER, str(rank), str(until)], stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    samples: dict[str, list] = {"t": [], "master_rss": [], "master_fds": [], "worker_rss": [], "client_rss": []}
    samples |= {"master_anon": [], "worker_anon": [], "client_anon": []}
    samples |= {"client_fds": [], "worker_fds": [], "files_bytes": [], "used_bytes": []}
    bound = read_manifest(paths)["buffer_bytes"]
    start = time.monotonic()
    try:
        while any(t.poll() is None for t in trainers):
            time.sleep(5)
            status = control.request(paths.endpoint, {"op": "status"}, timeout_s=10)
            assert status is not None, "the daemon stopped answering"
            workers = workers_of(paths)  # not master.children(): they fork from the worker server
            clients = [psutil.Process(t.pid) for t in trainers if t.poll() is None]
            if len(clients) < 2:
                break
            samples["t"].append(time.monotonic() - start)
            samples["master_rss"].append(master.memory_info().rss)
            samples["master_anon"].append(anonymous_bytes(master))
            samples["worker_anon"].append(sum(anonymous_bytes(w) for w in workers) / max(1, len(workers)))
            samples["client_anon"].append(sum(anonymous_bytes(c) for c in clients) / 2)
            samples["master_fds"].append(master.num_fds())
            samples["worker_rss"].append(sum(w.memory_info().rss for w in workers) / max(1, len(workers)))
            samples["worker_fds"].append(sum(w.num_fds() for w in workers))
            samples["client_rss"].append(sum(c.memory_info().rss for c in clients) / 2)
            samples["client_fds"].append(sum(c.num_fds() for c in clients))
            samples["files_bytes"].append(status["buffer"]["files_bytes"])
            samples["used_bytes"].append(status["buffer"]["used_bytes"])
        results = [json.loads(t.communicate(timeout=120)[0]) for t in trainers]
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
                t.wait()
    assert all(t.returncode == 0 for t in trainers)
    status = control.request(paths.endpoint, {"op": "status"}, timeout_s=10)
    # The first minutes warm up (allocator arenas, page cache: ~1.5 MiB in the master, then flat);
    # growth over the second half is a leak.
    warm = [i for i, t in enumerate(samples["t"]) if t >= SOAK_S / 2]
    t = [samples["t"][i] for i in warm]
    slopes = {k: slope_per_hour(t, [samples[k][i] for i in warm]) for k in samples if k != "t"}
    batches = sum(r["batches"] for r in results)
    print(
        f"\nsoak {SOAK_S:.0f} s: {batches} batches ({batches / SOAK_S:.0f}/s) on 2 ranks, "
        f"{status['totals']['produced']} produced; peak {status['buffer']['peak_bytes']} of {bound} bytes; "
        f"max files {max(samples['files_bytes'])}"
    )
    for k in ("master_rss", "worker_rss", "client_rss", "master_anon", "worker_anon", "client_anon"):
        print(
            f"  {k}: {samples[k][warm[0]] / 2**20:.1f} -> {samples[k][-1] / 2**20:.1f} MiB, "
            f"slope {slopes[k] / 2**20:+.2f} MiB/h"
        )
    for k in ("master_fds", "worker_fds", "client_fds"):
        print(f"  {k}: {samples[k][warm[0]]} -> {samples[k][-1]} (min {min(samples[k])}, max {max(samples[k])})")
    every_minute = range(0, len(samples["t"]), 12)
    per_minute = {k: [round(samples[k][i] / 2**20, 2) for i in every_minute] for k in ("master_anon", "client_anon")}
    print(f"  private memory each minute (MiB): {per_minute}")
    assert status["buffer"]["peak_bytes"] <= bound and max(samples["files_bytes"]) <= bound
    assert status["workers"]["restarts"] == 0
    quarter = max(1, len(warm) // 4)
    for k in ("master_fds", "worker_fds", "client_fds"):
        # A client maps a few batches at a time (read-ahead, unmapping in the background), so
        # its count moves by a few between samples: the trend is what must be flat.
        first, last = (float(np.median([samples[k][i] for i in part])) for part in (warm[:quarter], warm[-quarter:]))
        assert last - first <= 2, (k, first, last)
    # The leaks this guards against: ~110 bytes per batch produced or consumed (a list of names),
    # then ~34 (pathlib interning each batch's name in the master). Per process and per batch it
    # handled: at most one byte.
    per_hour = batches / SOAK_S * 3600
    memory = [k for k in slopes if k.endswith(("_rss", "_anon"))]
    bytes_per_batch = {k: slopes[k] / (per_hour if k.startswith("master") else per_hour / 2) for k in memory}
    print(f"  growth per batch handled (bytes): { {k: round(v, 2) for k, v in bytes_per_batch.items()} }")
    assert max(v for k, v in bytes_per_batch.items() if k.endswith("_anon")) <= 1, bytes_per_batch
