"""How long the trainer waited for data: the time its ``next()`` spent waiting for a batch.

The loader times every step on the trainer's thread and sends the running totals with each
position report (prefetchd_client.loader), so ``prefetchd status`` and the metrics show, per
rank, whether the GPU waits for data. Totals rather than increments: the reports are sent
without blocking and may be dropped, and a later one then carries what the dropped one had.

Fields added to a position report::

    "wait_s": 12.345678      seconds spent waiting in next(), this loader's whole life,
                             including the wait in progress (a trainer stuck on a batch
                             reports its growing wait every liveness check, ~0.5 s)
    "waited_steps": 17       steps whose wait exceeded WAITED_S
    "steps": 1200            batches taken
    "loader": 8812340911     a random id of this loader: the daemon sums totals per loader,
                             so a restarted trainer's totals add to the rank's, not replace them

The totals only grow for one loader id; the daemon checks that (prefetchd.ops.stalls).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

WAITED_S = 0.001  # a step that waited longer counts as a waited step (a ready batch takes ~0.1 ms)
_ID_BITS = 52  # an id JSON carries exactly in any language (a double's integers)


class TrainerWaits:
    """The totals, updated by the trainer's thread and read by the read-ahead thread: one
    tuple, swapped whole, so a reader never sees a wait counted in one field but not another."""

    def __init__(self) -> None:
        self.loader_id = random.SystemRandom().getrandbits(_ID_BITS)
        # (seconds waited, steps that waited > WAITED_S, steps taken, start of the wait in progress)
        self._totals: tuple[float, int, int, float | None] = (0.0, 0, 0, None)

    def timed(self, take: Callable[[int], object], step: int):
        """``take(step)``, its wait counted (also when it raises: the trainer waited all the same)."""
        waited_s, waited, steps, _ = self._totals
        started = time.perf_counter()
        self._totals = (waited_s, waited, steps, started)
        taken = False
        try:
            batch = take(step)
            taken = True
            return batch
        finally:
            wait = time.perf_counter() - started
            self._totals = (waited_s + wait, waited + (wait > WAITED_S), steps + taken, None)

    def totals(self) -> dict:
        """The totals as a trainer sees them: ``wait_s``, ``waited_steps``, ``steps``."""
        waited_s, waited, steps, started = self._totals
        if started is not None:  # a wait in progress counts up to now
            waited_s += time.perf_counter() - started
        return {"wait_s": waited_s, "waited_steps": waited, "steps": steps}

    def report_fields(self) -> dict:
        """What a position report carries (the module docstring)."""
        fields = self.totals()
        fields["wait_s"] = round(fields["wait_s"], 6)  # rounding keeps the totals non-decreasing
        fields["loader"] = self.loader_id
        return fields
