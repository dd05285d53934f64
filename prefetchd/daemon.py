"""The daemon process: run a job's master until it stops, in the foreground or detached.

Detached, it is started by prefetchd.launch (``prefetchd start``), reads its config as JSON on
stdin and answers on the ``--ready-fd`` pipe with one JSON line: readiness or why it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prefetchd_client.layout import JobPaths

from . import workerserver
from .errors import DaemonStop, ExitCode, UserError, describe, start_failure, to_json

if TYPE_CHECKING:
    from .config import Config


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
    _begin()  # main() did already; `start --foreground` comes straight here
    from .startup import start_master  # the master's machinery: imported while the server boots

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


def _begin() -> None:
    """The daemon process's first steps, done once: the umask, then the worker server, which
    boots (imports) beside the daemon's own start-up and whose workers inherit the umask."""
    os.umask(0o077)  # whatever the daemon or a library creates (the socket, logs) is the user's alone
    workerserver.start()


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
    parser = argparse.ArgumentParser(prog="prefetchd.daemon", description="internal: run one job's master")
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(argv)  # a bad command line: argparse's words on the early stderr
    ready = os.fdopen(args.ready_fd, "w")
    _let_go_of_early_stderr()
    _begin()  # after the early stderr is let go: the worker server would hold it open for good

    def notify(msg: dict) -> None:
        if ready.closed:
            return
        try:
            ready.write(json.dumps(msg) + "\n")
            ready.close()
        except OSError:
            pass  # `prefetchd start` is gone: nobody waits for the message

    # Launched early (launch.DaemonLaunch): these imports run while the command still parses
    # its flags, and the worker server boots meanwhile.
    from . import startup  # noqa: F401
    from .config import Config

    try:
        order = json.loads(sys.stdin.read())  # {"config", "job_dir", "keep"}; EOF: the command gave up
        config = Config.from_json(order["config"])
        job_dir, keep = order["job_dir"], order["keep"]
        if not isinstance(job_dir, str) or type(keep) is not bool:
            raise TypeError(f"job_dir {job_dir!r}, keep {keep!r}")
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
    return serve(config, JobPaths(Path(job_dir)), keep=keep, notify=notify, detach_output=True)


def _let_go_of_early_stderr() -> None:
    """From here on every failure reaches `prefetchd start` through the ready pipe. Its file
    for our stderr goes: workers would inherit it and write there for the job's whole life."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
