"""``python -m prefetchd.bench --quick``, run as a real process: every row in its JSON, a timeline
PNG, and nothing of it left behind (no daemon, no job root, no data folder). No speed is
asserted: the figures are the report's business, and this machine's two cores are shared. And
``prefetchd bench``, the command that runs it: its flags reach the benchmark, and without torch
it says in one line what to install."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import without_modules

ROWS = {
    "cold_start",
    "start",
    "throughput_rrc",
    "throughput_classic",
    "throughput_pillow",
    "throughput_simplejpeg",
    "partial_decode",
    "scaling_rrc",
    "scaling_classic",
    "steady_trainer",
    "bursty_trainer",
    "epoch_boundary",
    "trainer_restart",
    "client_cost",
    "daemon_cost",
    "packed_imagenet",
    "packed_coco",
    "ray",
}


@pytest.mark.long  # 55 CPU-s: every row of the benchmark; the quick tier runs `prefetchd bench` below
@pytest.mark.timeout(200)
def test_quick_bench_reports_every_row_and_cleans_up(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd.bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((out / "bench.json").read_text())

    assert (out / "bench.md").read_text().count("\n| ") == len(report["rows"]) + 1  # header and one per row
    rows = {r["id"]: r for r in report["rows"]}
    assert set(rows) == ROWS
    for r in rows.values():
        assert r["prefetchd"] and r["dataloader"], r
    # The raw figures behind the rows: both recipes, every system, every repeat; the default
    # install has every decoder, so prefetchd also ran with each one `auto` did not pick.
    assert report["settings"]["decoder"] == "turbojpeg"
    for recipe in ("rrc", "classic"):
        for system in ("prefetchd", "prefetchd_simplejpeg", "prefetchd_pillow", "dataloader_persistent"):
            assert len(report["throughput"][recipe][system]) == 1
        assert all(len(v) == 1 for v in report["decoder_loops"][recipe].values())
    assert rows["partial_decode"]["holds"] is not None
    # The cold start: `prefetchd start` timed as a user runs it, per installed decoder, against
    # DataLoader (DALI's row says why it is absent where DALI is not installed).
    cold = report["cold_start"]
    assert {"dataloader", "prefetchd_turbojpeg", "prefetchd_simplejpeg", "prefetchd_pillow"} <= set(cold["runs"])
    for decoder in ("turbojpeg", "simplejpeg", "pillow"):
        (run,) = cold["runs"][f"prefetchd_{decoder}"]
        assert 0 < run["start_s"] < run["first_batch_s"] and run["images"] == cold["images"] // 32 * 32 * cold["epochs"]
    steps = cold["start_breakdown_s"]
    assert len(steps) == 4 and rows["start"]["values"]["imports, each alone in a fresh interpreter"] == steps
    assert {"daemon launched", "daemon serving"} <= set(rows["start"]["values"]["steps_s"])  # the daemon's log
    assert not any(Path(p).exists() for p in cold["cleanup"])
    for kind in ("steady", "bursty"):
        assert report[kind]["prefetchd"][0]["timeline"]["buffer"], "no buffer samples for the timeline"
    assert set(report["restart"]) == {"prefetchd (warm)", "DataLoader fork"}
    assert "--quick" in rows["ray"]["prefetchd"]  # the Ray row needs a cluster: measured by the full run only

    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the dev extra installs it; without it the JSON says why there is no picture
        assert report["timeline_png"] is None

    # Nothing left: the job root and data folder are gone, and no daemon serves from them.
    cleanup = report["cleanup"]
    assert not Path(cleanup["root"]).exists() and not Path(cleanup["data"]).exists()
    assert not Path(cleanup["packs"]).exists()  # the packed rows' shards and second folder
    leftovers = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(root in " ".join(proc.info["cmdline"] or []) for root in (cleanup["root"], cold["cleanup"][1])):
            leftovers.append(proc.pid)
    assert leftovers == []


def test_prefetchd_bench_runs_the_benchmark(tmp_path):
    """The CLI command is a thin wrapper: its flags reach the benchmark's own parser."""
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "bench", "--out", str(tmp_path), "--help-script"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # An unknown flag goes through to the benchmark, whose argparse refuses it by name.
    assert result.returncode == 2 and "--help-script" in result.stderr


def test_prefetchd_bench_without_torch_says_what_to_install(tmp_path):
    """An interpreter where torch cannot be imported: a sitecustomize (which `site` runs at every
    start) marks it absent in sys.modules, so both `import torch` and find_spec("torch") say it
    is missing, in the command and in the benchmark's process, which inherits the environment."""
    env = {**os.environ, **without_modules(tmp_path / "site", "torch")}
    probe = "import importlib.util; print(importlib.util.find_spec('torch'))"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert found.stdout == "None\n", found.stdout + found.stderr
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr  # ExitCode.USER, as every user error
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "torch" in line and line.endswith("pip install torch"), line
    assert not out.exists()  # nothing made before the check


@pytest.mark.timeout(90)
def test_packed_rows_run_and_clean_up(tmp_path):
    """The packed rows on 16 images, one folder, in this process: each variant (the raw folder,
    packed as is, short side 320 and 256) served by a real daemon, the in-process loops and the
    crops' PSNR; the row's cells filled; the packs, the data and the job root gone after."""
    pytest.importorskip("torch")
    from rich.console import Console

    from prefetchd.bench.cli import parse_args
    from prefetchd.bench.common import make_dataset
    from prefetchd.bench.croppsnr import IDENTICAL_DB
    from prefetchd.bench.packed import measure_packed, variants
    from prefetchd.bench.run import Run
    from prefetchd.bench.speedrows import packed_rows

    s = parse_args(["--quick", "--images", "16", "--out", str(tmp_path)])
    run = Run(s, Console(quiet=True))
    try:
        run.files = make_dataset(run.data, s.images)[0]
        results: dict = {}
        measure_packed(run, results, folders={"imagenet": (500, 375)})
    finally:
        run.close()
    assert not run.data.exists() and not run.packs.exists() and not run.root.exists()

    f = results["packed"]["folders"]["imagenet"]
    assert f["packs"]["as_is"]["resized"] == 0 and f["packs"]["side_320"]["resized"] == 16
    assert f["jpeg_kb"]["side_256"] < f["jpeg_kb"]["side_320"] < f["jpeg_kb"]["raw"] == f["jpeg_kb"]["as_is"]
    for variant in variants():
        (got,) = f["throughput"][variant]
        assert got["batches"] == 2 * 2 and got["images_per_s"] > 0  # 2 epochs of 16 // 8
    assert f["psnr"]["as_is"]["identical"] == 16  # the same bytes: the same crops
    for side in ("side_320", "side_256"):
        assert 20 < f["psnr"][side]["p5_db"] <= f["psnr"][side]["median_db"] < IDENTICAL_DB
    (row,) = packed_rows(results["packed"], s)
    assert row.id == "packed_imagenet" and row.holds in (True, False)
    assert "320: " in row.prefetchd and " dB " in row.prefetchd and row.dataloader.startswith("raw folder ")
