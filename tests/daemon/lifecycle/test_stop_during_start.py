"""A stop signal at any moment of a start: a pod deleted while its daemon starts, `systemctl
stop` during ExecStart, Ctrl-C, or anyone's `kill` of a launched daemon or of `prefetchd start`.

The signal is sent the moment each step of the start shows (polled every millisecond, so the
machine's load does not move it): the worker server's socket folder, the job folder, the
index, the control socket, the manifest. Before the manifest the start is undone and refused
(exit 4, naming the signal); from the manifest on the job serves and stops cleanly (exit 0).
Nothing of it stays: no process of its sessions, no job folder, no socket folder.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_until, write_config
from tests.helpers import session, temp_leftovers

pytestmark = pytest.mark.timeout(300)

STEPS = ("worker server", "job folder", "index", "control socket", "manifest")


def _shown(step: str, job_dir: Path) -> bool:
    if step == "worker server":
        return any(name.startswith("pymp-") for name in os.listdir(os.environ["TMPDIR"]))
    path = {"job folder": "daemon.log", "index": "index", "control socket": "daemon.sock", "manifest": "manifest.json"}
    return (job_dir / path[step]).exists()


def _when_shown(step: str, job_dir: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not _shown(step, job_dir):
        assert proc.poll() is None, f"the start ended (exit {proc.returncode}) before its {step} showed"
        assert time.monotonic() < deadline, f"no {step} within 60 s"
        time.sleep(0.001)


def _check_nothing_left(sids: list[int], job_root: Path, when: str) -> None:
    for sid in sids:
        wait_until(lambda sid=sid: not session(sid), timeout_s=10, what=f"the end of a start stopped {when}")
    assert list(job_root.iterdir()) == [], when
    assert temp_leftovers() == [], when


def _check_outcome(proc: subprocess.Popen, stderr: str, step: str, refused: str) -> None:
    # The control socket is bound a few milliseconds before the start's last check for a stop:
    # the signal may come after it (the master's loop then stops the job that served).
    expected = {"control socket": (4, 0), "manifest": (0,)}.get(step, (4,))
    assert proc.returncode in expected, f"at its {step}: exit {proc.returncode}\n{stderr}"
    assert "Traceback" not in stderr, f"at its {step}:\n{stderr}"
    if proc.returncode == 4:
        assert refused in stderr, stderr


# Each variant starts five real daemons. The quick tier stops a foreground start with SIGTERM and
# a detached one through its command; Ctrl-C's SIGINT and a SIGTERM to the detached daemon itself,
# which take the same paths (stopsignals), run in the long tier.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.long)])
def test_a_stop_signal_at_each_step_of_a_foreground_start(tmp_path, jpeg_folder, job_root, sig):
    config = write_config(tmp_path, jpeg_folder, workers=2)
    for step in STEPS:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "start", str(config), "--foreground"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _when_shown(step, job_root / "job", proc)
            proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        _check_outcome(proc, stderr, step, f"stopped by {sig.name} during start-up")
        _check_nothing_left([proc.pid], job_root, f"at its {step}")


@pytest.mark.parametrize("target", [pytest.param("daemon", marks=pytest.mark.long), "command"])
def test_a_stop_signal_at_each_step_of_a_detached_start(tmp_path, jpeg_folder, job_root, target):
    # SIGTERM to the launched daemon, or to `prefetchd start` itself, which then cancels the start
    # (a job announced a moment before stops at once: the user saw none start).
    config = write_config(tmp_path, jpeg_folder, workers=2)
    for step in STEPS:
        command = subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "start", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            daemon = wait_until(partial(_launched_daemon, command.pid), timeout_s=30, what="the launched daemon")
            sid = os.getsid(daemon.pid)
            _when_shown(step, job_root / "job", command)
            (daemon if target == "daemon" else command).send_signal(signal.SIGTERM)
            _, stderr = command.communicate(timeout=60)
        finally:
            if command.poll() is None:
                command.kill()
                command.wait(10)
        if target == "daemon":
            _check_outcome(command, stderr, step, "stopped by SIGTERM during start-up")
        elif step in ("control socket", "manifest"):  # it may have heard the daemon was ready, or not
            # The socket is bound milliseconds before the daemon announces the job, and the command
            # checks for a stop once more after it heard: a signal that comes after that check finds a
            # start that is done (seen in 1 of 5 full runs here: exit 0, the job serving).
            assert command.returncode in (0, 4), stderr
            if command.returncode == 0:  # then its daemon serves, and must be stopped as any
                wait_until(lambda: not (job_root / "job").exists() or _stop(), what="the job stopped")
        else:  # the daemon's worker server boots while the command still reads its flags: before the handover
            assert command.returncode == 4, f"at its {step}: exit {command.returncode}\n{stderr}"
            assert re.search(r"stopped by SIGTERM (while the daemon started|before the daemon had its job)", stderr)
            assert "Traceback" not in stderr, stderr
        _check_nothing_left([command.pid, sid], job_root, f"at its {step}")


def _stop() -> bool:
    stop = subprocess.run([sys.executable, "-m", "prefetchd", "stop", "job"], capture_output=True, timeout=60)
    return stop.returncode == 0


def _launched_daemon(command_pid: int) -> psutil.Process | None:
    try:
        for child in psutil.Process(command_pid).children():
            if os.getsid(child.pid) == child.pid:  # the command's fork that leads a session of its own
                return child
    except (psutil.Error, ProcessLookupError):
        pass
    return None
