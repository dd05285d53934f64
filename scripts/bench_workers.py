"""--workers auto against a fixed count, one job alone (issue 28's first figures).

One run alternating the two, medians of --repeats. A folder of generated JPEGs (300-500 px) is
read with random-resized-crop 224 + flip, batch 32, by a trainer in this process:

- **fast**: --epochs epochs as fast as the trainer can take them, each run a cold start inside the
  clock (`prefetchd start` as a user runs it): images/s and the trainer's wait (its loader's
  wait_stats), fixed --workers N against --workers auto --max-workers N.
- **slow**: a trainer whose step takes --step-ms for --slow-s seconds: the CPU the daemon and its
  workers used in the last half of it against the CPU the batches the trainer took cost in the
  fast runs (what the trainer needs), and the memory (RSS) of the daemon and its workers then.

    python scripts/bench_workers.py [--images 400] [--workers 2] [--epochs 3] [--repeats 3]
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

CONFIG = """\
[job]
name = "{name}"
batch_size = 32

[daemon]
buffer = "256M"
{workers}

[[source]]
kind = "image_folder"
root = "{data}"

[[transform]]
op = "random_resized_crop"
size = 224

[[transform]]
op = "hflip"
"""


def common_arguments(doc: str) -> argparse.ArgumentParser:
    """The data, the workers and the runs, as this script and bench_node.py take them."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def auto_workers(most: int) -> str:
    """[daemon]'s lines of --workers auto up to ``most``, with a node budget of as many."""
    return f'workers = "auto"\nmax_workers = {most}\nnode_cpus = {most}'


def _daemon(name: str, env: dict):
    import psutil

    command = [sys.executable, "-m", "prefetchd", "status", name, "--json"]
    shown = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    state = json.loads(shown.stdout)
    return psutil.Process(state["pid"]), state


def _tree(daemon) -> tuple[float, int]:
    """CPU seconds and RSS bytes of the daemon and every process under it (workers, fork server)."""
    family = [daemon, *daemon.children(recursive=True)]
    cpu = rss = 0
    for p in family:
        try:
            cpu += sum(p.cpu_times()[:2])
            rss += p.memory_info().rss
        except Exception:  # noqa: BLE001 - a worker retired meanwhile
            pass
    return cpu, rss


def run_once(name: str, config: Path, env: dict, epochs: int, step_s: float, slow_s: float) -> dict:
    from prefetchd_client import PrefetchLoader

    began = time.perf_counter()
    started = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config)], env=env, capture_output=True, text=True, timeout=300
    )
    if started.returncode:
        raise SystemExit(f"{name}: start failed: {started.stderr}")
    loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=120)
    images = touched = 0
    for _ in range(epochs):
        for batch in loader:
            touched += int(batch["image"][:, ::16, ::16].sum() & 1)  # the trainer touches its pixels
            images += len(batch["index"])
    fast_s = time.perf_counter() - began
    waited = loader.wait_stats["wait_s"]
    daemon, _ = _daemon(name, env)
    cpu_fast, _ = _tree(daemon)
    result = {"images_per_s": images / fast_s, "wait_s": waited, "cpu_ms_per_image": 1000 * cpu_fast / images}
    # The slow trainer: a step of step_s; measured over the second half (the pool has settled).
    taken, half, cpu_half = 0, None, 0.0
    until = time.monotonic() + slow_s
    while time.monotonic() < until:
        for batch in loader:
            touched += int(batch["image"][:, ::16, ::16].sum() & 1)
            time.sleep(step_s)
            if half is None and time.monotonic() > until - slow_s / 2:
                half, cpu_half, taken = time.monotonic(), _tree(daemon)[0], 0
            taken += half is not None
            if time.monotonic() >= until:
                break
    cpu_end, rss = _tree(daemon)
    _, state = _daemon(name, env)
    loader.close()
    subprocess.run([sys.executable, "-m", "prefetchd", "stop", name], env=env, capture_output=True, timeout=120)
    needed = taken * 32 * result["cpu_ms_per_image"] / 1000  # what the batches it took cost to make
    result |= {
        "slow_cpu_s": cpu_end - cpu_half,
        "slow_needed_cpu_s": needed,
        "slow_rss_mb": rss / 2**20,
        "slow_workers": state["workers"]["count"],
    }
    return result


def main() -> None:
    parser = common_arguments(__doc__)
    parser.add_argument("--step-ms", type=float, default=400.0, help="the slow trainer's step")
    parser.add_argument("--slow-s", type=float, default=30.0, help="how long the slow trainer reads")
    args = parser.parse_args()

    from prefetchd.cli.datagen import make_image_folder

    work = Path(tempfile.mkdtemp(prefix="prefetchd-bench-workers-"))
    root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-", dir="/dev/shm"))
    try:
        data = make_image_folder(work / "images", classes=8, per_class=args.images // 8, size=(300, 500), seed=3)
        env = {**os.environ, "PREFETCHD_ROOT": str(root)}
        os.environ["PREFETCHD_ROOT"] = str(root)
        configs = {
            "fixed": CONFIG.format(name="fixed", workers=f"workers = {args.workers}", data=data),
            "auto": CONFIG.format(name="auto", workers=auto_workers(args.workers), data=data),
        }
        results: dict[str, list[dict]] = {"fixed": [], "auto": []}
        for _ in range(args.repeats):
            for name, text in configs.items():
                config = work / f"{name}.toml"
                config.write_text(text)
                result = run_once(name, config, env, args.epochs, args.step_ms / 1000, args.slow_s)
                results[name].append(result)
                print(name, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
        med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
        pairs = list(zip(results["auto"], results["fixed"]))
        print(
            json.dumps(
                {
                    "images": args.images,
                    "workers": args.workers,
                    "median": med,
                    "auto_over_fixed_images_per_s": [round(a["images_per_s"] / f["images_per_s"], 3) for a, f in pairs],
                    "slow_cpu_over_needed": {
                        name: [round(r["slow_cpu_s"] / r["slow_needed_cpu_s"], 3) for r in runs]
                        for name, runs in results.items()
                    },
                },
                indent=1,
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
