"""How ``prefetchd status`` shows a job: once (``render``), or live (``watch``, ``--watch``).

Both read the status reports the CLI fetched (prefetchd.ops.status builds them in the daemon;
a job that is not serving has only ``job``, ``state``, ``job_dir`` and maybe ``error``), so
what a person sees is what ``--json`` prints. A reply that is not what a daemon of ours sends
shows as such, never as a traceback.

Every string of a report is data (a stop reason quotes file names and a reader's words; a
reply or stopped.json may come from a peer): each is made printable (prefetchd_client.text)
before it is shown, and shown as rich Text, never read as markup.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from prefetchd.errors import ExitCode
from prefetchd.sizes import format_size
from prefetchd_client.text import printable

WATCH_INTERVAL_S = 1.0
_BAR_WIDTH = 20
_MAX_REPORT_DEPTH = 16  # a report of ours nests 5 deep; a hostile reply may nest ~1,000 (json's limit)
_MAX_SHOWN_CHARS = 10_000  # of one string: a daemon's stop reason is at most 8,192 (prefetchd.errors)


def render(s: dict, live: bool = False):
    """One job's report as rich renderables; ``live`` adds the watch view's bars and worker rows."""
    try:
        return Group(*_job(_printable_report(s), live))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):  # a daemon of ours never answers so
        # reprlib: a few items of a few levels, whatever the reply holds (repr would recurse into all of it)
        return Text(f"  the daemon's status reply is not what prefetchd sends: {printable(reprlib.repr(s), 200)}")


def _printable_report(value, depth: int = 0):
    """``value`` with every string in it, keys included, made printable (prefetchd_client.text)."""
    if isinstance(value, str):
        return printable(value, _MAX_SHOWN_CHARS)
    if depth > _MAX_REPORT_DEPTH:
        raise ValueError("the status reply nests deeper than any of ours")
    if isinstance(value, dict):
        return {printable(k, _MAX_SHOWN_CHARS): _printable_report(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_report(v, depth + 1) for v in value]
    return value


def watch(fetch: Callable[[], list[dict]], console: Console, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Show ``fetch()``'s reports, refreshed every ``interval_s``, until Ctrl-C (which ends it
    quietly: the caller exits 0)."""

    def frame():
        reports = fetch()
        stamp = Text(f"{time.strftime('%H:%M:%S')}  refreshed every {interval_s:g} s; Ctrl-C quits", style="dim")
        return Group(stamp, *(render(s, live=True) for s in reports) or [Text("no jobs")])

    try:
        if not console.is_terminal:  # a pipe or a file: Live would write its frame only at the end
            while True:
                console.print(frame())
                console.file.flush()
                time.sleep(interval_s)
        with Live(frame(), console=console, auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        pass


def _job(s: dict, live: bool):
    # emoji=False: ":fire:" in a job folder's path is text, not an emoji code
    yield Text.from_markup(f"[bold]{escape(s['job'])}[/]: {escape(s['state'])}  ({escape(s['job_dir'])})", emoji=False)
    if "error" in s:
        yield Text(f"  {s['error']}")
    if s["state"] == "stopped":
        code = s["exit_code"]
        name = ExitCode(code).name if code in ExitCode._value2member_map_ else "unknown"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["stopped_at"]))
        yield Text(
            f"  exit code {code} ({name}) at {when}; fix the cause and start the job again, "
            f"or remove its folder with `prefetchd stop {s['job']}`"
        )
    if s["state"] != "serving":
        return
    b, r, w = s["buffer"], s["rates"], s["workers"]
    yield Text(
        f"  pid {s['pid']}, up {s['uptime_s']:.0f} s; buffer {format_size(b['used_bytes'])} / "
        f"{format_size(b['bound_bytes'])} (files {format_size(b['files_bytes'])}, "
        f"peak {format_size(b['peak_bytes'])}, {b['pinned_batches']} consumed still mapped, "
        f"{b.get('spare_batches', 0)} spare)\n"
        f"  batch {format_size(b['batch_bytes'])}, "
        f"window {b['window_per_rank']} batches per rank; ranks {s['served_ranks']} of {s['world_size']}"
        + (f"; index {s['index']['samples']:,} samples, {format_size(s['index']['bytes'])}" if "index" in s else "")
    )
    yield Text(
        f"  produced {r['produced_images_per_s']:.0f} img/s, consumed {r['consumed_images_per_s']:.0f} img/s; "
        f"workers {w['busy']}/{w['count']} busy{_auto_text(w.get('auto'), w.get('budget'))}, {w['restarts']} restarts; "
        f"{s['totals']['bad_samples']} bad samples replaced"
        + ("; BACKING OFF: the tmpfs is full" if s.get("backing_off_no_space") else "")
    )
    ex = s.get("executor") or {}
    if ex.get("kind") == "ray":  # the cluster's state, and why it was given up
        state = f"lost ({ex['why']}); local workers only" if ex["state"] == "lost" else ex["state"]
        auto = ex.get("auto")  # --ray-workers auto: the target within its range, and how often it moved
        most = f"{auto['target']} (auto 1-{auto['max']}, {auto['changes']} changes)" if auto else ex["slots"]
        yield Text(f"  ray at {ex['address']}: {state}; {ex['in_flight']}/{most} in flight")
    yield from _store_lines(s.get("store") or {})
    refused = s["totals"].get("refused") or {}
    if refused:  # peer input dropped: a buggy or hostile trainer, a planted file (see the log)
        shown = ", ".join(f"{n} {kind.replace('_', ' ')}{'s' if n != 1 else ''}" for kind, n in sorted(refused.items()))
        yield Text(f"  refused: {shown}")
    yield _ranks_table(s, live)
    if live:
        yield _workers_table(w)


def _auto_text(auto: dict | None, budget: dict | None) -> str:
    """With --workers auto, its bounds and how often the count moved; with a node CPU budget,
    this job's lease of it (or why it cannot be settled)."""
    parts = []
    if auto:
        parts.append(f"auto {auto['min']}-{auto['max']}, {auto['changes']} change{'s' if auto['changes'] != 1 else ''}")
    if budget:
        parts.append(
            f"node budget {budget['lease']} of {budget['cpus']} CPUs over {budget['jobs']} job(s)"
            + (f", NOT SETTLED: {budget['refused']}" if budget.get("refused") else "")
        )
    return f" ({'; '.join(parts)})" if parts else ""


def _store_lines(store: dict):
    """An object store's outage, and each store's counters (absent for local data)."""
    if store.get("unreachable_s") is not None:
        yield Text(
            f"  STORE UNREACHABLE for {store['unreachable_s']:.0f} s, batches wait for it: {store.get('error')}"
        )
    for name, io in (store.get("stores") or {}).items():
        if name.startswith("cache:"):
            yield Text(f"  {name}: {io['requests']} reads served, {format_size(io['bytes'])}")
            continue
        mean = f", {1000 * io['seconds'] / io['requests']:.0f} ms a request" if io["requests"] else ""
        yield Text(
            f"  {name}: {io['requests']} requests, {format_size(io['bytes'])}, {io['retries']} retries, "
            f"{io['errors']} errors{mean}"
        )


def _ranks_table(s: dict, live: bool) -> Table:
    window = s["buffer"]["window_per_rank"]
    table = Table("rank", "trainer", "epoch", "step", box=None, padding=(0, 0, 0, 1), pad_edge=False)
    for header in (["buffer"] if live else []) + ["ready", "in flight", "consumed", "report"]:
        table.add_column(header)
    for header in ("wait 1m", "waited", "> 1 ms"):  # the trainer's waits for data (_wait_cells)
        table.add_column(header, justify="right")
    for rk in s["ranks"]:
        age = "never" if rk["last_report_s_ago"] is None else f"{rk['last_report_s_ago']:.1f} s"
        row = [str(rk[k]) for k in ("rank", "trainer", "epoch", "step")]
        if live:  # the rank's share of the window that is ready
            row.append(ProgressBar(total=max(1, window), completed=rk["ready"], width=_BAR_WIDTH))
        row += [str(rk["ready"]), str(rk["in_flight"]), str(rk["consumed"]), age, *_wait_cells(rk.get("wait"))]
        table.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in row))  # a str cell is markup
        consumers = rk.get("consumers") or []
        if any(c["consumer"] for c in consumers):  # several trainers read the job: a row each, under the rank's
            for c in consumers:
                table.add_row(*map(Text, _consumer_cells(rk["rank"], c, live)))
    return table


def _consumer_cells(rank: int, c: dict, live: bool) -> list[str]:
    """One consumer's row: its position on the rank, its trainer (lagging: served on demand), its waits."""
    age = "never" if c["last_report_s_ago"] is None else f"{c['last_report_s_ago']:.1f} s"
    name = printable(c["consumer"]) or "(default)"
    trainer = f"{c['trainer']}, lagging" if c["lagging"] else c["trainer"]
    position = ["-", "-"] if c["epoch"] is None else [str(c["epoch"]), str(c["step"])]
    blank = [""] * (3 if live else 2)  # the rank's buffer, ready and in flight: shared by its consumers
    return [f" {rank}:{name}", trainer, *position, *blank, str(c["consumed"]), age, *_wait_cells(c.get("wait"))]


def _wait_cells(wait: dict | None) -> tuple[str, str, str]:
    """The share of the last minute the trainer waited for data, its total wait, and how many
    of its steps waited over 1 ms."""
    if wait is None:  # a progress-file trainer, or no report yet: not known, which is not 0
        return "unknown", "unknown", "unknown"
    return (
        f"{wait['last_minute_share']:.1%}",
        f"{wait['seconds_total']:.2f} s",
        f"{wait['waited_steps_total']}/{wait['steps_total']}",
    )


def _workers_table(w: dict) -> Table:
    table = Table("worker pid", "kind", "state", "making", box=None, padding=(0, 0, 0, 1), pad_edge=False)
    for each in w["each"]:
        task = each["task"]
        state = "booting" if not each["ready"] else ("busy" if task is not None else "idle")
        table.add_row(*map(Text, (str(each["pid"]), str(each["kind"]), state, str(task or ""))))
    return table
