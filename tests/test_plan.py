"""The plan is a pure function: disjoint, equal per rank, deterministic."""

import numpy as np
import pytest
from hypothesis import given
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
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), Plan(1000, 4, 8, seed=8).permutation(0))
    r1, r2 = a.sample_rng(3, 17), b.sample_rng(3, 17)
    assert r1.random() == r2.random()
    assert a.sample_rng(3, 17).random() != a.sample_rng(4, 17).random()


def test_global_step_is_rank_slices_of_one_window():
    """Global step k is samples [k*W*B, (k+1)*W*B) of the permutation: the basis of elastic resume."""
    plan = Plan(100, 2, 5, seed=3)
    perm = plan.permutation(0)
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
