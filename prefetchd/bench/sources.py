"""The same images as files, as WebDataset shards (`prefetchd pack`) and as Parquet row
groups: indexing time, and how fast one worker makes batches from each, with a warm page
cache and with a cold one (the data's pages evicted before each run), read-ahead on and off.

    python -m prefetchd.bench.sources --images 2000 --out /var/tmp/bench-sources

The data must live on a disk, not a tmpfs: eviction (POSIX_FADV_DONTNEED) is what makes a
cache cold, and a tmpfs has nothing to evict to. Runs alternate between the systems; the
figures are medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prefetchd.cli.datagen import make_image_folder
from prefetchd.config import build_config
from prefetchd.master.job import build_index
from prefetchd.plan import Plan
from prefetchd.sources import shards
from prefetchd.sources.index import scan_image_folder
from prefetchd.sources.kinds import own_options
from prefetchd.workers.producer import BatchProducer
from prefetchd.workers.spec import ProducerSpec

TRANSFORMS = [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}]
BATCH = 32


def make_data(out: Path, images: int) -> tuple[Path, Path, Path, float]:
    """(ImageFolder, shard folder, Parquet folder, pack's images/s)."""
    folder = out / "train"
    if not folder.exists():
        make_image_folder(folder, classes=10, per_class=images // 10, size=(300, 500), quality=90)
    packed = out / "shards"
    if not (packed / "pack.json").exists():
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "prefetchd",
                "pack",
                str(folder),
                str(packed),
                "--shard-size",
                "32M",
                "--workers",
                "1",
            ],
            check=True,
            capture_output=True,
        )
        pack_rate = images / (time.perf_counter() - started)
    else:
        pack_rate = float("nan")
    parquet = out / "parquet"
    if not parquet.exists():
        import pyarrow as pa
        import pyarrow.parquet as pq

        parquet.mkdir()
        index = scan_image_folder(str(folder), "bench")
        table = pa.table(
            {
                "image": [Path(index.path(i)).read_bytes() for i in range(len(index))],
                "label": pa.array(index.labels, pa.int64()),
            }
        )
        pq.write_table(table, parquet / "train.parquet", row_group_size=100)  # the Hub's size for images
        # pyarrow cuts pages only between write batches (1,024 rows): a 100-row group is one page,
        # and dictionary-encoded whole. Written in batches of 8 rows, its pages are about 1 MB.
        pq.write_table(table, parquet / "paged.parquet", row_group_size=100, use_dictionary=False, write_batch_size=8)
    return folder, packed, parquet, pack_rate


def sources(folder: Path, packed: Path, parquet: Path) -> dict[str, dict]:
    count = len(json.loads((packed / "pack.json").read_text())["shards"])
    return {
        "files": {"kind": "image_folder", "root": str(folder)},
        "shards": {"kind": "webdataset", "urls": f"{packed}/shard-{{000000..{count - 1:06d}}}.tar"},
        "parquet": {"kind": "parquet", "path": str(parquet / "train.parquet")},
        "parquet-paged": {"kind": "parquet", "path": str(parquet / "paged.parquet")},
    }


def producer(source: dict) -> BatchProducer:
    config = build_config({"source": [source], "transform": TRANSFORMS}, base=Path.cwd(), default_name="bench")
    index, sizes = build_index(config.sources)
    plan = Plan(len(index), 1, BATCH, 0, True, sizes)
    spec = ProducerSpec(
        job_dir="/nonexistent",
        plan=plan.to_json(),
        source_names=["s"],
        transforms=TRANSFORMS,
        pipeline=None,
        config_hash="",
        decoder=config.decoder,
        sources=[own_options(config.sources[0])],
    )
    return BatchProducer(spec, index=index)


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def epoch_rate(make: BatchProducer, files: list[Path], cold: bool, epoch: int) -> float:
    """Images/s of one epoch's batches, made in this process."""
    if cold:
        evict(files)
    steps = make.plan.batches_per_epoch
    started = time.perf_counter()
    for step in range(steps):
        make.make_in_memory(epoch, step, 0)
    return steps * BATCH / (time.perf_counter() - started)


def index_seconds(source: dict, cache: Path, cold_cache: bool) -> float:
    if cold_cache:
        for f in cache.glob("*.npy"):
            f.unlink()
    config = build_config({"source": [source], "transform": TRANSFORMS}, base=Path.cwd(), default_name="bench")
    started = time.perf_counter()
    build_index(config.sources)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--out", type=Path, default=Path("/var/tmp/bench-sources"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "index-cache"
    os.environ["PREFETCHD_CACHE"] = str(cache)
    folder, packed, parquet, pack_rate = make_data(args.out, args.images)
    by_name = sources(folder, packed, parquet)
    data_files = {
        "files": sorted(folder.rglob("*.jpg")),
        "shards": sorted(packed.glob("*.tar")),
        "parquet": [parquet / "train.parquet"],
        "parquet-paged": [parquet / "paged.parquet"],
    }
    n = len(data_files["files"])
    print(f"{n} images, {sum(f.stat().st_size for f in data_files['files']) / 1e6:.0f} MB; pack {pack_rate:.0f} img/s")

    # Indexing, per 1,000 samples.
    indexing = {
        "files (scan)": [index_seconds(by_name["files"], cache, False) for _ in range(args.repeats)],
        "shards, no cached index": [index_seconds(by_name["shards"], cache, True) for _ in range(args.repeats)],
        "shards, cached index": [index_seconds(by_name["shards"], cache, False) for _ in range(args.repeats)],
        "parquet": [index_seconds(by_name["parquet"], cache, False) for _ in range(args.repeats)],
    }
    for name, runs in indexing.items():
        print(f"index {name:26s} {1000 * statistics.median(runs) / n * 1000:8.2f} ms per 1,000 samples")

    makers = {name: producer(src) for name, src in by_name.items()}
    rows = {}
    systems = [
        ("files", False, True),
        ("shards", False, True),
        ("parquet", False, True),
        ("parquet-paged", False, True),
        ("files", True, True),
        ("shards", True, True),
        ("shards", True, False),
        ("parquet", True, True),
        ("parquet-paged", True, True),
    ]
    for repeat in range(args.repeats):
        for name, cold, read_ahead in systems:
            shards.READ_AHEAD_BYTES = (64 << 20) if read_ahead else 0
            label = f"{name:13s} {'cold' if cold else 'warm'} cache{'' if read_ahead else ', no read-ahead'}"
            rows.setdefault(label, []).append(epoch_rate(makers[name], data_files[name], cold, repeat))
    base = statistics.median(rows[f"{'files':13s} warm cache"])
    for label, runs in rows.items():
        rate = statistics.median(runs)
        print(f"{label:40s} {rate:8.0f} img/s  {rate / base:5.2f}x files warm  runs {[round(r) for r in runs]}")


if __name__ == "__main__":
    main()
