"""``prefetchd demo``: the whole path on a generated dataset, in one command.

Generates (once, cached) an ImageFolder of real JPEGs, starts a daemon on it, trains a tiny
CNN on the CPU through PrefetchLoader with a progress bar, prints images/s and how long the
loop waited for data, and stops the daemon.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console

from prefetchd import control
from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.launch import start_detached, stop_job
from prefetchd.cli.terminal import progress
from prefetchd.config import build_config
from prefetchd.errors import ConfigError
from prefetchd.sizes import format_size
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths

# The embedded default; configs/demo.toml is the same recipe as a file.
DEMO_TRANSFORMS = [
    {"op": "random_resized_crop", "size": 128},
    {"op": "hflip"},
    {"op": "color_jitter", "brightness": 0.2, "contrast": 0.2, "saturation": 0.2},
]
DEMO_CLASSES = 10


DEMO_BATCH = 32  # or all the images, when there are fewer


def demo_images(images: int) -> int:
    """How many JPEGs ``--images N`` makes: as many per class, so a multiple of the classes."""
    if images < DEMO_CLASSES:
        raise ConfigError(f"--images must be at least {DEMO_CLASSES} (one per class), got {images}")
    return images // DEMO_CLASSES * DEMO_CLASSES


def demo_folder(images: int) -> Path:
    cache = Path(os.environ.get("PREFETCHD_CACHE", Path.home() / ".cache" / "prefetchd"))
    return cache / f"demo-data-{images}"


def demo_data(images: int, console: Console | None = None) -> Path:
    """The demo's ImageFolder of ``images`` JPEGs (demo_images), generated on first use, with
    its progress on ``console`` (a bar on a terminal, a line every few seconds elsewhere)."""
    folder = demo_folder(images)
    make = functools.partial(make_image_folder, folder, DEMO_CLASSES, images // DEMO_CLASSES, (240, 480))
    if console is None or (folder.is_dir() and sum(1 for _ in folder.rglob("*.jpg")) >= images):
        return make()
    console.print(f"generating {images} JPEGs in {folder} (once: later demos reuse them)", highlight=False)
    with progress(console, "generated JPEGs") as report:
        return make(progress=report)


def _train_step_factory():
    """A tiny CNN step with torch; a numpy stand-in when torch is absent."""
    try:
        import torch
    except ImportError:
        import numpy as np

        def step(batch):
            x = np.asarray(batch["image"], dtype=np.float32)
            return float(x.mean())

        return step
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 5, stride=4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, DEMO_CLASSES),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(batch):
        x = batch["image"].permute(0, 3, 1, 2).float().div_(255)
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def run_demo(*, images: int, epochs: int, workers: int | None, buffer: str, root, console: Console) -> dict:
    images = demo_images(images)
    if epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {epochs}")
    overrides = {"buffer": buffer, "workers": workers, "batch_size": min(DEMO_BATCH, images)}
    raw = {
        "job": {"name": "demo"},
        "source": [{"kind": "image_folder", "root": str(demo_folder(images))}],
        "transform": DEMO_TRANSFORMS,
    }
    cfg = build_config(raw, base=Path.cwd(), default_name="demo", overrides=overrides)
    # Made once the flags are read: a bad one (--buffer abc) left an empty folder in /dev/shm,
    # and generated the JPEGs (seconds) before saying so.
    data = demo_data(images, console)
    root = root or os.environ.get("PREFETCHD_ROOT") or None  # the user's: the job goes, the root stays
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="prefetchd-demo-", dir="/dev/shm")) if own_root else Path(root)
    paths = JobPaths.of(cfg.name, root)
    console.print(
        f"data: {images} JPEGs in {data}; starting job {cfg.name} with {cfg.workers} worker(s) under {root} "
        "(indexing, booting the workers)...",
        highlight=False,
    )
    started = False
    try:
        began = time.perf_counter()
        start_detached(cfg, paths)
        started = True
        serving = f"job {cfg.name} serving after {time.perf_counter() - began:.1f} s; loading the model..."
        console.print(serving, highlight=False)
        loader = PrefetchLoader(cfg.name, root=root, rank=0, world_size=1, timeout=60)
        train_step = _train_step_factory()
        waited, seen, loss = 0.0, 0, float("nan")
        start = time.perf_counter()
        with progress(console, "training") as report:
            steps, total = 0, epochs * len(loader)
            for epoch in range(epochs):
                batches = iter(loader)
                while True:
                    t0 = time.perf_counter()
                    batch = next(batches, None)
                    waited += time.perf_counter() - t0
                    if batch is None:
                        break
                    loss = train_step(batch)
                    seen += len(batch["label"])
                    steps += 1
                    report(steps, total, f"epoch {epoch} loss {loss:.3f}")
        elapsed = time.perf_counter() - start
        status = control.request(paths.endpoint, {"op": "status"}) or {}
        loader.close()
    finally:
        try:
            if started:  # else stop_job's "no job running" would stand in for why the start failed
                stop_job(paths)
        finally:  # whatever the stop said: the demo's own root goes
            if own_root:
                shutil.rmtree(root, ignore_errors=True)
    buf = status.get("buffer", {})
    result = {
        "images": seen,
        "seconds": elapsed,
        "images_per_s": seen / elapsed,
        "waited_s": waited,
        "peak_bytes": buf.get("peak_bytes"),
        "bound_bytes": buf.get("bound_bytes"),
    }
    console.print(
        f"trained {seen} images in {elapsed:.2f} s: {result['images_per_s']:.0f} images/s; "
        f"waited for data {waited:.3f} s ({100 * waited / elapsed:.1f} % of the loop); "
        f"buffer peak {format_size(result['peak_bytes'] or 0)} of {format_size(result['bound_bytes'] or 0)}",
        highlight=False,
    )
    return result
