"""``--workers auto``: how many workers the job's demand needs. Pure, like master/policy.py: no
processes, no clock of its own (``now`` is an argument), so each rule is tested in microseconds
(tests/unit/test_autoscale.py); the pool starts and ends the workers it decides.

The pool starts at ``high`` (a job alone is served at once, as with a fixed count) and follows
what the master sees each turn, without any report from the trainer:

- **Grow** by one while a trainer *starves* (a rank's next batch is not ready: its trainer
  waits, or will when it asks), every worker is busy and a batch could be started (the window
  is not full): one more every ``GROW_EVERY_S``, so a trainer that outruns the pool gets the
  workers it needs within seconds.
- **Shrink** when, for a whole ``SHRINK_WINDOW_S``, at least one worker was idle at every turn:
  half of the workers never needed together in that window go (at least one). A trainer slower
  than production leaves the window full and workers idle; they end, and their memory is the
  system's again. Workers idle while a trainer waits go too: they could start nothing (the node's
  CPU budget gives the job fewer, production is paused). A turn that grows restarts the window.

Which batches are made, and their bytes, do not depend on the count: determinism is untouched.
"""

from __future__ import annotations

GROW_EVERY_S = 0.5
SHRINK_WINDOW_S = 5.0


class AutoWorkers:
    def __init__(self, low: int, high: int, now: float):
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got {low} and {high}")
        self.low, self.high = low, high
        self.target = high
        self.changes = 0  # since the start
        self.last_change = ""  # why the last one was made, for the log and status
        self._last_grow = -GROW_EVERY_S
        self._window_start = now
        self._least_idle = high

    def decide(self, now: float, workers: int, busy: int, starving: bool, more_work: bool) -> int:
        """The count wanted after this turn: ``workers`` live (booting ones too), ``busy`` with
        a task; ``starving``: a rank's next batch is not ready; ``more_work``: the scheduler
        would start a batch now if a worker were free."""
        idle = max(0, workers - busy)
        if starving and idle == 0 and more_work:
            self._restart_window(now)
            if self.target < self.high and now - self._last_grow >= GROW_EVERY_S:
                self._last_grow = now
                self._change(self.target + 1, "a trainer waits and every worker is busy")
            return self.target
        # Idle workers while a trainer waits could start nothing (the node budget, a pause): they go too.
        self._least_idle = min(self._least_idle, idle)
        if now - self._window_start >= SHRINK_WINDOW_S:
            spare = self._least_idle
            self._restart_window(now)
            if spare >= 1 and self.target > self.low:
                self._change(
                    max(self.low, self.target - max(1, spare // 2)),
                    f"{spare} worker(s) stayed idle for {SHRINK_WINDOW_S:g} s",
                )
        return self.target

    def _restart_window(self, now: float) -> None:
        self._window_start, self._least_idle = now, self.high

    def _change(self, target: int, why: str) -> None:
        self.target, self.changes, self.last_change = target, self.changes + 1, why

    def snapshot(self) -> dict:
        return {"min": self.low, "max": self.high, "target": self.target, "changes": self.changes}
