"""The report of a run: the table printed, bench.json (every raw figure and the rows), bench.md
(the table in Markdown) and bench_timeline.png (prefetchd's buffer fill and every system's
per-step waits; matplotlib, from the `bench` extra, imported only here and only if installed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from prefetchd.bench import speedrows, waitrows
from prefetchd.bench.common import SYSTEM_NAMES, SYSTEMS, Settings


def summarize(results: dict, s: Settings) -> list[dict]:
    """The table's rows in its order, as bench.json holds them."""
    tp = speedrows.throughput_medians(results["throughput"])
    rows = [
        *speedrows.cold_start_rows(results["cold_start"], s),
        *speedrows.throughput_rows(tp, s),
        speedrows.partial_decode_row(tp, results["decoder_loops"], s),
        *speedrows.scaling_rows(tp, results["inprocess"], s),
        *waitrows.trainer_rows(results),
        waitrows.epoch_boundary_row(results["steady"]),
        waitrows.restart_row(results["restart"]),
        waitrows.client_row(results["client"]),
        speedrows.daemon_cost_row(results),
        *speedrows.packed_rows(results["packed"], s),
        speedrows.ray_row(results.get("ray", {"why": "not measured"}), s),
    ]
    return [asdict(row) for row in rows]


def write_report(console: Console, results: dict, s: Settings, out: Path) -> None:
    """Print the table and write the three files into ``out``; the JSON says why there is no
    picture when there is none."""
    print_table(console, results["rows"], s)
    png = out / "bench_timeline.png"
    results["timeline_png"] = str(png)
    why_not = plot_timeline(results, png)
    if why_not:
        results["timeline_png"] = None
        console.print(f"no timeline: {why_not}", markup=False)  # its "[bench]" is text, not a style
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(markdown_table(results["rows"], s, results["environment"]))
    console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + ("" if why_not else f", {png}"), highlight=False)


def print_table(console: Console, rows: list[dict], s: Settings) -> None:
    table = Table(
        title=f"prefetchd vs DataLoader: {s.images} JPEGs, {s.workers} workers, batch {s.batch_size}, "
        f"median of {s.repeats}",
        show_lines=True,
    )
    for col in ("measure", "prefetchd", "DataLoader", "ratio", "target", "holds"):
        table.add_column(col, overflow="fold")
    for r in rows:
        holds = {True: "[green]yes[/]", False: "[red]no[/]", None: ""}[r["holds"]]
        # escape: "[from the first batch on]" is text, not a style rich would swallow
        cells = (r["measure"], r["prefetchd"], r["dataloader"], r["ratio"], r["target"])
        table.add_row(*map(escape, cells), holds)
    console.print(table)


def markdown_table(rows: list[dict], s: Settings, env: dict) -> str:
    """The table as Markdown, for the README: the same cells as the printed one."""
    lines = [
        f"{s.images} generated JPEGs (~{env['dataset']['mean_kb']:.0f} KB, {env['dataset']['pixels']}), "
        f"{s.workers} worker(s) each, batch {s.batch_size}, median of {s.repeats}; {env['cores']} cores, "
        f"Python {env['python']}, torch {env['torch']}, Pillow {env['pillow']}.",
        "",
        "| measure | prefetchd | DataLoader | ratio | target | holds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        holds = {True: "yes", False: "**no**", None: ""}[r["holds"]]
        cells = [r["measure"], r["prefetchd"], r["dataloader"], r["ratio"], r["target"], holds]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot_timeline(results: dict, path: Path) -> str | None:
    """Buffer fill (prefetchd) above per-step waits (every system), for the first repeat of
    the steady and the bursty trainer. Returns why not, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'prefetchd[bench]')"
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex="col", height_ratios=[1, 1.4])
    colours = {"prefetchd": "tab:blue", "dataloader_persistent": "tab:orange", "dataloader_fresh": "tab:red"}
    for col, kind in enumerate(("steady", "bursty")):
        fill, wait = axes[0][col], axes[1][col]
        timeline = results[kind]["prefetchd"][0]["timeline"]
        samples = timeline["buffer"]
        fill.plot([x["t"] for x in samples], [x["used_bytes"] / 2**20 for x in samples], color=colours["prefetchd"])
        fill.set_ylabel("prefetchd buffer (MiB)")
        if kind == "bursty":  # the trainer's pauses, while the buffer banks what it makes
            pause = results["trainer_plans"]["bursty"]["pause_s"]
            for i, step in enumerate(timeline["steps"]):
                if i % results["trainer_plans"]["bursty"]["every"] == 0:
                    fill.axvspan(step["t"] - pause, step["t"], color="grey", alpha=0.15, linewidth=0)
        plan = results["trainer_plans"][kind]
        fill.set_title(
            f"{kind} trainer: step {plan['work_s'] * 1000:.0f} ms"
            + (f", {plan['pause_s']:.2f} s pause every {plan['every']} steps" if kind == "bursty" else "")
        )
        for system in SYSTEMS:
            steps = results[kind][system][0]["timeline"]["steps"]
            wait.plot(
                [x["t"] for x in steps],
                [x["wait"] * 1000 for x in steps],
                marker="o",
                markersize=3,
                linewidth=0.8,
                color=colours[system],
                label=SYSTEM_NAMES[system],
            )
            for x in steps:  # epoch boundaries, where a DataLoader starts over
                if x["epoch"] > 0 and x["step"] == 0:
                    wait.axvline(x["t"], color=colours[system], alpha=0.25, linestyle=":")
        wait.set_ylabel("wait for the batch (ms)")
        wait.set_xlabel("seconds since the trainer started")
        wait.legend(fontsize=8)
    fig.suptitle("DataLoader's queue is not observable: its panel shows waits only")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
