"""Run a job's master: in the foreground, or detached with a readiness handshake.

``prefetchd start`` launches ``python -m prefetchd.daemon`` in a new session and waits on a
pipe for one JSON line: ``{"ok": true, "pid": P}`` once the job serves (manifest written,
socket bound), or ``{"ok": false, "error": "...", "exit_code": N}``. If the process dies
without a word, the pipe closes and ``start`` reports that instead of hanging.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from prefetchd_client.errors import AuthError
from prefetchd_client.layout import JobPaths, daemon_alive, read_manifest

from . import control
from .config import Config
from .errors import JobError, UserError
from .master import DaemonStop, Master

_START_TIMEOUT_S = 600.0  # indexing a million files on a network filesystem takes a while
_STOP_TIMEOUT_S = 15.0


def serve(config: Config, paths: JobPaths, *, keep: bool, notify: Callable[[dict], None], detach_output: bool) -> int:
    os.umask(0o077)  # whatever the daemon or a library creates (the socket, logs) is the user's alone
    master = Master(config, paths, keep=keep)
    try:
        master.start()
    except (UserError, DaemonStop) as exc:
        notify({"ok": False, "error": str(exc), "exit_code": exc.exit_code})
        return exc.exit_code
    if detach_output:  # from now on stray output (a crash) lands in the job's log
        fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    notify({"ok": True, "pid": os.getpid(), "job_dir": str(paths.dir)})
    return master.run()


def start_detached(config: Config, paths: JobPaths, *, keep: bool = False, timeout_s: float = _START_TIMEOUT_S) -> dict:
    """Start the daemon in its own session; return its readiness message or raise UserError."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "prefetchd.daemon", "--ready-fd", str(write_fd), "--job-dir", str(paths.dir)]
    if keep:
        cmd.append("--keep")
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(write_fd,),
        start_new_session=True,
    )
    os.close(write_fd)
    proc.stdin.write(json.dumps(config.to_json()).encode())
    proc.stdin.close()
    try:
        line = _read_line(read_fd, timeout_s)
    finally:
        os.close(read_fd)
    if line is None:
        proc.kill()
        proc.wait()
        raise JobError(f"the daemon did not become ready within {timeout_s:.0f} s; it was stopped")
    if not line:
        code = proc.wait(timeout=10)
        raise JobError(f"the daemon exited during start-up (exit code {code}) without a message; see {paths.log}")
    msg = json.loads(line)
    if not msg["ok"]:
        proc.wait(timeout=30)
        err = UserError(msg["error"])
        err.exit_code = msg["exit_code"]
        raise err
    return msg


def _read_line(fd: int, timeout_s: float) -> bytes | None:
    """Bytes up to EOF or newline; None on timeout."""
    data, deadline = b"", time.monotonic() + timeout_s
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    return data.strip()


def stop_job(paths: JobPaths, *, keep: bool = False, timeout_s: float = _STOP_TIMEOUT_S) -> str:
    """Stop the job's daemon gracefully, kill it after the deadline; returns what happened."""
    if not daemon_alive(paths):
        if paths.dir.exists() and not keep:
            shutil.rmtree(paths.dir, ignore_errors=True)
            return "not running; removed its stale directory"
        raise JobError(f"no prefetchd job {paths.name!r} is running under {paths.dir.parent}")
    try:
        pid = int(read_manifest(paths)["pid"])
    except (OSError, ValueError, KeyError):
        pid = None
    try:  # at the endpoint in its manifest (ipc or TCP)
        reply = control.request_job(paths, {"op": "stop", "keep": keep}, timeout_s=3.0)
    except AuthError:
        reply = None  # no usable CURVE key here: the job is ours (we read its manifest), so signal it
    if reply is None and pid is not None:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while daemon_alive(paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    if daemon_alive(paths):
        if pid is None:
            raise JobError(f"the daemon of {paths.name!r} did not stop and its pid is unknown; see {paths.log}")
        _signal(pid, signal.SIGKILL)
        _wait_gone(pid, 10.0)
        if not keep:
            shutil.rmtree(paths.dir, ignore_errors=True)
        return f"killed pid {pid} after {timeout_s:.0f} s"
    return "stopped"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout_s: float) -> None:
    try:
        psutil.Process(pid).wait(timeout_s)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefetchd.daemon", description="internal: run one job's master")
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    config = Config.from_json(json.loads(sys.stdin.read()))
    sys.stdin.close()
    ready = os.fdopen(args.ready_fd, "w")

    def notify(msg: dict) -> None:
        ready.write(json.dumps(msg) + "\n")
        ready.close()

    return serve(config, JobPaths(Path(args.job_dir)), keep=args.keep, notify=notify, detach_output=True)


if __name__ == "__main__":
    sys.exit(main())
