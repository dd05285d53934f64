"""Every measurement of one run, in order, into one dict of raw figures (bench.json's body)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict

import numpy as np
import PIL
import torch

from prefetchd.bench.clientcost import measure_client
from prefetchd.bench.coldstart import measure_cold_start
from prefetchd.bench.common import JPEG_QUALITY, installed_decoders, make_dataset
from prefetchd.bench.packed import measure_packed
from prefetchd.bench.ray_executor import measure_ray
from prefetchd.bench.restart import measure_restart
from prefetchd.bench.run import Run
from prefetchd.bench.throughput import measure_throughput
from prefetchd.bench.trainers import measure_trainers


def environment(sizes: list[int]) -> dict:
    """The machine, the libraries and the dataset the figures come from."""
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "dataset": {
            "images": len(sizes),
            "mean_kb": sum(sizes) / len(sizes) / 1000,
            "pixels": "500x375, every fourth 375x500",
            "jpeg_quality": JPEG_QUALITY,
        },
    }


def measure_all(run: Run) -> dict:
    """Generate the data, then measure every row; the systems alternate within each row."""
    s = run.s
    started = time.perf_counter()
    run.log(f"generating {s.images} JPEGs in {run.data}; jobs under {run.root}")
    run.files, sizes = make_dataset(run.data, s.images)
    results = {"settings": asdict(s), "environment": environment(sizes)}
    measure_client(run, results)
    results["cold_start"] = measure_cold_start(
        installed_decoders(), s.repeats, quick=s.quick, dali_path=s.dali_path, log=run.log
    )
    measure_throughput(run, results)
    measure_trainers(run, results)
    measure_restart(run, results)
    measure_packed(run, results)
    if s.quick:  # a Ray cluster alone takes most of --quick's minute to start
        results["ray"] = {"why": "--quick; run without it, or python -m prefetchd.bench.ray_executor"}
    else:
        results["ray"] = measure_ray(
            run.data,
            run.root,
            workers=s.workers,
            repeats=s.repeats,
            batch=s.batch_size,
            epochs=s.epochs,
            buffer=s.buffer,
        )
    results["cleanup"] = {"root": str(run.root), "data": str(run.data), "packs": str(run.packs)}
    results["seconds"] = time.perf_counter() - started
    return results
