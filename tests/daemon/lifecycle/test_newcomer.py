"""issue 27, what a newcomer meets: a config that names a folder and nothing else serves the
default training pipeline, and `start` says what it found and will do (samples, classes,
batches, pipeline, buffer); `status --json` shows the sources and transforms the job runs with;
`status --watch` into a pipe shows each refresh as it comes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

from tests.conftest import cli, write_config


def test_a_config_of_a_folder_alone_serves_the_default_pipeline_and_start_says_so(tmp_path, job_root, jpeg_folder):
    config = tmp_path / "job.toml"
    config.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "first"
        batch_size = 4

        [daemon]
        buffer = "64M"

        [[source]]
        kind = "image_folder"
        root = "{jpeg_folder}"
        """)
    )
    result = cli("start", str(config))
    assert result.returncode == 0, result.stderr
    try:
        lines = result.stdout.splitlines()  # a line each, not one line with escaped newlines
        assert "data: 48 samples, 4 classes; 12 batches of 4 per epoch per rank (world size 1, 1 rank(s) here)" in lines
        assert any(line.startswith("pipeline: random_resized_crop 224, hflip; decoder ") for line in lines), lines
        assert any(line.startswith("buffer: 64.0 MiB bound, ") and line.endswith(" a batch)") for line in lines), lines
        status = json.loads(cli("status", "first", "--json").stdout)
        assert status["config"]["transform"] == [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}]
        assert [s["root"] for s in status["config"]["source"]] == [str(jpeg_folder)]
    finally:
        assert cli("stop", "first").returncode == 0


def test_status_watch_into_a_pipe_shows_each_refresh_as_it_comes(tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, name="piped"))
    watch = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "status", "piped", "--watch"], stdout=subprocess.PIPE, text=True
    )
    try:
        started, seen = time.monotonic(), []
        while sum("piped: serving" in line for line in seen) < 2:  # two frames, while it runs
            line = watch.stdout.readline()
            assert line and time.monotonic() - started < 15, f"no second frame in 15 s: {seen}"
            seen.append(line)
        assert watch.poll() is None
    finally:
        watch.kill()
        watch.wait(timeout=10)
