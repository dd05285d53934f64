"""The daemon process: run a job's master until it stops, in the foreground or detached.

Detached, it is started by prefetchd.cli.launch (``prefetchd start``), reads its config as JSON on
stdin and answers on the ``--ready-fd`` pipe with one JSON line: readiness or why it failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prefetchd import stopsignals
from prefetchd.errors import DaemonStop, ExitCode, JobError, UserError, describe, start_failure, to_json
from prefetchd.ops import sdnotify
from prefetchd.ops.startclock import StartClock
from prefetchd.workers import ONE_THREAD_PER_PROCESS, kernel, workerserver
from prefetchd_client.layout import JobPaths

if TYPE_CHECKING:
    from prefetchd.config import Config

# How long a launched daemon waits for its job on stdin. `prefetchd start` sends it once it has
# parsed its flags and read its config (well under a second); a command stopped (Ctrl-Z) or hung
# for longer gets the daemon's refusal when it goes on.
ORDER_TIMEOUT_S = 120.0


def serve(
    config: Config,
    paths: JobPaths,
    *,
    keep: bool,
    notify: Callable[[dict], bool | None],
    detach_output: bool,
    on_stop: Callable[[DaemonStop], None] | None = None,
    clock: StartClock | None = None,
) -> int:
    """Start the job's master and run it until it stops; returns its exit code.

    ``notify`` hears once: the readiness message, or why the start failed, the error as data
    (an unforeseen exception too: ExitCode.INTERNAL, naming it). ``on_stop(stop)`` hears the
    DaemonStop of a daemon that served and stopped with a non-zero code (the foreground
    command says it). A service manager in the environment ($NOTIFY_SOCKET: `start
    --foreground` under systemd) hears READY=1 once the manifest is written and the socket
    bound, the master loop's watchdog beats, and STOPPING=1 (sdnotify.py). ``clock``: the
    steps of the start so far (a detached daemon's, from its process's beginning).
    """
    stopsignals.take()  # first: a stop at any moment of the start undoes it, then the master's loop acts on it
    manager = _begin()  # main() did already (and a detached daemon has no manager); `start --foreground` comes here
    from prefetchd.master.startup import start_master  # the master's machinery: imported while the server boots

    def announce() -> bool:  # the start's last step: the job serves only once the command has heard it
        if detach_output:  # from now on stray output (a crash) lands in the job's log
            fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        return notify({"ok": True, "pid": os.getpid(), "job_dir": str(paths.dir)}) is not False

    try:
        master = start_master(config, paths, keep=keep, announce=announce, clock=clock)
    except Exception as exc:  # a bug or the unforeseen too: still one clear message, never silence
        return _refuse_start(notify, paths, start_failure(exc, paths.log))
    manager.ready(f"serving job {paths.name} at {paths.dir}")
    try:
        code = master.run(manager)
    finally:
        manager.close()
    if code and on_stop is not None:
        on_stop(master.stop_reason)
    return code


def _begin(*, fork_server: bool = False) -> sdnotify.Notifier:
    """The daemon process's first steps, done once: the umask, the service manager's variables
    taken out of the environment, then the worker server, which boots (imports) beside the
    daemon's own start-up and whose workers inherit the umask but never $NOTIFY_SOCKET.
    ``fork_server``: the server is a fork of this process (workerserver.start), for the
    detached daemon, which comes here as bare as a fresh interpreter."""
    os.umask(0o077)  # whatever the daemon or a library creates (the socket, logs) is the user's alone
    os.environ.update(ONE_THREAD_PER_PROCESS)  # `start --foreground`: before numpy loads here, and in the worker server
    manager = sdnotify.Notifier.from_environment()  # silent on a second call: the variables are gone
    workerserver.start(fork=fork_server)
    # A week-long master's heap stays its size. After the fork: a worker keeps glibc's dynamic
    # thresholds, which serve its per-image buffers (0.5-1 MB) from the heap; fixed, each is
    # mapped and its pages faulted in afresh, 13-19 % of a worker's images/s (kernel.py).
    kernel.fix_heap_thresholds()
    return manager


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefetchd.master.daemon", description="internal: run one job's master")
    parser.add_argument("--ready-fd", type=int, required=True)
    # Until it has its job, a stop (DaemonLaunch.cancel's SIGTERM) ends it through the exit hooks,
    # which remove the worker server's socket folder; then it is a stop of the start (serve()).
    stopsignals.take()
    args = parser.parse_args(argv)  # a bad command line: argparse's words on the early stderr
    ready = os.fdopen(args.ready_fd, "w")
    _let_go_of_early_stderr()
    # After the early stderr is let go: the worker server would hold it open for good. A detached
    # daemon notifies no service manager: $NOTIFY_SOCKET, if any, is only taken from its workers.
    clock = StartClock()
    clock.mark("interpreter")
    _begin(fork_server=True)
    clock.mark("worker server forked")

    def notify(msg: dict) -> bool:
        """Whether the message reached `prefetchd start` (False: it is gone, nobody waits)."""
        if ready.closed:
            return False
        try:
            ready.write(json.dumps(msg) + "\n")
            ready.close()
        except OSError:
            with contextlib.suppress(OSError):
                ready.close()
            return False
        return True

    # Launched early (launch.DaemonLaunch): these imports run while the command still parses
    # its flags, and the worker server boots meanwhile.
    from prefetchd.config import Config
    from prefetchd.master import startup  # noqa: F401

    clock.mark("imports")

    try:
        order = json.loads(_read_order())  # {"config", "job_dir", "keep"}; EOF: the command gave up
        clock.mark("job received")
        config = Config.from_json(order["config"])
        job_dir, keep = order["job_dir"], order["keep"]
        if not isinstance(job_dir, str) or type(keep) is not bool:
            raise TypeError(f"job_dir {job_dir!r}, keep {keep!r}")
    except JobError as exc:  # a stop signal: said to a command that may be waiting
        notify({"ok": False, "error": to_json(exc)})
        return exc.exit_code
    except TimeoutError as exc:  # the command stopped or hung before it sent the job: say so, end
        late = JobError(f"{exc}; the daemon gave up, nothing was started: run `prefetchd start` again")
        notify({"ok": False, "error": to_json(late)})
        return late.exit_code
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
    return serve(config, JobPaths(Path(job_dir)), keep=keep, notify=notify, detach_output=True, clock=clock)


def _read_order(timeout_s: float | None = None) -> bytes:
    """All of stdin, the job order `prefetchd start` sends once its flags and config are read;
    TimeoutError when it has not come within ``timeout_s`` (a command stopped, or hung, before
    it sent it: the launched daemon must not wait for it for ever); JobError on a stop signal
    (DaemonLaunch.cancel's, for one: the command will not send it)."""
    timeout_s = ORDER_TIMEOUT_S if timeout_s is None else timeout_s
    fd, data, deadline = sys.stdin.fileno(), b"", time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"`prefetchd start` sent no job within {timeout_s:.0f} s of launching the daemon")
        if not stopsignals.readable_unless_stopped(fd, left):
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return data
        data += chunk


def _let_go_of_early_stderr() -> None:
    """From here on every failure reaches `prefetchd start` through the ready pipe. Its file
    for our stderr goes: workers would inherit it and write there for the job's whole life."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
