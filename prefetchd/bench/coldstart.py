"""Cold start: from nothing running to 3,200 images in the trainer's hand, for a short run.

A smoke test, a tutorial or a sweep of short trials pays for starting every time. On 400
generated JPEGs of 300-700 px (quality 90), random-resized-crop 224 + flip, batch 32, 2 worker
processes (or threads) per system, 8 epochs, a consumer that touches every 16th row and column
of each batch, alternating runs and medians:

  prefetchd      the clock starts before `prefetchd start` (a process of its own, as a user
                 runs it: the command, the daemon and its workers all start inside the clock);
                 start_s is until it returns, first_batch_s until the first batch is in hand
  DataLoader     Pillow, persistent workers (fork), the clock starts before it is made
  DALI           its CPU pipeline (prefetchd.bench.dali), where installed: --dali-path names
                 a folder it was installed into (pip install --target DIR nvidia-dali-cuda120)

The trainer process's own imports (torch, the client, DALI) are outside every clock. Also
measured: where `prefetchd start` spends its time (an interpreter, the command's imports, the
daemon's, and those of the server workers fork from).

    python -m prefetchd.bench.coldstart [--repeats 3] [--dali-path DIR]

``measure_cold_start`` is also the cold-start rows of ``prefetchd bench``.
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
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from prefetchd.bench.common import installed_decoders
from prefetchd.bench.dataloader import JpegFolder
from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.launch import stop_job
from prefetchd.ops.startclock import process_age_s, steps_in_log
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import read_manifest

IMAGES, BATCH, WORKERS, EPOCHS = 400, 32, 2, 8
# What `prefetchd start` imports, in the order it runs them, each timed alone in a fresh interpreter
# (in a start they overlap: the daemon is launched before the command's imports, and the worker
# server, a fork of the daemon, preloads beside the daemon's own).
STEPS = {
    "interpreter": "pass",
    "command (prefetchd.cli.app)": "import prefetchd.cli.app",
    "daemon (master side)": "import prefetchd.master.daemon, prefetchd.config, prefetchd.master.startup",
    "worker server (preload)": "import prefetchd.workers.worker, cv2, simplejpeg",
}


def make_data(folder: Path, images: int) -> list[tuple[str, int]]:
    make_image_folder(folder, classes=4, per_class=images // 4, size=(300, 700), seed=7, quality=90)
    return [(str(p), int(p.parent.name.split("_")[1])) for p in sorted(folder.rglob("*.jpg"))]


def touch(images: torch.Tensor) -> int:
    """Every 16th row and column: the consumer reads the batch, cheaply."""
    return int(images[:, ::16, ::16].sum())


def _walk(make_iter: Callable[[], object], t0: float, epochs: int) -> dict:
    """Consume `epochs` epochs; the clock's readings from t0."""
    first, images = None, 0
    for _ in range(epochs):
        for batch in make_iter():
            touch(batch["image"])
            images += len(batch["image"])
            first = first or time.perf_counter()
    done = time.perf_counter()
    return {
        "first_batch_s": first - t0,
        "cold_images_per_s": images / (done - t0),
        "images_per_s": (images - BATCH) / (done - first),
        "images": images,
    }


def prefetchd_cold(folder: Path, root: Path, decoder: str, name: str, epochs: int) -> dict:
    """`prefetchd start` as a user runs it, then a PrefetchLoader through `epochs` epochs."""
    config = root / f"{name}.toml"
    config.write_text(
        f'[job]\nbatch_size = {BATCH}\ndecoder = "{decoder}"\n[daemon]\nworkers = {WORKERS}\nbuffer = "1G"\n'
        f'[[source]]\nkind = "image_folder"\nroot = "{folder}"\n'
        '[[transform]]\nop = "random_resized_crop"\nsize = 224\n[[transform]]\nop = "hflip"\n'
    )
    command = [sys.executable, "-m", "prefetchd", "start", str(config), "--name", name, "--root", str(root)]
    t0 = time.perf_counter()
    started = subprocess.run(command, capture_output=True, text=True, timeout=120)
    start_s = time.perf_counter() - t0
    if started.returncode:
        raise RuntimeError(f"prefetchd start failed ({started.returncode}): {started.stderr.strip()}")
    loader = PrefetchLoader(name, root=root, rank=0, world_size=1, timeout=120)
    paths = JobPaths.of(name, root)
    try:
        result = _walk(lambda: iter(loader), t0, epochs)
        steps = steps_in_log(paths.log.read_text(errors="replace")) or {}
        daemon_began = time.perf_counter() - t0 - process_age_s(read_manifest(paths)["pid"])
    finally:
        loader.close()
        stop_job(paths, timeout_s=10)
    # On the clock of the run: the daemon's steps count from its process's start (the kernel's
    # clock ticks, 10 ms), which is when the command launched it.
    daemon_steps = {"daemon launched_s": daemon_began} | {f"daemon {k}_s": daemon_began + v for k, v in steps.items()}
    return {"start_s": start_s, "start_to_first_batch_s": result["first_batch_s"] - start_s, **result, **daemon_steps}


def dataloader_cold(files: list[tuple[str, int]], epochs: int) -> dict:
    t0 = time.perf_counter()
    loader = DataLoader(
        JpegFolder(files, "rrc"),
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        persistent_workers=True,
        drop_last=True,
    )
    iters = []

    def epoch():
        iters.append(iter(loader))
        return iters[-1]

    try:
        return _walk(epoch, t0, epochs)
    finally:
        for it in iters:
            getattr(it, "_shutdown_workers", lambda: None)()


def dali_cold(folder: Path, dali_path: str | None, epochs: int) -> dict:
    env = dict(os.environ)
    if dali_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (dali_path, env.get("PYTHONPATH")) if p)
    args = [str(folder), "--batch", str(BATCH), "--threads", str(WORKERS), "--epochs", str(epochs)]
    command = [sys.executable, "-m", "prefetchd.bench.dali", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"why": f"prefetchd.bench.dali failed ({done.returncode}): {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def start_breakdown(repeats: int = 5) -> dict:
    """Median seconds of each step of `prefetchd start`, each in a fresh interpreter (its
    imports alone; the interpreter's own start is the first row)."""
    out = {}
    for step, code in STEPS.items():
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
            times.append(time.perf_counter() - t)
        out[step] = statistics.median(times)
    return out


def measure_cold_start(
    decoders: tuple[str, ...],
    repeats: int,
    *,
    quick: bool = False,
    dali_path: str | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Every system `repeats` times, alternating: the raw runs per system, and the breakdown.
    quick: 64 images, 2 epochs (every code path, seconds)."""
    images, epochs = (64, 2) if quick else (IMAGES, EPOCHS)
    data = Path(tempfile.mkdtemp(prefix="prefetchd-cold-data-"))
    root = Path(tempfile.mkdtemp(prefix="prefetchd-cold-", dir="/dev/shm"))
    try:
        files = make_data(data, images)
        systems = ["dataloader", *(f"prefetchd_{d}" for d in decoders), "dali"]
        runs: dict[str, list] = {s: [] for s in systems}
        for r in range(repeats):
            for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
                if system == "dataloader":
                    got = dataloader_cold(files, epochs)
                elif system == "dali":
                    got = dali_cold(data, dali_path, epochs)
                else:
                    got = prefetchd_cold(data, root, system.removeprefix("prefetchd_"), f"cold-{r}-{system}", epochs)
                runs[system].append(got)
                log(f"cold start #{r} {system}: " + ", ".join(f"{k} {v:.3g}" for k, v in got.items() if k != "why"))
        if all("why" in x for x in runs["dali"]):
            log(f"cold start: no DALI row: {runs['dali'][0]['why']}")
            runs["dali"] = {"why": runs["dali"][0]["why"]}
        return {
            "images": images,
            "epochs": epochs,
            "batch": BATCH,
            "workers": WORKERS,
            "runs": runs,
            "start_breakdown_s": start_breakdown(1 if quick else 5),
            "cleanup": [str(data), str(root)],
        }
    finally:
        for job in root.iterdir() if root.exists() else ():
            if job.is_dir():
                try:
                    stop_job(JobPaths(job), timeout_s=10)
                except Exception:  # noqa: BLE001 - stopped or gone: removed below either way
                    pass
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


def describe(cold: dict) -> str:
    return (
        f"{cold['images']} JPEGs 300-700 px x {cold['epochs']} epochs, rrc 224 + flip, batch {cold['batch']}, "
        f"{cold['workers']} workers, `prefetchd start` inside the clock"
    )


def summary(cold: dict) -> dict:
    """Medians per system, and ratios to DataLoader."""
    out = {}
    for system, runs in cold["runs"].items():
        if isinstance(runs, dict):
            continue
        keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
        out[system] = {k: statistics.median(x[k] for x in runs) for k in keys}
    base = out["dataloader"]
    for m in out.values():
        m["cold_ratio"] = m["cold_images_per_s"] / base["cold_images_per_s"]
        m["ratio"] = m["images_per_s"] / base["images_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dali-path", help="a folder DALI was pip-installed into (--target), if not importable")
    a = p.parse_args(argv)
    log = lambda text: print(text, file=sys.stderr)  # noqa: E731
    cold = measure_cold_start(installed_decoders(), a.repeats, dali_path=a.dali_path, log=log)
    print(json.dumps({"summary": summary(cold), **cold}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
