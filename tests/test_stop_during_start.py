"""A stop signal at any moment of a start: a pod deleted while its daemon starts, `systemctl
stop` during ExecStart, Ctrl-C, or anyone's `kill` of a launched daemon. Swept over the whole
start (the interpreter, the worker server, the index, the workers, the first batch, serving):
every outcome is a clean stop (0), a refused start that says why (4), or an end before
prefetchd's code ran; and nothing of it stays: no process, no job folder, no socket folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial

import psutil
import pytest

from .conftest import wait_until, write_config
from .helpers import temp_leftovers

pytestmark = pytest.mark.timeout(300)

# Of the time a start takes to serve, measured first on this machine (loaded or not).
FRACTIONS = (0.0, 0.2, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.2)


def _session_ended(sid: int) -> bool:
    """No live process in session ``sid`` (a command's or a launched daemon's, which its worker
    server, resource tracker and workers stay in)."""
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except (OSError, psutil.Error):
            pass
    return True


def _foreground(config) -> subprocess.Popen:
    argv = [sys.executable, "-m", "prefetchd", "start", str(config), "--foreground"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _seconds_to_serve(config, job_root) -> float:
    began = time.monotonic()
    proc = _foreground(config)
    try:
        wait_until(lambda: (job_root / "job" / "manifest.json").exists(), timeout_s=60, what="the job serving")
        return time.monotonic() - began
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
        proc.stderr.close()


def _check_nothing_left(sid: int, job_root, when: str) -> None:
    wait_until(partial(_session_ended, sid), timeout_s=10, what=f"the end of everything of a start stopped {when}")
    assert list(job_root.iterdir()) == [], when
    assert temp_leftovers() == [], when


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_at_any_moment_of_a_foreground_start_leaves_nothing(tmp_path, jpeg_folder, job_root, sig):
    config = write_config(tmp_path, jpeg_folder, workers=2)
    serving_s = _seconds_to_serve(config, job_root)
    outcomes = []
    for fraction in FRACTIONS:
        when = f"{fraction * serving_s:.2f} s into a {serving_s:.2f} s start"
        proc = _foreground(config)
        try:
            time.sleep(fraction * serving_s)
            proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # -sig, 128 + sig (Ctrl-C while the command loads or reads its flags): before the start
        assert proc.returncode in (0, 4, -sig, 128 + sig), f"{when}: exit {proc.returncode}\n{stderr}"
        assert "Traceback" not in stderr, f"{when}:\n{stderr}"
        if proc.returncode == 4:
            assert f"stopped by {sig.name} during start-up" in stderr, stderr
        outcomes.append(proc.returncode)
        _check_nothing_left(proc.pid, job_root, when)
    assert 4 in outcomes and 0 in outcomes, outcomes  # the sweep reached the start itself, and serving


def test_a_launched_daemon_stopped_at_any_moment_of_its_start_leaves_nothing(tmp_path, jpeg_folder, job_root):
    # `prefetchd start` (detached) whose daemon someone SIGTERMs while it starts: the command
    # says so (exit 4, naming the signal), or the job had served and stops cleanly.
    config = write_config(tmp_path, jpeg_folder, workers=2)
    serving_s = _seconds_to_serve(config, job_root)
    outcomes = []
    for fraction in FRACTIONS:
        when = f"{fraction * serving_s:.2f} s into a {serving_s:.2f} s start"
        began = time.monotonic()
        command = subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "start", str(config)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            daemon = wait_until(partial(_launched_daemon, command.pid), timeout_s=30, what="the launched daemon")
            sid = os.getsid(daemon.pid)
            time.sleep(max(0.0, fraction * serving_s - (time.monotonic() - began)))
            daemon.send_signal(signal.SIGTERM)
            _, stderr = command.communicate(timeout=60)
        finally:
            if command.poll() is None:
                command.kill()
                command.wait(10)
        assert command.returncode in (0, 4), f"{when}: exit {command.returncode}\n{stderr}"
        assert "Traceback" not in stderr, f"{when}:\n{stderr}"
        if command.returncode == 4:
            assert "SIGTERM" in stderr, stderr
        outcomes.append(command.returncode)
        _check_nothing_left(sid, job_root, when)
    assert 4 in outcomes, outcomes


def _launched_daemon(command_pid: int) -> psutil.Process | None:
    try:
        for child in psutil.Process(command_pid).children():
            if "prefetchd.daemon" in " ".join(child.cmdline()):
                return child
    except psutil.Error:
        pass
    return None
