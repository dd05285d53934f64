"""The start's step clock: a process's age from the kernel's start time, and the steps a job's
log holds (what `prefetchd bench` shows of a cold start)."""

from __future__ import annotations

import subprocess
import sys
import time

from prefetchd.ops.startclock import LOG_PREFIX, StartClock, process_age_s, steps_in_log


def test_a_process_age_counts_from_its_start_to_the_tick():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        age = process_age_s(child.pid)
        assert 0.45 <= age <= 0.5 + 0.5, age  # ticks of 10 ms, and a loaded machine's scheduling
        assert process_age_s() > age  # this process began before its child
    finally:
        child.kill()
        child.wait()


def test_the_log_gives_back_the_last_starts_steps():
    clock = StartClock()
    for step in ("interpreter", "imports", "serving"):
        clock.mark(step)
    steps = list(clock.steps.values())
    assert list(clock.steps) == ["interpreter", "imports", "serving"] and steps == sorted(steps)
    earlier = LOG_PREFIX + '{"serving": 9.0}'
    log = f"2026-11-27 INFO {earlier}\n2026-11-27 INFO starting\n2026-11-27 INFO {clock.log_line()}\n"
    assert steps_in_log(log) == clock.steps
    assert steps_in_log("no start logged\n") is None
    assert steps_in_log(LOG_PREFIX + "{not json\n") is None
    assert steps_in_log(LOG_PREFIX + "[1, 2]\n") is None
