"""Two trainers reading one job (two consumers) against one trainer (issue 28's fourth figure).

One run alternating the two cases, medians of --repeats. A folder of generated JPEGs (300-500 px)
is read with random-resized-crop 224 + flip, batch 32, through a buffer shorter than the run (so
the daemon deletes and refills as the trainers go): one trainer process reading --epochs epochs,
then two trainer processes (``consumer="a"`` and ``"b"``) reading the same epochs at once. What
the daemon and its workers spent (CPU seconds, from the end of `prefetchd start` to the last
batch read), the batches it made (``totals.produced``), its peak against the bound, and the
trainers' images/s. Each batch made once, the two-trainer run costs the daemon what the
one-trainer run did.

    python scripts/bench_consumers.py [--images 400] [--workers 2] [--epochs 6] [--repeats 3] [--buffer 128M]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_workers import CONFIG, _daemon, _tree, common_arguments  # noqa: E402

TRAINER = """\
import json, sys, time
from prefetchd_client import PrefetchLoader
name, consumer, epochs = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=120, consumer=consumer)
print("ready", flush=True)
sys.stdin.readline()  # all trainers begin together: a start skew is not what is measured
began, images, touched = time.perf_counter(), 0, 0
for _ in range(epochs):
    for batch in loader:
        touched += int(batch["image"][:, ::16, ::16].sum() & 1)  # the trainer touches its pixels
        images += len(batch["index"])
print(json.dumps({"images": images, "seconds": time.perf_counter() - began, "wait_s": loader.wait_stats["wait_s"]}))
loader.close()
"""


def run_once(name: str, config: Path, env: dict, epochs: int, consumers: list[str]) -> dict:
    started = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config)], env=env, capture_output=True, text=True, timeout=300
    )
    if started.returncode:
        raise SystemExit(f"{name}: start failed: {started.stderr}")
    daemon, _ = _daemon(name, env)
    cpu_before, _ = _tree(daemon)
    trainers = [
        subprocess.Popen(
            [sys.executable, "-c", TRAINER, name, c, str(epochs)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for c in consumers
    ]
    for t in trainers:
        assert t.stdout.readline().strip() == "ready"
    for t in trainers:
        t.stdin.write("go\n")
        t.stdin.flush()
    reports = [json.loads(t.communicate(timeout=600)[0]) for t in trainers]
    cpu_after, _ = _tree(daemon)
    _, state = _daemon(name, env)
    subprocess.run([sys.executable, "-m", "prefetchd", "stop", name], env=env, capture_output=True, timeout=120)
    images = reports[0]["images"]
    return {
        "daemon_cpu_s": cpu_after - cpu_before,
        "produced": state["totals"]["produced"],
        "peak_over_bound": state["buffer"]["peak_bytes"] / state["buffer"]["bound_bytes"],
        "images_per_s_each": statistics.mean(r["images"] / r["seconds"] for r in reports),
        "daemon_cpu_ms_per_image_read": 1000 * (cpu_after - cpu_before) / images,
    }


def main() -> None:
    parser = common_arguments(__doc__)
    parser.set_defaults(epochs=6)
    parser.add_argument("--buffer", default="128M", help="26 batches of 4.8 MB: a window of 24, 2 epochs of 12")
    args = parser.parse_args()

    from prefetchd.cli.datagen import make_image_folder

    work = Path(tempfile.mkdtemp(prefix="prefetchd-bench-consumers-"))
    root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-", dir="/dev/shm"))
    try:
        data = make_image_folder(work / "images", classes=8, per_class=args.images // 8, size=(300, 500), seed=3)
        env = {**os.environ, "PREFETCHD_ROOT": str(root)}
        text = CONFIG.format(name="shared", workers=f"workers = {args.workers}", data=data)
        config = work / "shared.toml"
        config.write_text(text.replace('buffer = "256M"', f'buffer = "{args.buffer}"'))
        cases = {"one": [""], "two": ["a", "b"]}
        results: dict[str, list[dict]] = {case: [] for case in cases}
        for _ in range(args.repeats):
            for case, consumers in cases.items():
                result = run_once("shared", config, env, args.epochs, consumers)
                results[case].append(result)
                print(case, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
                time.sleep(1)
        med = {case: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for case, runs in results.items()}
        pairs = list(zip(results["two"], results["one"]))
        print(
            json.dumps(
                {
                    "images": args.images,
                    "workers": args.workers,
                    "epochs": args.epochs,
                    "median": med,
                    "two_over_one_daemon_cpu": [round(t["daemon_cpu_s"] / o["daemon_cpu_s"], 3) for t, o in pairs],
                    "two_over_one_produced": [round(t["produced"] / o["produced"], 3) for t, o in pairs],
                },
                indent=1,
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
