"""The daemon process of a `prefetchd start`, launched before the command knows its job.

Standard library only: `prefetchd start` launches it before it imports anything of its own (the
CLI's parsers, zmq, the config's numpy and Pillow), so that none of those imports delay the
daemon's. prefetchd.cli.launch then hands it its job and waits for its readiness message.

The command forks it (prefetchd.__main__): at that moment the command is an interpreter that has
loaded nothing but the standard library's start and prefetchd's lightest modules, as bare as a
fresh one, and a fork is one 50-100 ms interpreter start less on the way to the first batch.
Anything else that starts a daemon (a test, a script that calls start_detached) execs a fresh
interpreter instead: its process may hold threads, locks and state that a daemon must not inherit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from typing import TYPE_CHECKING, NoReturn

from prefetchd import stopsignals
from prefetchd.cli.quickexit import exit_now
from prefetchd.workers import ONE_THREAD_PER_PROCESS, kernel  # the package and ctypes: nothing else

if TYPE_CHECKING:
    from prefetchd.config import Config
    from prefetchd_client.layout import JobPaths

_CANCEL_WAIT_S = 20.0  # to leave its imports, or undo a start (pool.halt, the job folder); then it is killed

# `-c`, not `-m prefetchd.master.daemon`: multiprocessing's spawn re-imports the main module of a `-m`
# run in every worker it starts, and the daemon's imports cost each worker ~350 ms at every start.
_DAEMON_ENTRY = "import sys; from prefetchd.master.daemon import main; sys.exit(main())"


class DaemonLaunch:
    """A daemon process, launched before its config is known.

    ``prefetchd start`` launches it first thing (prefetchd.__main__, before the command's own
    imports), so that the daemon's interpreter, its imports and its worker server boot while the
    command imports typer and parses its flags and config: two processes' start-up side by side
    instead of one after the other.
    start_detached then sends it what it serves on stdin; cancel() ends one the command did
    not use (a bad flag, --help). Until it reads its stdin it has made nothing but its own
    processes, which end with it."""

    def __init__(self, *, fork: bool = False) -> None:
        """``fork``: this process becomes the daemon's by a fork rather than an exec; only for
        a process as bare as a fresh interpreter (see the module's docstring), and never while
        a second thread runs in it (one a sitecustomize started): then it execs."""
        self.ready_fd, write_fd = os.pipe()
        # Its stderr until it can send a message (main() lets it go then): a crash before that,
        # an import error say, leaves its last words here rather than on /dev/null.
        self.early_stderr = tempfile.TemporaryFile()
        try:
            if fork and kernel.single_threaded():
                self.proc = _fork_the_daemon(write_fd, self.early_stderr.fileno())
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _DAEMON_ENTRY, "--ready-fd", str(write_fd)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=self.early_stderr,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                    env={**os.environ, **ONE_THREAD_PER_PROCESS},  # its own and every process it starts
                )
        except BaseException:
            self.close()
            raise
        finally:
            os.close(write_fd)

    def send(self, config: Config, paths: JobPaths, keep: bool) -> None:
        order = {"config": config.to_json(), "job_dir": str(paths.dir), "keep": keep}
        try:
            self.proc.stdin.write(json.dumps(order).encode())
            self.proc.stdin.close()
        except BrokenPipeError:  # it died at once; the closed pipe, read next, says so
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def cancel(self) -> None:
        """End it unused (its worker server and resource tracker follow it) and close our ends.
        SIGTERM first: the daemon then exits through its exit hooks, which remove the worker
        server's socket folder from $TMPDIR (a SIGKILL would leave it there)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.send_signal(signal.SIGCONT)  # one stopped (SIGSTOP, Ctrl-Z) acts on it now, not when killed
            try:
                self.proc.wait(timeout=_CANCEL_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self.close()

    def close(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1
        self.early_stderr.close()
        if getattr(self, "proc", None) is not None and self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


class ForkedDaemon:
    """What prefetchd.cli.launch uses of a subprocess.Popen, for the daemon this process forked."""

    def __init__(self, pid: int, stdin) -> None:
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as Popen, say 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"the daemon (pid {self.pid})", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a signal to a pid that another process may now hold
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_the_daemon(ready_fd: int, stderr_fd: int) -> ForkedDaemon:
    pid, order_fd = kernel.fork_with_a_pipe(lambda order_r: _be_the_daemon(order_r, ready_fd, stderr_fd))
    return ForkedDaemon(pid, os.fdopen(order_fd, "wb"))


def _be_the_daemon(order_fd: int, ready_fd: int, stderr_fd: int) -> NoReturn:
    """In the forked child: become what the exec'd daemon would be (a session of its own, the
    job order on stdin, /dev/null for stdout, the early stderr, no other descriptor of the
    command's, the one-thread environment, no main module for multiprocessing to import in
    each worker, as `python -c`), run it, and leave: never back into the command's code."""
    code = 1
    try:
        os.setsid()
        stopsignals.forget()  # a stop the command received before the fork is the command's to act on
        null = os.open(os.devnull, os.O_RDWR)
        for fd, to in ((order_fd, 0), (null, 1), (stderr_fd, 2)):
            os.dup2(fd, to)
        kernel.close_descriptors_but(ready_fd)
        os.environ.update(ONE_THREAD_PER_PROCESS)
        sys.argv = ["-c", "--ready-fd", str(ready_fd)]
        sys.modules["__main__"] = types.ModuleType("__main__")
        from prefetchd.master.daemon import main

        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - its last words on the early stderr, which start shows
        import traceback

        traceback.print_exc()
    finally:
        exit_now(code)
