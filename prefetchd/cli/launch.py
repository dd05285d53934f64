"""The command's side of a detached daemon: launch it with a readiness handshake, stop it.

``prefetchd start`` launches the daemon (prefetchd.master.daemon) in a new session
(daemonlaunch.DaemonLaunch, first thing), hands it its job and waits on a pipe for one JSON
line: ``{"ok": true, "pid": P, "job_dir": D}`` once the job serves (manifest written, socket
bound), or ``{"ok": false, "error": E}``, E the error as data (errors.to_json: ``{"type",
"message", "exit_code"}``). If the process dies without a word, the pipe closes and ``start``
reports that instead of hanging. This module imports nothing of the daemon itself:
the command pays only for what it runs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from prefetchd import control, stopsignals
from prefetchd.cli.daemonlaunch import DaemonLaunch
from prefetchd.errors import JobError, error_from_json
from prefetchd.sources.progress import MARK as PROGRESS_MARK  # in the lines a long start echoes
from prefetchd_client.errors import AuthError, UnsafeFolder
from prefetchd_client.folders import OpenJob, open_job
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive, lock_holder
from prefetchd_client.text import printable

if TYPE_CHECKING:  # annotations only: `stop` and `status` need no config (numpy, Pillow)
    from pathlib import Path

    from prefetchd.config import Config

_PROGRESS_EVERY_S = 1.0  # how often a waiting start looks for progress lines in the daemon's log
_START_TIMEOUT_S = 600.0  # indexing a million files on a network filesystem takes a while
_STOP_TIMEOUT_S = 15.0
_EXIT_WAIT_S = 30.0  # a daemon that sent its failure only has to exit; then it is killed
_MAX_MESSAGE_BYTES = 1 << 20  # the readiness line is ~100 bytes; a failure message a few KiB
def start_detached(
    config: Config,
    paths: JobPaths,
    *,
    keep: bool = False,
    timeout_s: float = _START_TIMEOUT_S,
    launched: DaemonLaunch | None = None,
) -> dict:
    """Start the daemon in its own session (``launched`` early, or now); return its readiness
    message or raise UserError: the daemon's own error, rebuilt from its report, when it failed
    to start (never silence). A stop signal meanwhile (Ctrl-C; SIGTERM too where `prefetchd
    start` took them, stopsignals) cancels the start, whatever the daemon has got to: the user
    sees no job start, so none may serve (one it announced a moment before stops at once)."""
    try:
        daemon = launched or DaemonLaunch()
    except OSError as exc:  # a pipe, a temporary file, the fork or the exec refused
        why = f"could not start the daemon's process ({exc.strerror or exc}){_why_not(exc)}"
        raise JobError(f"{why}; nothing was started") from None
    try:
        stopsignals.check_starting()  # one that came while the command read its flags and config
        msg = _hand_over(daemon, config, paths, keep, timeout_s)
        stopsignals.check_starting()  # one that came as the daemon announced the job: it stops too
        return msg
    except (KeyboardInterrupt, stopsignals.StopRequested):
        daemon.cancel()
        name = stopsignals.received() or signal.SIGINT
        raise JobError(f"stopped by {name.name} while the daemon started: the start was undone") from None


def _why_not(exc: OSError) -> str:
    """What the user can do about an OSError of the launch, by its errno."""
    if exc.errno in (errno.EAGAIN, errno.ENOMEM):
        return ": the user's process limit (`ulimit -u`) or the memory is used up"
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return ": too many open files (`ulimit -n` for this shell, or the system's limit)"
    if exc.errno in (errno.ENOENT, errno.EACCES, errno.EROFS, errno.ENOSPC):  # "No usable temporary directory"
        return ": no writable temporary folder; set $TMPDIR to one"
    return ""


def _hand_over(daemon: DaemonLaunch, config: Config, paths: JobPaths, keep: bool, timeout_s: float) -> dict:
    """Send the daemon its job, then its readiness message, or the UserError it failed with."""
    proc = daemon.proc
    try:
        daemon.send(config, paths, keep)
        line = _read_line(daemon.ready_fd, timeout_s, _ProgressEcho(paths.log))
        if line is None:
            proc.kill()
            proc.wait()
            raise JobError(f"the daemon did not become ready within {timeout_s:.0f} s; it was stopped")
        msg = _start_message(line)
        if msg is None:
            raise JobError(_silent_exit(_wait_exit(proc, _EXIT_WAIT_S), daemon.early_stderr, paths))
    finally:
        daemon.close()
    if not msg["ok"]:
        _wait_exit(proc, _EXIT_WAIT_S)
        raise error_from_json(msg["error"])
    return msg


def _start_message(line: bytes) -> dict | None:
    """The daemon's start-up message, checked; None for none (it died first) or a garbled one.
    The error a failure carries is checked where it is rebuilt (errors.error_from_json)."""
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(msg, dict) or type(msg.get("ok")) is not bool:
        return None
    if msg["ok"]:
        return msg if isinstance(msg.get("job_dir"), str) and type(msg.get("pid")) is int else None
    return msg if isinstance(msg.get("error"), dict) else None


def _silent_exit(code: int, early_stderr, paths: JobPaths) -> str:
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):  # a number no Signals member names keeps its number
            how = f"killed by {signal.Signals(-code).name}"
    early_stderr.seek(0, os.SEEK_END)
    early_stderr.seek(max(0, early_stderr.tell() - 4096))
    lines = early_stderr.read().decode("utf-8", "replace").strip().splitlines()
    said = f"; its last output: {lines[-1].strip()}" if lines else ""
    where = f"; see {paths.log}" if paths.log.exists() else "; `prefetchd start --foreground` shows its output"
    return f"the daemon exited during start-up ({how}) without a message{said}{where}"


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> int:
    """Its exit code; killed (and waited for) after ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class _ProgressEcho:
    """The progress lines of a long start (indexing many shards in a store) as the daemon logs
    them, shown on the command's stderr while it waits: the log is the job's own, in a folder
    the start made private; read from where the last look ended, never following a symlink."""

    def __init__(self, log: Path):
        self.log, self.offset, self.next_look = log, 0, 0.0

    def show_new(self) -> None:
        if time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + _PROGRESS_EVERY_S
        try:
            fd = os.open(self.log, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # not there yet
            return
        try:
            data = os.pread(fd, _MAX_MESSAGE_BYTES, self.offset)
        finally:
            os.close(fd)
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.decode("utf-8", "replace").splitlines():
            if PROGRESS_MARK in line:
                print(printable(line.partition(" INFO ")[2] or line), file=sys.stderr, flush=True)


def _read_line(fd: int, timeout_s: float, progress: _ProgressEcho | None = None) -> bytes | None:
    """Bytes up to EOF or newline (at most _MAX_MESSAGE_BYTES); None on timeout. ``progress``
    is shown meanwhile."""
    data, deadline = b"", time.monotonic() + timeout_s
    while b"\n" not in data and len(data) < _MAX_MESSAGE_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if progress is not None:
            progress.show_new()
        if stopsignals.readable_unless_stopped(fd, left):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    return data.strip()


def stop_job(paths: JobPaths, *, keep: bool = False, timeout_s: float = _STOP_TIMEOUT_S) -> str:
    """Stop the job's daemon gracefully, kill it after the deadline; returns what happened.

    Only a job whose root and folder are this user's private folders is touched (open_job),
    only the process proven to hold its lock is signalled (lock_holder: the manifest's pid
    could name any process), and its folder is removed relative to the checked root.
    """
    try:
        job = open_job(paths)
    except FileNotFoundError:
        raise JobError(f"no prefetchd job {paths.name!r} is running under {paths.dir.parent}") from None
    except UnsafeFolder as exc:
        raise JobError(f"{exc}. Nothing was signalled or removed") from None
    with job:
        if not daemon_alive(paths, dir_fd=job.dir_fd):
            if keep:
                raise JobError(f"no prefetchd job {paths.name!r} is running under {paths.dir.parent}")
            job.remove()
            return "not running; removed its stale directory"
        try:  # at the endpoint in its manifest (ipc or TCP)
            reply = control.request_job(paths, {"op": "stop", "keep": keep}, timeout_s=3.0, dir_fd=job.dir_fd)
        except AuthError:
            reply = None  # no usable CURVE key here: the job is ours (its folders are), so signal it
        if reply is None:
            _signal(job, signal.SIGTERM)
        if _wait_gone(job, timeout_s):
            return "stopped"
        pid = _signal(job, signal.SIGKILL)
        if pid is None:  # it ended on its own just after the deadline
            return "stopped"
        if not _wait_gone(job, 10.0):
            raise JobError(f"the daemon of {paths.name!r} (pid {pid}) survived SIGKILL for 10 s; see {paths.log}")
        if not keep:
            job.remove()
        return f"killed pid {pid} after {timeout_s:.0f} s"


def _signal(job: OpenJob, sig: int) -> int | None:
    """Send ``sig`` to the process proven to hold the job's lock; its pid, or None when the
    lock is free. JobError, signalling nothing, when the holder cannot be proven."""
    pid = lock_holder(job)
    if pid is None:
        if not daemon_alive(job.paths, dir_fd=job.dir_fd):
            return None
        raise JobError(
            f"the daemon of {job.paths.name!r} did not answer, and the process holding {job.paths.lock} "
            f"cannot be proven (/proc/locks, /proc/<pid>/fd); nothing was signalled. See {job.paths.log}"
        )
    try:
        # A pidfd names one process: if the pid was reused between the proof and the open,
        # the proof below fails or the signal reaches no one, never a stranger.
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return pid
    except OSError as exc:  # no pidfd_open (a kernel before 5.3, a seccomp filter): the pid just proven
        if exc.errno not in (errno.ENOSYS, errno.EPERM):
            raise
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        return pid
    try:
        if lock_holder(job) == pid:
            signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)
    return pid


def _wait_gone(job: OpenJob, timeout_s: float) -> bool:
    """Wait until the job's lock is free, i.e. its daemon is dead; whether it is, by the deadline."""
    deadline = time.monotonic() + timeout_s
    while daemon_alive(job.paths, dir_fd=job.dir_fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
