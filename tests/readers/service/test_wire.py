"""The reader service's wire format: exact Batch round trips and refusal of malformed frames."""

from __future__ import annotations

import socket
import struct

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readers.service.wire import (
    HEADER,
    MAGIC,
    WIRE_VERSION,
    FrameKind,
    ProtocolError,
    ServiceError,
    batch_to_frame,
    decode_frame,
    encode_frame,
    encode_frame_buffers,
    frame_meta,
    frame_to_batch,
    recv_frame,
    recv_raw_frame,
    send_buffers,
)
from recpipe.batch import Batch
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor

MAX = 1 << 24


def _roundtrip(batch: Batch, *, narrow: bool = True) -> Batch:
    frame = decode_frame(b"".join(batch_to_frame(batch, narrow=narrow)), max_frame_bytes=MAX)
    return frame_to_batch(frame)


def _kjt(keys: list[str], b: int, gen: torch.Generator, *, big: bool) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=gen)
    high = 1 << 62 if big else 1000
    return KeyedJaggedTensor(
        keys, torch.randint(0, high, (int(lengths.sum()),), generator=gen), lengths
    )


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """Random batches: plain keys, IKJT and partial groups, optional session ids, big/small ids."""
    b = draw(st.integers(1, 12))
    f = draw(st.integers(0, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    big = draw(st.booleans())
    plain = _kjt(["p0", "p1"][: draw(st.integers(0, 2))], b, gen, big=big)
    if not plain.keys():
        plain = KeyedJaggedTensor(
            [], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), stride=b
        )
    # repeat rows so that dedup finds duplicates
    rows = torch.randint(0, max(b // 2, 1), (b,), generator=gen)
    ikjts: dict[str, object] = {}
    if draw(st.booleans()):
        user = _kjt(["u0", "u1"], b, gen, big=big).index_select(rows)
        ikjts["user"] = InverseKeyedJaggedTensor.from_kjt(user)
    if draw(st.booleans()):
        hist = _kjt(["h0"], b, gen, big=big).index_select(rows)
        ikjts["hist"] = PartialInverseKeyedJaggedTensor.from_kjt(hist)
    labels_dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.float64]))
    return Batch(
        dense=torch.randn((b, f), generator=gen),
        labels=(torch.rand(b, generator=gen) * 3).to(labels_dtype),
        kjt=plain,
        ikjts=ikjts,
        session_ids=draw(st.sampled_from([None, rows + (1 << 40 if big else 0)])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), narrow=st.booleans())
def test_batch_roundtrip_is_exact(batch: Batch, narrow: bool) -> None:
    decoded = _roundtrip(batch, narrow=narrow)
    assert decoded.equals(batch)
    assert decoded.to_plain().equals(batch.to_plain())


def test_narrowing_is_exact_and_saves_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    small = _kjt(["a", "b"], 64, gen, big=False)
    batch = Batch(torch.zeros((64, 1)), torch.zeros(64), small, session_ids=torch.arange(64))
    narrow = b"".join(batch_to_frame(batch, narrow=True))
    wide = b"".join(batch_to_frame(batch, narrow=False))
    assert len(narrow) < len(wide)
    for data in (narrow, wide):
        decoded = frame_to_batch(decode_frame(data, max_frame_bytes=MAX))
        assert decoded.equals(batch)
        assert decoded.kjt.values().dtype == torch.int64


def test_nan_and_special_floats_travel_bit_exactly() -> None:
    dense = torch.tensor([[float("nan"), float("inf")], [-0.0, float("-inf")]])
    kjt = KeyedJaggedTensor(["w"], torch.tensor([float("nan"), 1e-45]), torch.tensor([2, 0]))
    batch = Batch(dense, torch.tensor([float("nan"), 1.0]), kjt)
    decoded = _roundtrip(batch)
    assert torch.equal(decoded.dense.view(torch.int32), dense.view(torch.int32))
    assert torch.equal(decoded.labels.view(torch.int32), batch.labels.view(torch.int32))
    assert torch.equal(decoded.kjt.values().view(torch.int32), kjt.values().view(torch.int32))


def test_values_outside_int32_stay_int64() -> None:
    values = torch.tensor([0, 2**31, -(2**31) - 1, 2**62])
    kjt = KeyedJaggedTensor(["a"], values, torch.tensor([4]))
    batch = Batch(torch.zeros((1, 0)), torch.zeros(1), kjt)
    frame = decode_frame(b"".join(batch_to_frame(batch)), max_frame_bytes=MAX)
    assert "kjt.values" not in frame.meta["widen"]
    assert frame_to_batch(frame).equals(batch)


def test_tensor_frames_roundtrip_dtypes_and_layouts() -> None:
    tensors = {
        "bf16": torch.arange(5, dtype=torch.bfloat16),
        "noncontig": torch.arange(12, dtype=torch.int32).view(3, 4).t(),
        "empty": torch.empty((0, 3), dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
        "odd": torch.arange(3, dtype=torch.uint8),  # 3 bytes: the next tensor starts padded
        "after": torch.arange(3, dtype=torch.int64),
    }
    frame = decode_frame(
        encode_frame(FrameKind.BATCH, {"x": [1, "a"]}, tensors), max_frame_bytes=MAX
    )
    assert frame.kind is FrameKind.BATCH and frame.meta == {"x": [1, "a"]}
    assert list(frame.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert frame.tensors[name].dtype == tensor.dtype
        assert torch.equal(frame.tensors[name], tensor)


def test_frames_over_a_socket() -> None:
    gen = torch.Generator().manual_seed(1)
    user = _kjt(["u"], 32, gen, big=True).index_select(torch.arange(32) // 4)
    batch = Batch(
        torch.randn((32, 2), generator=gen),
        torch.zeros(32),
        _kjt(["p"], 32, gen, big=True),
        ikjts={"user": InverseKeyedJaggedTensor.from_kjt(user)},
        session_ids=torch.arange(32) // 4,
    )
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(10)
        sent = send_buffers(a, batch_to_frame(batch)) + send_buffers(
            a, encode_frame_buffers(FrameKind.END, {"n": 1})
        )
        first = recv_frame(b, max_frame_bytes=MAX)
        second = recv_frame(b, max_frame_bytes=MAX)
    assert frame_to_batch(first).equals(batch)
    assert second.kind is FrameKind.END and second.meta == {"n": 1}
    assert first.nbytes + second.nbytes == sent


# -- malformed input ----------------------------------------------------------------------------
def _frame(
    kind: int = int(FrameKind.BATCH),
    descriptor: bytes = b"{}",
    payload: bytes = b"",
    *,
    magic: bytes = MAGIC,
    version: int = WIRE_VERSION,
) -> bytes:
    return HEADER.pack(magic, version, kind, len(descriptor), len(payload)) + descriptor + payload


def _descriptor(tensors: list, meta: dict | None = None) -> bytes:
    return orjson.dumps({"meta": meta or {}, "tensors": tensors})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"RPW", "truncated frame"),
        (_frame(magic=b"HTTP"), "not a recpipe frame"),
        (_frame(version=99), "wire version 99"),
        (_frame(kind=77), "unknown frame kind 77"),
        (_frame(descriptor=b"{not json"), "not valid JSON"),
        (_frame(descriptor=b"[1, 2]"), "must be a JSON object"),
        (
            _frame(descriptor=_descriptor([["x", "complex128", [1]]]), payload=bytes(16)),
            "unknown dtype",
        ),
        (_frame(descriptor=_descriptor([["x", "int64", [-1]]])), "invalid shape"),
        (
            _frame(descriptor=_descriptor([["x", "int64", [True]]]), payload=bytes(8)),
            "invalid shape",
        ),
        (
            _frame(descriptor=_descriptor([["x", "int64", [4]]]), payload=bytes(8)),
            "payload holds 8",
        ),
        (_frame(descriptor=_descriptor([["x", "int64", [1]]]), payload=bytes(16)), "describe 8"),
        (
            _frame(
                descriptor=_descriptor([["x", "int64", [1]], ["x", "int64", [1]]]),
                payload=bytes(16),
            ),
            "repeated",
        ),
        (_frame(descriptor=_descriptor(["x"])), r"\[name, dtype, shape\]"),
        (_frame() + b"extra", "header announces"),
    ],
)
def test_malformed_frames_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_frame(data, max_frame_bytes=MAX)


def test_oversized_frame_is_refused_before_allocation() -> None:
    header = HEADER.pack(MAGIC, WIRE_VERSION, int(FrameKind.BATCH), 2, 1 << 40)  # a 1 TiB claim
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(10)
        a.sendall(header)
        with pytest.raises(ProtocolError, match=r"exceeds `max_frame_bytes`=1024"):
            recv_frame(b, max_frame_bytes=1024)


def test_batch_frame_with_bad_contents_is_refused() -> None:
    kjt = KeyedJaggedTensor(["a"], torch.arange(3), torch.tensor([1, 2]))
    batch = Batch(torch.zeros((2, 1)), torch.zeros(2), kjt)
    frame = decode_frame(b"".join(batch_to_frame(batch, narrow=False)), max_frame_bytes=MAX)
    missing = dict(frame.tensors)
    del missing["labels"]
    with pytest.raises(ProtocolError, match="missing field 'labels'"):
        frame_to_batch(type(frame)(frame.kind, frame.meta, missing))
    inconsistent = {**frame.tensors, "kjt.lengths": torch.tensor([5, 5])}
    with pytest.raises(ProtocolError, match="does not describe a valid batch"):
        frame_to_batch(type(frame)(frame.kind, frame.meta, inconsistent))
    with pytest.raises(ProtocolError, match="expected a BATCH frame, got END"):
        frame_to_batch(decode_frame(encode_frame(FrameKind.END), max_frame_bytes=MAX))


def test_peer_closing_mid_frame_is_a_clear_error() -> None:
    frame = encode_frame(FrameKind.BATCH, {}, {"x": torch.arange(100)})
    a, b = socket.socketpair()
    with b:
        b.settimeout(10)
        a.sendall(frame[: len(frame) // 2])
        a.close()
        with pytest.raises(
            ServiceError,
            match=r"connection closed by the peer in the middle of the BATCH frame payload",
        ):
            recv_frame(b, max_frame_bytes=MAX)


def test_silent_peer_times_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.05)
        a.sendall(struct.pack("<4s", MAGIC))
        with pytest.raises(ServiceError, match=r"timed out waiting for the frame header \(4 of 20"):
            recv_frame(b, max_frame_bytes=MAX)


def test_raw_frames_relay_unchanged() -> None:
    """What the server does with a reader's frame: receive it whole, read its meta, pass it on."""
    batch = _small_batch()
    buffers = batch_to_frame(batch, meta={"reader": 3})
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(10)
        b.settimeout(10)
        send_buffers(a, buffers)
        a.sendall(encode_frame(FrameKind.END, {"batches": 1}))
        kind, raw = recv_raw_frame(b)
        assert kind is FrameKind.BATCH
        assert bytes(raw) == b"".join(bytes(x) for x in buffers)
        assert frame_meta(raw)["reader"] == 3
        assert frame_meta(raw)["rows"] == batch.batch_size
        assert frame_to_batch(decode_frame(raw, max_frame_bytes=1 << 30)).equals(batch)
        kind, raw = recv_raw_frame(b)
        assert (kind, frame_meta(raw)) == (FrameKind.END, {"batches": 1})
        a.sendall(encode_frame(FrameKind.BATCH, tensors={"x": torch.zeros(4096)}))
        with pytest.raises(ProtocolError, match="exceeds `max_frame_bytes`=1024"):
            recv_raw_frame(b, max_frame_bytes=1024)


def test_frame_meta_refuses_truncated_frames() -> None:
    with pytest.raises(ProtocolError, match="truncated frame"):
        frame_meta(b"RPWF")
    raw = encode_frame(FrameKind.END, {"batches": 1})
    with pytest.raises(ProtocolError, match="not a recpipe frame"):
        frame_meta(b"XXXX" + raw[4:])


def _small_batch() -> Batch:
    gen = torch.Generator().manual_seed(7)
    kjt = _kjt(["a", "b"], 16, gen, big=False)
    ikjt = InverseKeyedJaggedTensor.from_kjt(_kjt(["u"], 16, gen, big=False))
    return Batch(dense=torch.rand(16, 3), labels=torch.rand(16), kjt=kjt, ikjts={"g": ikjt})
