"""Stop signals (SIGTERM, SIGINT) taken as requests: the handler only records one. In the
daemon process, and in `prefetchd start`, which cancels the start it launched (launch.py).

The start checks for one between its steps (startup.start_master, the wait for workers to
boot): a stop there undoes the start, which is refused (exit 4). Once the job is announced, the
master's loop acts on it: a clean stop (exit 0). The handlers are installed first thing in the
daemon process, so no moment of the start is left to the default action (a kill that leaves
the job folder behind, or, as PID 1 in a container, a signal ignored). A handler never raises:
an exception raised inside an import is swallowed by the import machinery, and one raised
inside the undoing of a failed start cuts it short.
"""

from __future__ import annotations

import collections
import select
import signal

from prefetchd.errors import JobError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: collections.deque[int] = collections.deque()
_CHECK_EVERY_S = 0.05  # while a start waits on a pipe: how soon a stop is acted on


def take() -> None:
    """From now on (in this process, from its main thread) a stop signal is recorded, not acted on."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def _record(signum: int, frame) -> None:
    _received.append(signum)


def forget() -> None:
    """Drop the stops recorded so far: a forked child's are its parent's to act on."""
    _received.clear()


def received() -> signal.Signals | None:
    """The first stop signal received, or None."""
    return signal.Signals(_received[0]) if _received else None


class StopRequested(JobError):
    """A stop signal came while a job started (exit 4, as a job that could not start)."""


def check_starting() -> None:
    """Between the steps of a start: a stop received so far ends the start (StopRequested: its
    undoing removes what it made)."""
    sig = received()
    if sig is not None:
        raise StopRequested(f"stopped by {sig.name} during start-up: the job was not started, nothing was left behind")


def readable_unless_stopped(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has data (or EOF) within ``timeout_s``, cut to a short wait: a start that
    waits on a pipe calls it in a loop, and a stop received meanwhile ends it (StopRequested)."""
    check_starting()
    return bool(select.select([fd], [], [], min(timeout_s, _CHECK_EVERY_S))[0])
