"""The loader's packed transport: a batch crosses from a worker as one buffer, and the loader
hands out the same batches as without packing."""

from __future__ import annotations

import pytest
import torch

from readers.dataset import make_dataloader
from readers.source import ReaderConfig
from recpipe.ikjt import InverseKeyedJaggedTensor

CFG = ReaderConfig(batch_size=16, shuffle=True, seed=11, shuffle_buffer=6)


def _storages(batch) -> int:
    """How many shared-memory buffers the batch's tensors came in."""
    tensors = [batch.dense, batch.labels, batch.kjt.values(), batch.kjt.lengths()]
    for group in batch.ikjts.values():
        tensors += [group.values()]
        if isinstance(group, InverseKeyedJaggedTensor):
            tensors += [group.lengths(), group.inverse_lookup]
        else:
            tensors += [group.window_offsets, group.window_lengths]
    return len({t.untyped_storage().data_ptr() for t in tensors})


@pytest.fixture
def partial_schema(tiny_schema):
    """The tiny schema with a partial (windowed) group beside a full one."""
    return tiny_schema.with_dedup([("user_sellers", "user_segment")], partial=("user_items",))


@pytest.mark.parametrize("dedup", [True, False])
def test_packed_loader_yields_the_batches_of_the_unpacked_one(make_dataset, partial_schema, dedup):
    root = make_dataset(num_sessions=40)
    kw = {"schema": partial_schema, "config": CFG, "num_workers": 2, "dedup": dedup}
    packed = list(make_dataloader(root, packed=True, **kw))
    plain = list(make_dataloader(root, packed=False, **kw))
    assert len(packed) == len(plain) > 2
    for a, b in zip(packed, plain, strict=True):
        assert a.equals(b)
    if dedup:
        kinds = {type(g).__name__ for g in packed[0].ikjts.values()}
        assert kinds == {"InverseKeyedJaggedTensor", "PartialInverseKeyedJaggedTensor"}


def test_a_batch_crosses_from_a_worker_as_one_buffer(make_dataset, partial_schema):
    root = make_dataset(num_sessions=20)
    loader = make_dataloader(root, schema=partial_schema, config=CFG, num_workers=2)
    batches = list(loader)  # packed by default with workers
    assert batches and all(_storages(b) == 1 for b in batches)
    unpacked = make_dataloader(root, schema=partial_schema, config=CFG, num_workers=2, packed=False)
    assert all(_storages(b) > 5 for b in unpacked)  # about one per tensor


def test_packed_batches_resume_and_move_like_any(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=40)
    loader = make_dataloader(root, schema=tiny_schema, config=CFG, num_workers=2)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    rest = list(it)
    again = make_dataloader(root, schema=tiny_schema, config=CFG, num_workers=2)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest)  # the same batches (the workers' interleaving may differ)
    assert all(any(a.equals(b) for b in rest) for a in resumed)
    moved = first.to("meta", non_blocking=True)
    assert moved.batch_size == first.batch_size and moved.dense.device == torch.device("meta")


def _epochs(loader, epochs: int) -> list[list]:
    return [list(loader) for _ in range(epochs)]


def test_epochs_ahead_gives_every_epoch_as_without(make_dataset, partial_schema):
    root = make_dataset(num_sessions=30, row_group_rows=20)
    kw = {"schema": partial_schema, "config": CFG, "num_workers": 2}
    ahead = make_dataloader(root, epochs_ahead=True, **kw)
    want = _epochs(make_dataloader(root, **kw), 3)
    got = _epochs(ahead, 3)
    assert [len(e) for e in got] == [len(e) for e in want] and len(want[0]) > 2
    for got_epoch, want_epoch in zip(got, want, strict=True):  # the workers' turns may shift
        assert all(any(a.equals(b) for b in want_epoch) for a in got_epoch)
    assert ahead.epoch == 3 and ahead.state_dict()["epoch"] == 3
    assert ahead._live is not None  # the same workers went on from epoch to epoch


def test_epochs_ahead_resumes_and_goes_on_after_a_loop_left_early(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=30, row_group_rows=20)
    kw = {"schema": tiny_schema, "config": CFG, "num_workers": 2, "epochs_ahead": True}
    want = _epochs(make_dataloader(root, **kw), 2)
    loader = make_dataloader(root, **kw)
    assert len(list(loader)) == len(want[0])
    head = []
    for batch in loader:  # epoch 1, left after two batches
        head.append(batch)
        if len(head) == 2:
            break
    state = loader.state_dict()
    rest = list(loader)  # goes on where it stopped
    assert all(a.equals(b) for a, b in zip(head + rest, want[1], strict=True))
    again = make_dataloader(root, **kw)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest) and all(any(a.equals(b) for b in rest) for a in resumed)
    assert again.epoch == loader.epoch == 2


def test_persistent_workers_read_each_epoch_not_the_first_again(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=30, row_group_rows=20)
    kw = {"schema": tiny_schema, "config": CFG, "num_workers": 2}
    want = _epochs(make_dataloader(root, **kw), 2)
    got = _epochs(make_dataloader(root, persistent_workers=True, **kw), 2)
    assert not all(any(a.equals(b) for b in want[0]) for a in want[1])  # epochs differ
    for got_epoch, want_epoch in zip(got, want, strict=True):
        assert len(got_epoch) == len(want_epoch)
        assert all(any(a.equals(b) for b in want_epoch) for a in got_epoch)
