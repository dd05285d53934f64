"""Bad input through the real command: a clear message, a non-zero exit, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli, write_config

pytestmark = pytest.mark.timeout(120)


def assert_clean_failure(result, *phrases: str, root=None) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    if root is not None:
        assert list(root.iterdir()) == [], "a failed start left files behind"


def test_missing_data_folder(tmp_path, job_root):
    cfg = write_config(tmp_path, tmp_path / "nowhere")
    assert_clean_failure(cli("start", str(cfg)), "data folder", "does not exist", "--data", root=job_root)


def test_empty_data_folder(tmp_path, job_root):
    (tmp_path / "empty").mkdir()
    cfg = write_config(tmp_path, tmp_path / "empty")
    assert_clean_failure(cli("start", str(cfg)), "no class sub-folders", root=job_root)


def test_unreadable_file_list(tmp_path, job_root):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[source]]\nkind = "file_list"\npath = "missing.txt"\n[[transform]]\nop = "center_crop"\nsize = 8\n'
    )
    assert_clean_failure(cli("start", str(cfg)), "cannot read file list", "missing.txt", root=job_root)


def test_unknown_transform_op_and_key(tmp_path, jpeg_folder, job_root):
    cfg = write_config(tmp_path, jpeg_folder, extra='\n[[transform]]\nop = "sharpen"\n')
    assert_clean_failure(cli("start", str(cfg)), "unknown transform op 'sharpen'", root=job_root)
    cfg = write_config(tmp_path, jpeg_folder, extra='\n[[transform]]\nop = "hflip"\nprob = 0.3\n')
    assert_clean_failure(cli("start", str(cfg)), "unknown key 'prob'", "known keys: p", root=job_root)


def test_buffer_that_does_not_parse(tmp_path, jpeg_folder, job_root):
    cfg = write_config(tmp_path, jpeg_folder)
    result = cli("start", str(cfg), "--buffer", "30 gigs")
    assert_clean_failure(result, "--buffer", "K, M, G or T", root=job_root)
    assert result.returncode == 2


def test_buffer_smaller_than_one_batch(tmp_path, jpeg_folder, job_root):
    cfg = write_config(tmp_path, jpeg_folder, world_size=2)
    assert_clean_failure(
        cli("start", str(cfg), "--buffer", "20K"), "smaller than one batch per rank", "use --buffer", root=job_root
    )


def test_buffer_larger_than_the_free_tmpfs(tmp_path, jpeg_folder, job_root):
    free = os.statvfs(job_root).f_bavail * os.statvfs(job_root).f_frsize
    too_big = f"{free // (1 << 20) + 1024}M"
    cfg = write_config(tmp_path, jpeg_folder)
    from prefetchd.master.job import in_a_container

    # issue 27: Docker's --shm-size was the advice on a host with no container, against docs/operations.md
    advice = ("docker/compose.yaml", "not shared") if in_a_container() else ("docs/operations.md",)
    result = cli("start", str(cfg), "--buffer", too_big)
    assert_clean_failure(result, "exceeds the", "free", *advice, root=job_root)
    assert "--shm-size" not in result.stderr


def test_fewer_samples_than_one_global_batch(tmp_path, jpeg_folder, job_root):
    cfg = write_config(tmp_path, jpeg_folder, batch_size=40, world_size=2)
    assert_clean_failure(cli("start", str(cfg)), "fewer than one global batch", root=job_root)


def test_missing_config_file_and_bad_job_names(tmp_path, job_root):
    assert_clean_failure(cli("start", str(tmp_path / "nope.toml")), "does not exist")
    assert_clean_failure(cli("status", "../x"), "invalid job name")
    assert_clean_failure(cli("stop", "not-running"), "no prefetchd job 'not-running' is running")
    assert_clean_failure(cli("status", "not-running"), "prefetchd start")


def test_status_with_no_jobs(job_root):
    result = cli("status")
    assert result.returncode == 0 and "no jobs" in result.stdout
    assert cli("status", "--json").stdout.strip() == "[]"


def test_demo_runs_end_to_end(tmp_path, job_root):
    result = cli(
        "demo",
        "--images",
        "20",  # one batch of 20: the whole path, at a tenth of the default's CPU
        "--epochs",
        "1",
        "--workers",
        "1",
        "--root",
        str(job_root),
        env={"PREFETCHD_CACHE": str(tmp_path)},
        timeout=110,
    )
    assert result.returncode == 0, result.stderr
    assert "images/s" in result.stdout and "waited for data" in result.stdout
    assert list(job_root.iterdir()) == []


def test_a_demo_on_an_empty_cache_shows_its_progress_at_once_and_runs_under_prefetchd_root(tmp_path, job_root):
    """issue 27: silent for ~23 s while it made its JPEGs, then ~11 s more; and it ignored $PREFETCHD_ROOT."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "demo", "--images", "60", "--epochs", "1", "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PREFETCHD_CACHE": str(tmp_path)},
    )
    started = time.monotonic()
    first = demo.stdout.readline()
    first_s = time.monotonic() - started
    rest, err = demo.communicate(timeout=110)
    assert demo.returncode == 0, err
    assert first.startswith("generating 60 JPEGs in ") and "generated JPEGs: 60 of 60" in rest, first + rest
    assert f"under {job_root} " in rest and "serving after " in rest and "images/s" in rest, rest
    assert "training: " in rest and " of " in rest and "loss " in rest, rest  # the loop too, as it goes
    assert list(job_root.iterdir()) == [] and job_root.is_dir()  # the job gone, the user's root kept
    print(f"\n[figure] demo: first line after {first_s:.2f} s (the command's imports included)")
    assert first_s < 10  # 2 s on a quiet machine; this bound catches a demo silent until its data is made


@pytest.mark.parametrize(
    "flags, why",
    [(["--images", "5"], "--images must be at least 10 (one per class), got 5"), (["--epochs", "0"], "--epochs must")],
)
def test_a_demo_too_small_to_train_is_refused_before_it_generates_anything(tmp_path, flags, why):
    result = cli("demo", "--images", "20", *flags, env={"PREFETCHD_CACHE": str(tmp_path)})
    assert result.returncode == 2 and why in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


# The tests that look for a demo's own root in /dev/shm, one after the other (one of them makes one).
_DEMO_ROOTS = pytest.mark.xdist_group("demo_roots")


@_DEMO_ROOTS
@pytest.mark.parametrize("own_root", [True, False], ids=["its-own-root", "root-given"])
def test_a_demo_whose_start_fails_says_why_not_that_no_job_runs(tmp_path, job_root, own_root, monkeypatch):
    """The demo stopped its job in a `finally`, started or not: "no prefetchd job 'demo' is
    running" stood in for the start's own error (there, 30 images for a batch of 32), and the
    demo's own root in /dev/shm, removed after that stop, was left."""
    if own_root:  # no --root and no $PREFETCHD_ROOT: the demo makes a root of its own
        monkeypatch.delenv("PREFETCHD_ROOT")
    before = {p.name for p in Path("/dev/shm").glob("prefetchd-demo-*")}
    flags = ["--images", "10", "--buffer", "1K", *([] if own_root else ["--root", str(job_root)])]
    result = cli("demo", *flags, env={"PREFETCHD_CACHE": str(tmp_path)})
    assert result.returncode == 2 and "smaller than one batch per rank" in result.stderr, result.stderr
    assert "is running" not in result.stderr and list(job_root.iterdir()) == []
    assert {p.name for p in Path("/dev/shm").glob("prefetchd-demo-*")} <= before


@_DEMO_ROOTS
def test_a_demo_with_a_bad_flag_leaves_no_folder(tmp_path):
    """Its private root in /dev/shm was made before the flags were read: `--buffer abc` left it."""
    before = {p.name for p in Path("/dev/shm").glob("prefetchd-demo-*")}
    result = cli("demo", "--images", "16", "--buffer", "abc", env={"PREFETCHD_CACHE": str(tmp_path)})
    assert result.returncode == 2 and "cannot read 'abc' as a size" in result.stderr, result.stderr
    assert {p.name for p in Path("/dev/shm").glob("prefetchd-demo-*")} <= before


@pytest.mark.parametrize("command", [["start", "--data", "DATA"], ["status"], ["stop", "job"]])
def test_an_empty_root_is_refused_not_taken_as_the_current_folder(tmp_path, jpeg_folder, job_root, command):
    """`--root "$DIR"` with DIR unset: the empty path was the current folder, and `start` put
    the job's batches on the disk under it instead of the tmpfs."""
    args = [str(jpeg_folder) if a == "DATA" else a for a in command]
    command_line = [sys.executable, "-m", "prefetchd", *args, "--root", ""]
    result = subprocess.run(command_line, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--root" in result.stderr and "is empty (an unset shell variable?)" in result.stderr
    assert list(tmp_path.iterdir()) == [] and list(job_root.iterdir()) == []


def test_a_file_named_as_the_root_is_refused_without_advice_to_remove_it(tmp_path, jpeg_folder, job_root):
    """The advice to `rm` a root that is not a folder is for the default root (a leftover); a
    root the user named may be their data."""
    data = tmp_path / "precious.jpg"
    data.write_bytes(b"\xff\xd8 the user's own file")
    result = cli("start", "--data", str(jpeg_folder), "--root", str(data))
    assert result.returncode != 0 and "is not a folder" in result.stderr, result.stderr
    assert "rm " not in result.stderr and "--root DIR" in result.stderr
    assert data.read_bytes() == b"\xff\xd8 the user's own file"


@pytest.mark.parametrize("root", ["/sys/kernel", "/proc/no-such-folder"])
def test_a_root_where_no_folder_can_be_made_is_a_clear_refusal(jpeg_folder, job_root, root):
    """Was exit 70, "internal error during start-up: PermissionError ... 'default'"."""
    result = cli("start", "--data", str(jpeg_folder), "--root", root)
    assert result.returncode == 4, result.stderr
    assert "cannot create the job " in result.stderr and "choose another --root" in result.stderr, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
