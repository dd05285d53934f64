"""prefetchd against torch.utils.data.DataLoader: the same JPEGs, recipe and number of workers.

One run measures every row below on one folder of generated ImageNet-sized JPEGs (500 x 375
or 375 x 500, ~110 KB, made with prefetchd.cli.datagen in a temporary folder removed at the end).
Within each repeat the systems alternate (the order rotates), and the table shows medians
over the repeats. The systems: prefetchd (one daemon with N workers, PrefetchLoader) and
DataLoader (the usual Dataset: PIL open and full decode, the recipe, flip, uint8 HWC tensor;
default collate, num_workers=N, shuffle, no pinning) with persistent_workers True and False.

  throughput       images/s delivered to a consumer that only reads one byte of every page,
                   for random-resized-crop 224 + flip, and shortest side 256-480 + random crop
                   224 + flip; ratio prefetchd / the faster DataLoader
  scaling          prefetchd images/s with N workers / (N x one in-process ImagePipeline loop);
                   beside it, N such loops at once, no loader: what the machine itself gives
  steady trainer   a loop that sleeps a fixed step, 80 % of the production capacity: its waits
  bursty trainer   blocks of K steps faster than production, each after a pause that brings
                   the average demand to 80 % of capacity: its waits
  epoch boundary   the steady trainer's wait for the first batch of each new epoch, and
                   whether prefetchd had it in the buffer when the trainer asked
  trainer restart  a fresh trainer process to its first batch (scripts/bench_restart.py)
  client cost      map + header parse + tensors for a 256 x 224 x 224 x 3 batch vs np.copyto of it
  daemon cost      CPU of the daemon's master per 1,000 batches, of its workers per image
  ray              --executor ray on a Ray cluster of N CPUs on this machine vs N local workers:
                   images/s and start-to-first-batch (scripts/bench_ray.py; needs prefetchd[ray])

It prints the table, and writes into --out: bench.json (every raw figure), bench.md (the
table in Markdown) and bench_timeline.png (prefetchd's buffer fill and every system's per-step waits; matplotlib,
from the `bench` extra). Everything it starts is stopped, and everything it writes outside
--out is removed, also on Ctrl-C or an error.

    python scripts/bench.py [--quick] [--images 1500] [--workers N] [--repeats 3] [--batch-size 64]
    prefetchd bench ...      (the same, from a source checkout)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import bench_coldstart  # siblings in scripts/: python puts this file's folder first on sys.path
import bench_ray
import bench_restart
import numpy as np
import PIL
import psutil
import torch
from bench_dataloader import JpegFolder
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from prefetchd import control
from prefetchd.cli.datagen import make_image
from prefetchd.cli.launch import start_detached, stop_job
from prefetchd.config import build_config, default_workers
from prefetchd.settings import DECODERS
from prefetchd.sources.index import read_image_file
from prefetchd.workers.transforms import ImagePipeline, resolve_decoder
from prefetchd_client import PrefetchLoader
from prefetchd_client.batchfile import BatchLayout, BatchWriter, FieldSpec, map_batch
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest

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
ROWS = (
    "cold_start",
    "start",
    "throughput_rrc",
    "throughput_classic",
    "throughput_pillow",
    "throughput_simplejpeg",
    "partial_decode",
    "scaling_rrc",
    "scaling_classic",
    "steady_trainer",
    "bursty_trainer",
    "epoch_boundary",
    "trainer_restart",
    "client_cost",
    "daemon_cost",
)
PAGE = 4096
JPEG_QUALITY = 94  # ~110 KB for a 500 x 375 datagen image, like an average ImageNet training JPEG
CLASSES = 8
CLIENT_BATCH = (256, 224, 224, 3)  # the client-cost row's batch: ImageNet's per-GPU batch


@dataclass(frozen=True)
class Settings:
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


def parse_args(argv: list[str] | None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny data, 1 repeat, every code path: under a minute")
    p.add_argument("--images", type=int, help="JPEGs to generate [1500; quick 48]")
    p.add_argument("--workers", type=int, help=f"worker processes N, both systems [cores - 1 = {default_workers()}]")
    p.add_argument("--repeats", type=int, help="repeats per row; medians are reported [3; quick 1]")
    p.add_argument("--batch-size", type=int, help="samples per batch [64; quick 8]")
    p.add_argument("--buffer", help="prefetchd's byte bound [1G; quick 32M]")
    p.add_argument(
        "--decoder", default="auto", choices=("auto", *DECODERS), help="prefetchd's JPEG decoder [auto: the default's]"
    )
    p.add_argument("--burst-every", type=int, help="steps per burst of the bursty trainer [20; quick 4]")
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench_timeline.png")
    p.add_argument("--dali-path", help="a folder DALI was installed in (pip install --target DIR nvidia-dali-cuda120)")
    a = p.parse_args(argv)
    q = a.quick
    s = Settings(
        images=a.images or (48 if q else 1500),
        workers=a.workers or default_workers(),
        repeats=a.repeats or (1 if q else 3),
        batch_size=a.batch_size or (8 if q else 64),
        epochs=2,
        buffer=a.buffer or ("32M" if q else "1G"),
        decoder=resolve_decoder(a.decoder),  # what a default install runs: the fastest installed
        steady_load=0.8,
        burst_every=a.burst_every or (4 if q else 20),
        burst_speed=1.5,
        burst_load=0.8,
        burst_blocks=2 if q else 3,
        # spawn and forkserver differ from fork only by the context name: quick keeps fork.
        restart_contexts=("fork",) if q else ("fork", "spawn", "forkserver"),
        client_iters=10 if q else 100,
        inprocess_images=32 if q else 300,
        out=a.out,
        quick=q,
        dali_path=a.dali_path,
    )
    if s.images // s.batch_size < 2:
        p.error(f"--images {s.images} holds fewer than 2 batches of {s.batch_size}")
    return s


# ---------------------------------------------------------------- data


def _write_jpeg(job: tuple[str, int, int, int]) -> int:
    path, seed, w, h = job
    make_image(np.random.default_rng(seed), w, h).save(path, "JPEG", quality=JPEG_QUALITY)
    return os.path.getsize(path)


def make_dataset(folder: Path, images: int) -> tuple[list[tuple[str, int]], list[int]]:
    """ImageNet-like JPEGs as folder/class_XX/img_XXXXX.jpg: 500 x 375, every fourth one
    portrait. Made on every core: 1,500 of them take ~35 s on one. Returns (path, label)
    pairs and the file sizes."""
    files = [(str(folder / f"class_{i % CLASSES:02d}" / f"img_{i:05d}.jpg"), i % CLASSES) for i in range(images)]
    for c in range(min(CLASSES, images)):
        (folder / f"class_{c:02d}").mkdir(parents=True)
    jobs = [(path, i, *((375, 500) if i % 4 == 3 else (500, 375))) for i, (path, _) in enumerate(files)]
    # fork: the children need nothing but numpy and Pillow, already imported; nothing has run
    # in torch yet, so no thread pool is copied half-made.
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        sizes = list(pool.map(_write_jpeg, jobs, chunksize=16))
    return files, sizes


# ---------------------------------------------------------------- one run: what it owns


class Run:
    """What one benchmark run owns: the data folder, the job root and every daemon started
    in it. close() stops the daemons (prefetchd stop, then their recorded pids) and removes
    both folders, whatever state the run is in."""

    def __init__(self, s: Settings, console: Console):
        self.s, self.console = s, console
        self.data = Path(tempfile.mkdtemp(prefix="prefetchd-bench-data-"))
        self.root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-", dir="/dev/shm"))
        self.jobs: list[JobPaths] = []
        # Every daemon master and worker this run saw, with its start time: a pid the kernel
        # has given to another process since is never killed.
        self.pids: dict[int, float] = {}
        self.files: list[tuple[str, int]] = []
        self._names = itertools.count()

    def log(self, text: str) -> None:
        self.console.log(text, highlight=False)

    def start_job(self, recipe: str, tag: str, decoder: str | None = None, **overrides) -> tuple[JobPaths, int]:
        """Start a prefetchd daemon serving `recipe` on this run's data; returns (paths, master pid)."""
        s = self.s
        name = f"{tag}-{next(self._names)}"
        raw = {
            "job": {"decoder": decoder or s.decoder},
            "source": [{"kind": "image_folder", "root": str(self.data)}],
            "transform": RECIPES[recipe],
        }
        settings = {"batch_size": s.batch_size, "workers": s.workers, "buffer": s.buffer, **overrides}
        cfg = build_config(raw, base=Path.cwd(), default_name=name, overrides=settings)
        paths = JobPaths.of(name, self.root)
        self.jobs.append(paths)
        pid = int(start_detached(cfg, paths)["pid"])
        self.remember(pid)
        return paths, pid

    def remember(self, master_pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            master = psutil.Process(master_pid)
            for proc in (master, *master.children(recursive=True)):
                self.pids[proc.pid] = proc.create_time()

    def stop_job(self, paths: JobPaths) -> None:
        if paths.dir.exists():
            with contextlib.suppress(Exception):
                stop_job(paths, timeout_s=10)

    def close(self) -> None:
        # A daemon interrupted while it started has no manifest yet: it is our child, and its
        # command line names a job folder under our private root.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    if f"--job-dir {self.root}/" in " ".join(child.cmdline()):
                        self.remember(child.pid)
        # Every job folder under our root: ours, and the restart row's (bench_restart's).
        found = self.root.iterdir() if self.root.exists() else ()
        jobs = {*self.jobs, *(JobPaths(d) for d in found if d.is_dir())}
        for paths in jobs:
            if daemon_alive(paths):
                with contextlib.suppress(Exception):
                    self.remember(int(read_manifest(paths)["pid"]))
            self.stop_job(paths)
        # Belt and braces: a daemon that did not answer `stop` is killed by the pid we saw.
        procs = []
        for pid, started in self.pids.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    procs.append(proc)
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.data, ignore_errors=True)


# ---------------------------------------------------------------- systems and consumers


@contextlib.contextmanager
def open_system(run: Run, system: str, recipe: str, tag: str) -> Iterator[tuple]:
    """Yield (loader, paths, master pid) ready to iterate; paths and pid are None for DataLoader.
    The daemon is started fresh (empty buffer) and stopped on the way out."""
    s = run.s
    if system.startswith("prefetchd"):
        paths, pid = run.start_job(recipe, tag, decoder=system.removeprefix(OTHER) if system != "prefetchd" else None)
        loader = PrefetchLoader(paths.name, root=run.root, rank=0, world_size=1, timeout=120)
        try:
            yield loader, paths, pid
        finally:
            loader.close()
            run.stop_job(paths)
        return
    loader = DataLoader(
        JpegFolder(run.files, recipe),
        batch_size=s.batch_size,
        shuffle=True,
        num_workers=s.workers,
        persistent_workers=system == "dataloader_persistent",
        pin_memory=False,
        drop_last=True,  # prefetchd's default too: every batch full
    )
    yield loader, None, None


class Batches:
    """(epoch, step, batch) over `epochs` epochs, as `for epoch ...: for batch in loader`.

    The first epoch's iterator is made here, as a trainer makes it before its first step: a
    DataLoader forks its workers now (a prefetchd daemon is already producing). It keeps no
    reference to a batch it handed out (no enumerate, whose reused tuple would): a batch is
    freed when the trainer drops it, or by the loader itself, as in a plain loop. close()
    ends a DataLoader's workers even mid-epoch."""

    def __init__(self, loader, epochs: int):
        self._iters = [iter(loader)]
        self._gen = self._walk(loader, epochs)

    def _walk(self, loader, epochs: int):
        for epoch in range(epochs):
            if epoch:
                self._iters.append(iter(loader))
            step = 0
            for batch in self._iters[-1]:
                yield epoch, step, batch
                del batch
                step += 1

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        for it in self._iters:  # persistent workers live in the loader's iterator
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iters.clear()


def touch(images: torch.Tensor) -> int:
    """Read one byte of every page of the batch: the consumer pays for getting the data in
    reach (page faults on a mapping) but no compute, so the loader is the bottleneck."""
    return int(images.numpy().reshape(-1)[::PAGE].sum())


def consume(
    batches: Batches,
    steps: int | None,
    plan: Callable[[int], tuple[float, float]],
    t0: float | None = None,
    ready: Callable[[int], bool] | None = None,
) -> list[dict]:
    """A trainer: for step i, sleep `pause`, wait for the batch, touch it, then "compute" for
    `work` seconds (a sleep, as a GPU step leaves the CPU free); (pause, work) = plan(i).
    Returns, per step, when it asked (t, seconds since t0), how long it waited, when it had
    touched the batch, and (prefetchd: `ready`, looked at just before asking) whether the
    batch was already in the buffer: then its wait is the client's own cost, not data's."""
    records, t0 = [], time.perf_counter() if t0 is None else t0
    for i in itertools.count():
        if steps is not None and i >= steps:
            break
        pause, work = plan(i)
        if pause:
            time.sleep(pause)
        was_ready = ready(i) if ready else None
        asked = time.perf_counter()
        try:
            epoch, step, batch = next(batches)
        except StopIteration:
            break
        got = time.perf_counter()
        touch(batch["image"])
        done = time.perf_counter()
        del batch  # a mapped prefetchd batch can be freed once no array holds it
        records.append(
            {"epoch": epoch, "step": step, "t": asked - t0, "wait": got - asked, "done": done - t0, "ready": was_ready}
        )
        if work:
            time.sleep(work)
    return records


class BufferSampler:
    """Samples the daemon's status (what `prefetchd status --json` prints) for the timeline:
    bytes held by the buffer and batches ready, every 0.1 s. In a forked process of its own:
    a status request costs a millisecond or two of Python, which in a thread of the trainer's
    process would hold the GIL just when the trainer wakes, and charge prefetchd for its own
    measurement. (A Python start per sample, the CLI, would take a good part of a core.)"""

    def __init__(self, paths: JobPaths, t0: float, every_s: float = 0.1):
        self.paths, self.t0, self.every_s = paths, t0, every_s
        ctx = multiprocessing.get_context("fork")  # needs only zmq, which it opens afresh
        self._conn, child = ctx.Pipe()
        self._halt = ctx.Event()
        self._proc = ctx.Process(target=self._run, args=(child,), daemon=True, name="buffer-sampler")

    def start(self) -> None:
        self._proc.start()

    def _run(self, conn) -> None:
        samples = []
        while True:
            halted = self._halt.is_set()  # then one last sample: the end of the run, however short
            status = control.request_job(self.paths, {"op": "status"}, timeout_s=1.0)
            if status:
                samples.append(
                    {
                        "t": time.perf_counter() - self.t0,
                        "used_bytes": status["buffer"]["used_bytes"],
                        "ready": status["ranks"][0]["ready"],
                    }
                )
            if halted:
                break
            self._halt.wait(self.every_s)
        conn.send_bytes(json.dumps(samples).encode())  # JSON, never pickle

    def halt(self) -> list[dict]:
        """Stop sampling and return the samples."""
        self._halt.set()
        samples = json.loads(self._conn.recv_bytes()) if self._conn.poll(10) else []
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        return samples


# ---------------------------------------------------------------- CPU accounting


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _workers_of(status: dict) -> list[psutil.Process]:
    """The daemon's live worker processes, by the pids its status reports."""
    found = []
    for pid in status.get("workers", {}).get("pids", []):
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def cpu_snapshot(paths: JobPaths | None, pid: int | None) -> dict:
    """CPU seconds so far of this (consumer) process, of the daemon's master and of its live
    workers, and what the daemon has produced (from its status). DataLoader: its workers are
    this process's children."""
    me = psutil.Process()
    snap = {"consumer_s": _cpu_s(me)}
    if pid is None:
        workers = 0.0
        for child in me.children():
            # DataLoader's forked workers share our command line; a daemon master does not.
            with contextlib.suppress(psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE and child.cmdline() == me.cmdline():
                    workers += _cpu_s(child)
        snap["workers_s"] = workers
        return snap
    status = control.request_job(paths, {"op": "status"}) or {}
    snap["master_s"] = _cpu_s(psutil.Process(pid))
    snap["workers_s"] = sum(_cpu_s(w) for w in _workers_of(status))
    snap["produced_batches"] = status.get("totals", {}).get("produced")
    return snap


# ---------------------------------------------------------------- rows: throughput and scaling


def throughput_run(run: Run, system: str, recipe: str) -> dict:
    """Deliver `epochs` epochs as fast as the system can; images/s from the first batch to the
    last (both systems start their workers together, so neither gets a head start)."""
    s = run.s
    with open_system(run, system, recipe, f"tp-{recipe}") as (loader, paths, pid):
        before = cpu_snapshot(paths, pid)
        batches = Batches(loader, s.epochs)
        try:
            steps = consume(batches, None, lambda i: (0.0, 0.0))
            after = cpu_snapshot(paths, pid)  # before the workers stop and take their CPU with them
        finally:
            batches.close()
    done = [r["done"] for r in steps]
    images = s.batch_size * (len(done) - 1)
    result = {
        "batches": len(done),
        "seconds": done[-1] - done[0],
        "images_per_s": images / (done[-1] - done[0]),
        "consumer_cpu_s_per_batch": (after["consumer_s"] - before["consumer_s"]) / len(done),
        "first_batch_s": steps[0]["wait"],
    }
    if pid is not None:
        produced = after["produced_batches"] - before["produced_batches"]
        result |= {
            "master_cpu_s": after["master_s"] - before["master_s"],
            "workers_cpu_s": after["workers_s"] - before["workers_s"],
            "produced_batches": produced,
            "master_cpu_s_per_1000_batches": 1000 * (after["master_s"] - before["master_s"]) / produced,
            "worker_cpu_ms_per_image": 1000 * (after["workers_s"] - before["workers_s"]) / (produced * s.batch_size),
        }
    elif system == "dataloader_persistent":  # the workers lived the whole run: all their CPU is here
        result["worker_cpu_ms_per_image"] = 1000 * after["workers_s"] / (len(done) * s.batch_size)
    return result


def pipeline_loop(files: list[str], recipe: str, decoder: str) -> float:
    """prefetchd's ImagePipeline on `files`, one image at a time into one output array (no batch
    file, no digest, no IPC): a worker's upper bound. Returns images/s."""
    pipeline = ImagePipeline(RECIPES[recipe], decoder)
    out = np.empty(pipeline.output_shape, np.uint8)
    start = time.perf_counter()
    for i, path in enumerate(files):
        pipeline.apply(path, np.random.default_rng(i), out, read_image_file(path))
    return len(files) / (time.perf_counter() - start)


def _loop_in_child(files: list[str], recipe: str, decoder: str, results) -> None:
    results.put(pipeline_loop(files, recipe, decoder))


def inprocess_run(run: Run, recipe: str) -> dict:
    """The scaling row's yardstick: one loop in this process. Beside it, N such loops at once
    in N forked processes: what this machine gives N busy cores with no loader at all (its
    cores share caches, memory bandwidth and a hypervisor), to tell the machine's share of
    a scaling shortfall from the loader's."""
    s = run.s
    files = [path for path, _ in run.files[: s.inprocess_images]]
    one = pipeline_loop(files, recipe, s.decoder)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_loop_in_child, args=(files, recipe, s.decoder, results)) for _ in range(s.workers)]
    try:
        for proc in procs:
            proc.start()
        rates = [results.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(10)  # it has sent its figure and is flushing its queue; killed only if stuck
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return {"images": len(files), "images_per_s": one, "parallel_images_per_s": sum(rates), "parallel": rates}


def rotated(items: tuple, r: int) -> tuple:
    """The systems in another order every repeat, so drift (thermal, other load) hits all alike."""
    k = r % len(items)
    return items[k:] + items[:k]


def measure_throughput(run: Run, results: dict) -> None:
    others = tuple(OTHER + d for d in installed_decoders() if d != run.s.decoder)
    tp = results["throughput"] = {rc: {sy: [] for sy in (*SYSTEMS, *others)} for rc in RECIPES}
    ip = results["inprocess"] = {rc: [] for rc in RECIPES}
    # One in-process loop per decoder, alternating: the partial decode row's gain without a loader.
    loops = results["decoder_loops"] = {rc: {d: [] for d in installed_decoders()} for rc in RECIPES}
    files = [path for path, _ in run.files[: run.s.inprocess_images]]
    for r in range(run.s.repeats):
        for recipe in RECIPES:
            for system in rotated((*SYSTEMS, *others, "inprocess", "loops"), r):
                if system == "loops":
                    for decoder in rotated(tuple(loops[recipe]), r):
                        loops[recipe][decoder].append(pipeline_loop(files, recipe, decoder))
                    run.log(f"loops {recipe} #{r}: " + ", ".join(f"{d} {v[-1]:.0f}" for d, v in loops[recipe].items()))
                    continue
                if system == "inprocess":
                    ip[recipe].append(inprocess_run(run, recipe))
                    got = ip[recipe][-1]
                else:
                    tp[recipe][system].append(throughput_run(run, system, recipe))
                    got = tp[recipe][system][-1]
                run.log(f"throughput {recipe} #{r}: {system} {got['images_per_s']:.0f} img/s")


def installed_decoders() -> tuple[str, ...]:
    """The decoders of settings.DECODERS whose libraries are installed here."""
    found = []
    for decoder in DECODERS:
        with contextlib.suppress(ImportError):
            found.append(resolve_decoder(decoder))
    return tuple(found)


# ---------------------------------------------------------------- rows: trainers


def capacity(results: dict, batch_size: int) -> dict:
    """Seconds per batch the slower system sustains on random-resized-crop: the trainers are
    set against it, so "below capacity" holds for every system."""
    rates = {sy: statistics.median(x["images_per_s"] for x in results["throughput"]["rrc"][sy]) for sy in SYSTEMS}
    return {"images_per_s": rates, "batch_s": batch_size / min(rates.values())}


def trainer_plans(s: Settings, batch_s: float) -> dict:
    """The two trainers, as (pause, work) per step, with their parameters for the report."""
    steady = batch_s / s.steady_load
    burst = batch_s / s.burst_speed
    # The pause that brings K burst steps plus the pause to K batches at `burst_load` of capacity.
    pause = max(0.0, s.burst_every * batch_s / s.burst_load - s.burst_every * burst)
    return {
        "steady": {"work_s": steady},
        "bursty": {"work_s": burst, "pause_s": pause, "every": s.burst_every, "steps": s.burst_every * s.burst_blocks},
    }


def trainer_run(run: Run, system: str, kind: str, plan: dict) -> dict:
    """One trainer against one fresh system on random-resized-crop; prefetchd's buffer is
    sampled meanwhile. The steady trainer runs `epochs` epochs; the bursty one K x blocks
    steps, with its pause before every block, the first too: both systems get the same head
    start (a DataLoader's workers start at iter(), before the pause)."""
    s = run.s
    per_epoch = s.images // s.batch_size
    if kind == "steady":
        steps, epochs = None, s.epochs

        def schedule(i):
            return 0.0, plan["work_s"]
    else:
        steps = plan["steps"]
        epochs = math.ceil(steps / per_epoch) + 1

        def schedule(i):
            return (plan["pause_s"] if i % plan["every"] == 0 else 0.0), plan["work_s"]

    with open_system(run, system, "rrc", kind) as (loader, paths, pid):
        t0 = time.perf_counter()  # one clock for the steps and the buffer samples
        sampler = BufferSampler(paths, t0) if paths else None
        if sampler:
            sampler.start()
        batches = Batches(loader, epochs)

        def ready(i: int) -> bool:  # step i of the stream is batch (i // per_epoch, i % per_epoch)
            return paths.batch(i // per_epoch, i % per_epoch, 0).exists()

        try:
            records = consume(batches, steps, schedule, t0, ready if paths else None)
        finally:
            batches.close()
            samples = sampler.halt() if sampler else []
    return {"steps": records, "buffer": samples}


def wait_stats(steps: list[dict]) -> dict:
    """Total wait, per-step median, p95 and max, leaving out the very first batch (start-up,
    which the restart row measures); the waits at each new epoch's first batch, and the p95
    of the other steps (what taking a batch costs when the boundary is nothing special)."""
    waits = [r["wait"] for r in steps[1:]]
    ordinary = [r["wait"] for r in steps[1:] if r["step"] > 0]
    boundary = [r for r in steps if r["epoch"] > 0 and r["step"] == 0]
    return {
        "ordinary_p95_s": float(np.percentile(ordinary, 95)),
        # prefetchd only (None for DataLoader, whose queue cannot be looked into)
        "ready_when_asked": None if steps[0]["ready"] is None else sum(bool(r["ready"]) for r in steps[1:]),
        "boundary_ready_when_asked": None if steps[0]["ready"] is None else all(r["ready"] for r in boundary),
        "first_batch_s": steps[0]["wait"],
        "total_s": float(sum(waits)),
        "median_s": float(np.median(waits)),
        "p95_s": float(np.percentile(waits, 95)),
        "max_s": float(max(waits)),
        "epoch_boundary_s": [r["wait"] for r in boundary],
        "steps": len(steps),
    }


def measure_trainers(run: Run, results: dict) -> None:
    s = run.s
    cap = results["capacity"] = capacity(results, s.batch_size)
    plans = results["trainer_plans"] = trainer_plans(s, cap["batch_s"])
    for kind in ("steady", "bursty"):
        results[kind] = {sy: [] for sy in SYSTEMS}
    for r in range(s.repeats):
        for system in rotated(SYSTEMS, r):
            for kind in ("steady", "bursty"):
                raw = trainer_run(run, system, kind, plans[kind])
                stats = wait_stats(raw["steps"])
                results[kind][system].append({**stats, "timeline": raw})
                run.log(f"{kind} trainer #{r}: {system} waited {stats['total_s']:.3f} s over {stats['steps']} steps")


# ---------------------------------------------------------------- rows: restart, client, daemon


def measure_restart(run: Run, results: dict) -> None:
    """scripts/bench_restart.py's measurement on this run's data, batch size and workers."""
    s = run.s
    batch_bytes = s.batch_size * 224 * 224 * 3 + 2 * PAGE
    rows = bench_restart.measure_restart(
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


def measure_client(run: Run, results: dict) -> None:
    """Per batch, what the client does with a batch that is ready: map the file, parse and
    check its header, wrap the arrays as tensors, against the cheapest copying loader: one
    np.copyto of the same bytes into memory already faulted in. Also reported: the first
    touch of every page of the mapping, which a consumer pays later (page faults)."""
    fields = [FieldSpec("image", "uint8", CLIENT_BATCH), FieldSpec("label", "int64", CLIENT_BATCH[:1])]
    fields.append(FieldSpec("index", "int64", CLIENT_BATCH[:1]))
    layout = BatchLayout.plan(fields)
    path = run.root / "client-cost.batch"
    writer = BatchWriter(path, layout)
    writer.arrays["image"][...] = 7  # any bytes: the cost does not depend on them
    writer.finish(0, 0, 0, {"crc32": 0})
    image_bytes = layout.fields[0].nbytes
    src = np.fromfile(path, dtype=np.uint8)[layout.offsets[0] : layout.offsets[0] + image_bytes]
    dst = np.ones_like(src)  # faulted in: the copy is timed, not the allocation

    def mapped() -> tuple[float, float]:
        t0 = time.perf_counter()
        _, arrays = map_batch(path)
        tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}
        t1 = time.perf_counter()
        touch(tensors["image"])
        return t1 - t0, time.perf_counter() - t1

    def copied() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    per_repeat = []
    for r in range(run.s.repeats):
        got = {}
        for which in rotated(("map", "copy"), r):
            if which == "map":
                times = [mapped() for _ in range(run.s.client_iters)]
                got["map_s"] = statistics.median(t for t, _ in times)
                got["first_touch_s"] = statistics.median(t for _, t in times)
            else:
                got["copy_s"] = statistics.median(copied() for _ in range(run.s.client_iters))
        per_repeat.append(got)
        run.log(f"client #{r}: map {got['map_s'] * 1e6:.0f} us, copy {got['copy_s'] * 1e3:.2f} ms")
    path.unlink()
    results["client"] = {"batch_shape": list(CLIENT_BATCH), "bytes": image_bytes, "repeats": per_repeat}


# ---------------------------------------------------------------- the summary


def med(xs) -> float:
    return float(statistics.median(xs))


def _ms(x: float) -> str:
    return f"{x * 1000:.2f} ms" if x < 1 else f"{x:.2f} s"


def summarize(results: dict, s: Settings) -> list[dict]:
    """The table's rows: medians over repeats, the ratio, the target and whether it holds."""
    rows = []

    def row(rid, measure, pf, dl, ratio, target, holds, values):
        rows.append(
            {"id": rid, "measure": measure, "prefetchd": pf, "dataloader": dl, "ratio": ratio}
            | {"target": target, "holds": holds, "values": values}
        )

    cold = bench_coldstart.summary(results["cold_start"])
    default, dl = cold[f"prefetchd_{s.decoder}"], cold["dataloader"]
    shown = ("dataloader", f"prefetchd_{s.decoder}")
    peers = {sy: f"{m['cold_ratio']:.2f}x" for sy, m in cold.items() if sy not in shown}
    if isinstance(results["cold_start"]["runs"]["dali"], dict):
        peers["dali"] = "not installed (--dali-path)"
    row(
        "cold_start",
        f"cold start, {bench_coldstart.describe(results['cold_start'])}: end to end [from the first batch on] "
        f"(img/s); other systems' end-to-end ratios: " + ", ".join(f"{sy} {r}" for sy, r in peers.items()),
        f"{default['cold_images_per_s']:.0f} [{default['images_per_s']:.0f}]",
        f"{dl['cold_images_per_s']:.0f} [{dl['images_per_s']:.0f}]",
        f"{default['cold_ratio']:.2f}x [{default['ratio']:.2f}x]",
        ">= 1.0x [>= 1.4x]",
        default["cold_ratio"] >= 1.0 and default["ratio"] >= 1.4,
        cold,
    )
    steps = results["cold_start"]["start_breakdown_s"]
    row(
        "start",
        "`prefetchd start` returning, and from then to the first batch in hand (s); its steps, each alone: "
        + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()),
        f"{default['start_s']:.2f} s, then {default['start_to_first_batch_s']:.2f} s",
        f"first batch {dl['first_batch_s']:.2f} s",
        "",
        "<= 1 s, then <= 0.3 s",
        default["start_s"] <= 1.0 and default["start_to_first_batch_s"] <= 0.3,
        {"start_s": default["start_s"], "start_to_first_batch_s": default["start_to_first_batch_s"], "steps": steps},
    )
    tp = {rc: {sy: med(x["images_per_s"] for x in v) for sy, v in results["throughput"][rc].items()} for rc in RECIPES}
    dl_best = {rc: max(tp[rc]["dataloader_persistent"], tp[rc]["dataloader_fresh"]) for rc in RECIPES}
    for recipe, goal in (("rrc", 1.4), ("classic", 2.0)):
        t = tp[recipe]
        ratio = t["prefetchd"] / dl_best[recipe]
        row(
            f"throughput_{recipe}",
            f"throughput, {RECIPE_NAMES[recipe]}, decoder {s.decoder} (what `auto` picks here) (img/s)",
            f"{t['prefetchd']:.0f}",
            f"persistent {t['dataloader_persistent']:.0f} / not {t['dataloader_fresh']:.0f}",
            f"{ratio:.2f}x",
            f">= {goal}x",
            ratio >= goal,
            {**t, "ratio": ratio},
        )
    # Each other decoder against the same DataLoader (Pillow), recipe by recipe.
    for decoder, goal in (("pillow", 1.0), ("simplejpeg", None)):
        system = "prefetchd" if decoder == s.decoder else OTHER + decoder
        if system not in tp["rrc"]:
            row(f"throughput_{decoder}", f"throughput, decoder {decoder}", "not installed", "-", "", "", None, {})
            continue
        ratios = {rc: tp[rc][system] / dl_best[rc] for rc in RECIPES}
        row(
            f"throughput_{decoder}",
            f"throughput, decoder {decoder} vs DataLoader: rrc / classic (img/s)",
            f"{tp['rrc'][system]:.0f} / {tp['classic'][system]:.0f}",
            f"best {dl_best['rrc']:.0f} / {dl_best['classic']:.0f}",
            f"{ratios['rrc']:.2f}x / {ratios['classic']:.2f}x",
            "" if goal is None else f"rrc >= {goal}x",
            None if goal is None else ratios["rrc"] >= goal,
            {"images_per_s": {rc: tp[rc][system] for rc in RECIPES}, "ratio": ratios},
        )
    loops = {rc: {d: med(v) for d, v in results["decoder_loops"][rc].items()} for rc in RECIPES}
    systems = {d: "prefetchd" if d == s.decoder else OTHER + d for d in ("turbojpeg", "simplejpeg")}
    if all(sy in tp["rrc"] for sy in systems.values()):
        # The region-of-interest decode's own gain: the same libjpeg-turbo, the same DCT scaling,
        # the same resample; only the rows and columns outside the crop are skipped.
        gain = {rc: tp[rc][systems["turbojpeg"]] / tp[rc][systems["simplejpeg"]] for rc in RECIPES}
        loop_gain = {rc: loops[rc]["turbojpeg"] / loops[rc]["simplejpeg"] for rc in RECIPES}
        row(
            "partial_decode",
            "partial decode: turbojpeg (the crop's region) vs simplejpeg (whole image), rrc / classic: "
            "daemon img/s [one in-process loop]",
            f"{tp['rrc'][systems['turbojpeg']]:.0f} / {tp['classic'][systems['turbojpeg']]:.0f} "
            f"[{loops['rrc']['turbojpeg']:.0f} / {loops['classic']['turbojpeg']:.0f}]",
            f"whole {tp['rrc'][systems['simplejpeg']]:.0f} / {tp['classic'][systems['simplejpeg']]:.0f} "
            f"[{loops['rrc']['simplejpeg']:.0f} / {loops['classic']['simplejpeg']:.0f}]",
            f"{gain['rrc']:.2f}x / {gain['classic']:.2f}x [{loop_gain['rrc']:.2f}x / {loop_gain['classic']:.2f}x]",
            "> 1x",
            min(gain.values()) > 1,
            {"daemon": gain, "loop": loop_gain, "loops_images_per_s": loops},
        )
    else:
        row("partial_decode", "partial decode", "turbojpeg or simplejpeg not installed", "-", "", "> 1x", None, {})
    for recipe in RECIPES:
        one = med(x["images_per_s"] for x in results["inprocess"][recipe])
        many = med(x["parallel_images_per_s"] for x in results["inprocess"][recipe])
        t = tp[recipe]
        best_dl = max(t["dataloader_persistent"], t["dataloader_fresh"])
        scaling, dl = t["prefetchd"] / (s.workers * one), best_dl / (s.workers * one)
        row(
            f"scaling_{recipe}",
            f"scaling, {recipe}: img/s / ({s.workers} x {one:.0f} of one in-process loop) "
            f"[{s.workers} bare loops at once: {many / (s.workers * one):.2f}]",
            f"{scaling:.2f} [{t['prefetchd'] / many:.2f} of the bare loops]",
            f"{dl:.2f} [{best_dl / many:.2f}]",
            "",
            ">= 0.95",
            scaling >= 0.95,
            {
                "inprocess_images_per_s": one,
                "parallel_loops_images_per_s": many,
                "machine": many / (s.workers * one),
                "prefetchd": scaling,
                "dataloader_best": dl,
                "prefetchd_of_parallel_loops": t["prefetchd"] / many,
                "dataloader_best_of_parallel_loops": best_dl / many,
            },
        )

    def waits(kind: str) -> dict:
        return {
            sy: {k: med(x[k] for x in results[kind][sy]) for k in ("total_s", "median_s", "p95_s", "max_s")}
            for sy in SYSTEMS
        }

    for kind, goal in (("steady", None), ("bursty", 0.01)):
        w = waits(kind)
        least = min(w["dataloader_persistent"]["total_s"], w["dataloader_fresh"]["total_s"])
        ratio = w["prefetchd"]["total_s"] / least if least > 0 else math.inf
        plan = results["trainer_plans"][kind]
        how = f"step {plan['work_s'] * 1000:.0f} ms" + (
            f", {plan['pause_s']:.2f} s pause every {plan['every']} steps" if kind == "bursty" else ""
        )

        def fmt(x):
            return f"{_ms(x['total_s'])} (step p50 {_ms(x['median_s'])}, p95 {_ms(x['p95_s'])}, max {_ms(x['max_s'])})"

        # How many steps found their batch already in the buffer: the rest of the wait is the client's.
        ready = [(x["ready_when_asked"], x["steps"] - 1) for x in results[kind]["prefetchd"]]
        w["prefetchd"]["ready_when_asked"] = ready
        row(
            f"{kind}_trainer",
            f"{kind} trainer: total wait ({how})",
            fmt(w["prefetchd"]) + "; ready when asked: " + ", ".join(f"{k}/{n}" for k, n in ready),
            f"persistent {fmt(w['dataloader_persistent'])} / not {fmt(w['dataloader_fresh'])}",
            f"{ratio:.3f}x",
            "" if goal is None else f"<= {goal}x",
            None if goal is None else ratio <= goal,
            {**w, "ratio": ratio},
        )

    # No next() takes 0 s: "no wait" means the new epoch's first batch was already in the
    # buffer when the trainer asked, so what it spent is the client's per-batch cost, as on
    # any other step (whose p95 is shown beside it).
    boundary = {
        sy: med([b for x in results["steady"][sy] for b in x["epoch_boundary_s"]] or [math.nan]) for sy in SYSTEMS
    }
    ordinary = {sy: med(x["ordinary_p95_s"] for x in results["steady"][sy]) for sy in SYSTEMS}
    all_ready = all(x["boundary_ready_when_asked"] for x in results["steady"]["prefetchd"])
    row(
        "epoch_boundary",
        "epoch boundary: wait for a new epoch's first batch (other steps' p95)",
        f"{_ms(boundary['prefetchd'])} ({_ms(ordinary['prefetchd'])}); "
        f"{'ready' if all_ready else 'NOT always ready'} when asked",
        f"persistent {_ms(boundary['dataloader_persistent'])} ({_ms(ordinary['dataloader_persistent'])}) / "
        f"not {_ms(boundary['dataloader_fresh'])} ({_ms(ordinary['dataloader_fresh'])})",
        "",
        "0: batch ready when asked",
        all_ready,
        {"boundary_s": boundary, "other_steps_p95_s": ordinary, "prefetchd_boundary_batches_ready": all_ready},
    )

    restart = {name: med(x["first_batch_s"] for x in runs) for name, runs in results["restart"].items()}
    restart_process = {name: med(x["process_s"] for x in runs) for name, runs in results["restart"].items()}
    pf_name = "prefetchd (warm)"
    pf = restart[pf_name]
    dl = {name: v for name, v in restart.items() if name != pf_name}
    row(
        "trainer_restart",
        "trainer restart: first batch after imports (from process start)",
        f"{_ms(pf)} ({restart_process[pf_name]:.2f} s)",
        " / ".join(f"{name.split()[-1]} {_ms(v)} ({restart_process[name]:.2f} s)" for name, v in dl.items()),
        f"{min(dl.values()) / pf:,.0f}x faster",
        "<= 50 ms",
        pf <= 0.05,
        {"first_batch_s": restart, "process_s": restart_process},
    )

    c = results["client"]["repeats"]
    mapped, copied, touched = (
        med(x["map_s"] for x in c),
        med(x["copy_s"] for x in c),
        med(x["first_touch_s"] for x in c),
    )
    row(
        "client_cost",
        "client cost per 256x224x224x3 batch: map + header + tensors vs np.copyto",
        f"{_ms(mapped)} (+ first touch of every page {_ms(touched)})",
        f"copy {_ms(copied)}",
        f"{mapped / copied:.4f}x",
        "<= 0.01x",
        mapped / copied <= 0.01,
        {"map_s": mapped, "copy_s": copied, "first_touch_s": touched, "ratio": mapped / copied},
    )

    dc = {}
    for recipe in RECIPES:
        runs = results["throughput"][recipe]
        dc[recipe] = {
            "master_cpu_s_per_1000_batches": med(x["master_cpu_s_per_1000_batches"] for x in runs["prefetchd"]),
            "worker_cpu_ms_per_image": med(x["worker_cpu_ms_per_image"] for x in runs["prefetchd"]),
            "dataloader_worker_cpu_ms_per_image": med(
                x["worker_cpu_ms_per_image"] for x in runs["dataloader_persistent"]
            ),
            "inprocess_ms_per_image": 1000 / med(x["images_per_s"] for x in results["inprocess"][recipe]),
            "consumer_cpu_ms_per_batch": {
                sy: 1000 * med(x["consumer_cpu_s_per_batch"] for x in runs[sy]) for sy in SYSTEMS
            },
        }
    d = dc["rrc"]
    row(
        "daemon_cost",
        "daemon cost (rrc): master CPU per 1,000 batches; worker CPU per image",
        f"{d['master_cpu_s_per_1000_batches']:.2f} s; {d['worker_cpu_ms_per_image']:.2f} ms",
        f"worker {d['dataloader_worker_cpu_ms_per_image']:.2f} ms "
        f"(in-process loop {d['inprocess_ms_per_image']:.2f} ms)",
        "",
        "",
        None,
        dc,
    )
    ray_runs = results.get("ray", {"why": "not measured"})
    if "why" in ray_runs:
        why = f"not run: {ray_runs['why']}"
        row("ray", "--executor ray vs local workers", why, "-", "", ">= 0.90x", None, ray_runs)
    else:
        r = bench_ray.summary(ray_runs)
        row(
            "ray",
            f"--executor ray ({s.workers} Ray CPUs, no local workers) vs {s.workers} local workers, rrc: img/s "
            "[start to first batch]",
            f"{r['ray']['images_per_s']:.0f} [{r['ray']['first_batch_s']:.2f} s]",
            f"local {r['local']['images_per_s']:.0f} [{r['local']['first_batch_s']:.2f} s]",
            f"{r['ratio']:.2f}x",
            ">= 0.90x",
            r["ratio"] >= 0.90,
            r,
        )
    return rows


def print_table(console: Console, rows: list[dict], s: Settings) -> None:
    table = Table(
        title=f"prefetchd vs DataLoader: {s.images} JPEGs, {s.workers} workers, batch {s.batch_size}, "
        f"median of {s.repeats}",
        show_lines=True,
    )
    for col in ("measure", "prefetchd", "DataLoader", "ratio", "target", "holds"):
        table.add_column(col, overflow="fold")
    for r in rows:
        holds = {True: "[green]yes[/]", False: "[red]no[/]", None: ""}[r["holds"]]
        table.add_row(r["measure"], r["prefetchd"], r["dataloader"], r["ratio"], r["target"], holds)
    console.print(table)


def markdown_table(rows: list[dict], s: Settings, env: dict) -> str:
    """The table as Markdown, for the README: the same cells as the printed one."""
    lines = [
        f"{s.images} generated JPEGs (~{env['dataset']['mean_kb']:.0f} KB, {env['dataset']['pixels']}), "
        f"{s.workers} worker(s) each, batch {s.batch_size}, median of {s.repeats}; {env['cores']} cores, "
        f"Python {env['python']}, torch {env['torch']}, Pillow {env['pillow']}.",
        "",
        "| measure | prefetchd | DataLoader | ratio | target | holds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        holds = {True: "yes", False: "**no**", None: ""}[r["holds"]]
        cells = [r["measure"], r["prefetchd"], r["dataloader"], r["ratio"], r["target"], holds]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the timeline


def plot_timeline(results: dict, path: Path) -> str | None:
    """Buffer fill (prefetchd) above per-step waits (every system), for the first repeat of
    the steady and the bursty trainer. Returns why not, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'prefetchd[bench]')"
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex="col", height_ratios=[1, 1.4])
    colours = {"prefetchd": "tab:blue", "dataloader_persistent": "tab:orange", "dataloader_fresh": "tab:red"}
    for col, kind in enumerate(("steady", "bursty")):
        fill, wait = axes[0][col], axes[1][col]
        timeline = results[kind]["prefetchd"][0]["timeline"]
        samples = timeline["buffer"]
        fill.plot([x["t"] for x in samples], [x["used_bytes"] / 2**20 for x in samples], color=colours["prefetchd"])
        fill.set_ylabel("prefetchd buffer (MiB)")
        if kind == "bursty":  # the trainer's pauses, while the buffer banks what it makes
            pause = results["trainer_plans"]["bursty"]["pause_s"]
            for i, step in enumerate(timeline["steps"]):
                if i % results["trainer_plans"]["bursty"]["every"] == 0:
                    fill.axvspan(step["t"] - pause, step["t"], color="grey", alpha=0.15, linewidth=0)
        plan = results["trainer_plans"][kind]
        fill.set_title(
            f"{kind} trainer: step {plan['work_s'] * 1000:.0f} ms"
            + (f", {plan['pause_s']:.2f} s pause every {plan['every']} steps" if kind == "bursty" else "")
        )
        for system in SYSTEMS:
            steps = results[kind][system][0]["timeline"]["steps"]
            wait.plot(
                [x["t"] for x in steps],
                [x["wait"] * 1000 for x in steps],
                marker="o",
                markersize=3,
                linewidth=0.8,
                color=colours[system],
                label=SYSTEM_NAMES[system],
            )
            for x in steps:  # epoch boundaries, where a DataLoader starts over
                if x["epoch"] > 0 and x["step"] == 0:
                    wait.axvline(x["t"], color=colours[system], alpha=0.25, linestyle=":")
        wait.set_ylabel("wait for the batch (ms)")
        wait.set_xlabel("seconds since the trainer started")
        wait.legend(fontsize=8)
    fig.suptitle("DataLoader's queue is not observable: its panel shows waits only")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------- main


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: through every finally


def environment(s: Settings, sizes: list[int]) -> dict:
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
    s = run.s
    started = time.perf_counter()
    run.log(f"generating {s.images} JPEGs in {run.data}; jobs under {run.root}")
    run.files, sizes = make_dataset(run.data, s.images)
    results = {"settings": asdict(s), "environment": environment(s, sizes)}
    measure_client(run, results)
    results["cold_start"] = bench_coldstart.measure_cold_start(
        installed_decoders(), run.s.repeats, quick=run.s.quick, dali_path=run.s.dali_path, log=run.log
    )
    measure_throughput(run, results)
    measure_trainers(run, results)
    measure_restart(run, results)
    if s.quick:  # a Ray cluster alone takes most of --quick's minute to start
        results["ray"] = {"why": "--quick; run without it, or scripts/bench_ray.py"}
    else:
        results["ray"] = bench_ray.measure_ray(
            run.data, run.root, workers=s.workers, repeats=s.repeats, batch=s.batch_size, epochs=s.epochs,
            buffer=s.buffer,
        )
    results["cleanup"] = {"root": str(run.root), "data": str(run.data)}
    results["seconds"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log keeps the table whole
    signal.signal(signal.SIGTERM, _interrupt)
    # Forked children (DataLoader workers, the data and loop processes) are stopped with
    # SIGTERM by their owners: they must simply die, not unwind this process's cleanup.
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(s, console)
    try:
        results = measure_all(run)
    except KeyboardInterrupt:
        return 130  # Ctrl-C or SIGTERM: the finally below has stopped and removed everything
    finally:
        run.close()
    results["cleanup"]["pids"] = sorted(run.pids)
    results["rows"] = summarize(results, s)
    print_table(console, results["rows"], s)
    png = out / "bench_timeline.png"
    results["timeline_png"] = str(png)
    why_not = plot_timeline(results, png)
    if why_not:
        results["timeline_png"] = None
        console.print(f"no timeline: {why_not}")
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(markdown_table(results["rows"], s, results["environment"]))
    console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + ("" if why_not else f", {png}"), highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
