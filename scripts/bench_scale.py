"""A dataset of 10^8 samples: how long `prefetchd start` takes and how much memory each process holds.

The figures of issue 26's scale part (docs/benchmarks.md, "10^8 samples"). The dataset is
--shards shard names of --per-shard tiny JPEGs each, all hard links to one real shard and its
index object (tests/scaledata.py): indexing, planning and serving run as for that many
different shards, while the disk holds one. Per run (medians of --repeats): `prefetchd start`
returning (a process, as a user runs it, inside the clock, the index cache empty), then a
PrefetchLoader's first batch, --batches batches from the epoch's start and as many after a
resume near its end; then each process's RSS and PSS (the index is read by row from the
tmpfs, counted once, in `status`), and the client's RSS growth over its own start.

    python scripts/bench_scale.py [--shards 10000] [--per-shard 10000] [--repeats 3] [--batches 200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.scaledata: the dataset the tests use

CONFIG = """\
[job]
name = "scale"
seed = 0
world_size = 1
batch_size = 64

[daemon]
buffer = "64M"

[[source]]
kind = "webdataset"
urls = "{urls}"

[[transform]]
op = "random_resized_crop"
size = 32

[[transform]]
op = "hflip"
"""


def run_once(config: Path, env: dict, batches: int) -> dict:
    from prefetchd_client import PrefetchLoader

    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "prefetchd", "start", str(config)], env=env, capture_output=True)
    start_s = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"prefetchd start failed: {result.stderr.decode()}")
    client_before = psutil.Process().memory_info().rss
    loader = PrefetchLoader("scale", root=env["PREFETCHD_ROOT"], as_tensors=False)
    try:
        it = iter(loader)
        next(it)
        first_batch_s = time.perf_counter() - started
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        rate = batches * 64 / (time.perf_counter() - t)
        near_end = (len(loader) - batches - 1) * 64
        loader.load_state_dict({**loader.state_dict(), "samples_consumed": near_end})
        it = iter(loader)
        for _ in range(batches):
            next(it)
        manifest = json.loads((Path(env["PREFETCHD_ROOT"]) / "scale" / "manifest.json").read_text())
        master = psutil.Process(manifest["pid"])
        processes = {}
        for p in [master, *master.children(recursive=True)]:
            info = p.memory_full_info()
            name = "master" if p.pid == master.pid else " ".join(p.cmdline()[-1:])[-40:]
            processes[f"{p.pid} {name}"] = (info.rss >> 20, info.pss >> 20)
        status = json.loads(
            subprocess.run(
                [sys.executable, "-m", "prefetchd", "status", "scale", "--json"], env=env, capture_output=True
            ).stdout
        )
        client_growth = (psutil.Process().memory_info().rss - client_before) >> 20
    finally:
        loader.close()
        subprocess.run([sys.executable, "-m", "prefetchd", "stop", "scale"], env=env, capture_output=True)
    return {
        "start_s": start_s,
        "first_batch_s": first_batch_s,
        "images_per_s": rate,
        "max_rss_mb": max(rss for rss, _ in processes.values()),
        "processes_rss_pss_mb": processes,
        "client_rss_growth_mb": client_growth,
        "index": status["index"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--per-shard", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    from tests.scaledata import make_scaled_shards

    work = Path(tempfile.mkdtemp(prefix="prefetchd-scale-"))
    job_root = Path(tempfile.mkdtemp(prefix="prefetchd-scale-", dir="/dev/shm"))
    try:
        made = time.perf_counter()
        urls = make_scaled_shards(work / "data", args.shards, args.per_shard)
        print(f"dataset: {args.shards} x {args.per_shard} samples made in {time.perf_counter() - made:.1f} s")
        config = work / "scale.toml"
        config.write_text(CONFIG.format(urls=urls))
        runs = []
        for i in range(args.repeats):
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))  # the index cache empty, each run
            env = {**os.environ, "PREFETCHD_ROOT": str(job_root), "PREFETCHD_CACHE": str(cache)}
            runs.append(run_once(config, env, args.batches))
            print(f"run {i + 1}: {json.dumps(runs[-1])}")
        print("medians:")
        for key in ("start_s", "first_batch_s", "images_per_s", "max_rss_mb", "client_rss_growth_mb"):
            print(f"  {key}: {statistics.median(r[key] for r in runs):.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(job_root, ignore_errors=True)


if __name__ == "__main__":
    main()
