"""A private Ray instance (``--ray-address local``, issue 24): it lives in a 0700 folder of the
user's own (never the shared /tmp/ray, never through a symlink planted there) and goes whole,
every process of it and nothing else, when its start is cancelled, its daemon killed or its
boot fails; the guard that sweeps it never touches a later start's instance or another
user's folder.

Every Ray process a test starts is ended by its pid (found by the files it holds open in the
test's own temp folder), never by `ray stop`, which would end other tests' clusters.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from prefetchd.remote import raycluster
from tests.conftest import cli, wait_until, write_config
from tests.crossusers import MALLORY, no_traceback
from tests.daemon.scaleout.test_ray_trust import _holding_files_under, _kill_all

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray"), pytest.mark.heavy]


def _ray_processes_of(start: psutil.Process) -> dict[int, psutil.Process]:
    """Every process below `prefetchd start` (the daemon, its bridge, the instance), and every
    process in the daemon's session (re-parented ones too)."""
    found = {}
    try:
        below = start.children(recursive=True)
    except psutil.Error:
        return found
    sessions = set()
    for p in below:
        found[p.pid] = p
        try:
            if os.getsid(p.pid) == p.pid:
                sessions.add(p.pid)
        except OSError:
            pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions:
                found[p.pid] = p
        except (OSError, psutil.Error):
            continue
    return found


def _session_dir(processes) -> str | None:
    """The session folder Ray's processes write their logs in (<session>/logs/...)."""
    for p in processes:
        try:
            files = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
        except OSError:
            continue
        for f in files:
            parts = f.split("/logs/")
            if len(parts) == 2 and os.path.basename(parts[0]).startswith("session_"):
                return parts[0]
    return None


def _named(processes, name: str) -> bool:
    for p in processes:
        try:
            if p.name() == name or (p.cmdline() and os.path.basename(p.cmdline()[0]) == name):
                return True
        except psutil.Error:
            continue
    return False


def _cancel_local_start(config: Path, when: str) -> tuple[subprocess.CompletedProcess, dict, str | None, float]:
    """Start with --ray-address local, SIGTERM `start` once process ``when`` of the instance runs;
    (the start's result, every process seen under it, the raylet's session folder, seconds the
    start took to return after the signal)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "start", str(config), "--executor", "ray", "--ray-address", "local",
         "--workers", "0", "--ray-workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    start, seen = psutil.Process(proc.pid), {}
    try:
        session = None

        def reached():
            nonlocal session
            seen.update(_ray_processes_of(start))
            session = session or _session_dir(seen.values())
            return _named(seen.values(), when) or proc.poll() is not None

        wait_until(reached, timeout_s=120, interval_s=0.01, what=f"the private instance's {when}")
        session = session or _session_dir(seen.values())
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while proc.poll() is None:  # every process seen before `start` returns
            seen.update(_ray_processes_of(start))
            time.sleep(0.01)
        took = time.monotonic() - signalled
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen, session, took


def _alive(processes) -> list[psutil.Process]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            continue
    return left


@pytest.mark.long  # 15 CPU-s of a private Ray instance booted and cancelled
def test_a_cancelled_local_start_leaves_no_ray_process_and_used_a_private_folder(job_root, jpeg_folder, tmp_path):
    """Before: the instance lived in the shared /tmp/ray (session folders 0777), and a SIGTERM
    to `start` while Ray booted left ray::DashboardAgent and ray::RuntimeEnvAgent behind (2 of 4
    trials, alive 40 s later)."""
    config = write_config(tmp_path, jpeg_folder, workers=0)
    result, seen, session, took = _cancel_local_start(config, "raylet")
    try:
        left = _alive(seen.values())
        if left:  # a SIGKILLed process may take a moment to be gone; the guard sweeps for 3 s, then exits
            _, left = psutil.wait_procs(left, timeout=10)
            left = _alive(left)  # an orphan that exited may stay a zombie until PID 1 reaps it
        assert result.returncode != 0, result.stdout
        assert no_traceback(result), result.stderr
        assert not left, f"left behind by a cancelled start: {[(p.pid, p.name()) for p in left]}"
        private = job_root / "job" / "ray"
        assert session is not None and session.startswith(f"{private}/"), f"Ray's session folder was {session}"
        assert took < 20, f"`start` took {took:.1f} s to return after SIGTERM"
        assert not private.exists(), "the private instance's folder outlived the start"
    finally:
        _kill_all(_alive(seen.values()))


@pytest.mark.long
@pytest.mark.parametrize("when", ["gcs_server", "ray::DashboardAgent", "ray::IDLE"])
def test_a_local_start_cancelled_at_any_point_leaves_no_ray_process(job_root, jpeg_folder, tmp_path, when):
    config = write_config(tmp_path, jpeg_folder, workers=0)
    result, seen, _, _ = _cancel_local_start(config, when)
    try:
        _, left = psutil.wait_procs(_alive(seen.values()), timeout=10)  # the guard sweeps for 3 s, then exits
        left = _alive(left)  # an orphan that exited may stay a zombie until PID 1 reaps it
        assert not left, f"left behind by a start cancelled at {when}: {[(p.pid, p.name()) for p in left]}"
        assert no_traceback(result), result.stderr
    finally:
        _kill_all(_alive(seen.values()))


@pytest.mark.long  # Ray gives its GCS ~40 s before it says it failed
def test_a_ray_that_cannot_boot_says_rays_own_reason(job_root, jpeg_folder, tmp_path):
    """Before: "no worker booted within 120 s" (or Ray's first line, without its reason)."""
    config = write_config(tmp_path, jpeg_folder, workers=0)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli(
            "start", str(config), "--executor", "ray", "--ray-address", "local", "--workers", "0", "--ray-workers", "1",
            env={"RAY_GCS_SERVER_PORT": str(port)}, timeout=200,
        )  # fmt: skip
    assert result.returncode == 5, (result.returncode, result.stderr)
    assert "Ray's own words" in result.stderr and f"port is {port}" in result.stderr, result.stderr
    assert no_traceback(result), result.stderr


def test_paths_too_long_for_rays_sockets_are_refused_before_ray_starts(job_root, jpeg_folder, tmp_path, monkeypatch):
    """<job>/ray/s, and a folder in $TMPDIR (job_root's: 36 bytes), too long for Ray's sockets."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert len(os.environ["TMPDIR"]) + len("/prefetchd-ray-xxxxxxxx/s") + raycluster.SOCKET_SUFFIX_BYTES > 107
    config = write_config(tmp_path, jpeg_folder, name="longer-name", workers=0)
    result = cli("start", str(config), "--executor", "ray", "--ray-address", "local", "--workers", "0")
    assert result.returncode == 5, (result.returncode, result.stderr)
    assert "would exceed 107 bytes" in result.stderr and "XDG_RUNTIME_DIR" in result.stderr, result.stderr
    assert no_traceback(result), result.stderr


def test_a_symlink_where_the_private_folder_goes_is_not_followed(job_root, jpeg_folder, tmp_path, monkeypatch):
    """<job>/ray planted as a symlink (by the user, unluckily): the processes holding files where
    it points are not ended as the instance's, nor is anything there removed."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1]); sys.stdin.read()", str(elsewhere / "keep")],
        stdin=subprocess.PIPE,
    )
    try:
        wait_until(lambda: _holding_files_under(elsewhere, os.getuid()), what="the holder to open its file")
        (job_root / "job").mkdir(mode=0o700)
        (job_root / "job" / "ray").symlink_to(elsewhere)
        config = write_config(tmp_path, jpeg_folder, workers=0)
        result = cli("start", str(config), "--executor", "ray", "--ray-address", "local", "--workers", "0")
        assert result.returncode == 5 and no_traceback(result), result.stderr
        assert holder.poll() is None, "a process holding a file where the symlink points was ended"
        assert (elsewhere / "keep").read_text() == "mine"
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)


def test_only_the_private_instances_processes_are_ended_not_others_holding_its_files(tmp_path):
    """The clean-up of a private instance SIGKILLs this user's processes that carry the
    instance's mark (every Ray process inherits it from the bridge: GCS, raylet, both agents,
    the workers, 8 of 8 with Ray 2.60) or write a file under its folder. Before issue 24: any
    process holding a file there, so the user's own `tail -f <job>/ray/s/session_latest/logs/
    raylet.err` (or `less`) was SIGKILLed at every stop. Then: marked processes holding a file
    there, so an agent still starting (no log open yet) outlived a cancelled start (CI). Then:
    marked processes, which missed agents whose title rewrite had overwritten the environment
    /proc shows (1 cancelled start in 6). A reader of the logs is spared."""
    from prefetchd.remote.rayinstance import end_instance

    folder = tmp_path / "ray"
    (folder / "s" / "logs").mkdir(parents=True)
    log = folder / "s" / "logs" / "raylet.err"
    log.write_text("")
    hold = "import sys; f = open(sys.argv[1], sys.argv[2]); sys.stdin.read()"
    marked = {**os.environ, **raycluster.instance_mark(str(folder))}
    unmarked = {k: v for k, v in os.environ.items() if k != raycluster.INSTANCE_MARK}

    def holding(mode: str, env: dict) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", hold, str(log), mode], stdin=subprocess.PIPE, env=env)

    reader, ray_like, writer = holding("r", unmarked), holding("r", marked), holding("a", unmarked)
    wait = "import sys; sys.stdin.read()"  # marked, no file held: an agent still starting
    starting = subprocess.Popen([sys.executable, "-c", wait], stdin=subprocess.PIPE, env=marked)
    processes = (reader, ray_like, writer, starting)
    try:
        wait_until(lambda: len(_holding_files_under(folder, os.getuid())) == 3, what="three to open the log")
        ended = end_instance(str(folder), timeout_s=10)
        assert sorted(ended) == sorted([ray_like.pid, writer.pid, starting.pid])
        for p in processes[1:]:
            p.wait(timeout=10)  # ended (and reaped by end_instance: its code reads 0 here)
        assert reader.poll() is None, "the user's own reader of Ray's log was SIGKILLed"
    finally:
        for p in processes:
            p.stdin.close()
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_a_guard_ends_nothing_in_a_folder_a_later_start_made_anew(tmp_path):
    """A guard sweeps for seconds after its bridge is gone; a start that follows at once removes
    the folder and makes it anew, and the processes there are the new instance's: not the old
    guard's to end."""
    from prefetchd.remote.rayinstance import end_instance

    folder = tmp_path / "ray"
    folder.mkdir()
    marked = {**os.environ, **raycluster.instance_mark(str(folder))}
    code = "import sys; sys.stdin.read()"
    new_instance = None
    try:
        def remade():
            nonlocal new_instance
            folder.rmdir()
            folder.mkdir()
            new_instance = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=marked)

        timer = threading.Timer(0.3, remade)  # while the guard waits out its quiet period
        timer.start()
        assert end_instance(str(folder), timeout_s=10, quiet_s=2.0, same_folder=True) == []
        timer.join()
        assert new_instance.poll() is None, "the new start's process was ended by the old guard"
    finally:
        if new_instance is not None:
            new_instance.stdin.close()
            new_instance.kill()
            new_instance.wait(timeout=10)


@pytest.mark.long  # a Ray start (~12 s on 2 cores)
def test_a_killed_daemons_private_instance_outside_the_job_folder_is_removed(
    job_root, jpeg_folder, tmp_path, monkeypatch
):
    """A job path too long for Ray's sockets puts the private instance in a fresh 0700 folder in
    the temp folder (/tmp/prefetchd-ray-*). Before: after a kill -9 of the daemon its processes
    were ended (the bridge's guard) but that folder, Ray's session and logs, stayed for good: no
    later start or stop knows its name. Now the guard removes it once the processes are gone."""
    short = Path(tempfile.mkdtemp(prefix="pfd", dir="/tmp"))  # room for Ray's socket paths
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(short))
    config = write_config(tmp_path, jpeg_folder, name="a-job-name-too-long-for-rays-sockets", workers=0)
    holders: list[psutil.Process] = []
    try:
        result = cli(
            "start", str(config), "--executor", "ray", "--ray-address", "local", "--ray-workers", "1", timeout=180
        )
        assert result.returncode == 0, result.stderr
        (elsewhere,) = short.glob("prefetchd-ray-*")
        assert not (job_root / "a-job-name-too-long-for-rays-sockets" / "ray").exists()
        holders = _holding_files_under(elsewhere, os.getuid())
        assert holders, "no Ray process holds a file in the private folder"
        pid = int(next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("pid:")))
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(holders), timeout_s=30, what="the instance's processes to be ended")
        wait_until(lambda: not elsewhere.exists(), timeout_s=30, what=f"{elsewhere} to be removed")
    finally:
        _kill_all(_alive(holders) + _holding_files_under(short, os.getuid()))
        shutil.rmtree(short, ignore_errors=True)


def test_the_guard_removes_only_a_folder_of_the_users_own(users):
    """Self-attack of the guard's clean-up: once the pool removed the instance's folder in /tmp,
    another user may make a folder of that name before the guard runs. The guard must leave it
    (nothing is deleted through a path that is not ours); before the check, it removed hers."""
    mallory = users[MALLORY]
    base = Path(tempfile.mkdtemp(prefix="pfd-guard-", dir="/tmp"))
    base.chmod(0o1777)  # sticky and open to all, as /tmp
    theirs = base / "prefetchd-ray-abcdefgh"
    made = mallory.run("/bin/sh", "-c", f"mkdir -m 777 {theirs} && echo hers > {theirs}/file")
    assert made.returncode == 0, made.stderr
    code = (
        "import sys; from prefetchd.remote.rayinstance import start_guard; "
        "print(start_guard(sys.argv[1], True).pid, flush=True)"
    )
    try:
        started = subprocess.run([sys.executable, "-c", code, str(theirs)], capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        guard = int(started.stdout.split()[-1])  # it runs once its parent, the "bridge" here, is gone
        wait_until(lambda: not psutil.pid_exists(guard), timeout_s=30, what="the guard to finish")
        assert (theirs / "file").read_text() == "hers\n", "the guard removed another user's folder"
    finally:
        shutil.rmtree(base, ignore_errors=True)
