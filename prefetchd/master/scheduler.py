"""Scheduling decisions: what to produce next and what to delete. Pure: no I/O, no clock.

Each rank reads its batches in order, across epochs; batch ``i`` of a rank is its linear
index (``epoch * batches_per_epoch + step``). A *consumer* is one trainer reading the job
(``PrefetchLoader(job, consumer=...)``; most jobs have one, the default ``""``); its
*position* on a rank is the next batch it will read there. The scheduler keeps the ranks
this daemon serves (all of them, or its node's). The byte bound, divided by the batch size,
is shared equally between them; of each rank's share, ``retain`` batches keep what was
consumed last (a trainer restarted from a checkpoint a few steps back finds them warm) and
``window`` batches lie ahead.

A rank keeps ``[anchor - retain, anchor + window)``, the anchor being its rearmost consumer
that keeps up: one behind the leading consumer by at most ``lag_limit`` (three quarters of
the window: the leader keeps a quarter ahead of it). A batch is made once for all of them and
deleted when they all passed it. A consumer further behind is *lagging*: it keeps only
``[position, position + LAGGING_AHEAD)``, made for it on demand (again, if the others had
it made), and holds nobody back: lagging consumers share ``lag_slots`` of a rank, the one
served longest ago first (``make_room`` says which of their batches give way). It keeps up
again once within half the limit (not at the limit: a consumer about as fast as the leader
would flip at every step, each flip deleting batches the next one remakes).

- Produce: the missing batch nearest to a consumer's position, over all ranks (the most
  urgent first), while the buffer holds fewer than ``capacity`` batches (ready or being
  written), plus ``reserved`` slots the master counts for consumed batches a client still
  maps: the byte bound is never exceeded, not even during a seek or for a lagging consumer.
- Delete: every ready batch outside what its rank keeps: consumed more than ``retain``
  batches ago or, after a backward seek, too far ahead. A paused rank's range stays as it is.
- Make room: when the buffer is full but the batch a consumer reads next is missing while
  later ones are ready, the ready batch farthest ahead is deleted so it can be made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prefetchd_client.layout import DEFAULT_CONSUMER

LAGGING_AHEAD = 2  # batches kept for a lagging consumer: the one it reads and the one it maps next
# A batch made for a lagging consumer that has not reported since, while this many positions
# came from all consumers (seconds, when they read), is the slot of one that stopped reading.
UNREAD_AFTER_REPORTS = 64
_LAGGING_RANGES = slice(1, None)  # RankState.keeps: the main range first, then one a lagging consumer


@dataclass
class RankState:
    # Consumers' positions. Before any reports, one guess under the default consumer (0, or
    # the first batch a previous daemon left), dropped when the first consumer reports.
    positions: dict[str, int] = field(default_factory=lambda: {DEFAULT_CONSUMER: 0})
    heard: bool = False  # a consumer reported: ``positions`` are reports, not the guess
    lagging: set[str] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    in_flight: set[int] = field(default_factory=set)
    consumed: dict[str, int] = field(default_factory=dict)  # per consumer: batches passed that were ready
    consumed_by_gone: int = 0  # by consumers forgotten since (their names are not kept)
    keeps: tuple[tuple[int, int], ...] = ()  # [start, end) ranges kept, from the positions (Scheduler._settle)
    last_lead: int = 0  # the leading position when there last was one (status shows a parked rank's)
    moved: dict[str, int] = field(default_factory=dict)  # per consumer: the scheduler's count of reports at its last
    made_at: dict[int, int] = field(default_factory=dict)  # per ready batch: that count when it was made
    served: dict[str, int] = field(default_factory=dict)  # per consumer: that count when its next batch was last made

    @property
    def parked(self) -> bool:
        """No consumer reads this rank: their trainers are gone and the policy released it."""
        return not self.positions

    @property
    def position(self) -> int:
        """The leading consumer's position (the rank's one position when it has one consumer)."""
        return max(self.positions.values(), default=self.last_lead)

    def kept(self, index: int, ranges: slice = slice(None)) -> bool:
        """Whether one of the ranges ``keeps[ranges]`` holds batch ``index`` (``slice(1, None)``:
        a lagging consumer's)."""
        return any(start <= index < end for start, end in self.keeps[ranges])

    @property
    def consumed_total(self) -> int:
        """Batches read by every consumer since the start: a counter, never smaller."""
        return sum(self.consumed.values()) + self.consumed_by_gone


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
        self.lag_limit = self.window * 3 // 4
        self.lag_slots = max(LAGGING_AHEAD, self.window // 2)  # the most a rank keeps for its lagging consumers
        self._reports = 0  # positions applied: a clock of activity, not of time (the scheduler has none)
        self.ranks = {rank: RankState() for rank in served}
        for state in self.ranks.values():
            self._settle(state)
        self.reserved = 0  # slots taken by consumed batches still mapped by a client

    @property
    def held(self) -> int:
        """Batches that occupy the buffer: ready or being written."""
        return sum(len(r.ready) + len(r.in_flight) for r in self.ranks.values())

    def _settle(self, state: RankState) -> None:
        """Who lags, and the ranges the rank keeps, from its consumers' positions."""
        if not state.positions:
            state.keeps = ()
            return
        lead = state.last_lead = state.position
        for name, pos in state.positions.items():
            behind = lead - pos
            if behind > self.lag_limit:
                state.lagging.add(name)
            elif behind <= self.lag_limit // 2:
                state.lagging.discard(name)
        state.lagging &= state.positions.keys()
        anchor = min(pos for name, pos in state.positions.items() if name not in state.lagging)
        keeps = [(anchor - self.retain, anchor + self.window)]
        keeps += sorted((state.positions[name], state.positions[name] + LAGGING_AHEAD) for name in state.lagging)
        state.keeps = tuple(keeps)

    def _fronts(self, state: RankState) -> Iterable[tuple[str, int, int, bool]]:
        """(consumer, position, end, lagging): where each consumer reads, how far ahead of it
        batches are made, and whether it lags."""
        if not state.positions:
            return
        main_end = state.keeps[0][1]
        for name, pos in state.positions.items():
            lagging = name in state.lagging
            yield name, pos, pos + LAGGING_AHEAD if lagging else main_end, lagging

    def _capped(self, state: RankState) -> bool:
        """Its lagging consumers hold ``lag_slots`` batches: nothing more is made for them."""
        return bool(state.lagging) and len(self._held_for_lagging(state)) >= self.lag_slots

    def _served_fronts(self, state: RankState) -> Iterable[tuple[str, int, int, bool]]:
        """The fronts batches may be made for now: lagging consumers share ``lag_slots`` (the
        others keep the rest of the share), and wait while those are taken."""
        capped = self._capped(state)
        return (front for front in self._fronts(state) if not (capped and front[3]))

    def _held_for_lagging(self, state: RankState) -> list[int]:
        """The batches (ready or being made) only lagging consumers keep."""
        main_start, main_end = state.keeps[0] if state.keeps else (0, 0)
        return [
            i
            for i in state.ready | state.in_flight
            if not main_start <= i < main_end and state.kept(i, _LAGGING_RANGES)
        ]

    def _owner(self, state: RankState, index: int) -> str:
        """The lagging consumer a batch only lagging consumers keep is kept for (the nearest behind it)."""
        return max((state.positions[n], n) for n in state.lagging if state.positions[n] <= index)[1]

    def move_position(self, rank: int, index: int, consumer: str = DEFAULT_CONSUMER) -> list[int]:
        """Record that ``consumer`` will read ``index`` next on ``rank``; returns ready batches to delete."""
        state = self.ranks[rank]
        if not state.heard:  # the guess makes way for the first report, which reads on from it
            state.heard = True
            state.positions = {consumer: state.positions.get(DEFAULT_CONSUMER, 0)}
        before = state.positions.get(consumer)
        if before is not None and index > before:
            # In flight too: under load a trainer reads a published batch before the master has
            # the worker's result, and that batch was consumed all the same.
            passed = sum(1 for i in state.ready | state.in_flight if before <= i < index)
            state.consumed[consumer] = state.consumed.get(consumer, 0) + passed
        state.positions[consumer] = index  # a parked consumer reads again
        self._reports += 1
        state.moved[consumer] = self._reports
        return self._drop_outside(state)

    def _drop_outside(self, state: RankState) -> list[int]:
        self._settle(state)
        doomed = {i for i in state.ready if not state.kept(i)}
        doomed.update(self._beyond_lag_slots(state))
        state.ready.difference_update(doomed)
        for index in doomed:
            state.made_at.pop(index, None)
        return sorted(doomed)

    def _beyond_lag_slots(self, state: RankState) -> list[int]:
        """Ready batches only lagging consumers keep, past ``lag_slots`` of them (consumers that
        fell behind with their batches made, or many of them): those of the consumers that
        reported last are kept, each one's next batch before its second."""
        held = self._held_for_lagging(state)
        if len(held) <= self.lag_slots:
            return []
        keep = sorted(held, key=lambda i: self._staleness(state, i))[: self.lag_slots]
        return [i for i in held if i not in keep and i in state.ready]

    def _staleness(self, state: RankState, index: int) -> tuple[int, int]:
        """How little a batch only lagging consumers keep is wanted: its consumer's last report
        the longest ago first, then the farthest from it."""
        owner = self._owner(state, index)
        return -state.moved.get(owner, 0), index - state.positions[owner]

    @property
    def full(self) -> bool:
        return self.held + self.reserved >= self.capacity

    def ready_ahead(self, most: int) -> int:
        """The fewest batches ready from a consumer's position on, counted up to ``most`` (0: a
        trainer waits, or will when it asks; ``most`` when no rank is served)."""
        fewest = most
        for state in self.ranks.values():
            for pos in state.positions.values():
                fewest = min(fewest, next((i for i in range(fewest) if pos + i not in state.ready), fewest))
        return fewest

    def next_task(self) -> tuple[int, int] | None:
        """(rank, index) of the most urgent missing batch, or None when full or all windows are full."""
        if self.full:
            return None
        best = None
        for rank, state in self.ranks.items():
            for name, pos, end, lagging in self._served_fronts(state):
                for index in range(pos, end):
                    if index not in state.ready and index not in state.in_flight:
                        # at equal distance, a consumer that keeps up first, then the one served longest ago
                        urgency = (index - pos, lagging, state.served.get(name, -1))
                        if best is None or urgency < best[0]:
                            best = (urgency, rank, index)
                        break
        return None if best is None else (best[1], best[2])

    def make_room(self) -> tuple[int, int] | None:
        """(rank, index) of a ready batch to delete, now, so that the batch a trainer waits for
        can be made; None when nothing needs to give way.

        The buffer can be full while a consumer's next batch is missing and later ones are
        ready: a restarted daemon adopted the batches past one that was being written when the
        last one was killed, a batch the trainer still maps takes the slot the gap needed,
        lagging consumers (or consumers that stopped reading) hold the slots. Waiting would
        never end (the trainer holds its last batch while it waits for the next), so a ready
        batch gives its slot back, made again later if it is wanted:

        - for a consumer that keeps up: a retained batch, else one only lagging consumers keep
          (they hold nobody back), else the one farthest ahead of its rank's leader;
        - for a lagging one: a batch kept for a lagging consumer that reported less lately than
          it (one paused, or a name with no trainer, cannot hold ``lag_slots`` for good), else,
          on a full buffer, a retained batch or one from the second half of a leader's window
          (the leader keeps half).

        A gap further ahead needs nothing: the trainer reaches it by consuming, which frees
        slots. Checking only the next batches keeps this O(consumers) on a full buffer.
        """
        lagging_waits, keeps_up_waits = [], False
        for rank, state in self.ranks.items():
            for name, pos, _, lagging in self._fronts(state):
                if pos not in state.ready and pos not in state.in_flight:
                    keeps_up_waits |= not lagging
                    if lagging:
                        lagging_waits.append((rank, name))
        victim = None
        if keeps_up_waits and self.full:
            victim = self._retained_victim() or self._lagging_victim() or self._ahead_victim(1)
        elif lagging_waits:
            victim = self._stale_lagging_victim(lagging_waits)
            if victim is None and self.full and any(not self._capped(self.ranks[r]) for r, _ in lagging_waits):
                victim = self._retained_victim() or self._ahead_victim(max(1, self.window // 2))
        if victim is not None:
            self.ranks[victim[0]].ready.discard(victim[1])
            self.ranks[victim[0]].made_at.pop(victim[1], None)
        return victim

    def _stale_lagging_victim(self, waits: list[tuple[int, str]]) -> tuple[int, int] | None:
        """For a lagging consumer whose rank's lagging slots are taken: a ready batch kept for a
        lagging consumer that is not the one it reads next (a next batch comes first), or one
        that is, made UNREAD_AFTER_REPORTS reports ago or more and not read since (its consumer
        stopped reading, or is a name with no trainer); the least wanted first."""
        best = None
        for rank in {rank for rank, _ in waits}:
            state = self.ranks[rank]
            if not self._capped(state):
                continue
            for index in self._held_for_lagging(state):
                owner = self._owner(state, index)
                made = state.made_at.get(index, self._reports)
                unread = self._reports - made >= UNREAD_AFTER_REPORTS and state.moved.get(owner, 0) < made
                if index in state.ready and (index != state.positions[owner] or unread):
                    candidate = (index != state.positions[owner], self._staleness(state, index), rank, index)
                    best = candidate if best is None or candidate > best else best  # the least wanted
        return None if best is None else best[2:]

    def _retained_victim(self) -> tuple[int, int] | None:
        """The oldest ready batch kept only as retained (behind the consumers that keep up, and
        read by no lagging one), if any."""
        behind = [
            (index, rank)
            for rank, state in self.ranks.items()
            if state.keeps
            for index in state.ready
            if state.keeps[0][0] <= index < state.keeps[0][0] + self.retain
            and not state.kept(index, _LAGGING_RANGES)
        ]
        return None if not behind else min(behind)[::-1]

    def _lagging_victim(self) -> tuple[int, int] | None:
        """A ready batch only lagging consumers keep: the one farthest ahead of its consumer (its
        second batch before anyone's next)."""
        candidates = [
            (index - max(p for p in state.positions.values() if p <= index), rank, index)
            for rank, state in self.ranks.items()
            for index in self._held_for_lagging(state)
            if index in state.ready
        ]
        return None if not candidates else max(candidates)[1:]

    def _ahead_victim(self, least: int) -> tuple[int, int] | None:
        """The ready batch farthest ahead of its rank's leader, at least ``least`` ahead."""
        farthest = max(
            ((index - state.position, rank, index) for rank, state in self.ranks.items() for index in state.ready),
            default=None,
        )
        return None if farthest is None or farthest[0] < least else farthest[1:]

    def task_started(self, rank: int, index: int) -> None:
        self.ranks[rank].in_flight.add(index)

    def task_finished(self, rank: int, index: int) -> bool:
        """The batch is published; True if it stays, False if it must be deleted (left its window)."""
        state = self.ranks[rank]
        state.in_flight.discard(index)
        if state.kept(index):
            state.ready.add(index)
            state.made_at[index] = self._reports
            for name, pos in state.positions.items():
                if pos == index:
                    state.served[name] = self._reports
            return True
        return False

    def park(self, rank: int, consumer: str = DEFAULT_CONSUMER) -> list[int]:
        """Forget a consumer whose trainer is gone: returns the ready batches nobody else keeps,
        to delete; nothing more is made for it until it reports a position again."""
        state = self.ranks[rank]
        state.heard = True
        state.positions.pop(consumer, None)
        state.lagging.discard(consumer)
        state.consumed_by_gone += state.consumed.pop(consumer, 0)
        state.moved.pop(consumer, None)
        state.served.pop(consumer, None)
        return self._drop_outside(state)

    def task_abandoned(self, rank: int, index: int) -> None:
        """The batch was not produced (its worker died): it becomes missing again."""
        self.ranks[rank].in_flight.discard(index)

    def adopt(self, rank: int, index: int) -> bool:
        """Count a valid batch found in the buffer at start-up as ready; False if it does not fit."""
        if self.held + self.reserved >= self.capacity:
            return False
        self.ranks[rank].ready.add(index)
        self.ranks[rank].made_at[index] = self._reports
        return True

    def start_at_adopted(self) -> None:
        """Until a consumer reports, a rank is assumed at its first adopted batch (not at 0)."""
        for state in self.ranks.values():
            if state.ready and not state.heard:
                state.positions = {DEFAULT_CONSUMER: min(state.ready)}
                self._settle(state)
