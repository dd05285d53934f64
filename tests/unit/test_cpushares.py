"""How a node's CPU budget is divided (prefetchd.master.cpushares): pure, every daemon alike."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd.master.cpushares import LOW_RUNWAY_S, Claim, divide


def test_jobs_about_to_wait_share_with_those_that_wait_before_windows_are_filled():
    claims = [Claim("filling", 8, 30.0), Claim("soon", 2, 1.5), Claim("waits", 8, 0.0)]
    assert divide(claims, 4) == {"waits": 2, "soon": 2, "filling": 0}


def test_starving_jobs_are_served_first_and_the_rest_gets_what_is_left():
    claims = [Claim("fast", 8, 0.0), Claim("slow-a", 8, 9.0), Claim("slow-b", 8, 9.0)]
    assert divide(claims, 10) == {"fast": 8, "slow-a": 1, "slow-b": 1}


def test_when_all_wait_shares_are_equal_or_by_weight():
    even = [Claim(k, 10, 0.0) for k in "abc"]
    assert divide(even, 9) == {"a": 3, "b": 3, "c": 3}
    weighted = [Claim("a", 10, 0.0, 2.0), Claim("b", 10, 0.0), Claim("c", 10, 0.0)]
    assert divide(weighted, 8) == {"a": 4, "b": 2, "c": 2}


def test_what_a_job_does_not_want_goes_to_the_others():
    claims = [Claim("a", 1, 0.0), Claim("b", 10, 0.0), Claim("c", 0, 0.0)]
    assert divide(claims, 6) == {"a": 1, "b": 5, "c": 0}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 40), st.sampled_from([0.0, 0.5, 1.99, 2.0, 60.0, 1e6]), st.sampled_from([0.5, 1.0, 2.0, 3.0])
        ),
        min_size=0,
        max_size=8,
    ),
    st.integers(0, 64),
)
def test_never_more_than_the_budget_nor_than_asked_and_the_same_in_any_order(raw, cpus):
    claims = [Claim(f"job{i}", d, s, w) for i, (d, s, w) in enumerate(raw)]
    shares = divide(claims, cpus)
    assert sum(shares.values()) == min(cpus, sum(c.demand for c in claims))  # nothing idle that is wanted
    assert all(0 <= shares[c.key] <= c.demand for c in claims)
    shuffled = claims[:]
    random.Random(len(raw)).shuffle(shuffled)
    assert divide(shuffled, cpus) == shares  # every daemon computes the same division
    if any(shares[c.key] < c.demand for c in claims if c.runway_s < LOW_RUNWAY_S):  # one that waits, short:
        assert all(shares[c.key] == 0 for c in claims if c.runway_s >= LOW_RUNWAY_S)  # nothing went to filling


def test_more_starving_jobs_than_cpus_take_turns_by_the_cpu_time_they_had():
    first = divide([Claim("a", 1, 0.0), Claim("b", 1, 0.0)], 1)
    assert first == {"a": 1, "b": 0}  # equal so far: by key
    assert divide([Claim("a", 1, 0.0, used=3.0), Claim("b", 1, 0.0, used=1.0)], 1) == {"a": 0, "b": 1}
    heavy = [Claim("a", 1, 0.0, weight=4.0, used=3.0), Claim("b", 1, 0.0, used=1.0)]
    assert divide(heavy, 1) == {"a": 1, "b": 0}  # 3/4 of a weighted second is less than 1


def test_a_huge_budget_and_demands_divide_quickly():
    import time

    claims = [Claim(f"j{i}", 4096, float(i % 3)) for i in range(2000)]
    began = time.perf_counter()
    shares = divide(claims, 4096)
    assert sum(shares.values()) == 4096 and time.perf_counter() - began < 2.0
