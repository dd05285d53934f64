"""Time from a fresh trainer process to its first batch: prefetchd's warm buffer vs DataLoader.

A trainer reads a few batches and "crashes"; a new process resumes from its state. With
prefetchd the batches are already in the buffer; DataLoader starts its workers and makes
the first batch from scratch (fork, spawn and forkserver). Runs alternate; medians.

    python -m prefetchd.bench.restart [--repeats 5] [--workers 1]

``measure_restart`` is the trainer-restart row of ``prefetchd bench``: ``time_restarts`` on its
data, batch size and workers.
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
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefetchd import control
from prefetchd.bench.common import PAGE
from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.launch import start_detached, stop_job
from prefetchd.config import build_config
from prefetchd_client.layout import JobPaths

if TYPE_CHECKING:
    from prefetchd.bench.run import Run

BATCH = 32
PREFETCHD_TRAINER = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    from prefetchd_client import PrefetchLoader
    t1 = time.perf_counter()
    loader = PrefetchLoader("restart", root=sys.argv[1], rank=0, world_size=1, timeout=120)
    if sys.argv[2] != "-":
        loader.load_state_dict(json.load(open(sys.argv[2])))
    batch = next(iter(loader))
    t2 = time.perf_counter()
    print(json.dumps({"imports_s": t1 - t0, "first_batch_s": t2 - t1, "n": len(batch["label"])}), flush=True)
""")
DATALOADER_TRAINER = textwrap.dedent("""
    import json, math, os, sys, time
    t0 = time.perf_counter()
    import numpy as np, torch
    from PIL import Image
    t1 = time.perf_counter()

    class Folder(torch.utils.data.Dataset):
        # The usual way: PIL open -> random-resized-crop -> flip -> uint8 array.
        def __init__(self, root):
            self.items = [(os.path.join(root, c, f), i) for i, c in enumerate(sorted(os.listdir(root)))
                          for f in sorted(os.listdir(os.path.join(root, c)))]
        def __len__(self):
            return len(self.items)
        def __getitem__(self, i):
            path, label = self.items[i]
            rng = np.random.default_rng(i)
            img = Image.open(path).convert("RGB")
            w, h = img.size
            for _ in range(10):
                area = w * h * rng.uniform(0.08, 1.0)
                ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
                cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
                if 0 < cw <= w and 0 < ch <= h:
                    x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
                    break
            else:
                cw, ch, x, y = w, h, 0, 0
            img = img.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            return torch.from_numpy(np.asarray(img).copy()), label

    if __name__ == "__main__":  # spawn and forkserver import this file in each worker
        loader = torch.utils.data.DataLoader(Folder(sys.argv[1]), batch_size=int(sys.argv[2]), shuffle=True,
                                             num_workers=int(sys.argv[3]), multiprocessing_context=sys.argv[4])
        batch = next(iter(loader))
        t2 = time.perf_counter()
        print(json.dumps({"imports_s": t1 - t0, "first_batch_s": t2 - t1, "n": len(batch[1])}), flush=True)
""")


def run_trainer(script: Path, args: list[str]) -> dict:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return result


def wait_until_idle(paths: JobPaths, timeout_s: float = 120.0) -> None:
    """Wait until the daemon's window is full and its workers idle: a daemon still filling its
    buffer would take CPU from the DataLoader trainers being timed."""
    deadline, idle_seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and idle_seen < 3:
        status = control.request_job(paths, {"op": "status"}) or {}
        idle_seen = idle_seen + 1 if status.get("workers", {}).get("busy", 1) == 0 else 0
        time.sleep(0.1)


def time_restarts(
    data: Path,
    root: Path,
    *,
    workers: int,
    repeats: int,
    batch: int = BATCH,
    contexts: tuple[str, ...] = ("fork", "spawn", "forkserver"),
    buffer: str = "512M",
    decoder: str = "pillow",
) -> dict[str, list[dict]]:
    """Time fresh trainers to their first batch: prefetchd from a warm buffer, then DataLoader in
    each multiprocessing context, alternating per repeat. ``root`` is a private job root; the
    daemon started here is stopped before this returns, whatever happens."""
    raw = {
        "source": [{"kind": "image_folder", "root": str(data)}],
        "transform": [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}],
        "job": {"decoder": decoder},
    }
    cfg = build_config(
        raw,
        base=Path.cwd(),
        default_name="restart",
        overrides={"batch_size": batch, "workers": workers, "buffer": buffer, "retain": 4},
    )
    paths = JobPaths.of("restart", root)
    state_file = root / "state.json"
    rows = {"prefetchd (warm)": [], **{f"DataLoader {ctx}": [] for ctx in contexts}}
    try:
        start_detached(cfg, paths)
        # The "crashed" trainer: read 3 batches (fewer in a tiny epoch, so its restart resumes
        # inside the same epoch), keep the state a checkpoint would hold.
        crash = textwrap.dedent(f"""
            import json
            from prefetchd_client import PrefetchLoader
            loader = PrefetchLoader("restart", root="{root}", rank=0, world_size=1, as_tensors=False)
            it = iter(loader)
            for _ in range(min(3, len(loader) - 1)):
                next(it)
            json.dump(loader.state_dict(), open("{state_file}", "w"))
        """)
        subprocess.run([sys.executable, "-c", crash], check=True, timeout=300)
        # The daemon fills the window ahead, as it would while the trainer restarts.
        wait_until_idle(paths)
        scripts = {}
        for name, code in (("prefetchd_trainer.py", PREFETCHD_TRAINER), ("dataloader_trainer.py", DATALOADER_TRAINER)):
            scripts[name] = root / name
            scripts[name].write_text(code)
        for _ in range(repeats):
            rows["prefetchd (warm)"].append(run_trainer(scripts["prefetchd_trainer.py"], [str(root), str(state_file)]))
            for ctx in contexts:
                rows[f"DataLoader {ctx}"].append(
                    run_trainer(scripts["dataloader_trainer.py"], [str(data), str(batch), str(workers), ctx])
                )
    finally:
        if paths.dir.exists():
            stop_job(paths)
    return rows


def measure_restart(run: Run, results: dict) -> None:
    """The trainer-restart row: ``time_restarts`` on this run's data, batch size and workers."""
    s = run.s
    batch_bytes = s.batch_size * 224 * 224 * 3 + 2 * PAGE
    rows = time_restarts(
        run.data,
        run.root,
        workers=s.workers,
        repeats=s.repeats,
        batch=s.batch_size,
        contexts=s.restart_contexts,
        buffer=f"{12 * batch_bytes // 2**20 + 1}M",  # ~12 batches: the window fills in seconds
        decoder=s.decoder,
    )
    results["restart"] = rows
    for name, runs in rows.items():
        run.log(f"restart: {name} first batch {statistics.median(x['first_batch_s'] for x in runs) * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--images", type=int, default=256)
    args = parser.parse_args()

    cache = Path(os.environ.get("PREFETCHD_CACHE", Path.home() / ".cache" / "prefetchd"))
    data = make_image_folder(cache / f"bench-{args.images}", classes=8, per_class=args.images // 8, size=(375, 500))
    root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-", dir="/dev/shm"))
    try:
        rows = time_restarts(data, root, workers=args.workers, repeats=args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"time to first batch of {BATCH} x 224x224 after a trainer restart, {args.workers} worker(s), "
        f"median of {args.repeats} (seconds)"
    )
    print(f"{'':24} {'after imports':>14} {'process start':>14}")
    base = statistics.median(r["first_batch_s"] for r in rows["prefetchd (warm)"])
    for name, results in rows.items():
        first = statistics.median(r["first_batch_s"] for r in results)
        whole = statistics.median(r["process_s"] for r in results)
        print(f"{name:24} {first:14.4f} {whole:14.3f}   x{first / base:,.0f}")


if __name__ == "__main__":
    main()
