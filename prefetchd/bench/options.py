"""The command line of `prefetchd bench`, shared with the rows that also run alone
(``python -m prefetchd.bench.packed``): the flags and their --quick defaults, into Settings."""

from __future__ import annotations

import argparse

from prefetchd.bench.common import Settings
from prefetchd.settings import DECODERS, default_workers
from prefetchd.workers.decoders import resolve_decoder


def parse_args(argv: list[str] | None, description: str | None = None, prog: str = "prefetchd bench") -> Settings:
    """A run's Settings from the command line of `prefetchd bench` (or of a row run alone)."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    try:
        decoder = resolve_decoder(a.decoder)  # what a default install runs: the fastest installed
    except ImportError as exc:
        p.error(f"--decoder {a.decoder}: {exc}")
    s = Settings(
        images=a.images or (48 if q else 1500),
        workers=a.workers or default_workers(),
        repeats=a.repeats or (1 if q else 3),
        batch_size=a.batch_size or (8 if q else 64),
        epochs=2,
        buffer=a.buffer or ("32M" if q else "1G"),
        decoder=decoder,
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
