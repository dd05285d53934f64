"""The packed rows: what `prefetchd pack --max-short-side N --quality 90` buys and costs.

A folder is packed three ways (stored as is, short side 320, short side 256: the classic
ImageNet resize), and prefetchd serves each pack and the raw folder with the random-resized-crop
224 + flip recipe, alternating within each repeat: images/s, and the workers' CPU per image.
Where the time goes: one in-process loop of the same pipeline over the same images' bytes, raw
and packed (no loader), and the mean JPEG size. What it costs: the PSNR of the 224 crops made
from the packed image against the raw one at the same relative crop (prefetchd.bench.croppsnr).

Two folders: the run's own (500 x 375, ImageNet's usual size) and one of 640 x 480 (COCO's),
generated the same way: the short side's ratio to 320 decides the gain.

    python -m prefetchd.bench.packed [--quick] [--images 1500] [--repeats 3] [--out DIR]

runs these rows alone (the flags of `prefetchd bench`), prints them and writes packed.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from prefetchd.bench.common import RECIPES, make_dataset, rotated
from prefetchd.bench.croppsnr import crop_psnr, summarize
from prefetchd.bench.run import Run
from prefetchd.bench.throughput import throughput_run
from prefetchd.cli.pack import KEY_DIGITS, check_options, pack
from prefetchd.sources.index import scan_image_folder
from prefetchd.workers.transforms import ImagePipeline

SIDES = (320, 256)  # --max-short-side of the packs; 256: torchvision's classic Resize(256)
QUALITY = 90  # pack's default --quality
RECIPE = "rrc"
FOLDERS = {"imagenet": (500, 375), "coco": (640, 480)}  # (w, h), every fourth one portrait
RUN_FOLDER = "imagenet"  # the run's own folder (prefetchd.bench.common.make_dataset's size)
RAW, AS_IS = "raw", "as_is"  # the image folder itself; packed with no --max-short-side


def variants() -> tuple[str, ...]:
    return (RAW, AS_IS, *(f"side_{n}" for n in SIDES))


def pack_variant(folder: Path, out: Path, side: int | None, workers: int) -> tuple[dict, float]:
    """``prefetchd pack folder out [--max-short-side side] --quality 90``; (pack.json, seconds)."""
    started = time.perf_counter()
    manifest = pack(str(folder), out, check_options("1G", side, QUALITY, workers))
    return manifest, time.perf_counter() - started


def shard_urls(out: Path, manifest: dict) -> list[str]:
    return [str(out / shard["name"]) for shard in manifest["shards"]]


def packed_bytes(urls: list[str], count: int) -> list[bytes]:
    """The image bytes of samples 0 .. count - 1 of a pack (its members are in id order)."""
    found: dict[int, bytes] = {}
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if ext != "cls" and len(key) == KEY_DIGITS and int(key) < count:
                    found[int(key)] = tar.extractfile(member).read()
        if len(found) == count:
            break
    return [found[i] for i in range(count)]


def loop_rate(images: list[bytes], decoder: str) -> float:
    """One in-process loop of the recipe's pipeline over encoded images: images/s."""
    pipeline = ImagePipeline(RECIPES[RECIPE], decoder)
    out = np.empty(pipeline.output_shape, np.uint8)
    start = time.perf_counter()
    for i, data in enumerate(images):
        pipeline.apply(f"sample {i}", np.random.default_rng(i), out, data)
    return len(images) / (time.perf_counter() - start)


def measure_folder(run: Run, folder: Path, name: str) -> dict:
    """One folder's packs, throughput, in-process loops and crop PSNR."""
    s = run.s
    sources = {RAW: {"kind": "image_folder", "root": str(folder)}}
    packs = {}
    for side in (None, *SIDES):
        variant = AS_IS if side is None else f"side_{side}"
        out = run.packs / f"{name}-{variant}"
        # --quick packs in this process: a pool's forkserver takes seconds to start
        manifest, seconds = pack_variant(folder, out, side, 1 if s.quick else s.workers + 1)
        urls = shard_urls(out, manifest)
        sources[variant] = {"kind": "webdataset", "urls": urls}
        packs[variant] = {
            "seconds": seconds,
            "images_per_s": manifest["samples"] / seconds,
            "resized": manifest["resized"],
            "bytes": sum(shard["bytes"] for shard in manifest["shards"]),
            "urls": urls,
        }
        run.log(f"packed {name} {variant}: {manifest['resized']} resized, {packs[variant]['bytes'] / 1e6:.1f} MB")
    index = scan_image_folder(str(folder), "bench")
    count = min(s.inprocess_images, len(index))
    encoded = {RAW: [Path(index.path(i)).read_bytes() for i in range(count)]}
    encoded |= {v: packed_bytes(sources[v]["urls"], count) for v in variants() if v != RAW}
    result = {
        "packs": packs,
        "jpeg_kb": {v: sum(map(len, data)) / len(data) / 1000 for v, data in encoded.items()},  # the loop's images
        "throughput": {v: [] for v in variants()},
        "loops": {v: [] for v in variants()},
        "psnr": {},
    }
    for r in range(s.repeats):
        for variant in rotated(variants(), r):
            got = throughput_run(run, "prefetchd", RECIPE, source=sources[variant])
            result["throughput"][variant].append(got)
            result["loops"][variant].append(loop_rate(encoded[variant], s.decoder))
            run.log(
                f"packed {name} #{r}: {variant} {got['images_per_s']:.0f} img/s "
                f"(in-process loop {result['loops'][variant][-1]:.0f})"
            )
    for variant in variants():
        if variant != RAW:
            values = [crop_psnr(raw, packed, i) for i, (raw, packed) in enumerate(zip(encoded[RAW], encoded[variant]))]
            result["psnr"][variant] = summarize(values)
    return result


def measure_packed(run: Run, results: dict, folders: dict[str, tuple[int, int]] = FOLDERS) -> None:
    """Each folder of ``folders``: "imagenet" is the run's own, another is made beside it."""
    packed = results["packed"] = {"sides": list(SIDES), "quality": QUALITY, "folders": {}}
    for name, size in folders.items():
        if name == RUN_FOLDER:
            folder, sizes = run.data, [Path(p).stat().st_size for p, _ in run.files]
        else:
            folder = run.packs / f"{name}-images"
            run.log(f"generating {run.s.images} JPEGs of {size[0]} x {size[1]} in {folder}")
            sizes = make_dataset(folder, run.s.images, size)[1]
        packed["folders"][name] = {"size": list(size), "mean_kb": statistics.mean(sizes) / 1000}
        packed["folders"][name] |= measure_folder(run, folder, name)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from prefetchd.bench.options import parse_args
    from prefetchd.bench.report import print_table
    from prefetchd.bench.speedrows import packed_rows

    s = parse_args(argv, __doc__, prog="python -m prefetchd.bench.packed")
    console = Console(width=None if sys.stdout.isatty() else 200)
    run = Run(s, console)
    try:
        run.files = make_dataset(run.data, s.images)[0]
        results = {"settings": asdict(s)}
        measure_packed(run, results)
    finally:
        run.close()
    rows = [asdict(row) for row in packed_rows(results["packed"], s)]
    print_table(console, rows, s)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packed.json").write_text(json.dumps({**results, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
