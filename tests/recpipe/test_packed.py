"""Batch.pack / PackedBatch.unpack: one buffer for every tensor of a batch, exactly."""

from __future__ import annotations

import pickle

import pytest
import torch

from recpipe._tensors import can_pin_memory
from recpipe.batch import Batch, PackedBatch
from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor
from recpipe.packed import ALIGN, pack_tensors, shared_buffer, tensor_views
from tests.common.tensors import kjt_from_rows
from tests.recpipe.test_batch import HISTORY, PLAIN, USER

EMPTY = {"none": [[], [], [], []]}


def _dedup() -> Batch:
    """Plain and full-dedup features, a partial group and session ids (as test_batch's)."""
    groups = {
        "user": InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(USER)),
        "history": PartialInverseKeyedJaggedTensor.from_kjt(kjt_from_rows(HISTORY)),
    }
    dense = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    labels, sessions = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([5, 5, 6, 6])
    return Batch(dense, labels, kjt_from_rows(PLAIN), ikjts=groups, session_ids=sessions)


def _odd() -> Batch:
    """Odd dtypes and shapes, derived offsets cached, empty features, a keyless plain KJT."""
    unique = kjt_from_rows(USER)
    unique.offsets()  # derived once: travels too
    empty = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(EMPTY))
    return Batch(
        dense=torch.tensor([[float("nan")], [1.5], [-0.0], [2.0]]),
        labels=torch.tensor([1, 0, 1, 1], dtype=torch.int8),
        kjt=KeyedJaggedTensor(
            [], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), stride=4
        ),
        ikjts={"user": InverseKeyedJaggedTensor.from_kjt(unique), "empty": empty},
        extras={
            "flag": torch.tensor([True, False, True, True]),
            "half": torch.arange(12, dtype=torch.bfloat16).reshape(4, 3),
            "wide": torch.arange(8, dtype=torch.float64).reshape(4, 2).t().contiguous().t(),
            "small": torch.tensor([1, 2, 3, 4], dtype=torch.int16),
        },
    )


def _with_offsets() -> Batch:
    batch = _dedup()
    batch.kjt.offsets()
    return batch


BATCHES = {
    "dedup": _dedup,
    "plain": lambda: _dedup().to_plain(),
    "odd": _odd,
    "offsets": _with_offsets,
    "no_rows": lambda: Batch(
        dense=torch.empty(0, 3), labels=torch.empty(0), kjt=kjt_from_rows({"a": []})
    ),
}


def _tensors(batch: Batch) -> list[torch.Tensor]:
    return batch._parts()[1]


@pytest.mark.parametrize("name", list(BATCHES))
def test_unpack_gives_the_batch_back_exactly(name):
    batch = BATCHES[name]()
    packed = batch.pack()
    got = packed.unpack()
    assert got.equals(batch)
    assert list(got.ikjts) == list(batch.ikjts)
    for key, group in batch.ikjts.items():
        assert type(got.ikjts[key]) is type(group)
    want, have = _tensors(batch), _tensors(got)
    assert [(t.dtype, t.shape) for t in have] == [(t.dtype, t.shape) for t in want]
    assert got.kjt.stride() == batch.kjt.stride() and got.kjt.keys() == batch.kjt.keys()
    # derived offsets travel when they were there, and stay underived when not
    assert (got.kjt.offsets_or_none() is None) == (batch.kjt.offsets_or_none() is None)
    # every tensor a view into the one buffer, each aligned
    assert {t.untyped_storage().data_ptr() for t in have} == {packed.buffer.data_ptr()}
    assert all(slot.offset % ALIGN == 0 for slot in packed.layout)
    assert packed.nbytes <= sum(s.nbytes for s in packed.layout) + ALIGN * len(packed.layout)
    # the same layout over a copy of the buffer (what a device copy is) gives the batch too
    assert PackedBatch(packed.buffer.clone(), packed.layout, packed.spec).unpack().equals(batch)


def test_a_packed_batch_pickles_as_its_buffer_and_a_small_layout():
    packed = _dedup().pack()
    again = pickle.loads(pickle.dumps(packed))
    assert again.unpack().equals(_dedup())
    layout_bytes = len(pickle.dumps((packed.layout, packed.spec)))
    assert layout_bytes < 4096


def _count_copies(monkeypatch) -> list[torch.Tensor]:
    """Every ``Tensor.to`` call from here on, recorded (its source tensor)."""
    calls: list[torch.Tensor] = []
    to = torch.Tensor.to

    def counting(self, *args, **kwargs):
        calls.append(self)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting)
    return calls


def test_unpacked_batch_moves_as_one_copy(monkeypatch):
    batch = _dedup().pack().unpack()
    calls = _count_copies(monkeypatch)
    moved = batch.to("meta", non_blocking=True)
    assert len(calls) == 1 and calls[0].dtype == torch.uint8  # the buffer, once
    assert {t.device.type for t in _tensors(moved)} == {"meta"}
    assert [(t.dtype, t.shape) for t in _tensors(moved)] == [
        (t.dtype, t.shape) for t in _tensors(batch)
    ]


def test_a_batch_of_separate_tensors_moves_tensor_by_tensor(monkeypatch):
    batch = _dedup()
    calls = _count_copies(monkeypatch)
    batch.to("meta")
    assert len(calls) == len(_tensors(batch))
    # views into a much larger storage are not copied whole
    big = torch.zeros(1000)
    assert shared_buffer([big[:4], big[8:12]]) is None
    assert shared_buffer([big[:4], torch.zeros(4)]) is None


def test_pin_memory_of_an_unpacked_batch_keeps_one_buffer():
    batch = _dedup().pack().unpack()
    pinned = batch.pin_memory()
    assert pinned.equals(batch)
    assert len({t.untyped_storage().data_ptr() for t in _tensors(pinned)}) == 1
    assert pinned.dense.is_pinned() == can_pin_memory()


def test_tensor_views_refuses_a_short_buffer():
    buffer, layout = pack_tensors([torch.arange(10)])
    with pytest.raises(DataError, match="too short"):
        tensor_views(buffer[:40], layout)
    with pytest.raises(DataError, match="1-d uint8"):
        tensor_views(buffer.view(torch.int64), layout)


@pytest.mark.parametrize("how", ["packed", "per tensor"])
def test_a_device_copy_carries_what_the_host_knows(how):
    """Where each key starts and a partial group's spans travel with the copy (on a GPU, reading
    them back would be a sync); the meta device cannot read anything back, so they must."""
    batch = _dedup()
    source = batch.pack().unpack() if how == "packed" else batch
    moved = source.to("meta")
    assert moved.kjt.offset_per_key() == batch.kjt.offset_per_key()
    history = moved.ikjts["history"]
    assert history._host == batch.ikjts["history"]._host_spans()
    _, positions, _ = history.key_windows("history")
    assert positions.shape == batch.ikjts["history"].key_windows("history")[1].shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(BATCHES))
def test_a_packed_batch_crosses_to_cuda_in_one_copy(name, monkeypatch):
    """Pinned, copied non-blocking, rebuilt as views on the device: the batch, exactly."""
    batch = BATCHES[name]()
    pinned = batch.pack().unpack().pin_memory()
    assert pinned.dense.is_pinned() or batch.dense.numel() == 0  # nothing to pin
    calls = _count_copies(monkeypatch)
    moved = pinned.to("cuda", non_blocking=True)
    assert len(calls) == 1
    monkeypatch.undo()
    assert {t.device.type for t in _tensors(moved)} == {"cuda"}
    assert moved.to("cpu").equals(batch)
    assert moved.kjt.offset_per_key() == batch.kjt.offset_per_key()
