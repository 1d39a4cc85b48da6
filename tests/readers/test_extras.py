"""Batch.extras, the hook for pass-through columns: checked, moved, pinned, compared, kept by
preprocessing and to_plain(), and carried over the reader service's wire."""

from __future__ import annotations

import socket

import pytest
import torch

from readers.pipeline import Pipeline
from readers.service.wire import Frame, FrameKind, batch_to_frame, frame_to_batch, recv_frame
from recpipe.batch import Batch
from recpipe.errors import DataError
from tests.common.data import session_batch


@pytest.fixture
def batch(tiny_schema):
    b = session_batch(tiny_schema, 12, seed=4)
    extras = {
        "request_id": torch.arange(100, 112, dtype=torch.int64),
        "user_id": torch.arange(12, dtype=torch.int64) * 10_000_000_000,  # beyond int32
        "score": torch.randn(12, 3),
    }
    return Batch(b.dense, b.labels, b.kjt, b.ikjts, b.session_ids, extras=extras)


def test_extras_are_checked(tiny_schema):
    b = session_batch(tiny_schema, 4, seed=1)
    with pytest.raises(DataError, match=r"`extras\['rid'\]` must be a tensor of B = 4 rows"):
        Batch(b.dense, b.labels, b.kjt, extras={"rid": torch.zeros(3)})
    with pytest.raises(DataError, match="`extras` keys must be non-empty strings"):
        Batch(b.dense, b.labels, b.kjt, extras={"": torch.zeros(4)})


def test_extras_move_and_compare(batch):
    moved = batch.to("cpu").pin_memory()
    assert moved.equals(batch) and moved.extras.keys() == batch.extras.keys()
    assert batch.to_plain().extras is batch.extras
    other = Batch(batch.dense, batch.labels, batch.kjt, batch.ikjts, batch.session_ids)
    assert not other.equals(batch)


def test_extras_survive_preprocessing(batch, tiny_schema):
    config = [{"transform": "HashModulo", "features": ["user_items"], "params": {"modulus": 7}}]
    out = Pipeline.from_config(config, schema=tiny_schema)(batch)
    assert out.extras is batch.extras


def test_extras_travel_over_the_wire(batch):
    frame_bytes = b"".join(bytes(b) for b in batch_to_frame(batch))
    left, right = socket.socketpair()
    with left, right:
        left.sendall(frame_bytes)
        frame = recv_frame(right)
    assert isinstance(frame, Frame) and frame.kind is FrameKind.BATCH
    decoded = frame_to_batch(frame)
    assert decoded.equals(batch)
    assert decoded.extras["user_id"].dtype == torch.int64  # narrowed to int32 only where it fits
