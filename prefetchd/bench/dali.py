"""NVIDIA DALI's CPU pipeline on a folder of JPEGs: the peer the cold-start rows compare with.

DALI decodes only the region its random crop keeps (``fn.decoders.image_random_crop``: the
same area and aspect-ratio ranges as torchvision's RandomResizedCrop), resizes it to 224 x 224
and flips half the images, on ``--threads`` CPU threads (``device_id=None``: no GPU at all).
The clock starts before the pipeline is built (imports excluded, as for every system) and the
consumer touches every 16th row and column of each batch, as prefetchd.bench.coldstart's do.

DALI is not a dependency of prefetchd (the ``nvidia-dali-cuda120`` wheel is ~1 GB installed):
prefetchd.bench.coldstart runs this module in a child process whose ``PYTHONPATH`` may name a
folder DALI was installed into (``pip install --target DIR nvidia-dali-cuda120``), and prints
one JSON object on stdout:

    python -m prefetchd.bench.dali FOLDER [--batch 32] [--threads 2] [--epochs 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def measure(files: list[str], batch: int, threads: int, epochs: int) -> dict:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0)
    def pipeline():
        jpegs, labels = fn.readers.file(files=files, labels=list(range(len(files))), random_shuffle=True)
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=224, resize_y=224)
        return fn.flip(images, horizontal=fn.random.coin_flip()), labels

    batches = epochs * (len(files) // batch)
    started = time.perf_counter()
    pipe = pipeline()
    pipe.build()
    built = time.perf_counter()
    touched, first = 0, None
    for _ in range(batches):
        images, _ = pipe.run()
        touched += int(np.asarray(images.as_tensor())[:, ::16, ::16].sum() & 1)  # a view, no copy
        first = first or time.perf_counter()
    done = time.perf_counter()
    del pipe
    return {
        "build_s": built - started,
        "first_batch_s": first - started,
        "cold_images_per_s": batches * batch / (done - started),
        "images_per_s": (batches - 1) * batch / (done - first),
        "images": batches * batch,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=8)
    a = p.parse_args(argv)
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        print(json.dumps({"why": "DALI is not installed: pip install nvidia-dali-cuda120 (runs CPU-only)"}))
        return 0
    files = sorted(str(f) for f in Path(a.folder).rglob("*.jpg"))
    print(json.dumps(measure(files, a.batch, a.threads, a.epochs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
