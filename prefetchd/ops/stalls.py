"""Trainer stall accounting: per trainer (a rank of a consumer), how long it waited for data.

Pure: the intake hands it the wait totals that come with a position report (the fields and
their meaning: prefetchd_client.waits), with the time; ``snapshot`` gives what ``status`` and
the metrics show. A trainer that never sent them (a progress-file trainer, an older client)
has no entry: its wait is unknown, not zero. Trainers are keyed by (rank, consumer).

Totals are kept per trainer since the daemon started: each loader's growth is added, so a
restarted trainer (a new loader id) adds to its rank's totals. The share of the last minute
comes from a short history of the running total, one point a second. A loader's first report
counts in the totals but not in that share: it carries what the loader waited before this
daemon heard of it (under a daemon restarted beside a running trainer, minutes of it), which
did not happen in the last minute; a new trainer's first report comes as its iteration starts
and carries nothing.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

WINDOW_S = 60.0  # "the wait in the last minute"
_POINT_EVERY_S = 1.0
MAX_WAIT_S = 1e9  # 31 years: a larger total is no trainer's
MAX_COUNT = 2**53  # what a JSON number holds exactly in any language


class BadWaits(ValueError):
    """Wait totals no loader sends: out of range, or smaller than the same loader's last."""


@dataclass
class RankWaits:
    """One rank's totals since the daemon started, and the loader that reports now."""

    seconds: float = 0.0
    waited_steps: int = 0
    steps: int = 0
    loader: int | None = None
    last: tuple[float, int, int] = (0.0, 0, 0)  # that loader's totals at its last report
    unseen_s: float = 0.0  # waits first reported by a loader: in the totals, not in the share
    # (time, seconds): the running total, a point a second, the oldest just before the window
    history: collections.deque = field(default_factory=collections.deque)


Key = tuple[int, str]  # (rank, consumer)


def trainer_name(key: Key) -> str:
    """How messages name a trainer: its rank, and its consumer when it has a name."""
    rank, consumer = key
    return f"rank {rank} of consumer {consumer!r}" if consumer else f"rank {rank}"


class StallLedger:
    def __init__(self) -> None:
        self.ranks: dict[Key, RankWaits] = {}

    def note(self, key: Key, loader: int, wait_s: float, waited_steps: int, steps: int, now: float) -> None:
        """Add a report's totals (already schema-checked: non-negative, finite); BadWaits when
        they are out of range or went backwards for the same loader (nothing changes then)."""
        if wait_s > MAX_WAIT_S or max(waited_steps, steps, loader) > MAX_COUNT:
            raise BadWaits(
                f"{trainer_name(key)}: wait totals out of range ({wait_s!r:.20} s, {waited_steps}/{steps} steps)"
            )
        waits = self.ranks.get(key)
        if waits is None:
            waits = self.ranks[key] = RankWaits()
            waits.history.append((now, 0.0))  # a share from here on
        totals = (float(wait_s), waited_steps, steps)
        new_loader = waits.loader != loader
        before = (0.0, 0, 0) if new_loader else waits.last  # a new loader counts from 0
        if any(now_ < then for now_, then in zip(totals, before)):
            who = trainer_name(key)
            raise BadWaits(f"{who}: wait totals went backwards for the same loader ({before} -> {totals})")
        if new_loader:
            waits.unseen_s += totals[0]
        waits.seconds += totals[0] - before[0]
        waits.waited_steps += totals[1] - before[1]
        waits.steps += totals[2] - before[2]
        waits.loader, waits.last = loader, totals
        self._remember(waits, now)

    @staticmethod
    def _remember(waits: RankWaits, now: float) -> None:
        history, seen = waits.history, waits.seconds - waits.unseen_s
        if now - history[-1][0] >= _POINT_EVERY_S or len(history) == 1:  # the first point is the base
            history.append((now, seen))
        else:  # the newest point holds the newest total
            history[-1] = (history[-1][0], seen)
        while len(history) > 2 and history[1][0] <= now - WINDOW_S:
            history.popleft()  # keep one point at or before the window's start

    def forget(self, key: Key) -> None:
        self.ranks.pop(key, None)

    def snapshot(self, key: Key, now: float) -> dict | None:
        """What status shows for a trainer: totals and the last minute's share of wall time
        spent waiting; None when it never sent its waits."""
        waits = self.ranks.get(key)
        if waits is None:
            return None
        return {
            "seconds_total": round(waits.seconds, 6),
            "waited_steps_total": waits.waited_steps,
            "steps_total": waits.steps,
            "last_minute_share": round(_share(waits.history, waits.seconds - waits.unseen_s, now), 4),
        }


def _share(history: collections.deque, seconds: float, now: float) -> float:
    """The wait in the window (or since the first report, if later) over its wall time, capped
    at 1 (a report's wait in progress may reach just past the moment it is read)."""
    start_t, start_s = history[0]
    window_start = now - WINDOW_S
    if start_t < window_start:  # the total at the window's start: between the points around it
        start_t, start_s = window_start, history[-1][1]
        for (t0, s0), (t1, s1) in zip(history, list(history)[1:]):
            if t0 <= window_start < t1:
                start_s = s0 + (s1 - s0) * (window_start - t0) / (t1 - t0)
                break
    elapsed = now - start_t
    if elapsed <= 0:
        return 0.0
    return min(1.0, max(0.0, (seconds - start_s) / elapsed))
