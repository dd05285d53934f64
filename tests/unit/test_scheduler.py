"""Scheduling decisions, without processes: urgency, the bound, deletion, pausing, seeking."""

import pytest

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
    assert s.ranks[0].consumed == 2


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
