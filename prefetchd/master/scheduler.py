"""Scheduling decisions: what to produce next and what to delete. Pure: no I/O, no clock.

Each rank reads its batches in order, across epochs; batch ``i`` of a rank is its linear
index (``epoch * batches_per_epoch + step``). A rank's *position* is the next batch it will
read. The scheduler keeps the ranks this daemon serves (all of them, or its node's). The
byte bound, divided by the batch size, is shared equally between them; of each
rank's share, ``retain`` batches keep what it consumed last (a trainer restarted from a
checkpoint a few steps back finds them warm) and ``window`` batches lie ahead. A rank keeps
``[position - retain, position + window)``.

- Produce: the missing batch nearest to its rank's position, over all ranks (the most
  urgent first), while the buffer holds fewer than ``capacity`` batches (ready or being
  written), plus ``reserved`` slots the master counts for consumed batches a client still
  maps: the byte bound is never exceeded, not even during a seek.
- Delete: every ready batch outside that range: consumed more than ``retain`` batches ago
  or, after a backward seek, too far ahead. A paused rank's range stays as it is.
- Make room: when the buffer is full but the batch a rank reads next is missing while
  later ones are ready, the ready batch farthest ahead is deleted so it can be made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class RankState:
    position: int = 0
    ready: set[int] = field(default_factory=set)
    in_flight: set[int] = field(default_factory=set)
    consumed: int = 0  # batches deleted because the rank passed them
    parked: bool = False  # its trainer is gone and the policy released its window


class Scheduler:
    def __init__(self, ranks: int | Iterable[int], capacity: int, retain: int = 0):
        """``ranks``: the ranks served (their numbers in the plan), or how many from rank 0."""
        served = range(ranks) if isinstance(ranks, int) else sorted(ranks)
        if capacity // len(served) <= retain:
            raise ValueError(
                f"capacity {capacity} batches leaves no window ahead for {len(served)} ranks retaining {retain}"
            )
        self.capacity = capacity
        self.retain = retain
        self.window = capacity // len(served) - retain
        self.ranks = {rank: RankState() for rank in served}
        self.reserved = 0  # slots taken by consumed batches still mapped by a client

    @property
    def held(self) -> int:
        """Batches that occupy the buffer: ready or being written."""
        return sum(len(r.ready) + len(r.in_flight) for r in self.ranks.values())

    def _in_window(self, rank: int, index: int) -> bool:
        pos = self.ranks[rank].position
        return pos - self.retain <= index < pos + self.window

    def move_position(self, rank: int, index: int) -> list[int]:
        """Record that ``rank`` will read ``index`` next; returns ready batches to delete."""
        state = self.ranks[rank]
        state.parked = False  # a report means a trainer reads this rank again
        if index > state.position:
            # In flight too: under load a trainer reads a published batch before the master has
            # the worker's result, and that batch was consumed all the same.
            state.consumed += sum(1 for i in state.ready | state.in_flight if state.position <= i < index)
        state.position = index
        doomed = sorted(i for i in state.ready if not self._in_window(rank, i))
        state.ready.difference_update(doomed)
        return doomed

    @property
    def full(self) -> bool:
        return self.held + self.reserved >= self.capacity

    def ready_ahead(self, most: int) -> int:
        """The fewest batches ready from a rank's position on, counted up to ``most`` (0: a trainer
        waits, or will when it asks; ``most`` when no rank is served)."""
        fewest = most
        for state in self.ranks.values():
            if not state.parked:
                fewest = min(fewest, next((i for i in range(fewest) if state.position + i not in state.ready), fewest))
        return fewest

    def next_task(self) -> tuple[int, int] | None:
        """(rank, index) of the most urgent missing batch, or None when full or all windows are full."""
        if self.full:
            return None
        best = None
        for rank, state in self.ranks.items():
            if state.parked:
                continue
            for distance in range(self.window):
                index = state.position + distance
                if index not in state.ready and index not in state.in_flight:
                    if best is None or distance < best[0]:
                        best = (distance, rank, index)
                    break
        return None if best is None else (best[1], best[2])

    def make_room(self) -> tuple[int, int] | None:
        """(rank, index) of a ready batch to delete, now, so that the batch a trainer waits for
        can be made; None when nothing needs to give way.

        The buffer can be full while a rank's next batch is missing and later ones are ready:
        a restarted daemon adopted the batches past one that was being written when the last
        one was killed, and a batch the trainer still maps takes the slot the gap needed.
        Waiting would never end (the trainer holds its last batch while it waits for the
        next), so the ready batch farthest ahead of its rank gives its slot back; it is made
        again later. A gap further ahead needs nothing: the trainer reaches it by consuming,
        which frees slots. Checking only the next batch keeps this O(ranks) on a full buffer.
        """
        if not self.full or all(
            state.parked or state.position in state.ready or state.position in state.in_flight
            for state in self.ranks.values()
        ):
            return None
        farthest = max(
            (
                (index - state.position, rank, index)
                for rank, state in self.ranks.items()
                if not state.parked
                for index in state.ready
            ),
            default=None,
        )
        if farthest is None or farthest[0] <= 0:  # only retained batches, behind the positions
            return None
        _, rank, index = farthest
        self.ranks[rank].ready.discard(index)
        return rank, index

    def task_started(self, rank: int, index: int) -> None:
        self.ranks[rank].in_flight.add(index)

    def task_finished(self, rank: int, index: int) -> bool:
        """The batch is published; True if it stays, False if it must be deleted (left its window)."""
        state = self.ranks[rank]
        state.in_flight.discard(index)
        if self._in_window(rank, index) and not state.parked:
            state.ready.add(index)
            return True
        return False

    def park(self, rank: int) -> list[int]:
        """Release the window of a rank whose trainer is gone: returns its ready batches to delete;
        nothing more is made for it until it reports a position again."""
        state = self.ranks[rank]
        state.parked = True
        doomed = sorted(state.ready)
        state.ready.clear()
        return doomed

    def task_abandoned(self, rank: int, index: int) -> None:
        """The batch was not produced (its worker died): it becomes missing again."""
        self.ranks[rank].in_flight.discard(index)

    def adopt(self, rank: int, index: int) -> bool:
        """Count a valid batch found in the buffer at start-up as ready; False if it does not fit."""
        if self.held + self.reserved >= self.capacity:
            return False
        self.ranks[rank].ready.add(index)
        return True

    def start_at_adopted(self) -> None:
        """Until its trainer reports, a rank is assumed at its first adopted batch (not at 0)."""
        for state in self.ranks.values():
            if state.ready:
                state.position = min(state.ready)
