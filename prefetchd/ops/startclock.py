"""When each step of a daemon's start was done: seconds since its process began.

The kernel's start time of the process is the zero, so the interpreter's own boot counts too.
The daemon logs the steps once it serves (``start-up steps ...``, JSON), which is where a slow
start is looked into, and what `prefetchd bench` shows of its cold start.
"""

from __future__ import annotations

import json
import os
import time

LOG_PREFIX = "start-up steps (s since the daemon's process began): "


def process_age_s(pid: int | str = "self") -> float:
    """Seconds since the process began (this one by default), to the kernel's clock tick (10
    ms, usually): its start time on the boot-time clock, which nothing rounds to the second."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        # After the command name (which may hold spaces or parentheses): starttime is field 22.
        start_ticks = int(f.read().rpartition(b")")[2].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


class StartClock:
    """The steps of one start, in order, each at the process's age when it was done."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    def mark(self, step: str) -> None:
        try:
            self.steps[step] = round(process_age_s(), 3)
        except (OSError, ValueError, IndexError):  # no /proc: the steps are only for looking into a start
            pass

    def log_line(self) -> str:
        return LOG_PREFIX + json.dumps(self.steps)


def steps_in_log(text: str) -> dict[str, float] | None:
    """The last start's steps in a job's log, or None."""
    at = text.rfind(LOG_PREFIX)
    if at < 0:
        return None
    line = text[at + len(LOG_PREFIX) :].partition("\n")[0]
    try:
        steps = json.loads(line)
    except ValueError:
        return None
    return steps if isinstance(steps, dict) else None
