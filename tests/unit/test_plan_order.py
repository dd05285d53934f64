"""Order 2: each batch computed from its positions, in memory that grows with the batch, not the epoch.

The permutation is a keyed Feistel network with cycle walking (a bijection of [0, n) for every n);
a mixed order computed run by run equals the one of the old rule (all draws keyed, concatenated
and lexsorted) built here whole; nothing a batch computes has the epoch's length.
"""

import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetchd import plan as plan_module
from prefetchd.plan import ORDER, Plan, permutation

_INTERLEAVE = 0x494C5645


# --- the permutation -------------------------------------------------------------------------


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32), epoch=st.integers(0, 1000))
def test_permutation_is_a_bijection_of_every_n(n, seed, epoch):
    p = permutation(np.arange(n), n, seed, epoch)
    assert p.dtype == np.int64
    assert np.array_equal(np.sort(p), np.arange(n))


@pytest.mark.parametrize("n", [2**20 + 7, 4**10, 4**10 - 1, 3 * 10**6])
def test_permutation_is_a_bijection_for_large_n(n):
    assert np.array_equal(np.sort(permutation(np.arange(n), n, 11, 2)), np.arange(n))


def test_permutation_of_one_and_of_huge_n():
    assert permutation([0], 1, 5, 0).tolist() == [0]
    n = 2**40
    positions = np.concatenate([np.arange(1000), n - 1 - np.arange(1000)])
    p = permutation(positions, n, 5, 0)
    assert p.min() >= 0 and p.max() < n and len(set(p.tolist())) == len(p)
    assert np.array_equal(p[:10], permutation(np.arange(10), n, 5, 0))  # a value does not depend on its company


def test_positions_outside_the_permutation_are_refused():
    for bad in ([-1], [10], [0, 3, 10]):
        with pytest.raises(ValueError, match=r"\[0, 10\)"):
            permutation(bad, 10, 0, 0)
    assert permutation([], 10, 0, 0).tolist() == []


def test_permutation_is_deterministic_and_keyed():
    n = 1000
    base = permutation(np.arange(n), n, 7, 3)
    assert np.array_equal(base, permutation(np.arange(n), n, 7, 3))
    others = [
        permutation(np.arange(n), n, 8, 3),
        permutation(np.arange(n), n, 7, 4),
        permutation(np.arange(n), n, 7, 3, 0, 0),
        permutation(np.arange(n), n, 7, 3, 0, 1),
        permutation(np.arange(n), n, 7, 3, 1, 0),
    ]
    for i, other in enumerate(others):
        assert (other != base).mean() > 0.9, i
        for later in others[i + 1 :]:
            assert (other != later).mean() > 0.9


@pytest.mark.parametrize("seed", range(5))
def test_permutation_shuffles(seed):
    n = 10_000
    p = permutation(np.arange(n), n, seed, 1)
    assert abs(np.corrcoef(np.arange(n), p)[0, 1]) < 0.05  # a random permutation: sd 0.01
    assert abs(np.corrcoef(p[:-1], p[1:])[0, 1]) < 0.05  # neighbours are unrelated
    deciles = np.bincount(p[:100] * 10 // n, minlength=10)  # the first 100 land all over
    assert ((deciles - 10) ** 2 / 10).sum() < 30, deciles  # chi-square, 9 df: p < 0.0005
    assert deciles.min() >= 2


@pytest.mark.parametrize("n", [3, 5, 10, 40])
def test_small_permutations_are_uniform_across_keys(n):
    """Where positions 0 and 1 go, over 10000 seeds: every pair about as often. A network of 6 rounds
    fails this at n = 5 (chi-square ~110 on 19 df), which is why the smallest have 8."""
    trials = 10_000
    firsts = np.array([permutation([0, 1], n, seed, 0) for seed in range(trials)])
    cells = np.bincount(firsts[:, 0] * n + firsts[:, 1], minlength=n * n).reshape(n, n)
    pairs = cells[~np.eye(n, dtype=bool)]
    e, df = trials / (n * (n - 1)), n * (n - 1) - 1
    assert ((pairs - e) ** 2 / e).sum() < df + 6 * (2 * df) ** 0.5 + 5  # 6 sd above the mean


@pytest.mark.parametrize("n", [10**6, 10**8 + 3, 50])
def test_the_python_tail_of_a_walk_is_the_numpy_walk(n, monkeypatch):
    positions = np.arange(0, min(n, 10**6), max(1, min(n, 10**6) // 5000))
    monkeypatch.setattr(plan_module, "_TAIL", 0)
    numpy_only = permutation(positions, n, 3, 1)
    monkeypatch.setattr(plan_module, "_TAIL", 10**9)
    python_after_one_pass = permutation(positions, n, 3, 1)
    assert np.array_equal(numpy_only, python_after_one_pass)


# --- the mixed order against the old rule, built whole ----------------------------------------


def reference_order(plan: Plan, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's (ids, passes) the old way: every draw listed, keyed, concatenated and lexsorted,
    the permutation of each (source, pass) being order 2's."""
    if plan.evaluation:
        return np.arange(plan.num_samples), np.zeros(plan.num_samples, np.int64)
    if not plan.mixing:
        n = plan.num_samples
        return permutation(np.arange(n), n, plan.seed, epoch), np.zeros(n, np.int64)
    sizes, counts = plan.source_sizes, plan.source_counts()
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ids, passes, keys, tags = [], [], [], []
    for s, (size, count) in enumerate(zip(sizes, counts)):
        if count == 0:
            continue
        n_passes = -(-count // size)
        perms = [permutation(np.arange(size), size, plan.seed, epoch, s, p) for p in range(n_passes)]
        ids.append(np.concatenate(perms)[:count] + offsets[s])
        passes.append(np.arange(count) // size)
        u = np.random.default_rng([plan.seed, _INTERLEAVE, epoch, s]).random()
        keys.append((np.arange(count) + u) / count)
        tags.append(np.full(count, s))
    order = np.lexsort((np.concatenate(tags), np.concatenate(keys)))
    return np.concatenate(ids)[order], np.concatenate(passes)[order]


def check_every_batch(plan: Plan, epochs=(0, 1)) -> None:
    length = plan.epoch_length
    for epoch in epochs:
        ids, passes = reference_order(plan, epoch)
        whole, whole_passes = plan.epoch_order(epoch)
        assert np.array_equal(whole, ids)
        if plan.mixing:
            assert np.array_equal(whole_passes, passes)
        for step in range(plan.batches_per_epoch):
            for rank in range(plan.world_size):
                at = plan._positions(step, rank) % length
                got, got_passes = plan.batch_samples(epoch, step, rank)
                assert np.array_equal(got, ids[at]), (epoch, step, rank)
                assert np.array_equal(got_passes, passes[at]), (epoch, step, rank)


sources = st.lists(st.integers(1, 200), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=sources,
    data=st.data(),
    mix=st.sampled_from(["cycle", "first_exhausted", "all_once"]),
    world=st.integers(1, 4),
    batch=st.integers(1, 16),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_mixed_batches_equal_the_lexsorted_order(sizes, data, mix, world, batch, drop_last, seed):
    weights = data.draw(st.lists(st.integers(1, 4), min_size=len(sizes), max_size=len(sizes)))
    plan = Plan(sum(sizes), world, batch, seed, drop_last, tuple(sizes), tuple(map(float, weights)), mix)
    check_every_batch(plan)


def test_mixed_order_with_sources_on_both_sides_of_eight_rounds():
    """Sources of <= 64 samples have 8-round networks, larger ones 6: one batch walks both."""
    plan = Plan(5 + 64 + 65 + 300, 2, 16, 9, False, (5, 64, 65, 300), (1.0, 2.0, 1.0, 3.0), "cycle")
    check_every_batch(plan, epochs=(0, 5))


def test_batches_longer_than_the_epoch_wrap_around_it_again():
    for plan in (
        Plan(3, 2, 8, 1, False),
        Plan(5, 1, 16, 2, False, (2, 3), (1.0, 1.0), "cycle"),
        Plan(4, 3, 7, 0, False, (4,), evaluation=True),
    ):
        check_every_batch(plan)
        assert plan.batch_valid(plan.batches_per_epoch - 1, plan.world_size - 1).sum() < plan.batch_size


def test_a_draw_count_off_the_estimate_is_counted_exactly_all_the_same(monkeypatch):
    plan = Plan(300, 1, 7, 4, True, (100, 50, 150), (1.0, 3.0, 2.0), "cycle")
    expected = reference_order(plan, 2)
    slow, bisections = plan_module._below_slow, []
    monkeypatch.setattr(plan_module, "_below_slow", lambda *a: bisections.append(a) or slow(*a))
    for off in (-9, 9):
        monkeypatch.setattr(plan_module, "_estimate", lambda cuts, f, u, off=off: np.floor(cuts[:, None] * f - u) + off)
        assert np.array_equal(plan.epoch_order(2)[0], expected[0])
        for step in range(0, plan.batches_per_epoch, 5):
            at = plan._positions(step, 0)
            assert np.array_equal(plan.sample_ids(2, step, 0), expected[0][at])
    assert len(bisections) > 20  # the counts did come from the bisection


# --- large epochs -----------------------------------------------------------------------------


def draw_at(plan: Plan, epoch: int, position: int) -> tuple[int, int]:
    """The (id, pass) at a position of a mixed epoch, found by bisection on the keys alone (Python
    floats are float64): nothing of the epoch's length, and nothing shared with the plan's code."""
    counts = [int(c) for c in plan.source_counts()]
    us = [float(np.random.default_rng([plan.seed, _INTERLEAVE, epoch, s]).random()) for s in range(len(counts))]

    def key(s, k):
        return (k + us[s]) / counts[s]

    def below(s, x, inclusive):  # draws of s with key < x (<= x when inclusive)
        lo, hi = 0, counts[s]
        while lo < hi:
            mid = (lo + hi) // 2
            if key(s, mid) < x or (inclusive and key(s, mid) == x):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def rank(s, k):
        x = key(s, k)
        return sum(below(t, x, t < s) for t in range(len(counts)) if t != s) + k

    for s in range(len(counts)):
        lo, hi = 0, counts[s]  # the first k of s with rank >= position
        while lo < hi:
            mid = (lo + hi) // 2
            if rank(s, mid) < position:
                lo = mid + 1
            else:
                hi = mid
        if lo < counts[s] and rank(s, lo) == position:
            size = plan.source_sizes[s]
            pass_, local = divmod(lo, size)
            offset = sum(plan.source_sizes[:s])
            return offset + int(permutation([local], size, plan.seed, epoch, s, pass_)[0]), pass_
    raise AssertionError(f"no draw at position {position}")


def test_sources_of_a_hundred_million_samples():
    sizes = (10**8, 3 * 10**8, 2 * 10**8)
    plan = Plan(sum(sizes), 8, 256, 17, False, sizes, (1.0, 1.0, 2.0), "cycle")
    assert plan.epoch_length == 12 * 10**8  # the second source sets it: each of its samples once
    step = plan.batches_per_epoch // 2
    plan.batch_samples(4, 0, 0)  # the first call builds the per-epoch keys
    start = time.perf_counter()
    ids, passes = plan.batch_samples(4, step, 5)
    assert time.perf_counter() - start < 0.1  # ~1 ms; a whole epoch would take minutes
    assert len(ids) == 256 and len(set(ids.tolist())) == 256
    assert ids.min() >= 0 and ids.max() < plan.num_samples
    source = plan.source_of(ids)
    assert np.bincount(source, minlength=3).tolist() == pytest.approx([64, 64, 128], abs=4)
    assert passes.tolist() == [0 if s == 1 else 1 for s in source]  # mid-epoch: the second pass of sources 0 and 2
    first = plan._positions(step, 5)[0]
    for i in (0, 1, 2, 100, 254, 255):
        assert (int(ids[i]), int(passes[i])) == draw_at(plan, 4, int(first) + i), i
    # The last step wraps around to the start of the epoch.
    last = plan.batches_per_epoch - 1
    ids, _ = plan.batch_samples(4, last, 7)
    valid = plan.batch_valid(last, 7)
    at = plan._positions(last, 7) % plan.epoch_length
    for i in (0, int(valid.sum()) - 1, int(valid.sum()), 255):
        if 0 <= i < 256:
            assert int(ids[i]) == draw_at(plan, 4, int(at[i]))[0], i


@pytest.mark.parametrize(
    "plan",
    [
        Plan(10**9, 8, 256, 3),
        Plan(10**9, 8, 256, 3, False),
        Plan(10**9, 8, 256, 3, True, (4 * 10**8, 5 * 10**8, 10**8), (1.0, 1.0, 1.0), "cycle"),
        Plan(10**9, 8, 256, 3, False, (4 * 10**8, 6 * 10**8), (1.0, 3.0), "first_exhausted"),
        Plan(10**9, 8, 256, 3, False, (10**9,), evaluation=True),
    ],
    ids=["plain", "padded", "cycle", "first_exhausted", "evaluation"],
)
def test_a_batch_of_a_billion_sample_epoch_takes_memory_of_a_batch(plan, monkeypatch):
    plan.batch_samples(1, 0, 0)  # the caches: keys, offsets
    monkeypatch.setattr(Plan, "epoch_order", lambda *a: pytest.fail("a batch listed the whole epoch"))
    tracemalloc.start()
    try:
        for step in (0, plan.batches_per_epoch // 2, plan.batches_per_epoch - 1):
            ids, _ = plan.batch_samples(1, step, 3)
            plan.batch_valid(step, 3)
            plan.sample_ids(1, step, 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert len(ids) == 256 and ids.max() < plan.num_samples


# --- the order's version ------------------------------------------------------------------------


def test_a_plan_records_its_order_and_refuses_another():
    assert ORDER == 2
    plan = Plan(100, 2, 5, seed=3)
    assert plan.to_json()["order"] == ORDER
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"plan order 1\b.*this prefetchd computes order 2"):
        Plan(100, 2, 5, seed=3, order=1)
    with pytest.raises(ValueError, match=r"plan order 3\b.*computed another way"):
        Plan.from_json(plan.to_json() | {"order": 3})
