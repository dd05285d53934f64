"""One error contract (issue 12, point 2): an error crosses a process boundary as data
(``{type, message, exit_code}``), is rebuilt as its own class or refused as an internal error;
a daemon that stops on an error leaves stopped.json, which the client, `status` and
`start --foreground` read; a new start of the job removes it."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import numpy as np
import pytest

from prefetchd.cli.datagen import make_image_folder
from prefetchd.errors import (
    MAX_MESSAGE_CHARS,
    ConfigError,
    DaemonStop,
    DataError,
    ExitCode,
    JobError,
    UserError,
    error_from_json,
    to_json,
)
from prefetchd_client import DaemonDied, PrefetchLoader
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_stopped
from tests.conftest import cli, write_config

pytestmark = pytest.mark.timeout(180)

_CLASS_OF_CODE = {
    ExitCode.USER: UserError,
    ExitCode.CONFIG: ConfigError,
    ExitCode.DATA: DataError,
    ExitCode.JOB: JobError,
}


def error_ending_with(code: ExitCode) -> UserError:
    cls = _CLASS_OF_CODE.get(code)
    message = f"what went wrong, for exit code {int(code)}: [daemon] key / --flag, 'quotes', ünïcode"
    return cls(message) if cls is not None else DaemonStop(message, code)


# -- the error as data ---------------------------------------------------------------------


@pytest.mark.parametrize("code", list(ExitCode), ids=[c.name for c in ExitCode])
def test_the_error_of_every_exit_code_comes_back_from_json_as_itself(code):
    error = error_ending_with(code)
    data = json.loads(json.dumps(to_json(error)))  # what a pipe or a file carries
    assert data == {"type": type(error).__name__, "message": str(error), "exit_code": int(code)}
    back = error_from_json(data)
    assert type(back) is type(error) and str(back) == str(error)
    assert back.exit_code == code and type(back.exit_code) is ExitCode


def test_a_type_it_does_not_know_comes_back_as_a_user_error_with_its_code():
    back = error_from_json({"type": "SomeNewerError", "message": "a newer daemon's words", "exit_code": 8})
    assert type(back) is UserError and back.exit_code == ExitCode.TASK_ERROR
    assert str(back) == "a newer daemon's words"


def test_a_message_too_long_for_the_contract_is_cut_and_still_reads_back():
    data = to_json(DataError("x" * (3 * MAX_MESSAGE_CHARS)))
    assert len(data["message"]) == MAX_MESSAGE_CHARS
    back = error_from_json(data)
    assert type(back) is DataError and str(back).startswith("xxx")


HOSTILE = {
    "a list": [1, 2],
    "a string": "DataError",
    "null": None,
    "no message": {"type": "DataError", "exit_code": 3},
    "an extra key": {"type": "DataError", "message": "m", "exit_code": 3, "pickle": "gASV"},
    "type not text": {"type": 3, "message": "m", "exit_code": 3},
    "type not a name": {"type": "os.system('x')", "message": "m", "exit_code": 3},
    "type too long": {"type": "E" * 65, "message": "m", "exit_code": 1},
    "message not text": {"type": "DataError", "message": ["m"], "exit_code": 3},
    "message too long": {"type": "DataError", "message": "m" * (MAX_MESSAGE_CHARS + 1), "exit_code": 3},
    "code a bool": {"type": "UserError", "message": "m", "exit_code": True},
    "code text": {"type": "UserError", "message": "m", "exit_code": "3"},
    "code a float": {"type": "UserError", "message": "m", "exit_code": 3.0},
    "code unknown": {"type": "UserError", "message": "m", "exit_code": 42},
    "code negative": {"type": "DaemonStop", "message": "m", "exit_code": -9},
    "code not its class's": {"type": "ConfigError", "message": "m", "exit_code": 5},
    "a user error ending well": {"type": "UserError", "message": "m", "exit_code": 0},
    "stopped_at text": {"type": "DaemonStop", "message": "m", "exit_code": 6, "stopped_at": "now"},
    "stopped_at far off": {"type": "DaemonStop", "message": "m", "exit_code": 6, "stopped_at": 1e300},
}


@pytest.mark.parametrize("data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_report_prefetchd_never_writes_is_refused_as_an_internal_error(data):
    back = error_from_json(data)  # never raises: a caller can always raise what it gets
    assert type(back) is DaemonStop and back.exit_code == ExitCode.INTERNAL
    assert str(back).startswith("internal error: an error report that prefetchd never writes: ")


# -- stopped.json as a client reads it -----------------------------------------------------


def test_read_stopped_ignores_what_no_daemon_writes_and_never_blocks(tmp_path):
    paths = JobPaths(tmp_path / "job")
    paths.dir.mkdir()
    assert read_stopped(paths) is None  # absent
    written = {**to_json(DaemonStop("cannot read a sample", ExitCode.SAMPLE_ERROR)), "stopped_at": 1.5}
    paths.stopped.write_text(json.dumps(written))
    assert read_stopped(paths) == written
    fd = os.open(paths.dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_stopped(paths, dir_fd=fd) == written
    finally:
        os.close(fd)
    for planted in (
        "{not json",
        "[" * 50_000,
        json.dumps({**written, "exit_code": "6"}),
        json.dumps({**written, "exit_code": 0}),  # a daemon leaves it only for a non-zero exit
        json.dumps({**written, "message": None}),
        json.dumps({k: v for k, v in written.items() if k != "stopped_at"}),
        json.dumps({**written, "stopped_at": float("inf")}),
        json.dumps({**written, "message": "m" * 70_000}),  # past the file's bound
        b"\xff\xfe not utf-8",
    ):
        paths.stopped.unlink()
        (paths.stopped.write_bytes if isinstance(planted, bytes) else paths.stopped.write_text)(planted)
        assert read_stopped(paths) is None, planted[:40]
    paths.stopped.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(written))
    paths.stopped.symlink_to(tmp_path / "elsewhere.json")
    assert read_stopped(paths) is None  # a symlink, even to a valid report
    paths.stopped.unlink()
    os.mkfifo(paths.stopped)
    assert read_stopped(paths) is None  # a FIFO with no writer: would block a plain open()


# -- a real daemon that stops on an error ----------------------------------------------------


def data_with_a_corrupt_jpeg(tmp_path):
    """17 samples, one of them x.jpg of random bytes: with batch_size 17 the first batch reads it."""
    data = make_image_folder(tmp_path / "data", classes=2, per_class=8, size=(40, 60), seed=3)
    victim = data / sorted(p.name for p in data.iterdir())[0] / "x.jpg"
    victim.write_bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    return data, victim


def assert_left_stopped_json(paths: JobPaths, code: ExitCode, *phrases: str) -> dict:
    stopped = read_stopped(paths)
    assert stopped is not None, sorted(p.name for p in paths.dir.iterdir())
    assert stopped["exit_code"] == code and stopped["type"] == "DaemonStop"
    for phrase in phrases:
        assert phrase in stopped["message"], stopped
    assert stat.S_IMODE(paths.stopped.lstat().st_mode) == 0o600
    return stopped


def assert_status_says_stopped(job: str, code: ExitCode, phrase: str) -> None:
    shown = cli("status", job)
    assert shown.returncode == 0 and f"{job}: stopped" in shown.stdout, shown.stdout + shown.stderr
    assert phrase in shown.stdout and f"exit code {int(code)} ({code.name})" in shown.stdout, shown.stdout
    report = json.loads(cli("status", job, "--json").stdout)
    assert report["state"] == "stopped" and report["exit_code"] == code and phrase in report["error"]


def test_a_daemon_stopped_by_a_bad_sample_leaves_why_for_the_client_status_and_a_restart(tmp_path, serve):
    data, victim = data_with_a_corrupt_jpeg(tmp_path)
    config = write_config(tmp_path, data, batch_size=17, size=16)
    failing = serve(config, {"on_error": "fail"})  # it serves, then its first batch reads x.jpg
    paths = failing.paths
    failing.wait_stopped(60)
    assert failing.exit_code == ExitCode.SAMPLE_ERROR and not daemon_alive(paths)
    assert_left_stopped_json(paths, ExitCode.SAMPLE_ERROR, "cannot read a sample", str(victim))
    with pytest.raises(DaemonDied, match=f"cannot read a sample: .*{victim}.*; exit code 6\\)"):
        next(iter(PrefetchLoader("job", as_tensors=False, timeout=30)))
    assert_status_says_stopped("job", ExitCode.SAMPLE_ERROR, "cannot read a sample")
    # A new start of the job (bad samples replaced now) serves, and what it says is true again.
    job = serve(config)
    assert not paths.stopped.exists(), "a restart kept the stale stopped.json"
    assert json.loads(cli("status", "job", "--json").stdout)["state"] == "serving"
    job.stop()
    assert not paths.dir.exists()


def test_start_foreground_exits_with_the_daemons_own_code_after_serving(tmp_path, job_root):
    data, victim = data_with_a_corrupt_jpeg(tmp_path)
    config = write_config(tmp_path, data, batch_size=17, size=16)
    result = cli("start", str(config), "--foreground", "--on-error", "fail", timeout=120)
    assert result.returncode == ExitCode.SAMPLE_ERROR, (result.returncode, result.stderr)
    assert "serving at" in result.stderr and "Traceback" not in result.stderr
    assert "the daemon stopped: cannot read a sample" in result.stderr and str(victim) in result.stderr
    paths = JobPaths(job_root / "job")
    assert_left_stopped_json(paths, ExitCode.SAMPLE_ERROR, "cannot read a sample")
    assert cli("stop", "job").returncode == 0 and not paths.dir.exists()


BOOM = "raise RuntimeError('this pipeline module fails at import')\n"


@pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])
def test_a_start_that_fails_in_a_folder_that_stays_leaves_why(tmp_path, jpeg_folder, serve, monkeypatch, foreground):
    # The failing start is the command's (its exit code, its words; PYTHONPATH reaches its
    # workers); the good starts around it are in this process.
    config = write_config(tmp_path, jpeg_folder)
    job = serve(config)
    paths = job.paths
    job.stop(keep=True)  # the folder stays, as a killed daemon's does
    (tmp_path / "boom_at_import.py").write_text(BOOM)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    broken = tmp_path / "broken.toml"
    broken.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "job"
        [daemon]
        workers = 1
        buffer = "1M"
        [[source]]
        kind = "image_folder"
        root = "{jpeg_folder}"
        [pipeline]
        callable = "boom_at_import:make"
        """)
    )
    result = cli("start", str(broken), *(["--foreground"] if foreground else []), timeout=120)
    assert result.returncode == ExitCode.WORKER_BOOT, (result.returncode, result.stderr)
    assert "a worker could not start" in result.stderr and "Traceback" not in result.stderr
    assert_left_stopped_json(paths, ExitCode.WORKER_BOOT, "a worker could not start", "fails at import")
    with pytest.raises(DaemonDied, match="a worker could not start.*; exit code 5\\)"):
        PrefetchLoader("job", as_tensors=False, timeout=30)
    assert_status_says_stopped("job", ExitCode.WORKER_BOOT, "a worker could not start")
    job = serve(config)
    assert not paths.stopped.exists(), "a restart kept the stale stopped.json"
    job.stop()
    assert not paths.dir.exists()


def test_a_requested_stop_leaves_no_stopped_json(tmp_path, jpeg_folder, serve):
    job = serve(write_config(tmp_path, jpeg_folder))
    job.stop(keep=True)  # what `prefetchd stop --keep` asks of the loop
    paths = job.paths
    assert paths.dir.exists() and not paths.stopped.exists()
    assert json.loads(cli("status", "job", "--json").stdout)["state"] == "not running"
