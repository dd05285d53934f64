"""issue 27's newcomer, from a fresh venv with the README's user install alone (no dev extra, no
torch): the three inputs that once said "serving" and then stopped, or failed without the fix,
now fail `start` naming the fix, or serve the default pipeline and say what they found. Long
tier: the install fetches the packages from the registry (~30 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.component.test_parquet import jpegs
from tests.component.test_shards import write_shard
from tests.conftest import REPO
from tests.daemon.data.test_bad_samples import hf_parquet

pytestmark = [pytest.mark.long, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("newcomer") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    started = time.monotonic()
    install = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "./client", ".[parquet]"]
    result = subprocess.run(install, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-2000:]
    print(f"\n[figure] user install (./client .[parquet]) in a fresh venv: {time.monotonic() - started:.1f} s")
    return venv


def start(venv: Path, config: Path, job_root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / "prefetchd"), "start", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PREFETCHD_ROOT": str(job_root)},
    )


def config_of(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent('[job]\nname = "newcomer"\nbatch_size = 4\n\n[[source]]\n') + source + "\n")
    return path


def test_the_first_inputs_of_a_newcomer_fail_with_the_fix_or_serve(tmp_path, job_root, user_venv):
    images = jpegs(16, seed=9)
    paths_only = hf_parquet(tmp_path / "hf.parquet", [None] * len(images))
    result = start(user_venv, config_of(tmp_path, f'kind = "parquet"\npath = "{paths_only}"'), job_root)
    assert result.returncode == 3 and "embed_table_storage" in result.stderr, result.stderr

    samples = [{"jpg": image, "json": json.dumps({"label": i % 2}).encode()} for i, image in enumerate(images)]
    shard = write_shard(tmp_path / "s.tar", samples)
    result = start(user_venv, config_of(tmp_path, f'kind = "webdataset"\nurls = "{shard}"'), job_root)
    assert result.returncode == 3 and "set label_key" in result.stderr, result.stderr
    assert not list(job_root.iterdir())

    folder = tmp_path / "folder"
    for i, image in enumerate(images):
        (folder / f"class_{i % 2}").mkdir(parents=True, exist_ok=True)
        (folder / f"class_{i % 2}" / f"{i}.jpg").write_bytes(image)
    result = start(user_venv, config_of(tmp_path, f'kind = "image_folder"\nroot = "{folder}"'), job_root)
    try:
        assert result.returncode == 0, result.stderr
        assert "data: 16 samples, 2 classes" in result.stdout and "random_resized_crop 224, hflip" in result.stdout
    finally:
        subprocess.run([str(user_venv / "bin" / "prefetchd"), "stop", "newcomer", "--root", str(job_root)], timeout=60)
    assert not list(job_root.iterdir())
