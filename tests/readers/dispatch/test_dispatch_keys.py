"""Rows of a batch: the id index, and each piece's distinct (table, id) rows against the
expanded batch read row by row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from readers.dispatch.keys import RowIndex, TableMap, piece_rows
from recpipe.errors import DataError
from tests.common.data import session_batch


@settings(max_examples=100, deadline=None)
@example([(0, [2**61])])  # fits no (table, id) key: found by CI
@example([(2, [2**61 - 1])])
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(-(2**62), 2**62), max_size=40)),
        max_size=30,
    )
)
def test_row_index_numbers_pairs_in_order_of_first_appearance(inserts):
    index = RowIndex(["a", "b", "c"])
    seen: dict[tuple[int, int], int] = {}
    for table, ids in inserts:
        for x in ids:
            seen.setdefault((table, x), len(seen))
        got = index.rows(table, np.array(ids, dtype=np.int64))
        assert got.tolist() == [seen[(table, x)] for x in ids]
    assert index.num_rows == len(seen)
    for (table, x), row in seen.items():
        assert index.lookup(table, np.array([x])).tolist() == [row]
        assert (index.table_of_row[row], index.id_of_row[row]) == (table, x)
    assert index.lookup(0, np.array([2**63 - 1])).tolist() == [-1]
    key = index.order_key  # None once an id is outside [0, 2**61) (3 tables: 2 bits)
    assert (key is None) == any(not 0 <= x < 2**61 for _, ids in inserts for x in ids)
    if key is not None:  # ordered as (table, id)
        want = np.lexsort((index.id_of_row, index.table_of_row))
        assert np.argsort(key, kind="stable").tolist() == want.tolist()


def test_row_index_grows_past_its_merge_threshold():
    index = RowIndex(["t"])
    rng = np.random.default_rng(0)
    ids = rng.permutation(50_000)
    for chunk in np.array_split(ids, 200):
        index.rows(0, chunk)
    assert index.rows(0, ids).tolist() == list(range(50_000))


@pytest.mark.parametrize("piece_size", [1, 3, 6])
def test_piece_rows_equal_the_rows_of_the_expanded_batch(tiny_schema, piece_size):
    batch = session_batch(tiny_schema, 24, seed=piece_size, vocab=30)
    tables = TableMap.from_tables(
        {
            "users": ["user_items", "user_sellers"],
            "segment": ["user_segment"],
            "items": ["item_id", "item_tags"],
        }
    )
    index = RowIndex(tables.tables)
    piece_of_row = np.arange(24) // piece_size
    piece_of_row[5] = -1  # left out
    got = piece_rows(batch, tables=tables, index=index, piece_of_row=piece_of_row)
    plain = batch.to_plain().kjt
    want: set[tuple[int, int, int]] = set()
    for feature, t in tables.features.items():
        jt = plain[feature]
        for r, ids in enumerate(jt.to_dense_list()):
            if piece_of_row[r] >= 0:
                want |= {(int(piece_of_row[r]), t, int(x)) for x in ids}
    keys = index.keys(got.row)
    assert {(int(p), int(t), int(x)) for p, t, x in zip(got.piece, *keys, strict=True)} == want
    assert got.piece.size == len(want)  # each row once per piece
    assert (np.diff(got.piece) >= 0).all()
    assert got.num_pieces == 24 // piece_size


def test_features_no_table_reads_cost_nothing_and_missing_ones_are_refused(tiny_schema):
    batch = session_batch(tiny_schema, 8, seed=1)
    index = RowIndex(["items"])
    got = piece_rows(
        batch,
        tables=TableMap(("items",), {"item_id": 0}),
        index=index,
        piece_of_row=np.zeros(8, np.int64),
    )
    assert set(index.table_of_row[got.row].tolist()) == {0}
    assert got.row.size == np.unique(batch.kjt["item_id"].values().numpy()).size
    with pytest.raises(DataError, match="no feature"):
        piece_rows(
            batch,
            tables=TableMap(("x",), {"nope": 0}),
            index=index,
            piece_of_row=np.zeros(8, np.int64),
        )


def test_table_map_errors():
    with pytest.raises(DataError, match="read by tables"):
        TableMap.from_tables({"a": ["f"], "b": ["f"]})
    with pytest.raises(DataError, match="`tables`"):
        TableMap(("a", "a"), {})
    with pytest.raises(DataError, match="do not exist"):
        TableMap(("a",), {"f": 1})
