"""The dispatcher's radix sort (``readers.dispatch._kernels.radix_order``) against NumPy: the
sorted keys, a stable order, and ``distinct`` on arrays long enough to take the radix path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch import _kernels as K
from readers.dispatch.keys import RowIndex, distinct
from readers.dispatch.shadow import CacheShadow


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), max_size=80), st.integers(0, 3))
def test_radix_order_is_a_stable_sort(values, copies):
    keys = np.array(values * (copies + 1), dtype=np.int64)  # repeated keys test stability
    ordered, order = K.radix_order(keys, True)
    assert ordered.tolist() == np.sort(keys).tolist()
    assert order.tolist() == np.argsort(keys, kind="stable").tolist()
    assert K.radix_order(keys, False)[1].size == 0


@pytest.mark.parametrize("high", [1, 2**11, 2**40, 2**62])
def test_distinct_takes_the_radix_path_on_long_arrays(high):
    rng = np.random.default_rng(high)
    keys = (
        (rng.integers(0, 64, 5000) << 40) | rng.integers(0, high, 5000)
        if high < 2**40
        else (rng.integers(0, high, 5000))
    )
    assert distinct(keys).tolist() == np.unique(keys).tolist()
    negative = keys - 7  # some below zero: NumPy's sort
    assert distinct(negative).tolist() == np.unique(negative).tolist()


def test_the_recency_order_is_table_then_id_on_many_rows():
    rng = np.random.default_rng(0)
    index = RowIndex(["a", "b", "c"])
    for t in (2, 0, 1):
        index.rows(t, rng.permutation(3000))
    shadow = CacheShadow(world_size=1, capacity=10, index=index)
    rows = rng.permutation(index.num_rows)[:4000]
    got = shadow._in_key_order(rows)
    tables, ids = index.keys(got)
    assert np.array_equal(got, rows[np.lexsort((index.id_of_row[rows], index.table_of_row[rows]))])
    assert np.all(np.diff(tables * 10**6 + ids) > 0)
