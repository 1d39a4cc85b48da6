"""Batch: shape checks, moving (to / pin_memory), the no-dedup view, equality."""

from __future__ import annotations

import pytest
import torch

from recpipe._tensors import can_pin_memory
from recpipe.batch import Batch
from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor
from tests.common.tensors import kjt_from_rows

USER = {"liked": [[1, 2], [1, 2], [3], [3]], "seller": [[7], [7], [8], [8]]}
HISTORY = {"history": [[1, 2], [1, 2, 3], [2, 3, 4], [9]]}
PLAIN = {"item": [[11], [12], [13], [14]]}


@pytest.fixture
def batch() -> Batch:
    return Batch(
        dense=torch.arange(8, dtype=torch.float32).reshape(4, 2),
        labels=torch.tensor([0.0, 1.0, 0.0, 1.0]),
        kjt=kjt_from_rows(PLAIN),
        ikjts={
            "user": InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(USER)),
            "history": PartialInverseKeyedJaggedTensor.from_kjt(kjt_from_rows(HISTORY)),
        },
        session_ids=torch.tensor([5, 5, 6, 6]),
    )


def test_to_plain_is_the_batch_without_dedup(batch):
    plain = batch.to_plain()
    assert plain.ikjts == {}
    assert plain.kjt.equals(kjt_from_rows({**PLAIN, **USER, **HISTORY}))
    assert plain.sparse_keys == batch.sparse_keys == ("item", "liked", "seller", "history")
    assert torch.equal(plain.dense, batch.dense) and plain.batch_size == 4
    assert plain.to_plain() is plain


def test_to_moves_every_tensor(batch):
    meta = batch.to("meta", non_blocking=True)
    tensors = [meta.dense, meta.labels, meta.session_ids, meta.kjt.values(), meta.kjt.lengths()]
    tensors += [meta.ikjts["user"].inverse_lookup, meta.ikjts["user"].values()]
    tensors += [meta.ikjts["history"].window_offsets]
    assert {t.device.type for t in tensors} == {"meta"}
    assert batch.to("cpu").equals(batch)


def test_pin_memory(batch):
    pinned = batch.pin_memory()
    assert pinned.equals(batch)
    # torch 2.13 cannot pin without an accelerator: then pin_memory() is a documented no-op
    assert pinned.dense.is_pinned() == can_pin_memory()
    assert pinned.ikjts["user"].inverse_lookup.is_pinned() == can_pin_memory()


def test_equals_is_exact(batch):
    other = Batch(batch.dense, batch.labels, batch.kjt, dict(batch.ikjts), batch.session_ids)
    assert batch.equals(other)
    other.labels = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert not batch.equals(other)
    assert not batch.equals(batch.to_plain())


def test_batch_without_plain_features():
    empty = KeyedJaggedTensor.from_jagged_dict({}, stride=4)
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(USER))
    b = Batch(torch.zeros(4, 0), torch.zeros(4), empty, {"user": ikjt})
    assert b.to_plain().kjt.equals(kjt_from_rows(USER)) and b.session_ids is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dense": torch.zeros(4)}, r"`dense` must be a \[B, F\] tensor"),
        ({"dense": torch.zeros(4, 2, dtype=torch.float64)}, "`dense` must be float32"),
        ({"labels": torch.zeros(3)}, r"`labels` must be a \[B\] tensor with B = 4"),
        ({"session_ids": torch.zeros(4, 1)}, "`session_ids` must be"),
        ({"kjt": kjt_from_rows({"item": [[1]]})}, "`kjt` has stride 1"),
        (
            {"ikjts": {"u": InverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"x": [[1]]}))}},
            "batch size 1",
        ),
        (
            {"ikjts": {"u": InverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"item": [[1]] * 4}))}},
            "'item' is in both",
        ),
    ],
)
def test_bad_batches_are_refused(batch, change, match):
    fields = {
        "dense": batch.dense,
        "labels": batch.labels,
        "kjt": batch.kjt,
        "ikjts": {},
        "session_ids": batch.session_ids,
    }
    with pytest.raises(DataError, match=match):
        Batch(**{**fields, **change})


def test_batch_with_nan_dense_equals_itself():
    from recpipe._tensors import tensors_equal

    a = torch.tensor([[1.0, float("nan")], [0.0, 2.0]])
    assert tensors_equal(a, a.clone())
    b = a.clone()
    b[1, 1] = 3.0
    assert not tensors_equal(a, b)
    c = a.clone()
    c[0, 1] = 5.0  # a number where the other has NaN
    assert not tensors_equal(a, c)
