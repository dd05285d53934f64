"""prefetchd against torch.utils.data.DataLoader: the same JPEGs, recipe and number of workers.

One run measures every row below on one folder of generated ImageNet-sized JPEGs (500 x 375
or 375 x 500, ~110 KB, made with prefetchd.cli.datagen in a temporary folder removed at the end).
Within each repeat the systems alternate (the order rotates), and the table shows medians
over the repeats. The systems: prefetchd (one daemon with N workers, PrefetchLoader) and
DataLoader (the usual Dataset: PIL open and full decode, the recipe, flip, uint8 HWC tensor;
default collate, num_workers=N, shuffle, no pinning) with persistent_workers True and False.

  cold start       from nothing running to the images in hand, `prefetchd start` inside the
                   clock, against DataLoader and (where installed) DALI (prefetchd.bench.coldstart)
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
  trainer restart  a fresh trainer process to its first batch (prefetchd.bench.restart)
  client cost      map + header parse + tensors for a 256 x 224 x 224 x 3 batch vs np.copyto of it
  daemon cost      CPU of the daemon's master per 1,000 batches, of its workers per image
  packed           `prefetchd pack --max-short-side 320` and 256 (--quality 90) against the raw
                   folder, random-resized-crop 224 + flip: images/s, and the PSNR of the crops
                   from packed against raw images at the same relative box; on the run's folder
                   and on one of 640 x 480 (prefetchd.bench.packed, prefetchd.bench.croppsnr)
  ray              --executor ray on a Ray cluster of N CPUs on this machine vs N local workers:
                   images/s and start-to-first-batch (prefetchd.bench.ray_executor; needs prefetchd[ray])

It prints the table, and writes into --out: bench.json (every raw figure), bench.md (the
table in Markdown) and bench_timeline.png (prefetchd's buffer fill and every system's per-step waits; matplotlib,
from the `bench` extra). Everything it starts is stopped, and everything it writes outside
--out is removed, also on Ctrl-C or an error. Needs torch (the DataLoader side).

    prefetchd bench [--quick] [--images 1500] [--workers N] [--repeats 3] [--batch-size 64]
    python -m prefetchd.bench ...      (the same)
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

from rich.console import Console

from prefetchd.bench import options
from prefetchd.bench.common import Settings
from prefetchd.errors import ExitCode

TORCH_MISSING = "prefetchd bench compares with torch's DataLoader, and torch does not import here"
TORCH_INSTALL = "pip install torch"


def parse_args(argv: list[str] | None) -> Settings:
    return options.parse_args(argv, __doc__)


def torch_missing() -> str | None:
    """Why torch cannot be used here (its ImportError's first line), or None. A real import, not
    find_spec: an installed torch whose libraries do not load is missing too."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None


_stopped: list[int] = []  # the stop signals received


def _interrupt(signum, frame):
    _stopped.append(signum)
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: through every finally


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    why = torch_missing()
    if why is not None:
        print(f"error: {TORCH_MISSING} ({why}): {TORCH_INSTALL}", file=sys.stderr)
        return int(ExitCode.USER)
    out = Path(s.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: --out {s.out}: cannot make the folder ({exc.strerror}); name another one", file=sys.stderr)
        return int(ExitCode.USER)
    # The measurements import torch: loaded once it is known to import.
    from prefetchd.bench.report import summarize, write_report
    from prefetchd.bench.run import Run
    from prefetchd.bench.suite import measure_all

    console = Console(width=None if sys.stdout.isatty() else 200)  # a log keeps the table whole
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    # Forked children (DataLoader workers, the data and loop processes) are stopped with
    # SIGTERM by their owners: they must simply die, not unwind this process's cleanup.
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    run = Run(s, console)
    try:
        results = measure_all(run)
    except KeyboardInterrupt:
        return 130  # Ctrl-C or SIGTERM: the finally below has stopped and removed everything
    except Exception as exc:
        if _stopped:  # a Ctrl-C reaches the whole process group: a step it ended first fails
            return 130
        trace = out / "bench-error.txt"
        trace.write_text("".join(traceback.format_exception(exc)))
        print(f"error: the benchmark failed: {str(exc)[:300]} (the traceback is in {trace})", file=sys.stderr)
        return 1
    finally:
        run.close()
    results["cleanup"]["pids"] = sorted(run.pids)
    results["rows"] = summarize(results, s)
    write_report(console, results, s, out)
    return 0
