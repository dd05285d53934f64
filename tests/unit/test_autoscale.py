"""--workers auto's decisions (prefetchd.master.autoscale), with the clock passed in."""

from __future__ import annotations

import pytest

from prefetchd.master.autoscale import GROW_EVERY_S, SHRINK_WINDOW_S, AutoWorkers


def turns(policy: AutoWorkers, start: float, seconds: float, **seen) -> float:
    """Feed the policy a turn every 50 ms (the master's tick) for ``seconds``; the time after."""
    now = start
    while now < start + seconds:
        policy.decide(now, **seen)
        now += 0.05
    return now


def test_it_starts_at_the_most_so_a_job_alone_is_served_as_with_a_fixed_count():
    assert AutoWorkers(1, 7, now=0.0).target == 7


def test_a_trainer_slower_than_production_leaves_workers_idle_and_they_go_by_halves_down_to_the_fewest():
    policy = AutoWorkers(1, 8, now=0.0)
    now = turns(policy, 0.0, SHRINK_WINDOW_S + 0.1, workers=8, busy=1, starving=False, more_work=False)
    assert policy.target == 5  # 7 idle throughout: half of them (3) go
    assert policy.last_change == "7 worker(s) stayed idle for 5 s"
    now = turns(policy, now, SHRINK_WINDOW_S + 0.1, workers=5, busy=1, starving=False, more_work=False)
    assert policy.target == 3
    for _ in range(4):
        now = turns(policy, now, SHRINK_WINDOW_S + 0.1, workers=policy.target, busy=0, starving=False, more_work=False)
    assert policy.target == 1  # never below the fewest
    assert policy.changes == 4


def test_one_turn_with_every_worker_busy_keeps_the_count():
    policy = AutoWorkers(1, 4, now=0.0)
    now = turns(policy, 0.0, SHRINK_WINDOW_S - 1, workers=4, busy=2, starving=False, more_work=False)
    policy.decide(now, workers=4, busy=4, starving=False, more_work=False)  # all needed together, once
    turns(policy, now + 0.05, 1.5, workers=4, busy=2, starving=False, more_work=False)
    assert policy.target == 4


def test_a_turn_that_grows_restarts_the_window():
    policy = AutoWorkers(1, 4, now=0.0)
    policy.target = 3
    now = turns(policy, 0.0, SHRINK_WINDOW_S - 1, workers=3, busy=1, starving=False, more_work=False)
    policy.decide(now, workers=3, busy=3, starving=True, more_work=True)
    assert policy.target == 4
    now = turns(policy, now + 0.05, SHRINK_WINDOW_S - 1, workers=4, busy=1, starving=False, more_work=False)
    assert policy.target == 4
    turns(policy, now, 1.1, workers=4, busy=1, starving=False, more_work=False)
    assert policy.target == 3


def test_workers_idle_while_a_trainer_waits_go_too():
    """The node's budget lets 2 work: a waiting trainer keeps no third idle for ever."""
    policy = AutoWorkers(1, 4, now=0.0)
    turns(policy, 0.0, SHRINK_WINDOW_S + 0.1, workers=4, busy=2, starving=True, more_work=True)
    assert policy.target == 3


def test_it_grows_by_one_a_step_while_a_trainer_waits_on_busy_workers_up_to_the_most():
    policy = AutoWorkers(1, 4, now=0.0)
    turns(policy, 0.0, 4 * SHRINK_WINDOW_S, workers=4, busy=0, starving=False, more_work=False)
    assert policy.target == 1
    now = 100.0
    policy.decide(now, workers=1, busy=1, starving=True, more_work=True)
    assert policy.target == 2 and "a trainer waits" in policy.last_change
    policy.decide(now + GROW_EVERY_S / 2, workers=2, busy=2, starving=True, more_work=True)
    assert policy.target == 2  # one step at a time: the new worker boots first
    turns(policy, now + GROW_EVERY_S, 10 * GROW_EVERY_S, workers=2, busy=2, starving=True, more_work=True)
    assert policy.target == 4


@pytest.mark.parametrize(
    "seen",
    [
        {"workers": 2, "busy": 1, "starving": True, "more_work": True},  # a worker is free: it gets the batch
        {"workers": 2, "busy": 2, "starving": True, "more_work": False},  # the window is full: nothing to start
    ],
)
def test_it_does_not_grow_when_another_worker_would_not_help(seen):
    policy = AutoWorkers(1, 4, now=0.0)
    policy.target = 2
    turns(policy, 0.0, 5.0, **seen)
    assert policy.target == 2


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        AutoWorkers(3, 2, now=0.0)
    with pytest.raises(ValueError):
        AutoWorkers(0, 2, now=0.0)
