"""Scheduling decisions, without processes: urgency, the bound, deletion, pausing, seeking."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd.master.scheduler import Scheduler


def drain(s: Scheduler, limit: int = 1000) -> list[tuple[int, int]]:
    """Start and finish tasks until the scheduler has nothing to do; returns them in order."""
    done = []
    while (task := s.next_task()) is not None and len(done) < limit:
        s.task_started(*task)
        assert s.task_finished(*task)
        done.append(task)
    return done


def test_fills_most_urgent_first_and_stops_at_capacity():
    s = Scheduler(ranks=2, capacity=6)
    order = drain(s)
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert s.held == 6 and s.next_task() is None


def test_consumed_batches_are_deleted_and_refilled_across_epochs():
    s = Scheduler(ranks=1, capacity=3)
    drain(s)
    assert s.move_position(0, 2) == [0, 1]
    assert drain(s) == [(0, 3), (0, 4)]
    assert s.ranks[0].consumed_total == 2


def test_paused_rank_pins_its_window_while_others_go_on():
    s = Scheduler(ranks=2, capacity=4)
    drain(s)
    s.move_position(1, 2)  # rank 0 is paused at 0
    assert drain(s) == [(1, 2), (1, 3)]
    assert s.ranks[0].ready == {0, 1}


def test_in_flight_counts_against_the_bound():
    s = Scheduler(ranks=1, capacity=2)
    a, b = s.next_task(), None
    s.task_started(*a)
    b = s.next_task()
    s.task_started(*b)
    assert s.next_task() is None  # two in flight fill a capacity of two


def test_backward_seek_drops_what_is_now_too_far_ahead():
    s = Scheduler(ranks=1, capacity=3)
    s.move_position(0, 10)
    drain(s)
    assert s.move_position(0, 8) == [11, 12]
    assert drain(s) == [(0, 8), (0, 9)]


def test_batch_finished_after_its_rank_moved_past_it_is_deleted():
    s = Scheduler(ranks=1, capacity=2)
    task = s.next_task()
    s.task_started(*task)
    s.move_position(0, 5)
    assert s.task_finished(*task) is False
    assert s.held == 0


def test_abandoned_task_is_reissued():
    s = Scheduler(ranks=1, capacity=2)
    task = s.next_task()
    s.task_started(*task)
    s.task_abandoned(*task)
    assert s.next_task() == task


def test_capacity_below_one_batch_per_rank_is_refused():
    with pytest.raises(ValueError):
        Scheduler(ranks=4, capacity=3)
    with pytest.raises(ValueError):
        Scheduler(ranks=2, capacity=6, retain=3)


def test_retained_batches_stay_behind_the_position_within_the_share():
    s = Scheduler(ranks=1, capacity=5, retain=2)
    assert s.window == 3
    assert drain(s) == [(0, 0), (0, 1), (0, 2)]
    assert s.move_position(0, 1) == []  # batch 0 is retained
    assert s.move_position(0, 3) == [0]  # 1 and 2 are the two retained
    assert drain(s) == [(0, 3), (0, 4), (0, 5)]
    assert s.ranks[0].ready == {1, 2, 3, 4, 5} and s.held == 5
    assert s.move_position(0, 2) == [5]  # a restart two steps back: 2 is ready, 5 now too far
    assert s.ranks[0].ready == {1, 2, 3, 4} and s.next_task() is None  # nothing behind is remade


def test_a_parked_rank_gets_nothing_until_it_reports_again():
    s = Scheduler(ranks=2, capacity=4)
    drain(s)
    assert s.park(0) == [0, 1]
    assert drain(s) == []  # rank 1's window is full, rank 0 is parked
    s.move_position(1, 1)
    assert drain(s) == [(1, 2)]
    s.move_position(0, 0)  # its trainer is back
    assert drain(s) == [(0, 0), (0, 1)]


def test_a_gap_before_ready_batches_in_a_full_buffer_takes_the_farthest_slot():
    """The deadlock a daemon kill -9 found: the restarted daemon adopted batches 41.. (40 was
    being written when its predecessor died), the trainer still maps 39 and waits for 40."""
    s = Scheduler(ranks=1, capacity=6)
    for index in (41, 42, 43, 44, 45):
        assert s.adopt(0, index)
    s.start_at_adopted()
    s.reserved = 1  # batch 39, retired but mapped
    assert s.move_position(0, 40) == []  # 41..45 lie in the window [40, 46)
    assert s.next_task() is None  # full: without make_room, 40 would never be made
    assert s.make_room() == (0, 45)
    assert s.next_task() == (0, 40)
    assert s.make_room() is None  # no longer full


def test_make_room_only_gives_a_slot_to_a_batch_nearer_than_the_one_it_takes():
    s = Scheduler(ranks=2, capacity=4)
    drain(s)  # each rank holds 0 and 1
    s.move_position(0, 1)  # rank 0 consumed 0 and misses 2, at distance 1
    s.reserved = 1
    # The farthest ready batch (rank 1's batch 1) is at distance 1 too: nothing gives way.
    assert s.next_task() is None and s.make_room() is None
    s.ranks[1].ready.discard(0)  # now rank 1 misses its next batch, at distance 0
    s.reserved = 2
    assert s.make_room() == (1, 1)
    assert s.next_task() == (1, 0)


# -- several consumers of one job (one trainer each) --------------------------------------------


def test_two_consumers_share_each_batch_and_free_it_when_both_passed():
    s = Scheduler(ranks=1, capacity=8)
    s.move_position(0, 0, "a")
    s.move_position(0, 0, "b")
    assert drain(s) == [(0, i) for i in range(8)]  # made once, not once per consumer
    assert s.move_position(0, 3, "a") == []  # b still reads 0..2
    assert drain(s) == []  # the window is anchored at b, the rearmost that keeps up
    assert s.move_position(0, 2, "b") == [0, 1]
    assert drain(s) == [(0, 8), (0, 9)]
    assert s.ranks[0].consumed == {"a": 3, "b": 2} and s.ranks[0].consumed_total == 5


def test_a_consumer_far_behind_is_served_on_demand_and_holds_nobody_back():
    s = Scheduler(ranks=1, capacity=8)
    assert s.lag_limit == 6
    s.move_position(0, 0, "a")
    s.move_position(0, 0, "b")
    drain(s)
    # b, 7 behind, lags: it keeps its next two batches, a its window; the rest goes
    assert s.move_position(0, 7, "a") == [2, 3, 4, 5, 6]
    assert s.ranks[0].lagging == {"b"}
    assert s.ranks[0].keeps == ((7, 15), (0, 2))
    assert s.move_position(0, 1, "b") == [0]
    assert sorted(drain(s)) == [(0, 2)] + [(0, i) for i in range(8, 13)]  # b's next, a's window: 8 in all
    assert s.held == 8 and s.next_task() is None


def test_a_lagging_consumer_keeps_up_again_only_well_within_the_limit():
    s = Scheduler(ranks=1, capacity=8)  # lag limit 6, back within 3
    s.move_position(0, 10, "a")
    s.move_position(0, 3, "b")
    assert s.ranks[0].lagging == {"b"}
    s.move_position(0, 5, "b")  # 5 behind: within the limit, not yet within half of it
    assert s.ranks[0].lagging == {"b"}
    s.move_position(0, 7, "b")
    assert s.ranks[0].lagging == set() and s.ranks[0].keeps == ((7, 15),)


def test_a_full_buffer_makes_room_for_a_lagging_consumers_next_batch():
    s = Scheduler(ranks=1, capacity=4)
    s.move_position(0, 10, "a")
    drain(s)  # a's window 10..13 fills the buffer
    s.move_position(0, 0, "b")  # a newcomer reading from the start
    assert s.next_task() is None
    assert s.make_room() == (0, 13)  # a's farthest batch gives way
    assert s.next_task() == (0, 0)


def test_a_consumer_that_leaves_frees_only_what_nobody_else_keeps():
    s = Scheduler(ranks=1, capacity=6)
    s.move_position(0, 0, "a")
    s.move_position(0, 2, "b")
    drain(s)
    assert s.park(0, "a") == [0, 1]  # b is past them
    assert s.ranks[0].positions == {"b": 2}
    assert drain(s) == [(0, 6), (0, 7)]
    assert s.park(0, "b") == [2, 3, 4, 5, 6, 7] and s.ranks[0].parked
    assert drain(s) == []


def test_the_first_report_reads_on_from_the_guess_whatever_its_consumer():
    s = Scheduler(ranks=1, capacity=4)
    for index in (5, 6, 7):
        s.adopt(0, index)
    s.start_at_adopted()
    assert s.ranks[0].positions == {"": 5}
    s.move_position(0, 6, "a")
    assert s.ranks[0].positions == {"a": 6} and s.ranks[0].consumed == {"a": 1}


@given(
    st.lists(
        st.tuples(st.sampled_from(["move", "make", "finish", "park", "pin"]), st.integers(0, 1),
                  st.sampled_from(["", "a", "b"]), st.integers(-3, 12)),
        max_size=80,
    )
)
@settings(max_examples=300, deadline=None)
def test_any_mix_of_consumers_keeps_the_bound_and_only_what_someone_keeps(ops):
    s = Scheduler(ranks=2, capacity=10, retain=1)
    in_flight = []
    for op, rank, consumer, n in ops:
        state = s.ranks[rank]
        if op == "move":
            s.move_position(rank, max(0, state.positions.get(consumer, 0) + n), consumer)
        elif op == "make":
            for _ in range(n % 4):
                task = s.next_task() or s.make_room() and s.next_task()
                if task:
                    s.task_started(*task)
                    in_flight.append(task)
        elif op == "finish" and in_flight:
            s.task_finished(*in_flight.pop(n % len(in_flight)))
        elif op == "park":
            s.park(rank, consumer)
        else:
            s.reserved = n % 3
        assert s.held <= s.capacity  # in flight and ready; reserved slots only stop new tasks
        for st_ in s.ranks.values():
            assert all(any(a <= i < b for a, b in st_.keeps) for i in st_.ready)
            if st_.positions:
                lead = max(st_.positions.values())
                assert all(lead - st_.positions[c] > s.lag_limit // 2 for c in st_.lagging)


def test_lagging_consumers_that_hold_every_slot_give_way_to_one_that_keeps_up():
    """An attack's case: paused consumers far behind (or names with no trainer) took the buffer
    before the leader came; the leader's next batch must still be made."""
    s = Scheduler(ranks=1, capacity=8, retain=2)  # window 6: lag limit 4, at most 3 for the lagging
    for name, pos in (("c1", 2), ("c2", 4), ("c3", 6), ("c4", 8)):
        s.move_position(0, pos, name)
    drain(s)
    s.move_position(0, 30, "a")  # the leader, from a later checkpoint: c1..c4 all lag now
    assert s.ranks[0].lagging == {"c1", "c2", "c3", "c4"}
    for _ in range(20):  # the leader reads on; whatever the lagging hold, its next batch comes
        index = s.ranks[0].positions["a"]
        while index not in s.ranks[0].ready:
            task = s.next_task() or (s.make_room() and s.next_task())
            assert task is not None, (s.ranks[0], s.held)
            s.task_started(*task)
            s.task_finished(*task)
        s.move_position(0, index + 1, "a")
        assert len(s._held_for_lagging(s.ranks[0])) <= s.lag_slots
    drain(s)
    assert len([i for i in s.ranks[0].ready if i >= 50]) >= 3  # the leader has a runway, not one batch


def test_a_lagging_consumer_takes_only_the_second_half_of_a_leaders_window():
    s = Scheduler(ranks=1, capacity=8)  # window 8
    s.move_position(0, 20, "lead")
    drain(s)  # 20..27
    s.move_position(0, 0, "late")
    assert s.make_room() == (0, 27)  # from the second half: the leader keeps 20..23 at least
    assert s.next_task() == (0, 0)
    s.task_started(0, 0)
    s.task_finished(0, 0)
    for _ in range(4):
        s.make_room()
    assert min(i for i in s.ranks[0].ready if i >= 20) == 20 and s.ranks[0].ready >= {20, 21, 22, 23}


def test_lagging_consumers_past_their_slots_wait_instead_of_churning_the_leaders_window():
    """An attack's case: 15 names far behind with no trainer; making room for them in turn
    deleted and remade the leader's batches forever (1,130 batches made in a pause)."""
    s = Scheduler(ranks=1, capacity=8, retain=2)
    s.move_position(0, 40, "lead")
    for i in range(15):
        s.move_position(0, i, f"fake{i}")
    made = 0
    for _ in range(200):  # the master's turns, nobody reading
        task = s.next_task() or (s.make_room() and s.next_task())
        if task is None:
            break
        s.task_started(*task)
        s.task_finished(*task)
        made += 1
    assert made <= 8, made  # the buffer filled once, then nothing more
    assert len(s._held_for_lagging(s.ranks[0])) <= s.lag_slots


def serve_next(s: Scheduler, rank: int, consumer: str, tries: int = 10) -> None:
    """Make batches as the master would until ``consumer``'s next one is ready; fail if it never is."""
    index = s.ranks[rank].positions[consumer]
    for _ in range(tries):
        if index in s.ranks[rank].ready:
            return
        task = s.next_task() or (s.make_room() and s.next_task())
        assert task is not None, f"{consumer}'s batch {index} is never made: {s.ranks[rank]}"
        s.task_started(*task)
        s.task_finished(*task)
    raise AssertionError(f"{consumer}'s batch {index} not made within {tries} tasks: {s.ranks[rank]}")


def test_a_lagging_consumer_that_reads_takes_the_slots_of_one_that_stopped():
    """A second attack's case: P lagged and stopped with its two batches made; L, lagging too,
    read one batch every 0.2 s and never got one (the lagging slots were P's for good)."""
    s = Scheduler(ranks=1, capacity=6, retain=2)  # window 4: two lagging slots
    s.move_position(0, 20, "a")
    drain(s)
    s.move_position(0, 3, "p")  # lags; reads no more
    drain(s)
    assert s.ranks[0].ready >= {3, 4}
    s.move_position(0, 0, "l")
    for step in range(10):
        serve_next(s, 0, "l")
        s.move_position(0, step + 1, "l")
    assert 20 in s.ranks[0].ready  # the leader's next batch stayed


def test_with_a_window_of_one_a_lagging_consumer_is_served_from_the_retained_slots():
    s = Scheduler(ranks=1, capacity=3, retain=2)  # window 1
    s.move_position(0, 18, "a")
    drain(s)
    s.move_position(0, 19, "a")
    drain(s)
    s.move_position(0, 20, "a")
    drain(s)  # 18 and 19 retained, 20 ahead: full
    s.move_position(0, 0, "l")
    for step in range(5):
        serve_next(s, 0, "l")
        s.move_position(0, step + 1, "l")
    assert 20 in s.ranks[0].ready


@pytest.mark.parametrize(("consumers", "capacity", "retain"), [(5, 4, 2), (8, 8, 2), (3, 3, 2), (12, 10, 2)])
def test_every_consumer_that_reads_is_served_however_many_lag(consumers, capacity, retain):
    """Consumers at random places, reading whenever their batch is ready (now and then seeking),
    repeating their position while they wait, as a loader does: none waits for good. Found by a
    second attack: lagging consumers that read kept the lagging slots from the ones that waited."""
    for seed in range(8):
        rng = random.Random(seed)
        s = Scheduler(ranks=1, capacity=capacity, retain=retain)
        pos = {f"c{i}": rng.randrange(0, 60) for i in range(consumers)}
        for name, index in pos.items():
            s.move_position(0, index, name)
        waiting_since: dict[str, int] = {}
        in_flight: list[tuple[int, int]] = []
        for turn in range(600):
            for _ in range(2):  # two workers
                task = s.next_task() or (s.make_room() and s.next_task())
                if task:
                    s.task_started(*task)
                    in_flight.append(task)
            if in_flight and rng.random() < 0.7:
                s.task_finished(*in_flight.pop(0))
            for name in pos:
                if rng.random() < 0.3:
                    continue  # busy with its step
                if pos[name] in s.ranks[0].ready:
                    pos[name] += 1 if rng.random() > 0.02 else rng.randrange(-30, 30)
                    pos[name] = max(0, pos[name])
                    waiting_since.pop(name, None)
                    s.move_position(0, pos[name], name)
                    continue
                since = waiting_since.setdefault(name, turn)
                assert turn - since < 300, f"seed {seed}: {name} waits at {pos[name]}: {s.ranks[0]}"
                if (turn - since) % 10 == 5:
                    s.move_position(0, pos[name], name)  # a waiting loader repeats its position
            assert s.held <= s.capacity
