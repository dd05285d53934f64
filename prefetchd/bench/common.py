"""What every measurement of the benchmark shares: the recipes and systems compared, the run's
settings, the generated dataset, and the small helpers for timing and medians.

No torch here: the entry point imports this module before it has checked that torch is installed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefetchd.cli.datagen import make_image
from prefetchd.settings import DECODERS
from prefetchd.workers.decoders import resolve_decoder

RECIPES = {
    "rrc": [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}],
    "classic": [{"op": "resize_short", "min": 256, "max": 480}, {"op": "random_crop", "size": 224}, {"op": "hflip"}],
}
RECIPE_NAMES = {"rrc": "random-resized-crop 224 + flip", "classic": "short side 256-480 + crop 224 + flip"}
SYSTEMS = ("prefetchd", "dataloader_persistent", "dataloader_fresh")
# The throughput rows also run prefetchd with each other installed decoder: "prefetchd_<decoder>".
OTHER = "prefetchd_"
SYSTEM_NAMES = {
    "prefetchd": "prefetchd",
    "dataloader_persistent": "DataLoader persistent_workers=True",
    "dataloader_fresh": "DataLoader persistent_workers=False",
}
PAGE = 4096
JPEG_QUALITY = 94  # ~110 KB for a 500 x 375 datagen image, like an average ImageNet training JPEG
CLASSES = 8
CLIENT_BATCH = (256, 224, 224, 3)  # the client-cost row's batch: ImageNet's per-GPU batch


@dataclass(frozen=True)
class Settings:
    """One run's parameters, as parsed from the command line (prefetchd.bench.cli)."""

    images: int
    workers: int
    repeats: int
    batch_size: int
    epochs: int  # per throughput and steady run; 2 gives each run an epoch boundary
    buffer: str
    decoder: str
    steady_load: float  # the steady trainer asks for this fraction of the production capacity
    burst_every: int  # K: steps per burst
    burst_speed: float  # within a burst the trainer steps this many times faster than production
    burst_load: float  # the bursty trainer's average demand, pauses included, as a fraction of capacity
    burst_blocks: int
    restart_contexts: tuple[str, ...]
    client_iters: int
    inprocess_images: int
    out: str
    quick: bool
    dali_path: str | None  # where DALI was pip-installed (--target), for the cold-start row's peer


@dataclass(frozen=True)
class Row:
    """One row of the table; ``values`` holds the figures behind its cells (bench.json)."""

    id: str
    measure: str
    prefetchd: str
    dataloader: str
    ratio: str
    target: str
    holds: bool | None  # None: no target, or not measured
    values: dict


def _write_jpeg(job: tuple[str, int, int, int]) -> int:
    path, seed, w, h = job
    make_image(np.random.default_rng(seed), w, h).save(path, "JPEG", quality=JPEG_QUALITY)
    return os.path.getsize(path)


def make_dataset(
    folder: Path, images: int, size: tuple[int, int] = (500, 375)
) -> tuple[list[tuple[str, int]], list[int]]:
    """ImageNet-like JPEGs as folder/class_XX/img_XXXXX.jpg: 500 x 375 (or `size`), every fourth
    one portrait. Made on every core: 1,500 of them take ~35 s on one. Returns (path, label)
    pairs and the file sizes."""
    files = [(str(folder / f"class_{i % CLASSES:02d}" / f"img_{i:05d}.jpg"), i % CLASSES) for i in range(images)]
    for c in range(min(CLASSES, images)):
        (folder / f"class_{c:02d}").mkdir(parents=True)
    w, h = size
    jobs = [(path, i, *((h, w) if i % 4 == 3 else (w, h))) for i, (path, _) in enumerate(files)]
    # fork: the children need nothing but numpy and Pillow, already imported; nothing has run
    # in torch yet, so no thread pool is copied half-made.
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        sizes = list(pool.map(_write_jpeg, jobs, chunksize=16))
    return files, sizes


def installed_decoders() -> tuple[str, ...]:
    """The decoders of settings.DECODERS whose libraries are installed here."""
    found = []
    for decoder in DECODERS:
        with contextlib.suppress(ImportError):
            found.append(resolve_decoder(decoder))
    return tuple(found)


def touch(images) -> int:
    """Read one byte of every page of a batch's image tensor: the consumer pays for getting the
    data in reach (page faults on a mapping) but no compute, so the loader is the bottleneck."""
    return int(images.numpy().reshape(-1)[::PAGE].sum())


def rotated(items: tuple, r: int) -> tuple:
    """The systems in another order every repeat, so drift (thermal, other load) hits all alike."""
    k = r % len(items)
    return items[k:] + items[:k]


def med(xs: Iterable[float]) -> float:
    return float(statistics.median(xs))


def fmt_ms(x: float) -> str:
    """Seconds as the table shows them: milliseconds below one second."""
    return f"{x * 1000:.2f} ms" if x < 1 else f"{x:.2f} s"
