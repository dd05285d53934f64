"""The plan is a pure function: disjoint, equal per rank, deterministic."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd.plan import Plan


def all_ids(plan: Plan, epoch: int, rank: int) -> np.ndarray:
    return np.concatenate([plan.sample_ids(epoch, k, rank) for k in range(plan.batches_per_epoch)])


@given(n=st.integers(1, 500), world=st.integers(1, 8), batch=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_ranks_are_disjoint_and_equal(n, world, batch, seed):
    plan = Plan(n, world, batch, seed, drop_last=True)
    if plan.batches_per_epoch == 0:
        assert n < world * batch
        return
    per_rank = [all_ids(plan, 3, r) for r in range(world)]
    assert {len(ids) for ids in per_rank} == {plan.batches_per_epoch * batch}
    merged = np.concatenate(per_rank)
    assert len(set(merged.tolist())) == len(merged), "a sample went to two ranks or twice to one"
    assert merged.min() >= 0 and merged.max() < n


@given(n=st.integers(1, 300), world=st.integers(1, 6), batch=st.integers(1, 12))
def test_no_drop_last_covers_every_sample_with_full_equal_batches(n, world, batch):
    plan = Plan(n, world, batch, seed=1, drop_last=False)
    per_rank = [all_ids(plan, 0, r) for r in range(world)]
    assert {len(ids) for ids in per_rank} == {plan.batches_per_epoch * batch}
    assert set(np.concatenate(per_rank).tolist()) == set(range(n))


def test_deterministic_and_epochs_differ():
    a, b = Plan(1000, 4, 8, seed=7), Plan(1000, 4, 8, seed=7)
    assert np.array_equal(a.sample_ids(2, 5, 1), b.sample_ids(2, 5, 1))
    assert not np.array_equal(a.epoch_order(0)[0], a.epoch_order(1)[0])
    assert not np.array_equal(a.epoch_order(0)[0], Plan(1000, 4, 8, seed=8).epoch_order(0)[0])
    r1, r2 = a.sample_rng(3, 17), b.sample_rng(3, 17)
    assert r1.random() == r2.random()
    assert a.sample_rng(3, 17).random() != a.sample_rng(4, 17).random()


def test_global_step_is_rank_slices_of_one_window():
    """Global step k is samples [k*W*B, (k+1)*W*B) of the permutation: the basis of elastic resume."""
    plan = Plan(100, 2, 5, seed=3)
    perm = plan.epoch_order(0)[0]
    for k in range(plan.batches_per_epoch):
        both = np.concatenate([plan.sample_ids(0, k, r) for r in range(2)])
        assert np.array_equal(both, perm[k * 10 : (k + 1) * 10])


def test_linear_index_crosses_epochs():
    plan = Plan(100, 1, 10)
    assert plan.linear(2, 3) == 23
    assert plan.unlinear(23) == (2, 3)
    assert plan.unlinear(plan.linear(1, 10)) == (2, 0)  # "end of epoch 1" is the start of epoch 2


def test_out_of_plan_batches_are_refused():
    plan = Plan(10, 2, 2)
    with pytest.raises(IndexError):
        plan.sample_ids(0, plan.batches_per_epoch, 0)
    with pytest.raises(IndexError):
        plan.sample_ids(0, 0, 2)


def mixed(sizes, weights, mix, world=1, batch=10, seed=0):
    return Plan(sum(sizes), world, batch, seed, True, tuple(sizes), tuple(weights), mix)


def test_cycle_gives_every_sample_of_the_largest_source_and_cycles_the_others():
    plan = mixed([1000, 100, 20], [0.7, 0.25, 0.05], "cycle")
    counts = plan.source_counts()
    assert counts[0] == 1000 and counts.sum() == plan.epoch_length
    np.testing.assert_allclose(counts / counts.sum(), [0.7, 0.25, 0.05], atol=1e-3)
    ids, passes = plan.epoch_order(0)
    source = plan.source_of(ids)
    assert sorted(ids[source == 0].tolist()) == list(range(1000))
    # The small source cycles: every sample about equally often, each pass a new shuffle.
    small = ids[source == 2] - 1100
    assert np.bincount(small, minlength=20).min() >= counts[2] // 20
    assert passes[source == 2].max() == -(-counts[2] // 20) - 1


def test_first_exhausted_repeats_nothing_and_all_once_ignores_weights():
    plan = mixed([1000, 100], [0.5, 0.5], "first_exhausted")
    ids, _ = plan.epoch_order(1)
    assert len(ids) == 200 and len(set(ids.tolist())) == 200
    assert plan.source_counts().tolist() == [100, 100]
    once = mixed([30, 10], [0.9, 0.1], "all_once")
    assert sorted(once.epoch_order(0)[0].tolist()) == list(range(40))


def test_mixed_batches_are_stratified_deterministic_and_disjoint_per_epoch():
    plan = mixed([500, 300, 200], [2, 1, 1], "cycle", world=2, batch=8)
    shares = []
    for step in range(plan.batches_per_epoch):
        both = np.concatenate([plan.sample_ids(0, step, r) for r in range(2)])
        shares.append(np.bincount(plan.source_of(both), minlength=3) / 16)
    np.testing.assert_allclose(np.mean(shares, axis=0), [0.5, 0.25, 0.25], atol=0.01)
    assert np.abs(np.array(shares) - [0.5, 0.25, 0.25]).max() <= 2 / 16  # every global batch is close
    again = mixed([500, 300, 200], [2, 1, 1], "cycle", world=2, batch=8)
    assert np.array_equal(plan.epoch_order(3)[0], again.epoch_order(3)[0])
    assert not np.array_equal(plan.epoch_order(3)[0], plan.epoch_order(4)[0])


def test_a_repeated_sample_is_augmented_afresh():
    plan = mixed([100, 5], [0.5, 0.5], "cycle")
    assert plan.sample_rng(0, 101, 0).random() != plan.sample_rng(0, 101, 1).random()
    assert plan.sample_rng(0, 7).random() == Plan(105, 1, 10).sample_rng(0, 7).random()  # pass 0: plain key


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 400), world=st.integers(1, 3), batch=st.integers(1, 8), seed=st.integers(0, 99))
def test_uses_place_each_sample_where_the_next_epoch_reads_it(n, world, batch, seed):
    """What a cache evicts by: a sample's position now, and its position in the next epoch."""
    plan = Plan(n, world, batch, seed, drop_last=False)
    this, following = plan.epoch_order(2)[0], plan.epoch_order(3)[0]
    for step in range(plan.batches_per_epoch):
        for rank in range(world):
            now, later = plan.uses(2, step, rank)
            ids = plan.sample_ids(2, step, rank)
            assert np.array_equal(this[now - 2 * n], ids)
            assert np.array_equal(following[later - 3 * n], ids) and (later >= 3 * n).all()


def test_uses_of_mixed_and_evaluation_plans_are_the_next_epochs_same_position():
    for plan in (mixed([50, 20], [0.5, 0.5], "cycle"), Plan(70, 1, 10, evaluation=True, drop_last=False)):
        now, later = plan.uses(1, 2, 0)
        assert now.tolist() == list(range(plan.epoch_length + 20, plan.epoch_length + 30))
        assert (later == now + plan.epoch_length).all()
