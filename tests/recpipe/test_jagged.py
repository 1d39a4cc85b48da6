"""JaggedTensor and KeyedJaggedTensor: constructors, layout, per-key views, selects, errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recpipe.errors import DataError, RecpipeError
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor
from tests.common.tensors import kjt_from_rows

ROWS = [[7, 3], [], [5], [9, 9, 1]]


# -- JaggedTensor -------------------------------------------------------------------------------


def test_jagged_layout_matches_docstring():
    jt = JaggedTensor.from_lengths(torch.tensor([7, 3, 5, 9, 9, 1]), torch.tensor([2, 0, 1, 3]))
    assert jt.offsets().tolist() == [0, 2, 2, 3, 6]
    assert jt.offsets().dtype == torch.int64
    assert jt.batch_size == 4 and jt.num_values == 6
    assert [r.tolist() for r in jt.to_dense_list()] == ROWS


def test_jagged_constructors_agree():
    a = JaggedTensor.from_dense_list([torch.tensor(r, dtype=torch.int64) for r in ROWS])
    b = JaggedTensor.from_offsets(torch.tensor([7, 3, 5, 9, 9, 1]), torch.tensor([0, 2, 2, 3, 6]))
    assert a.equals(b)
    assert a.lengths().tolist() == [2, 0, 1, 3]
    assert not a.equals(JaggedTensor.from_offsets(b.values().to(torch.int32), b.offsets()))


def test_jagged_empty_and_2d():
    empty = JaggedTensor.from_dense_list([], dtype=torch.float32)
    assert empty.batch_size == 0 and empty.dtype == torch.float32 and empty.to_dense_list() == []
    vals = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    jt = JaggedTensor.from_lengths(vals, torch.tensor([2, 0, 1, 3]))
    out = jt.index_select(torch.tensor([3, 1, 0]))
    assert out.offsets().tolist() == [0, 3, 3, 5]
    assert torch.equal(out.values(), torch.cat([vals[3:6], vals[0:2]]))


def test_jagged_index_select_is_differentiable():
    vals = torch.ones(6, 3, requires_grad=True)
    jt = JaggedTensor.from_lengths(vals, torch.tensor([2, 0, 1, 3]))
    jt.index_select(torch.tensor([0, 0, 2])).values().sum().backward()
    assert vals.grad[:, 0].tolist() == [2, 2, 1, 0, 0, 0]


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 2, 6], "must start at 0"),
        ([0, 4, 2, 6], "non-decreasing"),
        ([0, 2, 5], "must end at the number of values"),
        ([], "at least one"),
    ],
)
def test_jagged_bad_offsets(offsets, match):
    with pytest.raises(DataError, match=match):
        JaggedTensor.from_offsets(torch.arange(6), torch.tensor(offsets, dtype=torch.int64))


def test_jagged_bad_lengths_and_indices():
    with pytest.raises(DataError, match="non-negative"):
        JaggedTensor.from_lengths(torch.arange(2), torch.tensor([3, -1]))
    with pytest.raises(DataError, match="sum to 3"):
        JaggedTensor.from_lengths(torch.arange(2), torch.tensor([1, 2]))
    with pytest.raises(DataError, match=r"`offsets` must hold integers"):
        JaggedTensor.from_offsets(torch.arange(2), torch.tensor([0.0, 2.0]))
    jt = JaggedTensor.from_lengths(torch.arange(3), torch.tensor([1, 2]))
    with pytest.raises(RecpipeError, match=r"`indices` must lie in \[0, 2\), got 2"):
        jt.index_select(torch.tensor([0, 2]))


def test_jagged_to_and_pin_memory():
    jt = JaggedTensor.from_lengths(torch.arange(3), torch.tensor([1, 2]))
    assert jt.to("cpu") is jt
    meta = jt.to("meta")
    assert meta.device.type == "meta" and meta.offsets().device.type == "meta"
    assert jt.pin_memory().equals(jt)


# -- KeyedJaggedTensor ---------------------------------------------------------------------------


def test_kjt_layout_matches_docstring():
    kjt = kjt_from_rows({"user_items": [[7, 3], [], [5]], "item_id": [[9], [9], [1, 4]]})
    assert kjt.keys() == ["user_items", "item_id"]
    assert kjt.stride() == kjt.batch_size == 3
    assert kjt.values().tolist() == [7, 3, 5, 9, 9, 1, 4]
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 2]
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 5, 7]
    assert kjt.offset_per_key() == [0, 3, 7] and kjt.length_per_key() == [3, 4]
    item = kjt["item_id"]
    assert item.offsets().tolist() == [0, 1, 2, 4]
    assert [r.tolist() for r in item.to_dense_list()] == [[9], [9], [1, 4]]
    assert "item_id" in kjt and "nope" not in kjt


def test_kjt_constructors_agree():
    kjt = kjt_from_rows({"a": [[1], [2, 3]], "b": [[], [4]]})
    by_offsets = KeyedJaggedTensor.from_offsets(["a", "b"], kjt.values(), kjt.offsets())
    by_dict = KeyedJaggedTensor.from_jagged_dict(kjt.to_dict())
    assert kjt.equals(by_offsets) and kjt.equals(by_dict)
    assert KeyedJaggedTensor.from_lengths(["a", "b"], kjt.values(), kjt.lengths()).equals(kjt)


def test_kjt_from_arrays_shares_numpy_memory_for_one_key():
    values = np.arange(10, dtype=np.int64)
    offsets = np.array([2, 5, 5, 9])  # a sliced Arrow column: offsets do not start at 0
    kjt = KeyedJaggedTensor.from_arrays(["x"], [values], [offsets])
    assert kjt.values().tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert kjt.lengths().tolist() == [3, 0, 4]
    values[3] = 33
    assert kjt.values()[1].item() == 33  # same memory


def test_kjt_from_arrow_slices_nulls_and_chunks():
    col = pa.array([[1, 2], None, [3], [4, 5, 6]], type=pa.list_(pa.int64())).slice(1)
    big = pa.chunked_array([pa.array([[1], [2]], type=pa.large_list(pa.int32()))] * 1)
    kjt = KeyedJaggedTensor.from_arrow({"x": col, "y": pa.array([[7], [], [8, 9]])})
    assert kjt.lengths().tolist() == [0, 1, 3, 1, 0, 2]
    assert kjt.values().tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert KeyedJaggedTensor.from_arrow({"y": big}).dtype == torch.int32
    with pytest.raises(DataError, match="null ids"):
        KeyedJaggedTensor.from_arrow({"x": pa.array([[1, None]])})
    with pytest.raises(DataError, match="must be a list column"):
        KeyedJaggedTensor.from_arrow({"x": pa.array([1, 2])})


def test_kjt_select_split_concat():
    kjt = kjt_from_rows({"a": [[1], [2, 3]], "b": [[], [4]], "c": [[5], [6]]})
    ab, c = kjt.split([["a", "b"], ["c"]])
    assert ab.values().data_ptr() == kjt.values().data_ptr()  # adjacent keys: a view
    assert ab.equals(kjt_from_rows({"a": [[1], [2, 3]], "b": [[], [4]]}))
    assert KeyedJaggedTensor.concat([ab, c]).equals(kjt)
    ca = kjt.select(["c", "a"])
    assert ca.equals(kjt_from_rows({"c": [[5], [6]], "a": [[1], [2, 3]]}))
    with pytest.raises(DataError, match="unique"):
        KeyedJaggedTensor.concat([ab, ab])
    with pytest.raises(DataError, match="share one stride"):
        KeyedJaggedTensor.concat([ab, kjt_from_rows({"z": [[1]]})])
    with pytest.raises(DataError, match="unknown key 'nope'"):
        kjt["nope"]


def test_kjt_map_values_and_map_jagged():
    kjt = kjt_from_rows({"a": [[1, 2, 3], [4]], "b": [[5], []]})
    hashed = kjt.map_values(lambda v: v % 2)
    assert hashed.values().tolist() == [1, 0, 1, 0, 1] and hashed.lengths().equal(kjt.lengths())

    def first_only(jt: JaggedTensor) -> JaggedTensor:
        keep = torch.minimum(jt.lengths(), torch.ones_like(jt.lengths()))
        idx = jt.offsets()[:-1][keep.bool()]
        return JaggedTensor.from_lengths(jt.values()[idx], keep)

    cut = kjt.map_jagged(first_only, keys=["a"])
    assert cut.equals(kjt_from_rows({"a": [[1], [4]], "b": [[5], []]}))
    with pytest.raises(DataError, match="must return a tensor of 5 values"):
        kjt.map_values(lambda v: v[:2])
    with pytest.raises(DataError, match="JaggedTensor of 2 rows"):
        kjt.map_jagged(lambda jt: jt.index_select(torch.tensor([0])))


def test_kjt_errors_name_the_argument():
    with pytest.raises(DataError, match="`keys` must be unique"):
        KeyedJaggedTensor(["a", "a"], torch.arange(2), torch.tensor([1, 1]))
    with pytest.raises(DataError, match="not a multiple of the 2 keys"):
        KeyedJaggedTensor(["a", "b"], torch.arange(3), torch.tensor([1, 1, 1]))
    with pytest.raises(DataError, match="`stride` is 3"):
        KeyedJaggedTensor(["a"], torch.arange(2), torch.tensor([1, 1]), stride=3)
    with pytest.raises(DataError, match="`lengths` sum to 2"):
        KeyedJaggedTensor(["a"], torch.arange(3), torch.tensor([1, 1]))
    with pytest.raises(DataError, match="`lengths` or `offsets`"):
        KeyedJaggedTensor(["a"], torch.arange(3))
    with pytest.raises(DataError, match="one entry per key"):
        KeyedJaggedTensor.from_arrays(["a", "b"], [np.arange(2)], [np.array([0, 2])])


def test_kjt_empty_batch_and_no_keys():
    empty = kjt_from_rows({"a": [], "b": []})
    assert empty.stride() == 0 and empty.offset_per_key() == [0, 0, 0]
    assert empty["b"].batch_size == 0
    assert empty.index_select(torch.empty(0, dtype=torch.int64)).equals(empty)
    none = KeyedJaggedTensor.from_jagged_dict({}, stride=4)
    assert none.keys() == [] and none.stride() == 4
    assert KeyedJaggedTensor.concat([none, kjt_from_rows({"a": [[1]] * 4})]).stride() == 4


def test_kjt_to_and_pin_memory_keep_layout():
    kjt = kjt_from_rows({"a": [[1], [2, 3]], "b": [[], [4]]})
    meta = kjt.to("meta", non_blocking=True)
    assert meta.values().device.type == "meta" and meta.lengths().device.type == "meta"
    assert meta.keys() == kjt.keys() and meta.stride() == 2
    assert kjt.to(torch.device("cpu")) is kjt
    assert kjt.pin_memory().equals(kjt)


rows_strategy = st.lists(st.lists(st.integers(-5, 5), max_size=5), max_size=10)


@settings(max_examples=40, deadline=None)
@given(
    a=rows_strategy,
    data=st.data(),
    dtype=st.sampled_from([np.int32, np.int64]),
)
def test_kjt_index_select_matches_python(a, data, dtype):
    b = data.draw(
        st.lists(st.lists(st.integers(-5, 5), max_size=3), min_size=len(a), max_size=len(a))
    )
    rows = data.draw(st.lists(st.integers(0, max(len(a) - 1, 0)), max_size=12 if a else 0))
    kjt = kjt_from_rows({"a": a, "b": b}, dtype=dtype)
    want = kjt_from_rows({"a": [a[r] for r in rows], "b": [b[r] for r in rows]}, dtype=dtype)
    got = kjt.index_select(torch.tensor(rows, dtype=torch.int64))
    assert got.equals(want)
    assert [x.tolist() for x in got["b"].to_dense_list()] == [b[r] for r in rows]


def test_a_moved_kjt_splits_by_key_without_reading_the_device():
    """A copy carries the keys' offsets counted where they cost no sync, so a batch moved to a
    GPU is split by key without reading a size back; the ``meta`` device, which holds no data,
    stands in for one (reading it would raise)."""
    kjt = kjt_from_rows({"a": [[1, 2], [], [3]], "b": [[4], [5, 6, 7], []]})
    assert kjt.to("meta").offset_per_key() == [0, 3, 7]
    moved = kjt.to("meta")["b"]
    assert moved.values().device.type == "meta" and moved.values().shape == (4,)
    assert kjt.pin_memory().offset_per_key() == [0, 3, 7]
    empty = KeyedJaggedTensor(
        [], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    assert empty.to("meta").offset_per_key() == [0]
