"""The id index, deterministic init and the hot-set cost model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recpipe.errors import StoreError
from trainer.store import (
    CostCoefficients,
    IdIndex,
    choose_hot_rows,
    init_rows,
    measure_costs,
    rho_curve,
)

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(int64s, max_size=80), max_size=6), shards=st.sampled_from([1, 2, 16])
)
def test_index_matches_a_dict(batches, shards):
    index = IdIndex(num_shards=shards, initial_capacity=2)  # tiny: forces many shard growths
    model: dict[int, int] = {}
    for batch in batches:
        ids = np.array(batch, dtype=np.int64)
        rows, first_new = index.insert(ids)
        assert first_new == len(model)
        for i in batch:
            model.setdefault(i, len(model))  # dense rows in order of first appearance
        assert rows.tolist() == [model[i] for i in batch]
    everything = np.array(list(model), dtype=np.int64)
    assert index.lookup(everything).tolist() == list(range(len(model)))
    assert index.num_rows == len(model)


def test_index_extremes_and_absent_ids():
    index = IdIndex(num_shards=4)
    ids = np.array([-(2**63), 2**63 - 1, 0, -1], dtype=np.int64)
    rows, _ = index.insert(ids)
    assert rows.tolist() == [0, 1, 2, 3]
    assert index.lookup(np.array([1, -(2**63) + 1, 2**63 - 2])).tolist() == [-1, -1, -1]


def test_index_large_batch_and_rebuild():
    ids = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64)
    ids = np.unique(ids)
    index = IdIndex(num_shards=16, initial_capacity=2)
    rows, _ = index.insert(ids)
    np.testing.assert_array_equal(rows, np.arange(ids.size))
    rebuilt = IdIndex.from_ids(ids, num_shards=4)
    np.testing.assert_array_equal(rebuilt.lookup(ids[::-1]), rows[::-1])


def test_index_rebuild_refuses_duplicates():
    with pytest.raises(StoreError, match="duplicate"):
        IdIndex.from_ids(np.array([3, 4, 3]))


@pytest.mark.parametrize("bad", [0, 3, 12])
def test_index_validates_shards(bad):
    with pytest.raises(StoreError, match="`num_shards`"):
        IdIndex(num_shards=bad)


def test_init_rows_depend_only_on_seed_and_id():
    ids = np.array([5, -(2**63), 2**63 - 1, 0], dtype=np.int64)
    a = init_rows(ids, 16, seed=3, scale=0.1)
    b = init_rows(ids[::-1], 16, seed=3, scale=0.1)[::-1]
    assert a.tobytes() == b.tobytes()
    assert np.abs(a).max() <= 0.1 and a.std() > 0.02
    assert not np.array_equal(a, init_rows(ids, 16, seed=4, scale=0.1))
    assert len({row.tobytes() for row in a}) == len(ids)


def test_rho_curve():
    curve = rho_curve(np.array([1, 5, 0, 4]))
    np.testing.assert_allclose(curve, [0, 0.5, 0.9, 1.0, 1.0])


@settings(max_examples=50, deadline=None)
@given(
    counts=st.lists(st.integers(0, 1000), min_size=1, max_size=60),
    c_ar=st.floats(1e-9, 1e-6),
    c_a2a=st.floats(1e-9, 1e-6),
    budget=st.integers(0, 80),
)
def test_ternary_search_finds_the_minimum(counts, c_ar, c_a2a, budget):
    counts = np.array(counts)
    n = 500.0
    plan = choose_hot_rows(
        counts, accesses_per_batch=n, max_rows=budget, coefficients=CostCoefficients(c_ar, c_a2a)
    )
    curve = rho_curve(counts)
    hi = min(budget, int(np.count_nonzero(counts)))
    costs = [r * c_ar + n * (1 - curve[r]) * c_a2a for r in range(hi + 1)]
    assert plan.num_hot <= hi
    assert plan.cost == pytest.approx(min(costs), rel=1e-9)


def test_measured_costs_are_positive():
    coeffs = measure_costs(8, probe_rows=256, repeats=2)
    assert coeffs.c_ar > 0 and coeffs.c_a2a > 0
    assert "measured" in coeffs.source


def test_bad_coefficients_are_refused():
    with pytest.raises(StoreError, match="c_ar"):
        CostCoefficients(0.0, 1.0)


@pytest.mark.parametrize("later", [10, 5_000])  # without and with growth after the view
def test_saved_index_drops_entries_made_after_the_view(later):
    from trainer.store.index import saved_bytes

    rng = np.random.default_rng(later)
    first = np.unique(rng.integers(-(2**63), 2**63 - 1, 3_000, dtype=np.int64))
    index = IdIndex(num_shards=4, initial_capacity=2)
    index.insert(first)
    view = index.frozen_view()
    second = rng.integers(-(2**63), 2**63 - 1, later, dtype=np.int64)
    index.insert(second)
    data, info = saved_bytes(view)
    loaded = IdIndex.from_bytes(data, info)
    np.testing.assert_array_equal(loaded.lookup(first), np.arange(first.size))
    assert (loaded.lookup(second[~np.isin(second, first)]) == -1).all()
    rows, _ = loaded.insert(second)  # continues exactly like the original
    np.testing.assert_array_equal(rows, index.lookup(second))
    with pytest.raises(StoreError, match="corrupted"):
        IdIndex.from_bytes(data[:-8], info)


def _splitmix64_finaliser(x: int) -> int:
    """The finaliser written out in plain Python integers (the reference)."""
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@settings(max_examples=50, deadline=None)
@given(st.lists(int64s, min_size=1, max_size=64))
def test_the_index_hash_is_splitmix64(ids):
    """The id index places rows by this hash: stores written before the shared kernel open
    after it only if it is the same function."""
    from trainer.store import _kernels

    got = _kernels.hash_ids(np.array(ids, dtype=np.int64)).tolist()
    assert got == [_splitmix64_finaliser(i & ((1 << 64) - 1)) for i in ids]
