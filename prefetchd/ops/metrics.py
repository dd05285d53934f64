"""The Prometheus metrics of a job: their names, and how each is read off the status snapshot.

Every metric comes from one snapshot, the dict ``prefetchd status --json`` prints
(``prefetchd.ops.status.job_status``), taken on the master's loop thread (``prefetchd.ops.scrapes``);
this module only renames its figures. Conventions: one ``prefetchd_`` prefix, base units
(``_bytes``, ``_seconds``), ``_total`` on counters, the label ``job`` on every series and
``rank`` on per-rank ones. A figure the snapshot does not know (a trainer that reports no waits)
is absent, not zero. Imported only with ``--metrics``: it needs prometheus_client
(``pip install 'prefetchd[metrics]'``). ``METRICS`` is the table docs/operations.md shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class MasterDidNotAnswer(Exception):
    """No snapshot within the scrape's timeout: the HTTP server answers 503."""


# name, type, labels besides job, meaning
METRICS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("prefetchd_up", "gauge", (), "1: the daemon's loop answered this scrape"),
    ("prefetchd_uptime_seconds", "gauge", (), "seconds since `prefetchd start` began"),
    ("prefetchd_buffer_bound_bytes", "gauge", (), "the byte bound, --buffer"),
    ("prefetchd_buffer_used_bytes", "gauge", (), "bytes of the bound in use: ready + in_flight + pinned + spare"),
    ("prefetchd_buffer_bytes", "gauge", ("state",),
     "bytes by state: ready (batches waiting to be read), in_flight (being written), pinned (consumed but "
     "still mapped by a client), spare (consumed files kept to be overwritten by the next batches)"),
    ("prefetchd_buffer_peak_bytes", "gauge", (), "the most bytes in use since the start"),
    ("prefetchd_buffer_files_bytes", "gauge", (), "bytes the batch files hold on the tmpfs (measured, every 0.5 s)"),
    ("prefetchd_batch_bytes", "gauge", (), "bytes of one batch file"),
    ("prefetchd_rank_batches_ahead", "gauge", ("rank",), "batches ready for the rank, ahead of its position"),
    ("prefetchd_rank_batches_in_flight", "gauge", ("rank",), "the rank's batches being made"),
    ("prefetchd_rank_position_epoch", "gauge", ("rank",), "the epoch of the next batch the rank reads"),
    ("prefetchd_rank_position_step", "gauge", ("rank",), "the step of the next batch the rank reads"),
    ("prefetchd_rank_consumed_batches_total", "counter", ("rank",),
     "batches the rank read: passed by its position, then deleted"),
    ("prefetchd_rank_last_report_age_seconds", "gauge", ("rank",),
     "seconds since the rank last reported its position (absent before its first report)"),
    ("prefetchd_trainer_alive", "gauge", ("rank",),
     "1: a trainer process of the rank is alive (holds its lock); 0: gone, or none yet"),
    ("prefetchd_trainer_wait_seconds_total", "counter", ("rank",),
     "seconds the trainer waited for batches (absent: unknown, e.g. a progress-file trainer)"),
    ("prefetchd_trainer_waited_steps_total", "counter", ("rank",), "steps on which the trainer waited more than 1 ms"),
    ("prefetchd_trainer_steps_total", "counter", ("rank",), "steps the trainer took (batches it was handed)"),
    ("prefetchd_trainer_wait_last_minute_ratio", "gauge", ("rank",), "share of the last minute the trainer waited"),
    ("prefetchd_produced_batches_total", "counter", (), "batches published into the buffer"),
    ("prefetchd_produced_images_total", "counter", (), "samples in the batches published"),
    ("prefetchd_consumed_images_total", "counter", (), "samples in the batches the ranks consumed"),
    ("prefetchd_deleted_batches_total", "counter", (), "batches deleted (consumed, or out of a moved window)"),
    ("prefetchd_workers", "gauge", (), "worker slots (local processes, and Ray relays)"),
    ("prefetchd_workers_busy", "gauge", (), "workers making a batch now"),
    ("prefetchd_workers_target", "gauge", (), "with --workers auto: the count the demand wants now (absent: fixed)"),
    ("prefetchd_worker_count_changes_total", "counter", (), "with --workers auto: changes of that count"),
    ("prefetchd_worker_restarts_total", "counter", (), "workers that died and were replaced (Ray bridge: one)"),
    ("prefetchd_bad_samples_total", "counter", (), "unreadable samples replaced (--on-error replace)"),
    ("prefetchd_backing_off", "gauge", (), "1: the tmpfs is full and production waits for space"),
    ("prefetchd_refused_total", "counter", ("kind",), "peer input refused, by kind (message, position, ...)"),
    ("prefetchd_store_unreachable", "gauge", (), "1: an object store does not answer and batches wait for it"),
    ("prefetchd_store_requests_total", "counter", ("store",), "requests to an object store (s3://bucket, ...)"),
    ("prefetchd_store_bytes_total", "counter", ("store",), "bytes read from an object store"),
    ("prefetchd_store_retries_total", "counter", ("store",), "requests to an object store tried again"),
    ("prefetchd_store_errors_total", "counter", ("store",), "requests to an object store that failed"),
    ("prefetchd_store_request_seconds_total", "counter", ("store",),
     "seconds spent in requests to an object store (÷ requests: the mean latency)"),
)
_BY_NAME = {name: (kind, labels, doc) for name, kind, labels, doc in METRICS}


def families(snapshot: dict) -> list[Metric]:
    """The metric families of one status snapshot (``job_status``'s dict)."""
    job, buffer, totals = snapshot["job"], snapshot["buffer"], snapshot["totals"]
    found = {name: _family(name) for name in _BY_NAME}

    def put(name: str, value: float, *labels: str) -> None:
        found[name].add_metric([job, *labels], float(value))

    ranks = snapshot["ranks"]
    batch = buffer["batch_bytes"]
    put("prefetchd_up", 1)
    put("prefetchd_uptime_seconds", snapshot["uptime_s"])
    put("prefetchd_buffer_bound_bytes", buffer["bound_bytes"])
    put("prefetchd_buffer_used_bytes", buffer["used_bytes"])
    put("prefetchd_buffer_bytes", sum(r["ready"] for r in ranks) * batch, "ready")
    put("prefetchd_buffer_bytes", sum(r["in_flight"] for r in ranks) * batch, "in_flight")
    put("prefetchd_buffer_bytes", buffer["pinned_bytes"], "pinned")
    put("prefetchd_buffer_bytes", buffer["spare_batches"] * batch, "spare")
    put("prefetchd_buffer_peak_bytes", buffer["peak_bytes"])
    put("prefetchd_buffer_files_bytes", buffer["files_bytes"])
    put("prefetchd_batch_bytes", batch)
    for r in ranks:
        rank = str(r["rank"])
        put("prefetchd_rank_batches_ahead", r["ready"], rank)
        put("prefetchd_rank_batches_in_flight", r["in_flight"], rank)
        put("prefetchd_rank_position_epoch", r["epoch"], rank)
        put("prefetchd_rank_position_step", r["step"], rank)
        put("prefetchd_rank_consumed_batches_total", r["consumed"], rank)
        if r["last_report_s_ago"] is not None:
            put("prefetchd_rank_last_report_age_seconds", r["last_report_s_ago"], rank)
        put("prefetchd_trainer_alive", r["trainer"] == "alive", rank)
        wait = r.get("wait")  # None: unknown; absent from a daemon older than the field
        if wait is not None:
            put("prefetchd_trainer_wait_seconds_total", wait["seconds_total"], rank)
            put("prefetchd_trainer_waited_steps_total", wait["waited_steps_total"], rank)
            put("prefetchd_trainer_steps_total", wait["steps_total"], rank)
            put("prefetchd_trainer_wait_last_minute_ratio", wait["last_minute_share"], rank)
    put("prefetchd_produced_batches_total", totals["produced"])
    put("prefetchd_produced_images_total", totals["produced_images"])
    put("prefetchd_consumed_images_total", totals["consumed_images"])
    put("prefetchd_deleted_batches_total", totals["deleted"])
    put("prefetchd_workers", snapshot["workers"]["count"])
    put("prefetchd_workers_busy", snapshot["workers"]["busy"])
    auto = snapshot["workers"].get("auto")  # None: a fixed count; absent from a daemon older than auto
    if auto:
        put("prefetchd_workers_target", auto["target"])
        put("prefetchd_worker_count_changes_total", auto["changes"])
    put("prefetchd_worker_restarts_total", totals["worker_restarts"])
    put("prefetchd_bad_samples_total", totals["bad_samples"])
    put("prefetchd_backing_off", snapshot["backing_off_no_space"])
    refused = {"message": totals["bad_messages"], **totals["refused"]}  # one series from the start: rate() works
    for kind, count in sorted(refused.items()):
        put("prefetchd_refused_total", count, kind)
    store = snapshot.get("store") or {}  # absent from a daemon older than object stores
    put("prefetchd_store_unreachable", store.get("unreachable_s") is not None)
    for name, io in (store.get("stores") or {}).items():
        for field in ("requests", "bytes", "retries", "errors"):
            put(f"prefetchd_store_{field}_total", io[field], name)
        put("prefetchd_store_request_seconds_total", io["seconds"], name)
    return list(found.values())


def _family(name: str) -> Metric:
    kind, labels, doc = _BY_NAME[name]
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, doc, labels=["job", *labels])  # a counter's family drops "_total"; its sample has it


class SnapshotCollector(Collector):
    """A collector for a registry of the daemon's own (never the global one, never multiprocess
    mode): each collect() asks the master's loop for a snapshot through ``take_snapshot``
    (``ScrapeQueue.ask`` with its timeout) and raises MasterDidNotAnswer when none came."""

    def __init__(self, take_snapshot: Callable[[], dict | None]):
        self.take_snapshot = take_snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self.take_snapshot()
        if snapshot is None:
            raise MasterDidNotAnswer("the daemon's loop did not answer in time (stopped, hung or stopping)")
        yield from families(snapshot)


def markdown_table() -> str:
    """docs/operations.md's table: name, type, labels, meaning."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, doc in METRICS:
        shown = ", ".join(f"`{label}`" for label in ("job", *labels))
        rows.append(f"| `{name}` | {kind} | {shown} | {doc.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
