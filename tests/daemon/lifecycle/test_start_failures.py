"""Starting and restarting a job (issue 11, items 8-10): a failed start keeps what it did not
create and says why, in one message with its named exit code, foreground or not, pointing at
no file it removed; a restarted run resumed from a state does not replay an epoch."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prefetchd.cli.launch import start_detached
from prefetchd.config import load_config
from prefetchd.errors import JobError
from prefetchd.plan import Plan
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from tests.conftest import cli, daemon_family, start_job, wait_pids_gone, wait_until, write_config
from tests.helpers import importing_first, without_modules

pytestmark = pytest.mark.timeout(180)
SAMPLES = 48  # the jpeg_folder fixture


def kill_daemon(paths: JobPaths) -> None:
    """kill -9 the daemon and its workers, as a crash would: nothing of theirs is cleaned."""
    pids = daemon_family(paths)
    assert pids, "no daemon to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_pids_gone(pids)


def warm_buffer_of_a_killed_daemon(tmp_path, jpeg_folder) -> tuple[Path, JobPaths, set[str]]:
    config = write_config(tmp_path, jpeg_folder, batch_size=4, seed=7)
    paths = start_job(config)
    wait_until(lambda: len(list(paths.batch_dir.iterdir())) >= 8, timeout_s=60, what="8 batches made")
    kill_daemon(paths)
    return config, paths, {p.name for p in paths.batch_dir.iterdir()}


def assert_one_clear_message(result, code: int, *phrases: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


def assert_points_only_at_a_kept_log(text: str, paths: JobPaths) -> None:
    if str(paths.log) in text:
        assert paths.log.exists(), f"the message points at {paths.log}, which was removed: {text}"


# -- item 9: a failed start removes only what it created ------------------------------------


@pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])
def test_a_failed_restart_keeps_the_warm_buffer_of_a_killed_daemon(tmp_path, jpeg_folder, job_root, foreground):
    config, paths, batches = warm_buffer_of_a_killed_daemon(tmp_path, jpeg_folder)
    flags = ["--foreground"] if foreground else []
    result = cli("start", str(config), "--data", str(tmp_path / "typo"), *flags)
    assert_one_clear_message(result, 3, "typo", "does not exist")
    assert {p.name for p in paths.batch_dir.iterdir()} == batches, "the warm buffer was deleted"
    left = {p.name for p in paths.dir.iterdir()}
    assert {"daemon.log", "progress", "retired", "trainers", "producer.json"} <= left  # the killed daemon's
    assert not left & {"manifest.json", "daemon.sock", "index", "tmp"}, f"the failed start left {left}"
    assert "does not exist" in paths.log.read_text()  # the kept log says why this start failed
    start_job(config)  # the right --data: the buffer is still warm
    assert f"kept {len(batches)} batches from a previous daemon" in paths.log.read_text()


# -- item 10: one clear message and its named exit code, foreground or not -----------------


def test_a_foreground_start_with_a_missing_data_folder_exits_3_with_the_real_message(tmp_path, jpeg_folder, job_root):
    config = write_config(tmp_path, jpeg_folder)
    result = cli("start", str(config), "--foreground", "--data", "/nonexistent")
    assert_one_clear_message(result, 3, "/nonexistent", "does not exist", "--data")
    assert "daemon.log" not in result.stderr
    assert list(job_root.iterdir()) == [], "a failed first start left its job folder"


@pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])
def test_a_failed_first_start_points_at_no_log_it_removed(tmp_path, jpeg_folder, job_root, foreground):
    config = tmp_path / "c.toml"
    config.write_text(
        f'[job]\nname = "boot"\n[daemon]\nbuffer = "1M"\n[[source]]\nkind = "image_folder"\nroot = "{jpeg_folder}"\n'
        '[pipeline]\ncallable = "no_such_module_here:make"\n'
    )
    result = cli("start", str(config), "--workers", "1", *(["--foreground"] if foreground else []))
    assert_one_clear_message(result, 5, "a worker could not start", "no_such_module_here")
    assert list(job_root.iterdir()) == [], "a failed first start left its job folder"
    assert "daemon.log" not in result.stderr, result.stderr


@pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])
def test_an_unforeseen_error_during_start_exits_70_naming_it_and_keeps_the_warm_buffer(
    tmp_path, jpeg_folder, job_root, foreground
):
    config, paths, batches = warm_buffer_of_a_killed_daemon(tmp_path, jpeg_folder)
    planted = paths.dir / "producer.json"  # a folder where the start writes a file: os.replace fails
    planted.unlink()
    planted.mkdir()
    result = cli("start", str(config), *(["--foreground"] if foreground else []))
    assert_one_clear_message(result, 70, "internal error during start-up", "IsADirectoryError", "producer.json")
    assert f"the traceback is in {paths.log}" in result.stderr
    assert "Traceback" in paths.log.read_text()  # the kept log has it, the terminal does not
    assert {p.name for p in paths.batch_dir.iterdir()} == batches
    assert planted.is_dir()  # not this start's: left as it was found
    assert_points_only_at_a_kept_log(result.stderr, paths)


def test_a_daemon_that_dies_before_it_can_speak_is_reported_with_its_last_words(
    tmp_path, jpeg_folder, job_root, monkeypatch
):
    # A broken install seen only by the daemon's interpreter: it dies importing, before main().
    shadow = tmp_path / "shadow" / "prefetchd_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('prefetchd_client is broken in this environment')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    config = load_config(write_config(tmp_path, jpeg_folder))
    with pytest.raises(JobError) as caught:
        start_detached(config, JobPaths(job_root / "job"), timeout_s=60)
    message = str(caught.value)
    assert "exited during start-up (exit code 1) without a message" in message
    assert "prefetchd_client is broken in this environment" in message
    assert "daemon.log" not in message and "--foreground" in message
    assert list(job_root.iterdir()) == []


@pytest.mark.parametrize(
    "stdin, what",
    [(b"{not json", "JSONDecodeError"), (b"{}", "KeyError"), (b"[" * 50_000, "RecursionError")],
    ids=["garbled", "incomplete", "nested"],
)
def test_the_daemon_reports_a_config_it_cannot_read_instead_of_dying_silently(job_root, stdin, what):
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "prefetchd.master.daemon", "--ready-fd", str(write_fd)],
            input=stdin,
            capture_output=True,
            pass_fds=(write_fd,),
            timeout=60,
        )
        os.close(write_fd)
        write_fd = -1
        line = os.read(read_fd, 65536)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    assert line, f"the daemon exited {proc.returncode} without a message: {proc.stderr[-300:]!r}"
    message = json.loads(line)
    assert proc.returncode == 70 and b"Traceback" not in proc.stderr
    assert message["ok"] is False and message["error"]["exit_code"] == 70
    assert message["error"]["type"] == "DaemonStop"
    assert "could not read the config" in message["error"]["message"] and what in message["error"]["message"]
    assert list(job_root.iterdir()) == []


# -- item 8: set_epoch after load_state_dict does not replay a finished epoch ----------------


def test_set_epoch_of_the_epoch_a_loaded_state_finished_does_not_replay_it(tmp_path, jpeg_folder, serve):
    """The issue's elastic case: 40 of 48 samples consumed with batch 8; with batch 20 an epoch
    is 2 steps (40 samples), so the state has finished epoch 0. In Lightning's order (load the
    state, iter(), sampler.set_epoch(0), next()) epoch 0 must not come again."""
    job = serve(write_config(tmp_path, jpeg_folder, name="el", batch_size=8, seed=5))
    before = PrefetchLoader("el", as_tensors=False, timeout=60)
    consumed = [batch["index"].tolist() for _, batch in zip(range(5), before)]
    state = before.state_dict()
    before.close()
    assert (state["epoch"], state["samples_consumed"]) == (0, 40)
    job.stop()
    serve(write_config(tmp_path, jpeg_folder, name="el", batch_size=20, seed=5))

    resumed = PrefetchLoader("el", as_tensors=False, timeout=60)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest_of_epoch_0 = iter(resumed)
    resumed.sampler.set_epoch(0)
    assert [batch["index"].tolist() for batch in rest_of_epoch_0] == [], "epoch 0, finished by the state, came again"
    resumed.sampler.set_epoch(1)
    epoch_1 = [batch["index"].tolist() for batch in resumed]
    resumed.close()
    plan = Plan(SAMPLES, 1, 20, seed=5)
    assert epoch_1 == [plan.sample_ids(1, step, 0).tolist() for step in range(2)]
    assert len(sum(consumed, [])) == 40


def test_a_loop_resuming_an_end_of_epoch_state_in_the_epoch_it_finished_replays_nothing(tmp_path, jpeg_folder, serve):
    """A state taken right after epoch 0 reads (1, 0); a loop whose own counter still says epoch
    0 sets it and iterates: it gets nothing, then all of epoch 1. Mid-epoch, set_epoch of the
    current epoch still keeps the step."""
    serve(write_config(tmp_path, jpeg_folder, name="eoe", batch_size=8, seed=6))
    first = PrefetchLoader("eoe", as_tensors=False, timeout=60)
    epoch_0 = [batch["index"].tolist() for batch in first]
    state = first.state_dict()
    first.close()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)

    resumed = PrefetchLoader("eoe", as_tensors=False, timeout=60)
    resumed.load_state_dict(state)
    seen = {}
    for epoch in (0, 1):
        resumed.set_epoch(epoch)
        seen[epoch] = [batch["index"].tolist() for batch in resumed]
    resumed.close()
    plan = Plan(SAMPLES, 1, 8, seed=6)
    assert seen[0] == [], "epoch 0, finished by the state, came again"
    assert seen[1] == [plan.sample_ids(1, step, 0).tolist() for step in range(6)]
    assert epoch_0 == [plan.sample_ids(0, step, 0).tolist() for step in range(6)]

    mid = PrefetchLoader("eoe", as_tensors=False, timeout=60)
    mid.load_state_dict({**state, "epoch": 1, "samples_consumed": 16})
    mid.set_epoch(1)
    assert [batch["index"].tolist() for batch in mid] == seen[1][2:]
    mid.close()


def _symlink_loop(tmp_path: Path) -> str:
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    return "loop"


@pytest.mark.parametrize(
    "flags, code, words",
    [
        (lambda tmp: ["--data", _symlink_loop(tmp)], 2, "cannot resolve the path"),
        (lambda tmp: ["--world-size", "1000000000000"], 2, "world_size / --world-size must be at most"),
        (lambda tmp: ["--root", os.fsdecode(b"/dev/shm/prefetchd-test-\xfe")], 4, "not UTF-8"),
        (lambda tmp: ["--root", "/dev/shm/" + "r" * 100], 4, "Unix socket path"),
        (lambda tmp: ["--buffer", "1000T", "--root", str(tmp / "fresh-root")], 2, "exceeds"),
    ],
    ids=["data-symlink-loop", "huge-world-size", "non-utf8-root", "long-root", "failed-start-fresh-root"],
)
def test_start_failures_found_by_an_attack_are_one_message_and_a_named_code(
    tmp_path, jpeg_folder, job_root, monkeypatch, flags, code, words
):
    monkeypatch.chdir(tmp_path)
    extra = flags(tmp_path)
    data = [] if "--data" in extra else ["--data", str(jpeg_folder)]
    result = cli("start", *data, "--buffer", "1M", "--workers", "1", *extra)
    assert result.returncode == code, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "fresh-root").exists()  # a failed start leaves no root it created


def test_a_config_file_that_is_a_fifo_is_refused_at_once(tmp_path, job_root):
    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)
    result = cli("start", str(fifo), timeout=20)
    assert result.returncode == 2 and "not a regular file" in result.stderr


BROKEN_OPENCV = {  # what a cv2 that is there but broken raises at import
    "system library": 'raise ImportError("libGL.so.1: cannot open shared object file")',
    "another numpy": 'raise RuntimeError("module compiled against ABI version 0x1000009")',
    "leftover folder": "",  # a cv2/ of an uninstalled wheel: imports, has no setNumThreads
}


def _broken_opencv(tmp_path, how: str) -> dict:
    broken = tmp_path / "broken" / "cv2"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(BROKEN_OPENCV[how] + "\n")
    return importing_first(broken.parent)


@pytest.mark.parametrize("how", list(BROKEN_OPENCV))
@pytest.mark.parametrize("decoder", ["auto", "turbojpeg"])
def test_an_opencv_that_is_installed_but_does_not_load_fails_the_start_with_what_to_do(
    tmp_path, jpeg_folder, job_root, decoder, how
):
    """`start` checks that the decoder's modules are there without importing OpenCV (0.2 s of
    CPU); one that is there but broken is found by the workers, whose boot fails the start with
    what OpenCV raised and the fix, leaving nothing behind."""
    config = write_config(tmp_path, jpeg_folder)
    result = cli("start", str(config), "--decoder", decoder, env=_broken_opencv(tmp_path, how))
    assert result.returncode == 5, result.stderr
    assert "installed but do not load" in result.stderr and "--force-reinstall" in result.stderr, result.stderr
    assert "decoder = 'pillow'" in result.stderr and "Traceback" not in result.stderr
    assert list(job_root.iterdir()) == []


def test_a_broken_opencv_costs_a_pillow_job_nothing(tmp_path, jpeg_folder, job_root):
    """The worker server imports the decoders' libraries beside its preload, skipping any that
    fails: before, one raising anything but ImportError killed the server at each of its five
    starts, and with it every job on the node, Pillow's too ("the fork server ... died 5 times")."""
    config = write_config(tmp_path, jpeg_folder, name="pil")
    result = cli("start", str(config), "--decoder", "pillow", env=_broken_opencv(tmp_path, "another numpy"))
    assert result.returncode == 0, result.stderr
    batch = next(iter(PrefetchLoader("pil", as_tensors=False, timeout=60)))
    assert batch["image"].shape == (4, 32, 32, 3)
    assert cli("stop", "pil").returncode == 0


def test_a_missing_opencv_is_refused_by_the_config_check_naming_it(tmp_path):
    """Missing altogether, it is the config's error, before any process starts (exit 2)."""
    env = without_modules(tmp_path / "site", "cv2")
    result = cli("start", "--data", str(tmp_path), "--decoder", "simplejpeg", env=env)
    assert result.returncode == 2, result.stderr
    assert "(cv2 is missing): pip install opencv-python-headless simplejpeg" in result.stderr


@pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])
@pytest.mark.parametrize(("limit", "workers"), [(15, 1), (40, 1), (60, 4)])
def test_an_open_file_limit_too_low_for_the_daemon_is_refused_before_anything_is_made(
    tmp_path, jpeg_folder, job_root, foreground, limit, workers
):
    # Found by an attack of the forked launch: under `ulimit -n` 9-21 a start ran out of
    # descriptors part way (exit 70) and, still out of them, could not remove the folder it made.
    config = write_config(tmp_path, jpeg_folder, workers=workers)
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config), *(["--foreground"] if foreground else [])],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
    )
    assert_one_clear_message(result, 1, f"open-file limit (ulimit -n) is {limit}", "ulimit -n 1024")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(job_root.iterdir()) == [], "the refused start left something"


def test_a_low_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path, jpeg_folder, job_root):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    config = write_config(tmp_path, jpeg_folder)
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (20, hard)),
    )
    assert result.returncode == 0, result.stderr
    paths = JobPaths.of("job")
    assert f"open-file limit raised from 20 to {hard}" in paths.log.read_text()
    assert cli("stop", "job").returncode == 0
