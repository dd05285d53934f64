"""Run a job's master: in the foreground, or detached with a readiness handshake.

``prefetchd start`` launches ``python -m prefetchd.daemon`` in a new session and waits on a
pipe for one JSON line: ``{"ok": true, "pid": P, "job_dir": D}`` once the job serves (manifest
written, socket bound), or ``{"ok": false, "error": E}``, E the error as data (errors.to_json:
``{"type", "message", "exit_code"}``). If the process dies without a word, the pipe closes and
``start`` reports that instead of hanging.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prefetchd_client.errors import AuthError, UnsafeFolder
from prefetchd_client.folders import OpenJob, open_job
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive, lock_holder

from . import control
from .config import Config
from .errors import DaemonStop, ExitCode, JobError, UserError, describe, error_from_json, start_failure, to_json
from .startup import start_master

_START_TIMEOUT_S = 600.0  # indexing a million files on a network filesystem takes a while
_STOP_TIMEOUT_S = 15.0
_EXIT_WAIT_S = 30.0  # a daemon that sent its failure only has to exit; then it is killed
_MAX_MESSAGE_BYTES = 1 << 20  # the readiness line is ~100 bytes; a failure message a few KiB


def serve(
    config: Config,
    paths: JobPaths,
    *,
    keep: bool,
    notify: Callable[[dict], None],
    detach_output: bool,
    on_stop: Callable[[DaemonStop], None] | None = None,
) -> int:
    """Start the job's master and run it until it stops; returns its exit code.

    ``notify`` hears once: the readiness message, or why the start failed, the error as data
    (an unforeseen exception too: ExitCode.INTERNAL, naming it). ``on_stop(stop)`` hears the
    DaemonStop of a daemon that served and stopped with a non-zero code (the foreground
    command says it).
    """
    os.umask(0o077)  # whatever the daemon or a library creates (the socket, logs) is the user's alone
    try:
        master = start_master(config, paths, keep=keep)
    except Exception as exc:  # a bug or the unforeseen too: still one clear message, never silence
        return _refuse_start(notify, paths, start_failure(exc, paths.log))
    if detach_output:  # from now on stray output (a crash) lands in the job's log
        fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    notify({"ok": True, "pid": os.getpid(), "job_dir": str(paths.dir)})
    code = master.run()
    if code and on_stop is not None:
        on_stop(master.stop_reason)
    return code


def _refuse_start(notify: Callable[[dict], None], paths: JobPaths, error: UserError) -> int:
    report = to_json(error)
    report["message"] = _without_a_removed_log(report["message"], paths.log)
    notify({"ok": False, "error": report})
    return error.exit_code


def _without_a_removed_log(message: str, log: Path) -> str:
    """``message``, minus its pointer to the job's log when that is gone: a failed start
    removes a job folder it created, log included, and a message must not send the user to
    a file that does not exist. A folder that was there keeps its log (and the pointer)."""
    if str(log) not in message or log.exists():
        return message
    for pointer in (f" (full traceback in {log})", f"; see {log}", f", see {log}", f" see {log}"):
        message = message.replace(pointer, "")
    return message.replace(str(log), "the job's log (removed with the job folder)")


def start_detached(config: Config, paths: JobPaths, *, keep: bool = False, timeout_s: float = _START_TIMEOUT_S) -> dict:
    """Start the daemon in its own session; return its readiness message or raise UserError:
    the daemon's own error, rebuilt from its report, when it failed to start (never silence)."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "prefetchd.daemon", "--ready-fd", str(write_fd), "--job-dir", str(paths.dir)]
    if keep:
        cmd.append("--keep")
    # Its stderr until it can send a message (main() lets it go then): a crash before that,
    # an import error say, leaves its last words here rather than on /dev/null.
    with tempfile.TemporaryFile() as early_stderr:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=early_stderr,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
        os.close(write_fd)
        _send_config(proc, config)
        try:
            line = _read_line(read_fd, timeout_s)
        finally:
            os.close(read_fd)
        if line is None:
            proc.kill()
            proc.wait()
            raise JobError(f"the daemon did not become ready within {timeout_s:.0f} s; it was stopped")
        msg = _start_message(line)
        if msg is None:
            raise JobError(_silent_exit(_wait_exit(proc, _EXIT_WAIT_S), early_stderr, paths))
    if not msg["ok"]:
        _wait_exit(proc, _EXIT_WAIT_S)
        raise error_from_json(msg["error"])
    return msg


def _send_config(proc: subprocess.Popen, config: Config) -> None:
    try:
        proc.stdin.write(json.dumps(config.to_json()).encode())
        proc.stdin.close()
    except BrokenPipeError:  # it died at once; the closed pipe, read next, says so
        try:
            proc.stdin.close()
        except OSError:
            pass


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


def _read_line(fd: int, timeout_s: float) -> bytes | None:
    """Bytes up to EOF or newline (at most _MAX_MESSAGE_BYTES); None on timeout."""
    data, deadline = b"", time.monotonic() + timeout_s
    while b"\n" not in data and len(data) < _MAX_MESSAGE_BYTES:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefetchd.daemon", description="internal: run one job's master")
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)  # a bad command line: argparse's words on the early stderr
    ready = os.fdopen(args.ready_fd, "w")
    _let_go_of_early_stderr()

    def notify(msg: dict) -> None:
        if ready.closed:
            return
        try:
            ready.write(json.dumps(msg) + "\n")
            ready.close()
        except OSError:
            pass  # `prefetchd start` is gone: nobody waits for the message

    try:
        config = Config.from_json(json.loads(sys.stdin.read()))
    except Exception as exc:  # noqa: BLE001 - whatever it is, the command must hear it
        unreadable = DaemonStop(
            f"the daemon could not read the config that `prefetchd start` passed it ({describe(exc)}); "
            "are `prefetchd` and the daemon's python the same prefetchd version?",
            ExitCode.INTERNAL,
        )
        notify({"ok": False, "error": to_json(unreadable)})
        return unreadable.exit_code
    finally:
        sys.stdin.close()
    return serve(config, JobPaths(Path(args.job_dir)), keep=args.keep, notify=notify, detach_output=True)


def _let_go_of_early_stderr() -> None:
    """From here on every failure reaches `prefetchd start` through the ready pipe. Its file
    for our stderr goes: workers would inherit it and write there for the job's whole life."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
