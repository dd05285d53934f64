"""The client-cost row: what the client does with a batch that is ready (map the file, parse and
check its header, wrap its arrays as tensors) against the cheapest copying loader's np.copyto."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from prefetchd.bench.common import CLIENT_BATCH, rotated, touch
from prefetchd.bench.run import Run
from prefetchd_client.batchfile import BatchLayout, FieldSpec, map_batch
from prefetchd_client.batchwriter import BatchWriter


def measure_client(run: Run, results: dict) -> None:
    """Per batch, what the client does with a batch that is ready: map the file, parse and
    check its header, wrap the arrays as tensors, against the cheapest copying loader: one
    np.copyto of the same bytes into memory already faulted in. Also reported: the first
    touch of every page of the mapping, which the trainer's thread pays later (page faults),
    and both again as the loader maps: with the page tables made on its read-ahead thread
    (map_batch(populate=True), prefetchd_client.pagetables), which leaves the touch ~nothing."""
    fields = [FieldSpec("image", "uint8", CLIENT_BATCH), FieldSpec("label", "int64", CLIENT_BATCH[:1])]
    fields.append(FieldSpec("index", "int64", CLIENT_BATCH[:1]))
    layout = BatchLayout.plan(fields)
    path = run.root / "client-cost.batch"
    writer = BatchWriter(path, layout)
    writer.arrays["image"][...] = 7  # any bytes: the cost does not depend on them
    writer.finish(0, 0, 0, {})  # no digest: nothing reads this meta
    image_bytes = layout.fields[0].nbytes
    src = np.fromfile(path, dtype=np.uint8)[layout.offsets[0] : layout.offsets[0] + image_bytes]
    dst = np.ones_like(src)  # faulted in: the copy is timed, not the allocation

    def mapped(populate: bool = False) -> tuple[float, float]:
        t0 = time.perf_counter()
        _, arrays = map_batch(path, populate=populate)
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
        for which in rotated(("map", "populated", "copy"), r):
            if which != "copy":
                times = [mapped(which == "populated") for _ in range(run.s.client_iters)]
                got[f"{which}_s"] = statistics.median(t for t, _ in times)
                got[f"first_touch_after_{which}_s"] = statistics.median(t for _, t in times)
            else:
                got["copy_s"] = statistics.median(copied() for _ in range(run.s.client_iters))
        per_repeat.append(got)
        run.log(
            f"client #{r}: map {got['map_s'] * 1e6:.0f} us (then touch {got['first_touch_after_map_s'] * 1e3:.2f} ms), "
            f"with page tables {got['populated_s'] * 1e3:.2f} ms (then touch "
            f"{got['first_touch_after_populated_s'] * 1e3:.2f} ms), copy {got['copy_s'] * 1e3:.2f} ms"
        )
    path.unlink()
    results["client"] = {"batch_shape": list(CLIENT_BATCH), "bytes": image_bytes, "repeats": per_repeat}
