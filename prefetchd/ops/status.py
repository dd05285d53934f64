"""The status report: what `prefetchd status` shows, built from the master's public parts.

Read-only: it looks at the buffer's ledger, the pool's workers, the intake's view of the
trainers, the policies' counts and the master's rates, and measures the bytes of the files
on the tmpfs (the ledger says what should be there; the filesystem what is).
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field

from prefetchd import settings
from prefetchd_client.ranks import format_ranks

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

    def seen_per_second(self, now: float) -> float:
        """The rate over the time the events span (at least a second), not the whole window:
        a trainer that began 2 s ago is not taken for one five times slower."""
        self._forget_before(now - _RATE_WINDOW_S)
        if not self.events:
            return 0.0
        return sum(n for _, n in self.events) / max(1.0, now - self.events[0][0])

    def _forget_before(self, t: float) -> None:
        while self.events and self.events[0][0] < t:
            self.events.popleft()


def job_status(m) -> dict:  # m: the prefetchd.master.loop.Master, which imports this module
    """What `prefetchd status` shows: the buffer, each rank, workers, rates, sources, totals."""
    now = time.monotonic()
    buffer, plan, intake = m.buffer, m.job.plan, m.intake
    ranks = []
    for r, state in buffer.scheduler.ranks.items():
        consumers = _consumers_status(r, state, plan, intake, now)
        epoch, step = plan.unlinear(state.position)
        ages = [c["last_report_s_ago"] for c in consumers if c["last_report_s_ago"] is not None]
        waits = [c["wait"] for c in consumers if c["wait"] is not None]
        trainers = {c["trainer"] for c in consumers}
        ranks.append(
            {  # the rank as a whole: its leading consumer's position, the trainer that waits most
                "rank": r,
                "trainer": next((t for t in ("alive", "gone") if t in trainers), "never"),
                "epoch": epoch,
                "step": step,
                "ready": len(state.ready),
                "in_flight": len(state.in_flight),
                "consumed": state.consumed_total,
                "last_report_s_ago": min(ages, default=None),
                "wait": max(waits, key=lambda w: w["last_minute_share"], default=None),
                "consumers": consumers,
            }
        )
    workers = m.pool.snapshot()
    produced_per_s = m.produce_rate.per_second(now)
    consumed_per_s = m.consume_rate.per_second(now)
    return {
        "job": m.paths.name,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - m.started_at, 1),
        "batches_per_epoch": plan.batches_per_epoch,
        "world_size": m.config.world_size,
        "served_ranks": format_ranks(m.config.served_ranks),  # this node's share of the world
        "config": settings.echo(m.config),
        "buffer": {
            "bound_bytes": m.config.buffer_bytes,
            "used_bytes": buffer.used_bytes,
            "files_bytes": buffer.files_bytes(now),
            "pinned_batches": len(buffer.retired.pinned),
            "pinned_bytes": buffer.retired.pinned_bytes,
            "spare_batches": buffer.retired.spares,  # consumed batches' files kept to be overwritten
            "peak_bytes": buffer.peak_bytes,
            "batch_bytes": buffer.layout.size,
            "window_per_rank": buffer.scheduler.window,
            "retain_per_rank": buffer.scheduler.retain,
        },
        "index": {"samples": plan.num_samples, "bytes": m.job.index_bytes},  # read by row by every process
        "ranks": ranks,
        "backing_off_no_space": m.pauses.no_space.backing_off,
        "store": {  # object stores: an outage (how long so far, its last error) and each store's counters
            **m.pauses.outage.snapshot(now),
            "stores": m.pool.io_status(),
        },
        "executor": m.pool.executor_status() | {"auto": m.demand.snapshot()[2]},  # --ray-workers auto, or None
        "workers": {
            "count": len(workers),
            "busy": sum(w["task"] is not None for w in workers),
            "restarts": m.restarts.recent,
            "pids": [w["pid"] for w in workers],
            "each": workers,
            # --workers auto (min, max, target, changes) and the node's CPU budget (cpus, lease, jobs): None if unused
            **dict(zip(("auto", "budget"), m.demand.snapshot()[:2])),
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
            "deleted": buffer.deleted,
            "bad_samples": m.samples.bad,
            "bad_messages": intake.refusals.counts["message"],
            "refused": dict(intake.refusals.counts),  # peer input dropped, by kind (prefetchd.master.intake)
            # Counters since the start, for /metrics (prefetchd.ops.metrics); workers.restarts is the last minute's.
            "produced_images": m.produced * m.config.batch_size,
            # read by trainers: a batch read by two consumers counts twice (produced counts it once)
            "consumed_images": sum(r.consumed_total for r in buffer.scheduler.ranks.values()) * m.config.batch_size,
            "worker_restarts": m.worker_restarts,
        },
    }


def _consumers_status(rank: int, state, plan, intake, now: float) -> list[dict]:
    """Each consumer reading ``rank`` (one, the default "", unless several trainers read the job):
    its position (None once its trainer left and its window was released), whether it lags
    (served on demand, scheduler.py), what it consumed, its trainer and its waits."""
    out = []
    for name in intake.consumers:
        index, trainer = state.positions.get(name), intake.trainers.get((rank, name), "never")
        if index is None and trainer == "never":
            continue
        epoch, step = (None, None) if index is None else plan.unlinear(index)
        last = intake.last_report.get((rank, name))
        out.append(
            {
                "consumer": name,
                "trainer": trainer,
                "epoch": epoch,
                "step": step,
                "lagging": name in state.lagging,
                "consumed": state.consumed.get(name, 0),
                "last_report_s_ago": None if last is None else round(now - last, 3),
                "wait": intake.stalls.snapshot((rank, name), now),  # None: unknown (a progress-file trainer, none yet)
            }
        )
    return out


def _mix_status(m) -> list[dict]:
    """Each source's configured share and its realised share of the samples produced."""
    plan = m.job.plan
    total = sum(m.produced_per_source)
    configured = plan.source_counts() / plan.epoch_length if plan.mixing else None
    return [
        {
            "name": name,
            "weight": src.get("weight"),
            "configured_share": None if configured is None else round(float(configured[i]), 4),
            "realised_share": round(n / total, 4) if total else None,
            "samples_produced": n,
        }
        for i, (name, src, n) in enumerate(zip(m.job.source_names, m.config.sources, m.produced_per_source))
    ]
