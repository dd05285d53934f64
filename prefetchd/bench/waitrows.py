"""The waiting rows of the table, from a run's raw figures: the steady and the bursty trainer's
waits, the epoch boundary's, a restarted trainer's first batch, and the client's cost per batch.
Each: medians over repeats, the ratio, the target and whether it holds."""

from __future__ import annotations

import math

from prefetchd.bench.common import SYSTEMS, Row, fmt_ms, med


def _fmt_waits(x: dict) -> str:
    steps = f"step p50 {fmt_ms(x['median_s'])}, p95 {fmt_ms(x['p95_s'])}, max {fmt_ms(x['max_s'])}"
    return f"{fmt_ms(x['total_s'])} ({steps})"


def trainer_rows(results: dict) -> list[Row]:
    """The steady and the bursty trainer's total waits, and the steps' median, p95 and max."""
    rows = []
    for kind, goal in (("steady", None), ("bursty", 0.01)):
        w = {
            sy: {k: med(x[k] for x in results[kind][sy]) for k in ("total_s", "median_s", "p95_s", "max_s")}
            for sy in SYSTEMS
        }
        least = min(w["dataloader_persistent"]["total_s"], w["dataloader_fresh"]["total_s"])
        ratio = w["prefetchd"]["total_s"] / least if least > 0 else math.inf
        plan = results["trainer_plans"][kind]
        how = f"step {plan['work_s'] * 1000:.0f} ms" + (
            f", {plan['pause_s']:.2f} s pause every {plan['every']} steps" if kind == "bursty" else ""
        )
        # How many steps found their batch already in the buffer: the rest of the wait is the client's.
        ready = [(x["ready_when_asked"], x["steps"] - 1) for x in results[kind]["prefetchd"]]
        w["prefetchd"]["ready_when_asked"] = ready
        rows.append(
            Row(
                f"{kind}_trainer",
                f"{kind} trainer: total wait ({how})",
                _fmt_waits(w["prefetchd"]) + "; ready when asked: " + ", ".join(f"{k}/{n}" for k, n in ready),
                f"persistent {_fmt_waits(w['dataloader_persistent'])} / not {_fmt_waits(w['dataloader_fresh'])}",
                f"{ratio:.3f}x",
                "" if goal is None else f"<= {goal}x",
                None if goal is None else ratio <= goal,
                {**w, "ratio": ratio},
            )
        )
    return rows


def epoch_boundary_row(steady: dict) -> Row:
    """The steady trainer's wait for each new epoch's first batch. No next() takes 0 s: "no wait"
    means the batch was already in the buffer when the trainer asked, so what it spent is the
    client's per-batch cost, as on any other step (whose p95 is shown beside it)."""
    boundary = {sy: med([b for x in steady[sy] for b in x["epoch_boundary_s"]] or [math.nan]) for sy in SYSTEMS}
    ordinary = {sy: med(x["ordinary_p95_s"] for x in steady[sy]) for sy in SYSTEMS}
    all_ready = all(x["boundary_ready_when_asked"] for x in steady["prefetchd"])
    return Row(
        "epoch_boundary",
        "epoch boundary: wait for a new epoch's first batch (other steps' p95)",
        f"{fmt_ms(boundary['prefetchd'])} ({fmt_ms(ordinary['prefetchd'])}); "
        f"{'ready' if all_ready else 'NOT always ready'} when asked",
        f"persistent {fmt_ms(boundary['dataloader_persistent'])} ({fmt_ms(ordinary['dataloader_persistent'])}) / "
        f"not {fmt_ms(boundary['dataloader_fresh'])} ({fmt_ms(ordinary['dataloader_fresh'])})",
        "",
        "0: batch ready when asked",
        all_ready,
        {"boundary_s": boundary, "other_steps_p95_s": ordinary, "prefetchd_boundary_batches_ready": all_ready},
    )


def restart_row(restarts: dict) -> Row:
    """A fresh trainer process to its first batch: prefetchd's warm buffer, DataLoader's contexts."""
    first = {name: med(x["first_batch_s"] for x in runs) for name, runs in restarts.items()}
    process = {name: med(x["process_s"] for x in runs) for name, runs in restarts.items()}
    pf_name = "prefetchd (warm)"
    pf = first[pf_name]
    dl = {name: v for name, v in first.items() if name != pf_name}
    return Row(
        "trainer_restart",
        "trainer restart: first batch after imports (from process start)",
        f"{fmt_ms(pf)} ({process[pf_name]:.2f} s)",
        " / ".join(f"{name.split()[-1]} {fmt_ms(v)} ({process[name]:.2f} s)" for name, v in dl.items()),
        f"{min(dl.values()) / pf:,.0f}x faster",
        "<= 50 ms",
        pf <= 0.05,
        {"first_batch_s": first, "process_s": process},
    )


def client_row(client: dict) -> Row:
    """The client's own work on a ready batch against a copy; beside it, the page tables the
    loader makes on its read-ahead thread, and what they leave to the trainer's first touch."""
    c = client["repeats"]
    mapped, copied = med(x["map_s"] for x in c), med(x["copy_s"] for x in c)
    populated = med(x["populated_s"] for x in c)
    touched = {k: med(x[f"first_touch_after_{k}_s"] for x in c) for k in ("map", "populated")}
    return Row(
        "client_cost",
        "client cost per 256x224x224x3 batch: map + header + tensors vs np.copyto; the page tables the "
        "loader makes on its read-ahead thread, and the first touch of every page left to the trainer's thread",
        f"{fmt_ms(mapped)}; page tables {fmt_ms(populated - mapped)}, then first touch "
        f"{fmt_ms(touched['populated'])} (by page faults, without them: {fmt_ms(touched['map'])})",
        f"copy {fmt_ms(copied)}",
        f"{mapped / copied:.4f}x",
        "<= 0.01x",
        mapped / copied <= 0.01,
        {
            "map_s": mapped,
            "copy_s": copied,
            "map_and_page_tables_s": populated,
            "first_touch_s": touched["map"],
            "first_touch_after_page_tables_s": touched["populated"],
            "ratio": mapped / copied,
        },
    )
