"""The daemon process of a `prefetchd start`, launched before the command knows its job.

Standard library only: `prefetchd start` launches it before it imports anything of its own (the
CLI's parsers, zmq, the config's numpy and Pillow), so that none of those imports delay the
daemon's. prefetchd.cli.launch then hands it its job and waits for its readiness message.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

from prefetchd.workers import ONE_THREAD_PER_PROCESS  # the package alone: nothing but this

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

    def __init__(self) -> None:
        self.ready_fd, write_fd = os.pipe()
        # Its stderr until it can send a message (main() lets it go then): a crash before that,
        # an import error say, leaves its last words here rather than on /dev/null.
        self.early_stderr = tempfile.TemporaryFile()
        try:
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
