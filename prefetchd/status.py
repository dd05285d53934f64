"""The status report: what `prefetchd status` shows, built from the master's state.

Read-only: it looks at the master's scheduler, counters and rates, and measures the bytes
of the files on the tmpfs (the ledger says what should be there; the filesystem what is).
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field

_RATE_WINDOW_S = 10.0


@dataclass
class Rates:
    """Events in the last _RATE_WINDOW_S seconds, for the status rates."""

    events: collections.deque = field(default_factory=collections.deque)

    def add(self, now: float, n: int = 1) -> None:
        self.events.append((now, n))
        self._forget_before(now - _RATE_WINDOW_S)  # bounded by the window, whether or not status is asked

    def per_second(self, now: float) -> float:
        self._forget_before(now - _RATE_WINDOW_S)
        return sum(n for _, n in self.events) / _RATE_WINDOW_S

    def _forget_before(self, t: float) -> None:
        while self.events and self.events[0][0] < t:
            self.events.popleft()


_FILES_SCAN_S = 0.5  # status requests in a flood share one scan of the folders


def _files_bytes(m, now: float) -> int:
    """Blocks allocated to the buffer's files, as the filesystem reports them; each file once
    (a batch linked into batches/ still has its tmp/ name until its worker unlinks it)."""
    scanned_at, fs_bytes = m._files_scan
    if now - scanned_at < _FILES_SCAN_S:
        return fs_bytes
    fs_bytes, seen = 0, set()
    for folder in (m.paths.batch_dir, m.paths.tmp_dir, m.paths.retired_dir):
        with os.scandir(folder) as entries:
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    fs_bytes += st.st_blocks * 512
    m._files_scan = (now, fs_bytes)
    return fs_bytes


def job_status(m) -> dict:
    """What `prefetchd status` shows: the buffer, each rank, rates, sources, totals."""
    now = time.monotonic()
    size = m.layout.size
    fs_bytes = _files_bytes(m, now)
    ranks = []
    for r, state in enumerate(m.scheduler.ranks):
        epoch, step = m.plan.unlinear(state.position)
        last = m._last_report.get(r)
        ranks.append(
            {
                "rank": r,
                "trainer": m.trainers[r],
                "epoch": epoch,
                "step": step,
                "ready": len(state.ready),
                "in_flight": len(state.in_flight),
                "consumed": state.consumed,
                "last_report_s_ago": None if last is None else round(now - last, 3),
            }
        )
    produced_per_s = m._produce_rate.per_second(now)
    consumed_per_s = m._consume_rate.per_second(now)
    return {
        "job": m.paths.name,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - m.started_at, 1),
        "batches_per_epoch": m.plan.batches_per_epoch,
        "buffer": {
            "bound_bytes": m.config.buffer_bytes,
            "used_bytes": m.used_bytes,
            "files_bytes": fs_bytes,
            "pinned_batches": len(m.retired.pinned),
            "pinned_bytes": m.retired.pinned_bytes,
            "peak_bytes": m.peak_bytes,
            "batch_bytes": size,
            "window_per_rank": m.scheduler.window,
            "retain_per_rank": m.scheduler.retain,
        },
        "ranks": ranks,
        "backing_off_no_space": m._no_space_delay > 0,
        "workers": {
            "count": len(m.workers),
            "busy": sum(s.task is not None for s in m.workers),
            "restarts": len(m._restarts),
            "pids": [s.process.pid for s in m.workers],
        },
        "rates": {
            "produced_batches_per_s": round(produced_per_s, 2),
            "consumed_batches_per_s": round(consumed_per_s, 2),
            "produced_images_per_s": round(produced_per_s * m.config.batch_size, 1),
            "consumed_images_per_s": round(consumed_per_s * m.config.batch_size, 1),
        },
        "sources": _mix_status(m),
        "totals": {
            "produced": m.produced,
            "deleted": m.deleted,
            "bad_samples": m.bad_samples,
            "bad_messages": m.refusals["message"],
            "refused": dict(m.refusals),  # peer input dropped, by kind (prefetchd.master.Master.refuse)
        },
    }


def _mix_status(m) -> list[dict]:
    """Each source's configured share and its realised share of the samples produced."""
    total = sum(m.produced_per_source)
    configured = m.plan.source_counts() / m.plan.epoch_length if m.plan.mixing else None
    return [
        {
            "name": name,
            "weight": src.get("weight"),
            "configured_share": None if configured is None else round(float(configured[i]), 4),
            "realised_share": round(n / total, 4) if total else None,
            "samples_produced": n,
        }
        for i, (name, src, n) in enumerate(zip(m.source_names, m.config.sources, m.produced_per_source))
    ]
