"""The process local workers are forked from: multiprocessing's fork server, with the worker's
code (and the decoders it loads) imported once.

A spawned worker is a fresh interpreter that imports numpy, Pillow, OpenCV and prefetchd's
worker side: about 0.5 s before it can take a task, at every start and every replacement. A
worker forked from this server takes milliseconds. The server is started by the daemon before
it holds a lock, a socket or a thread, and it is itself a fresh interpreter (not a fork of the
master), so a worker inherits none of them, as with spawn. It boots beside the daemon's own
start-up. It exits when the master does (its pipe from the master closes), and the kernel kills
it when the master dies, even while it is stopped (this module, preloaded first, asks for
that); the workers then follow (worker.py asks the kernel for SIGKILL when their parent, the
server, dies). A stopped server would freeze every spawn and every death report: the pool
kills it (unstick), and its workers go with it and are replaced.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import time
from multiprocessing import connection, resource_tracker

from prefetchd.errors import JobError
from prefetchd.workers import kernel

CONTEXT = multiprocessing.get_context("forkserver")
# Imported once in the server. This module first: in the server it ties the server's life to the
# daemon's and imports the decoders' libraries (_become_the_server).
PRELOAD = [__name__, "prefetchd.workers.worker"]

SERVER_NAME = b"prefetchd-fork"  # the server's name in `ps -o comm` (at most 15 bytes)


def start(*, fork: bool = False) -> None:
    """Boot the server now (in the background; a no-op when it runs). A worker started before
    it is ready waits for it; one started after it died starts it again.

    ``fork``: the first server is a fork of this process rather than a fresh interpreter, which
    saves an interpreter's start (~0.1 s of a cold start, and its CPU beside the daemon's
    imports). Only for a process that is as bare as a fresh one: the detached daemon, first
    thing (no thread, no lock, no socket, only standard-library state and prefetchd's light
    modules), and with no second thread (kernel.single_threaded: else a fresh interpreter too).
    A server started again after it died is a fresh interpreter."""
    fit_socket_folder()
    CONTEXT.set_forkserver_preload(PRELOAD)
    if fork and server_pid() is None and kernel.single_threaded():
        _fork_the_server()
    multiprocessing.forkserver.ensure_running()


def _fork_the_server() -> None:
    """What multiprocessing.forkserver.ensure_running does, with os.fork in place of an exec: a
    listening socket only this user may connect to, the "alive" pipe whose EOF ends the server,
    and the resource tracker, whose fd every worker is sent."""
    server = multiprocessing.forkserver._forkserver
    with server._lock:
        resource_tracker.ensure_running()
        address = connection.arbitrary_address("AF_UNIX")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            pid, alive_w = kernel.fork_with_a_pipe(lambda alive_r: _serve_forks(listener.fileno(), alive_r))
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def _serve_forks(listener_fd: int, alive_r: int) -> None:
    """In the forked child: leave the daemon behind as an exec would (every fd but the two it
    serves by and stdio closed: the daemon's ready pipe held open here would hide the daemon's
    death from `prefetchd start`; the stop signals the daemon takes back to their defaults),
    then be the fork server until the daemon ends."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        kernel.close_descriptors_but(listener_fd, alive_r)
        # The daemon's resource tracker descriptor, closed just now: its number may be reused
        # (an accepted connection), so nothing here may write to it. Its workers are sent it.
        resource_tracker._resource_tracker._fd = None
        resource_tracker._resource_tracker._pid = None
        _become_the_server()  # this module was imported before the fork: not on its import here
        multiprocessing.forkserver.main(listener_fd, alive_r, PRELOAD)
        code = 0
    except SystemExit:  # the daemon ended (the alive pipe's EOF): how the server always ends
        code = 0
    finally:
        os._exit(code)  # never back into the daemon's code, nor its exit hooks


def run_worker(spec_json: str, conn, nice: int = 0) -> None:
    """A worker process's target (master/pool.py): the master names it without importing the
    worker side (Pillow, OpenCV, the producer, ~60 ms of a cold start's CPU), which this
    server has preloaded for the processes it forks."""
    from prefetchd.workers.worker import worker_main

    worker_main(spec_json, conn, nice)


# multiprocessing binds a fork server's socket at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX: 32
# bytes after the folder, and a socket path holds at most 107.
_SOCKET_FOLDER_MAX = 107 - 32


def fit_socket_folder() -> None:
    """Where $TMPDIR is too long for a socket path (a batch scheduler's per-job folder can be),
    this process's temporary files go to the first short system folder it may write instead;
    Python 3.11's multiprocessing would fail with "AF_UNIX path too long". JobError where no
    temporary folder can be written at all (the server's socket needs one)."""
    try:
        folder = tempfile.gettempdir()
    except FileNotFoundError as exc:  # "No usable temporary directory found in [...]"
        why = f"{exc.strerror}: the worker server's socket needs one; set $TMPDIR to one you can write"
        raise JobError(why) from None
    if len(os.fsencode(folder)) <= _SOCKET_FOLDER_MAX:
        return
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.access(folder, os.W_OK | os.X_OK):
            tempfile.tempdir = folder
            return


def unstick() -> bool:
    """Kill the server if it is stopped (SIGSTOP): a stopped server never answers a spawn (the
    daemon would block for good) nor reports a death (a dead worker would look alive). Its
    workers die with it and the pool replaces them; the next start() boots a new server.
    Whether it was killed."""
    pid = server_pid()
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    if state not in (b"T", b"t"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    await_death(pid)  # not reaped: ensure_running reaps it, and then starts a new one
    return True


def _in_the_server() -> bool:
    """Whether this import is the fork server's preload (not the daemon's, a worker's, a test's)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not multiprocessing.forkserver.main.__code__:
        frame = frame.f_back
    return frame is not None


def _become_the_server() -> None:
    """The server's first steps, forked or a fresh interpreter: its life tied to the daemon's,
    the decoders' libraries imported. (glibc's heap thresholds are left dynamic here, for the
    workers: the daemon fixes its own after it forks the server, master/daemon.py.)

    SIGKILL when its parent, the daemon, dies: its pipe from the daemon closing ends it too,
    but not while it is stopped, nor while a worker (which holds that pipe as well) is blocked
    in a sample; the kernel's signal does."""
    # Ctrl-C in a terminal reaches the whole process group of `start --foreground`: the daemon
    # alone decides what it means (stopsignals), and the server, preloading, would print a
    # KeyboardInterrupt traceback there. (Not set by the daemon around the spawn: ignored there
    # for a moment, a Ctrl-C taken by another of its threads would be lost.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel.die_with_the_parent(SERVER_NAME)
    _preload_decoder_libraries()


def _preload_decoder_libraries() -> None:
    """Not in PRELOAD: the server skips only an ImportError there, so a broken library that
    raises anything else (a RuntimeError: built against another numpy) killed it, and with it
    every worker, whatever the job's decoder. Here any failure is skipped; a worker of a job that
    needs the library imports it again and says why, and how to fix it (fastdecode.require)."""
    from prefetchd.workers.decoders import LIBRARIES  # in the server only: the daemon's start waits for none

    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - even SystemExit: the server must live
            sys.modules.pop(name, None)


if _in_the_server():  # a fresh interpreter (`start --foreground`, or started again after a death)
    _become_the_server()


def server_pid() -> int | None:
    """The running server's pid (the parent of the workers started now), if there is one."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def died(pid: int, within_s: float = 0.0) -> bool:
    """Whether the server ``pid`` has exited, or does within ``within_s`` (checked without
    reaping it: ensure_running does)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def await_death(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until the server ``pid``, which broke off a spawn, has exited (not reaped: the next
    start() reaps it and boots a new one); SIGKILL after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not died(pid):
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            return
        time.sleep(0.01)
