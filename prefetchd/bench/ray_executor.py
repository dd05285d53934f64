"""--executor ray against local workers at the same CPU count, on a Ray cluster on this machine.

A Ray head node with N CPUs (ray.cluster_utils.Cluster: its processes are this process's
children) runs the tasks of a daemon started with ``--executor ray --workers 0 --ray-workers 2N``
(twice as many batches in flight as CPUs, as docs/scale-out.md advises);
the local daemon has ``--workers N``. Each run delivers ``epochs`` epochs to one trainer as fast
as it can: images/s from the first batch to the last, and the time from ``prefetchd start`` to
the first batch (for Ray: connecting, checking the node's decoders, the first task). Runs
alternate; medians. The overhead target is <= 10 % (a ratio >= 0.90).

    python -m prefetchd.bench.ray_executor [--workers 2] [--repeats 3] [--images 600]

``measure_ray`` is also the Ray row of ``prefetchd bench``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.launch import start_detached, stop_job
from prefetchd.config import build_config
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths

_STORE_BYTES = 256 << 20  # the object store holds the batches in transit: a few MB each
RECIPE = [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}]


def one_run(data: Path, root: Path, name: str, overrides: dict, epochs: int) -> dict:
    raw = {"source": [{"kind": "image_folder", "root": str(data)}], "transform": RECIPE}
    cfg = build_config(raw, base=Path.cwd(), default_name=name, overrides=overrides)
    paths = JobPaths.of(name, root)
    started = time.perf_counter()
    start_detached(cfg, paths)
    try:
        loader = PrefetchLoader(name, root=root, rank=0, world_size=1, timeout=300, as_tensors=False)
        done = []
        for _ in range(epochs):
            for _batch in loader:
                done.append(time.perf_counter())
        loader.close()
    finally:
        stop_job(paths, timeout_s=30)
    images = cfg.batch_size * (len(done) - 1)
    return {"images_per_s": images / (done[-1] - done[0]), "first_batch_s": done[0] - started}


def measure_ray(data: Path, root: Path, *, workers: int, repeats: int, batch: int, epochs: int, buffer: str) -> dict:
    """{"local": [runs], "ray": [runs]} (each run: images/s, first batch s), or {"why": ...}."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        return {"why": "ray is not installed (pip install 'prefetchd[ray]')"}
    # The object store on the same tmpfs as the buffer, sized: both fit, as docs/scale-out.md says.
    node = {"num_cpus": workers, "object_store_memory": _STORE_BYTES, "plasma_directory": "/dev/shm"}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    common = {"batch_size": batch, "buffer": buffer}
    systems = {
        "local": {**common, "workers": workers},
        "ray": {**common, "workers": 0, "executor": "ray", "ray_address": cluster.address, "ray_workers": 2 * workers},
    }
    runs: dict = {name: [] for name in systems}
    try:
        for r in range(repeats):
            order = list(systems) if r % 2 == 0 else list(systems)[::-1]  # drift hits both alike
            for name in order:
                runs[name].append(one_run(data, root, f"ray-bench-{name}-{r}", systems[name], epochs))
    finally:
        cluster.shutdown()
    return runs


def summary(runs: dict) -> dict:
    measures = ("images_per_s", "first_batch_s")
    med = {k: {m: statistics.median(x[m] for x in v) for m in measures} for k, v in runs.items()}
    return {**med, "ratio": med["ray"]["images_per_s"] / med["local"]["images_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--images", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    data = Path(tempfile.mkdtemp(prefix="prefetchd-ray-bench-data-"))
    root = Path(tempfile.mkdtemp(prefix="prefetchd-ray-bench-", dir="/dev/shm"))
    try:
        make_image_folder(data, classes=8, per_class=a.images // 8, size=(300, 500))
        runs = measure_ray(
            data, root, workers=a.workers, repeats=a.repeats, batch=a.batch_size, epochs=a.epochs, buffer="512M"
        )
        print(json.dumps({"runs": runs, "median": summary(runs) if "why" not in runs else runs}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
