"""The trainer's side of a measurement: the batches of a loader over epochs, a trainer loop that
records when it asked for each batch and how long it waited, and the sampler of prefetchd's
buffer that the timeline draws."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import time
from collections.abc import Callable

from prefetchd import control
from prefetchd.bench.common import touch
from prefetchd_client.layout import JobPaths


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
