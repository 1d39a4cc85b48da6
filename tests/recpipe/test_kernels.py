"""The CPU kernels (through the public dispatchers) against the NumPy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recpipe.errors import DataError
from recpipe.kernels import (
    as_numpy,
    dedup_rows,
    get_kernel,
    jagged_index_add,
    jagged_index_select,
    partial_dedup,
    segment_reduce,
)
from tests.recpipe.kernel_reference import (
    ref_dedup_rows,
    ref_jagged_index_add,
    ref_jagged_index_select,
    ref_partial_dedup,
    ref_segment_reduce,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ID_DTYPES = [torch.int32, torch.int64]
EXTREME_IDS = [0, 1, -1, 2**31 - 1, -(2**31)]


def jagged(
    lists: list[list[int]], dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets) tensors from Python lists."""
    lengths = [len(x) for x in lists]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    values = torch.tensor([v for x in lists for v in x], dtype=dtype)
    return values, offsets


@st.composite
def id_lists(draw, *, max_rows: int = 12) -> list[list[int]]:
    """Rows drawn from a small pool of lists (so duplicates and shifts are common)."""
    num_rows = draw(st.integers(0, max_rows))
    ids = st.one_of(st.integers(0, 3), st.sampled_from(EXTREME_IDS))
    pool = draw(st.lists(st.lists(ids, max_size=6), min_size=1, max_size=4))
    long = draw(st.booleans())
    if long:  # a very long list, and its one-step shift
        base = draw(st.lists(st.integers(0, 3), min_size=300, max_size=300))
        pool += [base, [*base[1:], 7], [*base, 7]]
    picks = draw(st.lists(st.integers(0, len(pool) - 1), min_size=num_rows, max_size=num_rows))
    return [list(pool[p]) for p in picks]


@st.composite
def groups(draw) -> tuple[list[list[list[int]]], list[torch.dtype]]:
    """1 to 3 keys over the same rows, each with its own dtype."""
    num_keys = draw(st.integers(1, 3))
    first = draw(id_lists())
    keys = [first]
    for _ in range(num_keys - 1):  # other keys change out of step with the first
        pool = draw(st.lists(st.lists(st.integers(0, 2), max_size=3), min_size=1, max_size=3))
        picks = draw(
            st.lists(st.integers(0, len(pool) - 1), min_size=len(first), max_size=len(first))
        )
        keys.append([pool[p] for p in picks])
    dtypes = draw(st.lists(st.sampled_from(ID_DTYPES), min_size=num_keys, max_size=num_keys))
    return keys, dtypes


# --------------------------------------------------------------------------------------------
# dedup_rows


def check_dedup(
    keys: list[list[list[int]]], dtypes: list[torch.dtype], hash_mask: int = -1
) -> None:
    tensors = [jagged(lists, dtype) for lists, dtype in zip(keys, dtypes)]
    values = [v for v, _ in tensors]
    offsets = [o for _, o in tensors]
    unique, inverse = dedup_rows(values, offsets, hash_mask=hash_mask)
    ref_unique, ref_inverse = ref_dedup_rows(
        [v.numpy() for v in values], [o.numpy() for o in offsets]
    )
    assert unique.dtype == torch.int64 and inverse.dtype == torch.int64
    np.testing.assert_array_equal(unique.numpy(), ref_unique)
    np.testing.assert_array_equal(inverse.numpy(), ref_inverse)


@SETTINGS
@given(groups(), st.sampled_from([-1, 0, 1]))
def test_dedup_rows_matches_reference(group, hash_mask):
    keys, dtypes = group
    check_dedup(keys, dtypes, hash_mask)


@pytest.mark.parametrize("hash_mask", [-1, 0])
def test_dedup_rows_edges(hash_mask):
    check_dedup([[]], [torch.int64], hash_mask)  # empty batch
    check_dedup([[[]]], [torch.int32], hash_mask)  # one empty row
    check_dedup([[[3, 4]] * 9], [torch.int64], hash_mask)  # all duplicates
    check_dedup([[[i, i + 1] for i in range(40)]], [torch.int32], hash_mask)  # none
    long = list(range(20_000))
    check_dedup([[long, long, [*long[:-1], -5], long]], [torch.int64], hash_mask)


def test_dedup_rows_forced_collisions_never_merge():
    """Every row hashes to 0, and rows differ only on their second key or by one late id."""
    keys = [[[1, 2], [1, 2], [1, 2], [1, 3], [1, 2]], [[9], [8], [9], [9], [9]]]
    unique, inverse = dedup_rows(
        [jagged(k)[0] for k in keys], [jagged(k)[1] for k in keys], hash_mask=0
    )
    assert unique.tolist() == [0, 1, 3]
    assert inverse.tolist() == [0, 1, 0, 2, 0]


def test_dedup_rows_same_values_different_split():
    """[1, 2] + [] and [1] + [2] hold the same ids but are different rows."""
    unique, inverse = dedup_rows([torch.tensor([1, 2, 1, 2])], [torch.tensor([0, 2, 2, 3, 4])])
    assert inverse.tolist() == [0, 1, 2, 3]
    assert unique.tolist() == [0, 1, 2, 3]


def test_dedup_rows_rejects_bad_groups():
    v, o = jagged([[1], [2]])
    with pytest.raises(DataError, match="one tensor per key"):
        dedup_rows([], [])
    with pytest.raises(DataError, match=r"`offsets\[1\]` describes 1 rows"):
        dedup_rows([v, v[:1]], [o, torch.tensor([0, 1])])
    with pytest.raises(DataError, match=r"`values\[0\]` must be a 1-d int32 or int64"):
        dedup_rows([v.float()], [o])
    with pytest.raises(DataError, match=r"`offsets\[0\]` must run from 0 to len"):
        dedup_rows([v], [torch.tensor([0, 1, 3])])
    with pytest.raises(DataError, match=r"`offsets\[0\]` must be a 1-d int64"):
        dedup_rows([v], [o.int()])


# --------------------------------------------------------------------------------------------
# partial_dedup


@SETTINGS
@given(id_lists(max_rows=16), st.sampled_from(ID_DTYPES))
def test_partial_dedup_matches_reference(lists, dtype):
    values, offsets = jagged(lists, dtype)
    packed, win_offsets, win_lengths = partial_dedup(values, offsets)
    ref = ref_partial_dedup(values.numpy(), offsets.numpy())
    assert packed.dtype == dtype
    for got, want in zip((packed, win_offsets, win_lengths), ref):
        np.testing.assert_array_equal(got.numpy(), want)
    assert packed.shape[0] <= values.shape[0]
    for r, row in enumerate(lists):  # every row reads back exactly
        start, n = int(win_offsets[r]), int(win_lengths[r])
        assert packed[start : start + n].tolist() == row


def test_partial_dedup_shift_chain():
    lists = [[1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5], [], [7], [7, 8]]
    packed, win_offsets, win_lengths = partial_dedup(*jagged(lists))
    assert packed.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert win_offsets.tolist() == [0, 0, 1, 1, 5, 5, 5]
    assert win_lengths.tolist() == [3, 4, 4, 4, 0, 1, 2]


# --------------------------------------------------------------------------------------------
# jagged_index_select / jagged_index_add

VALUE_DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.bfloat16,
]


@st.composite
def select_cases(draw):
    lengths = draw(st.lists(st.integers(0, 5), max_size=10))
    if draw(st.booleans()) and lengths:
        lengths[draw(st.integers(0, len(lengths) - 1))] = 400  # a very long row
    width = draw(st.sampled_from([None, 1, 3]))
    dtype = draw(st.sampled_from(VALUE_DTYPES))
    num_rows = len(lengths)
    indices = draw(st.lists(st.integers(0, num_rows - 1), max_size=12)) if num_rows else []
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    total = int(offsets[-1])
    shape = (total,) if width is None else (total, width)
    values = (torch.arange(total * (width or 1), dtype=torch.float64).reshape(shape) * 0.5 - 7).to(
        dtype
    )
    return values, offsets, torch.tensor(indices, dtype=torch.int64)


def as_ref(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@SETTINGS
@given(select_cases())
def test_jagged_index_select_matches_reference(case):
    values, offsets, indices = case
    out, out_offsets = jagged_index_select(values, offsets, indices)
    ref_out, ref_offsets = ref_jagged_index_select(as_ref(values), offsets.numpy(), indices.numpy())
    assert out.dtype == values.dtype and out.shape[1:] == values.shape[1:]
    np.testing.assert_array_equal(as_ref(out), ref_out)
    np.testing.assert_array_equal(out_offsets.numpy(), ref_offsets)


@SETTINGS
@given(select_cases())
def test_jagged_index_add_matches_reference(case):
    values, offsets, indices = case
    if not values.dtype.is_floating_point:
        values = values.float()
    out, out_offsets = jagged_index_select(values, offsets, indices)
    grad = torch.ones_like(out) * 0.25 + out
    got = jagged_index_add(grad, out_offsets, offsets, indices, values.shape[0])
    want = ref_jagged_index_add(
        as_ref(grad), out_offsets.numpy(), offsets.numpy(), indices.numpy(), values.shape[0]
    )
    assert got.dtype == grad.dtype and got.shape == values.shape
    tol = 1e-2 if values.dtype in (torch.float16, torch.bfloat16) else 1e-6
    np.testing.assert_allclose(as_ref(got), want, rtol=tol, atol=tol)


@SETTINGS
@given(select_cases(), st.sampled_from(["offsets", "total", "both"]))
def test_jagged_index_select_with_the_known_layout_matches_reference(case, known):
    """A caller that knows the output's offsets or size passes them: same result, and the
    gradient still reaches the source rows."""
    values, offsets, indices = case
    ref_out, ref_offsets = ref_jagged_index_select(as_ref(values), offsets.numpy(), indices.numpy())
    layout = {
        "out_offsets": torch.from_numpy(ref_offsets) if known != "total" else None,
        "num_out_values": int(ref_offsets[-1]) if known != "offsets" else None,
    }
    out, out_offsets = jagged_index_select(values, offsets, indices, **layout)
    np.testing.assert_array_equal(as_ref(out), ref_out)
    np.testing.assert_array_equal(out_offsets.numpy(), ref_offsets)
    if values.dtype == torch.float64:
        leaf = values.clone().requires_grad_(True)
        out, _ = jagged_index_select(leaf, offsets, indices, **layout)
        out.sum().backward()
        want = ref_jagged_index_add(
            np.ones(ref_out.shape), ref_offsets, offsets.numpy(), indices.numpy(), len(values)
        )
        np.testing.assert_array_equal(leaf.grad.numpy(), want)


def test_jagged_index_select_refuses_a_known_layout_that_is_wrong():
    values, offsets = jagged([[1, 2], [3]])
    indices = torch.tensor([1, 0])  # out_offsets [0, 1, 3]
    with pytest.raises(DataError, match=r"`num_out_values` = 4 but the selected rows hold 3"):
        jagged_index_select(values, offsets, indices, num_out_values=4)
    with pytest.raises(DataError, match=r"`out_offsets`\[1\] = 2 but the selected rows put 1"):
        jagged_index_select(values, offsets, indices, out_offsets=torch.tensor([0, 2, 3]))
    with pytest.raises(DataError, match=r"`out_offsets` must hold M \+ 1 = 3 offsets"):
        jagged_index_select(values, offsets, indices, out_offsets=torch.tensor([0, 3]))
    with pytest.raises(DataError, match=r"`num_out_values` must be >= 0, got -1"):
        jagged_index_select(values, offsets, indices, num_out_values=-1)
    with pytest.raises(DataError, match=r"`num_out_values` must be an int, got 3.0"):
        jagged_index_select(values, offsets, indices, num_out_values=3.0)


def test_jagged_index_select_rejects_bad_indices():
    values, offsets = jagged([[1, 2], [3]])
    with pytest.raises(
        DataError, match=r"`indices`\[1\] = 2 is out of range for a batch of 2 rows"
    ):
        jagged_index_select(values, offsets, torch.tensor([0, 2]))
    with pytest.raises(DataError, match=r"`indices`\[0\] = -1"):
        jagged_index_select(values, offsets, torch.tensor([-1]))
    with pytest.raises(DataError, match="`indices` must be a 1-d int64"):
        jagged_index_select(values, offsets, torch.tensor([0.0]))


def test_jagged_index_select_int32_indices_and_noncontiguous_values():
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # [4, 3], not contiguous
    offsets = torch.tensor([0, 1, 4])
    out, out_offsets = jagged_index_select(values, offsets, torch.tensor([1, 0], dtype=torch.int32))
    torch.testing.assert_close(out, torch.cat([values[1:4], values[0:1]]))
    assert out_offsets.tolist() == [0, 3, 4]


def test_jagged_index_select_gradcheck():
    values = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 7, 9])
    indices = torch.tensor([2, 0, 2, 1, 3, 3])
    assert torch.autograd.gradcheck(
        lambda v: jagged_index_select(v, offsets, indices)[0], (values,)
    )
    values1d = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda v: jagged_index_select(v, offsets, indices)[0], (values1d,)
    )


def test_jagged_index_select_no_grad_for_ints_and_offsets():
    values = torch.randn(4, 2, requires_grad=True)
    out, out_offsets = jagged_index_select(values, torch.tensor([0, 1, 4]), torch.tensor([1]))
    assert out.requires_grad and not out_offsets.requires_grad
    out.sum().backward()
    assert values.grad[0].tolist() == [0.0, 0.0] and values.grad[1:].eq(1).all()


# --------------------------------------------------------------------------------------------
# segment_reduce


@st.composite
def reduce_cases(draw):
    lengths = draw(st.lists(st.integers(0, 6), max_size=10))
    if draw(st.booleans()) and lengths:
        lengths[0] = 500
    width = draw(st.sampled_from([None, 1, 4]))
    dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.float64]))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    total = int(offsets[-1])
    shape = (total,) if width is None else (total, width)
    seed = draw(st.integers(0, 2**16))
    values = torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return values, offsets, draw(st.sampled_from(["sum", "mean", "max"]))


@SETTINGS
@given(reduce_cases())
def test_segment_reduce_matches_reference(case):
    values, offsets, mode = case
    out = segment_reduce(values, offsets, mode)
    want, _ = ref_segment_reduce(values.numpy(), offsets.numpy(), mode)
    assert out.dtype == values.dtype and out.shape == (offsets.shape[0] - 1, *values.shape[1:])
    tol = 1e-2 if values.dtype == torch.float16 else 1e-6
    np.testing.assert_allclose(out.double().numpy(), want, rtol=tol, atol=tol)


@SETTINGS
@given(reduce_cases())
def test_segment_reduce_backward_matches_reference(case):
    values, offsets, mode = case
    values = values.detach().requires_grad_(True)
    out = segment_reduce(values, offsets, mode)
    grad_out = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape).to(values.dtype)
    out.backward(grad_out)
    _, argmax = ref_segment_reduce(values.detach().numpy(), offsets.numpy(), mode)
    g = grad_out.double().numpy().reshape(grad_out.shape[0], int(np.prod(grad_out.shape[1:])))
    want = np.zeros((values.shape[0], g.shape[1]))
    for b in range(offsets.shape[0] - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        if mode == "max":
            for d in range(g.shape[1]):
                if argmax[b, d] >= 0:
                    want[argmax[b, d], d] = g[b, d]
        else:
            want[start:end] = g[b] / (max(end - start, 1) if mode == "mean" else 1)
    tol = 1e-2 if values.dtype == torch.float16 else 1e-6
    np.testing.assert_allclose(
        values.grad.double().numpy().reshape(want.shape), want, rtol=tol, atol=tol
    )


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_segment_reduce_gradcheck(mode):
    values = torch.randperm(30, dtype=torch.float64).reshape(10, 3).requires_grad_(True)  # no ties
    offsets = torch.tensor([0, 3, 3, 4, 10])
    assert torch.autograd.gradcheck(lambda v: segment_reduce(v, offsets, mode), (values,))


def test_segment_reduce_max_nan_and_ties():
    values = torch.tensor([[1.0, 2.0], [float("nan"), 2.0], [3.0, 2.0]], requires_grad=True)
    out = segment_reduce(values, torch.tensor([0, 3]), "max")
    assert torch.isnan(out[0, 0]) and out[0, 1] == 2.0
    out.sum().backward()
    assert values.grad.tolist() == [[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]


def test_segment_reduce_rejects_bad_arguments():
    with pytest.raises(DataError, match="`mode` must be one of sum, mean, max, got 'min'"):
        segment_reduce(torch.ones(2), torch.tensor([0, 2]), "min")
    with pytest.raises(DataError, match="must be floating point"):
        segment_reduce(torch.ones(2, dtype=torch.int64), torch.tensor([0, 2]))


# --------------------------------------------------------------------------------------------
# plumbing


def test_as_numpy_shares_memory():
    t = torch.arange(5)
    a = as_numpy(t)
    a[0] = 42
    assert int(t[0]) == 42


def test_registry_rejects_unknown_ops_and_devices():
    with pytest.raises(DataError, match="`op` 'nope' is not a kernel"):
        get_kernel("nope", "cpu")
    with pytest.raises(DataError, match="no kernels for device type 'meta'"):
        get_kernel("dedup_rows", torch.device("meta"))
