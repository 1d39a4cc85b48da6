"""InverseKeyedJaggedTensor and the partial IKJT: dedup is exact, expansion gives the batch back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor
from tests.common.tensors import kjt_from_rows

I64 = (-(2**63), 2**63 - 1)
I32 = (-(2**31), 2**31 - 1)


def reference_dedup(rows_per_key: dict[str, list[list[int]]]) -> tuple[list[int], list[int]]:
    """First-occurrence unique rows and inverse by the tuple of all keys' lists."""
    columns = list(rows_per_key.values())
    batch = len(columns[0])
    seen: dict[tuple, int] = {}
    unique, inverse = [], []
    for b in range(batch):
        row = tuple(tuple(col[b]) for col in columns)
        if row not in seen:
            seen[row] = len(unique)
            unique.append(b)
        inverse.append(seen[row])
    return unique, inverse


@st.composite
def session_batches(draw, max_keys: int = 3, max_rows: int = 24):
    """Session-clustered batches: rows drawn from a few prototypes, keys optionally out of step.

    Covers empty batches, one row, empty lists, long lists, all-duplicate and no-duplicate
    batches, int32 and int64 ids over their full range.
    """
    num_keys = draw(st.integers(1, max_keys))
    batch = draw(st.integers(0, max_rows))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    lo, hi = I32 if dtype == np.int32 else I64
    ids = st.one_of(st.integers(0, 3), st.integers(lo, hi))
    short = st.lists(ids, max_size=6)
    long = st.builds(
        lambda start, n: list(range(start, start + n)), st.integers(0, 1000), st.integers(60, 300)
    )
    lists = st.one_of(short, short, short, long)
    kind = draw(st.sampled_from(["clustered", "all_dup", "no_dup", "out_of_step"]))
    num_protos = {"all_dup": 1, "no_dup": max(batch, 1)}.get(
        kind, draw(st.integers(1, max(batch, 1)))
    )
    rows_per_key: dict[str, list[list[int]]] = {}
    shared_picks = draw(st.lists(st.integers(0, num_protos - 1), min_size=batch, max_size=batch))
    for k in range(num_keys):
        protos = draw(st.lists(lists, min_size=num_protos, max_size=num_protos))
        if kind == "no_dup" and k == 0:
            protos = [[b, *p] for b, p in enumerate(protos)]  # distinct first element
        picks = list(range(batch)) if kind == "no_dup" else shared_picks
        if kind == "out_of_step" and k > 0:
            picks = draw(st.lists(st.integers(0, num_protos - 1), min_size=batch, max_size=batch))
        rows_per_key[f"f{k}"] = [protos[p] for p in picks]
    return rows_per_key, dtype


@settings(max_examples=80, deadline=None)
@given(session_batches())
def test_ikjt_expands_to_the_batch_exactly(case):
    rows_per_key, dtype = case
    kjt = kjt_from_rows(rows_per_key, dtype)
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt)
    assert ikjt.to_kjt().equals(kjt)
    unique, inverse = reference_dedup(rows_per_key)
    assert ikjt.inverse_lookup.tolist() == inverse
    assert ikjt.num_unique == len(unique) and ikjt.batch_size == kjt.stride()
    want = kjt_from_rows({k: [rows[u] for u in unique] for k, rows in rows_per_key.items()}, dtype)
    assert ikjt.unique.equals(want)
    stored = want.num_values
    assert ikjt.dedup_factor == pytest.approx(kjt.num_values / stored if stored else 1.0)
    assert ikjt.num_expanded_values == kjt.num_values
    arrays = InverseKeyedJaggedTensor.from_arrays(
        list(rows_per_key),
        [kjt[k].values().numpy() for k in kjt.keys()],
        [kjt[k].offsets().numpy() for k in kjt.keys()],
    )
    assert arrays.equals(ikjt)


def test_ikjt_layout_matches_docstring():
    rows = {"liked_items": [[7, 3], [7, 3], [7, 3], [5]], "liked_sellers": [[1], [1], [2], [2]]}
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(rows))
    assert ikjt.keys() == ["liked_items", "liked_sellers"]
    assert ikjt.values().tolist() == [7, 3, 7, 3, 5, 1, 2, 2]
    assert ikjt.lengths().tolist() == [2, 2, 1, 1, 1, 1]
    assert ikjt.inverse_lookup.tolist() == [0, 0, 1, 2]
    assert ikjt.dedup_factor == 11 / 8
    assert [r.tolist() for r in ikjt["liked_sellers"].to_dense_list()] == [[1], [2], [2]]
    assert list(ikjt.to_dict()) == ["liked_items", "liked_sellers"] and "liked_items" in ikjt


def test_out_of_step_rows_are_not_merged():
    # each key alone has 2 unique rows, but the tuples give 3
    rows = {"a": [[1], [1], [2]], "b": [[5], [6], [6]]}
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(rows))
    assert ikjt.num_unique == 3 and ikjt.dedup_factor == 1.0
    only_a = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(rows), keys=["a"])
    assert only_a.num_unique == 2 and only_a.keys() == ["a"]


def test_ikjt_edge_cases():
    empty = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"a": [], "b": []}))
    assert empty.batch_size == 0 and empty.num_unique == 0 and empty.dedup_factor == 1.0
    assert empty.to_kjt().equals(kjt_from_rows({"a": [], "b": []}))
    all_empty = kjt_from_rows({"a": [[], [], []]})
    ikjt = InverseKeyedJaggedTensor.from_kjt(all_empty)
    assert ikjt.num_unique == 1 and ikjt.dedup_factor == 1.0 and ikjt.to_kjt().equals(all_empty)
    one = kjt_from_rows({"a": [[4, 4]]}, np.int32)
    assert InverseKeyedJaggedTensor.from_kjt(one).to_kjt().equals(one)


def test_ikjt_map_keeps_the_inverse_and_commutes_with_expansion():
    kjt = kjt_from_rows({"a": [[10, 11, 12], [10, 11, 12], [13]], "b": [[1], [1], [2]]})
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt)
    hashed = ikjt.map_values(lambda v: v % 7)
    assert hashed.inverse_lookup is ikjt.inverse_lookup
    assert hashed.to_kjt().equals(kjt.map_values(lambda v: v % 7))

    def truncate(jt: JaggedTensor) -> JaggedTensor:  # keep the first two ids of each row
        keep = torch.clamp(jt.lengths(), max=2)
        out = JaggedTensor.from_lengths(torch.empty(int(keep.sum()), dtype=jt.dtype), keep)
        rows = torch.repeat_interleave(torch.arange(jt.batch_size), keep)
        src = jt.offsets()[rows] + torch.arange(out.num_values) - out.offsets()[rows]
        return JaggedTensor.from_lengths(jt.values()[src], keep)

    cut = ikjt.map_jagged(truncate, keys=["a"])
    assert cut.to_kjt().equals(kjt.map_jagged(truncate, keys=["a"]))
    assert cut.to_kjt()["a"].lengths().tolist() == [2, 2, 1]


def test_ikjt_to_kjt_gradient_accumulates_over_duplicates():
    values = torch.ones(3, 4, requires_grad=True)  # unique rows: [v0, v1], [v2]
    ikjt = InverseKeyedJaggedTensor(
        ["seq"], values, torch.tensor([2, 1]), torch.tensor([0, 1, 0, 0])
    )
    ikjt.to_kjt().values().sum().backward()
    assert values.grad[:, 0].tolist() == [3.0, 3.0, 1.0]


def test_ikjt_equals_to_and_pin_memory():
    kjt = kjt_from_rows({"a": [[1], [1], [2]]})
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt)
    assert ikjt.equals(InverseKeyedJaggedTensor.from_kjt(kjt))
    other = InverseKeyedJaggedTensor(
        ["a"], torch.tensor([1, 1, 2]), torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2])
    )
    assert not ikjt.equals(other) and other.to_kjt().equals(ikjt.to_kjt())
    meta = ikjt.to("meta")
    assert meta.inverse_lookup.device.type == "meta" and meta.values().device.type == "meta"
    assert ikjt.to("cpu") is ikjt and ikjt.pin_memory().equals(ikjt)


def test_ikjt_errors():
    with pytest.raises(DataError, match=r"`inverse_lookup` must lie in \[0, 2\), got 2"):
        InverseKeyedJaggedTensor(["a"], torch.arange(2), torch.tensor([1, 1]), torch.tensor([0, 2]))
    with pytest.raises(DataError, match="at least one key"):
        InverseKeyedJaggedTensor([], torch.arange(0), torch.arange(0), torch.arange(0))
    with pytest.raises(DataError, match="same number of rows"):
        InverseKeyedJaggedTensor.from_jagged(
            {
                "a": JaggedTensor.from_dense_list([torch.tensor([1])]),
                "b": JaggedTensor.from_dense_list([torch.tensor([1])] * 2),
            }
        )
    with pytest.raises(DataError, match="unknown key 'z'"):
        InverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"a": [[1]]}), keys=["z"])
    # a repeated key must be refused, not collapse into one feature
    vals, offs = [np.array([1]), np.array([2])], [np.array([0, 1]), np.array([0, 1])]
    for cls in (InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor, KeyedJaggedTensor):
        with pytest.raises(DataError, match=r"`keys` must be unique, got duplicates \['a'\]"):
            cls.from_arrays(["a", "a"], vals, offs, validate=False)


# -- partial IKJT ------------------------------------------------------------------------------


def test_partial_layout_matches_docstring():
    kjt = kjt_from_rows({"history": [[1, 2, 3], [1, 2, 3], [2, 3, 4], [8]]})
    p = PartialInverseKeyedJaggedTensor.from_kjt(kjt)
    assert p.values().tolist() == [1, 2, 3, 4, 8]
    assert p.window_offsets.tolist() == [0, 0, 1, 4]
    assert p.window_lengths.tolist() == [3, 3, 3, 1]
    assert p.dedup_factor == 2.0 and p.batch_size == 4
    assert p.to_kjt().equals(kjt)


@st.composite
def shifting_histories(draw):
    """Per key, a history that grows or slides by one id per row, with occasional resets."""
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    batch = draw(st.integers(0, 20))
    rows_per_key = {}
    for k in range(draw(st.integers(1, 2))):
        rows, cur = [], draw(st.lists(st.integers(0, 50), max_size=5))
        for _ in range(batch):
            step = draw(st.sampled_from(["same", "append", "slide", "reset"]))
            if step == "append":
                cur = [*cur, draw(st.integers(0, 50))]
            elif step == "slide" and cur:
                cur = [*cur[1:], draw(st.integers(0, 50))]
            elif step == "reset":
                cur = draw(st.lists(st.integers(0, 50), max_size=5))
            rows.append(cur)
        rows_per_key[f"h{k}"] = rows
    return rows_per_key, dtype


@settings(max_examples=60, deadline=None)
@given(shifting_histories())
def test_partial_ikjt_expands_exactly(case):
    rows_per_key, dtype = case
    kjt = kjt_from_rows(rows_per_key, dtype)
    p = PartialInverseKeyedJaggedTensor.from_kjt(kjt)
    assert p.to_kjt().equals(kjt)
    assert p.num_values <= kjt.num_values
    assert p.dedup_factor == pytest.approx(kjt.num_values / p.num_values if p.num_values else 1.0)
    same = PartialInverseKeyedJaggedTensor.from_arrays(
        kjt.keys(), [kjt[k].values() for k in kjt.keys()], [kjt[k].offsets() for k in kjt.keys()]
    )
    assert same.equals(p)


def test_partial_ikjt_to_pin_and_errors():
    p = PartialInverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"h": [[1, 2], [2, 3]]}))
    assert p.to("meta").values().device.type == "meta" and p.pin_memory().equals(p)
    with pytest.raises(DataError, match=r"window 1 .* outside the 3 values"):
        PartialInverseKeyedJaggedTensor(
            ["h"], torch.arange(3), torch.tensor([0, 2]), torch.tensor([2, 2])
        )
    with pytest.raises(DataError, match=r"len\(keys\) \* B"):
        PartialInverseKeyedJaggedTensor(
            ["a", "b"], torch.arange(3), torch.tensor([0]), torch.tensor([1])
        )


def test_a_moved_partial_ikjt_expands_a_key_without_reading_the_device():
    """A copy carries each key's expanded size and packed span, so a moved partial IKJT lays out
    a key's windows without reading them back; the ``meta`` device (no data) stands in for a
    GPU. On the CPU the carried spans give what the windows give."""
    rows = {"a": [[1, 2, 3], [2, 3, 4], [], [7]], "b": [[5], [5], [5, 6], []]}
    p = PartialInverseKeyedJaggedTensor.from_jagged(kjt_from_rows(rows).to_dict())
    ids, positions, offsets = p.to("meta").key_windows("a")
    want_ids, want_positions, want_offsets = p.key_windows("a")
    assert ids.device.type == "meta" and ids.shape == want_ids.shape
    assert positions.shape == want_positions.shape and offsets.shape == want_offsets.shape
    assert torch.equal(p.pin_memory().key_windows("b")[1], p.key_windows("b")[1])
    for key in rows:
        got = [t.tolist() for t in p.pin_memory().key_windows(key)]
        assert got == [t.tolist() for t in p.key_windows(key)]
