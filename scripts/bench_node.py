"""Three jobs on one node (issue 28): one fast trainer and two slow ones, each job with its own
daemon under one root, started together; three daemons of fixed --fixed-workers F (default W)
against three with --workers auto --max-workers W sharing a node budget of --node-cpus W. One run
alternating the two, medians.

Each trainer is a process of its own (random-resized-crop 224 + flip, batch 32, a folder of
generated JPEGs of 300-500 px): the fast one reads --epochs epochs with a step of --fast-step-ms
(0: as fast as it can), the slow ones --slow-batches batches with a step of --step-ms. Reported:
each trainer's wait for data (its loader's wait_stats) and images/s, the total wait, and, for the
shared budget, the most CPUs the daemons' leases held at once (read from the leases file through
the run).

    python scripts/bench_node.py [--images 400] [--workers 2] [--fixed-workers 2] [--epochs 3] [--repeats 3]
        [--fast-step-ms 0]
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
import threading
import time
from pathlib import Path

from bench_workers import CONFIG, auto_workers, common_arguments  # the same job, from the script beside this one

JOBS = ("fast", "slow1", "slow2")


def trainer(name: str, epochs: int, batches: int, step_s: float) -> None:
    """One trainer process: its figures as one JSON line."""
    from prefetchd_client import PrefetchLoader

    loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=300)
    began, images, touched = time.perf_counter(), 0, 0
    for _ in range(epochs):
        for batch in loader:
            touched += int(batch["image"][:, ::16, ::16].sum() & 1)  # the trainer touches its pixels
            images += len(batch["index"])
            time.sleep(step_s)
            if batches and images >= batches * 32:
                break
        if batches and images >= batches * 32:
            break
    took = time.perf_counter() - began
    print(json.dumps({"images_per_s": images / took, "wait_s": loader.wait_stats["wait_s"], "s": took}))
    loader.close()


def run_once(setup: str, work: Path, data: Path, args, env: dict) -> dict:
    root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-node-", dir="/dev/shm"))
    run_env = {**env, "PREFETCHD_ROOT": str(root)}
    workers = f"workers = {args.fixed_workers}" if setup == "fixed" else auto_workers(args.workers)
    try:
        starts = []
        for name in JOBS:
            config = work / f"{setup}-{name}.toml"
            config.write_text(CONFIG.format(name=name, workers=workers, data=data))
            command = [sys.executable, "-m", "prefetchd", "start", str(config)]
            starts.append(subprocess.Popen(command, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for p in starts:
            if p.wait(300):
                raise SystemExit(f"start failed: {p.stderr.read().decode()}")
        held, done = [], threading.Event()

        def watch_leases() -> None:  # the leases file is replaced whole: each read is one moment's
            while not done.wait(0.05):
                try:
                    leases = json.loads((root / ".cpus" / "leases.json").read_text())
                except (OSError, ValueError):
                    continue
                held.append(sum(e["lease"] for e in leases.values()))

        watcher = threading.Thread(target=watch_leases)
        watcher.start()
        trainers = {}
        for name in JOBS:
            fast = name == "fast"
            argv = [sys.executable, __file__, "--trainer", name, "--epochs", str(args.epochs if fast else 1000)]
            argv += ["--slow-batches", "0" if fast else str(args.slow_batches)]
            argv += ["--step-ms", str(args.fast_step_ms if fast else args.step_ms)]
            trainers[name] = subprocess.Popen(argv, env=run_env, stdout=subprocess.PIPE, text=True)
        result = {name: json.loads(p.communicate(timeout=600)[0]) for name, p in trainers.items()}
        done.set()
        watcher.join()
        result["total_wait_s"] = sum(result[n]["wait_s"] for n in JOBS)
        result["most_cpus_leased"] = max(held) if held else None
        for name in JOBS:
            subprocess.run([sys.executable, "-m", "prefetchd", "stop", name], env=run_env, capture_output=True)
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = common_arguments(__doc__)
    parser.add_argument("--step-ms", type=float, default=300.0, help="the slow trainers' step")
    parser.add_argument("--slow-batches", type=int, default=30)
    parser.add_argument("--fast-step-ms", type=float, default=0.0, help="the fast trainer's step (0: none)")
    parser.add_argument(
        "--fixed-workers", type=int, help="each fixed daemon's workers (default: --workers; a daemon's: cores - 1)"
    )
    parser.add_argument("--trainer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.fixed_workers = args.fixed_workers or args.workers
    if args.trainer:
        trainer(args.trainer, args.epochs, args.slow_batches, args.step_ms / 1000)
        return

    from prefetchd.cli.datagen import make_image_folder

    work = Path(tempfile.mkdtemp(prefix="prefetchd-bench-node-"))
    try:
        data = make_image_folder(work / "images", classes=8, per_class=args.images // 8, size=(300, 500), seed=3)
        results: dict[str, list[dict]] = {"fixed": [], "shared": []}
        for _ in range(args.repeats):
            for setup in results:
                result = run_once(setup, work, data, args, dict(os.environ))
                results[setup].append(result)
                print(setup, json.dumps(result), flush=True)
        ratios = [s["total_wait_s"] / f["total_wait_s"] for s, f in zip(results["shared"], results["fixed"])]
        print(
            json.dumps(
                {
                    "workers": {"fixed": args.fixed_workers, "shared_max_and_node_cpus": args.workers},
                    "median_total_wait_s": {
                        k: statistics.median(r["total_wait_s"] for r in v) for k, v in results.items()
                    },
                    "median_fast_images_per_s": {
                        k: statistics.median(r["fast"]["images_per_s"] for r in v) for k, v in results.items()
                    },
                    "shared_over_fixed_total_wait": [round(r, 3) for r in ratios],
                    "most_cpus_leased": [r["most_cpus_leased"] for r in results["shared"]],
                },
                indent=1,
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
