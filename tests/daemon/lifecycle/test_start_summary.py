"""issue 27: a config that names a folder and nothing else serves the default training pipeline,
and `start` says what it found and will do: samples, classes, batches, pipeline, buffer; `status
--json` shows the sources and transforms the job runs with."""

from __future__ import annotations

import json
import textwrap

from tests.conftest import cli


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
        out = result.stdout
        assert "data: 48 samples, 4 classes; 12 batches of 4 per epoch per rank (world size 1, 1 rank(s) here)" in out
        assert "pipeline: random_resized_crop 224, hflip; decoder " in out, out
        assert "buffer: 64.0 MiB bound, " in out and " batches ahead per rank (" in out, out
        status = json.loads(cli("status", "first", "--json").stdout)
        assert status["config"]["transform"] == [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}]
        assert [s["root"] for s in status["config"]["source"]] == [str(jpeg_folder)]
    finally:
        assert cli("stop", "first").returncode == 0
