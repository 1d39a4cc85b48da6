"""The reader service's wire format: length-prefixed frames of raw tensor buffers, no pickle.

Every message between ``recpipe serve`` and its clients is one *frame*::

    offset  size  field
    0       4     magic            b"RPWF"
    4       2     version          WIRE_VERSION (uint16, little endian)
    6       2     kind             FrameKind (uint16)
    8       4     descriptor_len   bytes of the JSON descriptor (uint32)
    12      8     payload_len      bytes of the tensor payload (uint64)
    20      D     descriptor       UTF-8 JSON: {"meta": {...}, "tensors": [[name, dtype, shape], ...]}
    20+D    P     payload          the tensors' raw bytes, in descriptor order, each padded to 8

A frame is checked before anything is allocated for it: the magic, the version, the kind, and
``descriptor_len + payload_len`` against the receiver's ``max_frame_bytes``. The descriptor is
then checked against the payload (known dtypes, non-negative shapes, sizes that add up to
``payload_len`` exactly), so a malformed frame raises :class:`ProtocolError` instead of
decoding garbage. Decoded tensors share one receive buffer (``torch.frombuffer``): a frame is
copied once, from the socket into that buffer.

A :class:`~recpipe.batch.Batch` travels as one ``BATCH`` frame (:func:`batch_to_frame`,
:func:`frame_to_batch`): its dense matrix, labels, session ids, the plain KJT and every IKJT
group (keys, unique values and lengths, the inverse lookup), bit for bit. The conversation
(``HELLO`` / ``WELCOME`` / ``BATCH``... / ``END``, with ``HEARTBEAT`` and ``ERROR``) is
described in :mod:`readers.service.session`.

Receiving honours the socket's timeout per read, and an optional ``deadline``
(``time.monotonic()``) for the whole frame: a peer that trickles bytes cannot stretch a frame
past it.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import orjson
import torch

from recpipe.errors import RecpipeError

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER",
    "HELLO_MAX_BYTES",
    "MAGIC",
    "WIRE_VERSION",
    "Frame",
    "FrameKind",
    "ProtocolError",
    "ServiceBusyError",
    "ServiceError",
    "ServiceTimeoutError",
    "batch_to_frame",
    "decode_frame",
    "encode_frame",
    "encode_frame_buffers",
    "frame_meta",
    "frame_to_batch",
    "recv_frame",
    "recv_raw_frame",
    "send_buffers",
]

MAGIC = b"RPWF"
WIRE_VERSION = 1
HEADER = struct.Struct("<4sHHIQ")
DEFAULT_MAX_FRAME_BYTES = 1 << 30  # 1 GiB: a B=4096 batch is a few MB
HELLO_MAX_BYTES = 64 * 1024  # HELLO and WELCOME are a few hundred bytes; refuse anything bigger
_ALIGN = 8
_PADDING = bytes(_ALIGN)

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ServiceError(RecpipeError, ConnectionError):
    """The reader service cannot be reached, refused us, failed, or went away."""


class ProtocolError(ServiceError):
    """A frame broke the wire format: bad magic/version/kind, oversized, inconsistent sizes."""


class ServiceTimeoutError(ServiceError):
    """A frame did not arrive (whole) in time: the socket's timeout or a deadline passed."""


class ServiceBusyError(ServiceError):
    """The reader service refused a client because it is at a limit (clients or readers); the
    same request may succeed later."""


class FrameKind(IntEnum):
    """What a frame carries."""

    HELLO = 1  # client -> server: token, shard, epoch; optionally a holdout part, a batch size
    WELCOME = 2  # server -> client: the handshake succeeded; server facts in meta
    BATCH = 3  # server -> client: one Batch
    HEARTBEAT = 4  # server -> client: alive, no batch ready yet
    END = 5  # server -> client: the stream is complete; totals in meta
    ERROR = 6  # either way: a refusal or a failure; meta["message"] says why


@dataclass(frozen=True)
class Frame:
    """One decoded frame.

    Attributes:
        kind: what the frame carries.
        meta: the descriptor's JSON metadata.
        tensors: the payload's tensors by name, in wire order (sharing one buffer).
        nbytes: the frame's size on the wire, header included.
    """

    kind: FrameKind
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


# -- encoding -----------------------------------------------------------------------------------
def _pad(nbytes: int) -> int:
    return -nbytes % _ALIGN


def encode_frame_buffers(
    kind: FrameKind,
    meta: Mapping[str, Any] | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> list[memoryview | bytes]:
    """Encode a frame as a list of buffers, ready for ``socket.sendmsg`` (no tensor copies).

    Args:
        kind: what the frame carries.
        meta: JSON-serialisable metadata (str keys; ints, floats, strings, lists, dicts).
        tensors: CPU tensors by name; non-contiguous ones are made contiguous first.

    Returns:
        The header, the descriptor and each tensor's bytes (plus padding), in order.
    """
    entries: list[list[Any]] = []
    payload: list[memoryview | bytes] = []
    payload_len = 0
    for name, tensor in (tensors or {}).items():
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        dtype_name = _DTYPE_NAMES.get(tensor.dtype)
        if dtype_name is None:
            msg = f"tensor `{name}` has dtype {tensor.dtype}, which the wire format cannot carry"
            raise ProtocolError(msg)
        tensor = tensor.detach().contiguous()
        entries.append([name, dtype_name, list(tensor.shape)])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            # A byte view of the tensor's storage: bfloat16 has no numpy dtype, so view as uint8.
            payload.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        pad = _pad(nbytes)
        if pad:
            payload.append(_PADDING[:pad])
        payload_len += nbytes + pad
    descriptor = orjson.dumps({"meta": dict(meta or {}), "tensors": entries})
    header = HEADER.pack(MAGIC, WIRE_VERSION, int(kind), len(descriptor), payload_len)
    return [header, descriptor, *payload]


def encode_frame(
    kind: FrameKind,
    meta: Mapping[str, Any] | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """Encode a frame as one ``bytes`` object (what reader processes hand to the server)."""
    return b"".join(encode_frame_buffers(kind, meta, tensors))


def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> int:
    """Send ``buffers`` completely with scatter-gather writes; returns the bytes sent."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(v.nbytes for v in views)
    while views:
        sent = sock.sendmsg(views[:512])  # IOV_MAX is 1024 on Linux
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
    return total


# -- decoding -----------------------------------------------------------------------------------
def _parse_header(
    header: bytes | memoryview, *, max_frame_bytes: int
) -> tuple[FrameKind, int, int]:
    magic, version, kind, descriptor_len, payload_len = HEADER.unpack(header)
    if magic != MAGIC:
        msg = f"not a recpipe frame: magic {bytes(magic)!r}, expected {MAGIC!r}"
        raise ProtocolError(msg)
    if version != WIRE_VERSION:
        msg = f"wire version {version} is not supported (this side speaks {WIRE_VERSION})"
        raise ProtocolError(msg)
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        msg = f"unknown frame kind {kind}"
        raise ProtocolError(msg) from None
    size = HEADER.size + descriptor_len + payload_len
    if size > max_frame_bytes:
        msg = (
            f"frame of {size} bytes exceeds `max_frame_bytes`={max_frame_bytes} "
            f"(kind {frame_kind.name})"
        )
        raise ProtocolError(msg)
    return frame_kind, descriptor_len, payload_len


def _parse_descriptor(
    raw: bytes | memoryview, payload_len: int
) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]:
    try:
        descriptor = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        msg = f"frame descriptor is not valid JSON: {exc}"
        raise ProtocolError(msg) from None
    if not isinstance(descriptor, dict):
        msg = f"frame descriptor must be a JSON object, got {type(descriptor).__name__}"
        raise ProtocolError(msg)
    meta = descriptor.get("meta", {})
    entries = descriptor.get("tensors", [])
    if not isinstance(meta, dict) or not isinstance(entries, list):
        msg = "frame descriptor needs an object `meta` and a list `tensors`"
        raise ProtocolError(msg)
    layout = []
    offset = 0
    seen: set[str] = set()
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3):
            msg = f"tensor entry must be [name, dtype, shape], got {entry!r:.200}"
            raise ProtocolError(msg)
        name, dtype_name, shape = entry
        if not isinstance(name, str) or name in seen:
            msg = f"tensor name {name!r:.100} is not a string or is repeated"
            raise ProtocolError(msg)
        seen.add(name)
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            msg = f"tensor `{name}` has unknown dtype {dtype_name!r:.50}"
            raise ProtocolError(msg)
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            msg = f"tensor `{name}` has an invalid shape {shape!r:.100}"
            raise ProtocolError(msg)
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if offset + nbytes > payload_len:
            msg = (
                f"tensor `{name}` ({dtype_name}{shape}) needs bytes up to {offset + nbytes} "
                f"but the payload holds {payload_len}"
            )
            raise ProtocolError(msg)
        layout.append((name, dtype, tuple(shape), offset, numel))
        offset += nbytes + _pad(nbytes)
    if offset != payload_len:
        msg = f"frame payload holds {payload_len} bytes but its tensors describe {offset}"
        raise ProtocolError(msg)
    return meta, layout


def _tensors_from_payload(
    payload: bytearray | memoryview,
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]],
) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, dtype, shape, offset, numel in layout:
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(payload, dtype=dtype, count=numel, offset=offset)
            tensors[name] = flat.view(shape)
    return tensors


def decode_frame(data: bytes | bytearray | memoryview, *, max_frame_bytes: int) -> Frame:
    """Decode one complete frame held in memory.

    The tensors share ``data``'s memory when it is writable (a ``bytearray``); a ``bytes``
    object is copied once first, since torch tensors must not alias read-only memory.

    Args:
        data: exactly one frame.
        max_frame_bytes: refuse frames larger than this.

    Raises:
        ProtocolError: the frame is malformed, truncated, has trailing bytes, or is too big.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER.size:
        msg = f"truncated frame: {view.nbytes} bytes, a header alone is {HEADER.size}"
        raise ProtocolError(msg)
    kind, descriptor_len, payload_len = _parse_header(
        view[: HEADER.size], max_frame_bytes=max_frame_bytes
    )
    expected = HEADER.size + descriptor_len + payload_len
    if view.nbytes != expected:
        msg = f"frame holds {view.nbytes} bytes but its header announces {expected}"
        raise ProtocolError(msg)
    start = HEADER.size + descriptor_len
    meta, layout = _parse_descriptor(view[HEADER.size : start], payload_len)
    payload = view[start:] if not view.readonly else bytearray(view[start:])
    return Frame(kind, meta, _tensors_from_payload(payload, layout), expected)


def _recv_exactly(
    sock: socket.socket, buffer: bytearray | memoryview, what: str, deadline: float | None
) -> None:
    view = memoryview(buffer)
    got = 0
    while got < view.nbytes:
        try:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            n = sock.recv_into(view[got:])
        except TimeoutError:
            msg = f"timed out waiting for the {what} ({got} of {view.nbytes} bytes received)"
            raise ServiceTimeoutError(msg) from None
        if n == 0:
            msg = (
                f"connection closed by the peer in the middle of the {what} "
                f"({got} of {view.nbytes} bytes received)"
            )
            raise ServiceError(msg)
        got += n


def recv_frame(
    sock: socket.socket,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    deadline: float | None = None,
) -> Frame:
    """Receive one frame from ``sock`` (honouring its timeout).

    Args:
        sock: a connected stream socket.
        max_frame_bytes: frames larger than this are refused before any allocation.
        deadline: a ``time.monotonic()`` time by which the whole frame must have arrived
            (``None``: only the socket's timeout, per read). Changes the socket's timeout.

    Raises:
        ServiceTimeoutError: the socket timed out or the deadline passed.
        ServiceError: the peer closed the connection.
        ProtocolError: the frame is malformed or too big.
    """
    header = bytearray(HEADER.size)
    _recv_exactly(sock, header, "frame header", deadline)
    kind, descriptor_len, payload_len = _parse_header(header, max_frame_bytes=max_frame_bytes)
    descriptor = bytearray(descriptor_len)
    _recv_exactly(sock, descriptor, f"{kind.name} frame descriptor", deadline)
    meta, layout = _parse_descriptor(descriptor, payload_len)
    payload = bytearray(payload_len)
    _recv_exactly(sock, payload, f"{kind.name} frame payload", deadline)
    tensors = _tensors_from_payload(payload, layout)
    return Frame(kind, meta, tensors, HEADER.size + descriptor_len + payload_len)


def recv_raw_frame(
    sock: socket.socket, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[FrameKind, bytearray]:
    """Receive one frame from ``sock`` without decoding it: its kind and its bytes, whole.

    What the server does with its readers' frames: check the header, then relay the bytes
    as they are (one copy in, one copy out, nothing decoded).

    Raises:
        ServiceTimeoutError: the socket timed out.
        ServiceError: the peer closed the connection.
        ProtocolError: the header is malformed or announces a frame over ``max_frame_bytes``.
    """
    header = bytearray(HEADER.size)
    _recv_exactly(sock, header, "frame header", None)
    kind, descriptor_len, payload_len = _parse_header(header, max_frame_bytes=max_frame_bytes)
    frame = bytearray(HEADER.size + descriptor_len + payload_len)
    frame[: HEADER.size] = header
    _recv_exactly(sock, memoryview(frame)[HEADER.size :], f"{kind.name} frame", None)
    return kind, frame


def frame_meta(frame: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The JSON metadata of a complete frame, without touching its payload.

    Raises:
        ProtocolError: the header or the descriptor is malformed.
    """
    view = memoryview(frame).cast("B")
    if view.nbytes < HEADER.size:
        msg = f"truncated frame: {view.nbytes} bytes, a header alone is {HEADER.size}"
        raise ProtocolError(msg)
    _, descriptor_len, payload_len = _parse_header(view[: HEADER.size], max_frame_bytes=view.nbytes)
    meta, _ = _parse_descriptor(view[HEADER.size : HEADER.size + descriptor_len], payload_len)
    return meta


# -- Batch <-> frame ----------------------------------------------------------------------------
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _put(
    tensors: dict[str, torch.Tensor],
    widen: list[str],
    name: str,
    tensor: torch.Tensor,
    narrow: bool,
) -> None:
    """Add ``tensor``; int64 tensors whose values fit in int32 travel as int32 if ``narrow``."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if narrow and tensor.dtype == torch.int64 and tensor.numel():
        lo, hi = torch.aminmax(tensor)
        if int(lo) >= _INT32_MIN and int(hi) <= _INT32_MAX:
            tensor = tensor.to(torch.int32)
            widen.append(name)
    tensors[name] = tensor


def batch_to_frame(
    batch: Batch, *, meta: Mapping[str, Any] | None = None, narrow: bool = True
) -> list[memoryview | bytes]:
    """Encode ``batch`` as one ``BATCH`` frame (a buffer list for :func:`send_buffers`).

    Offsets are not sent (the receiver derives them from the lengths).

    Args:
        batch: the batch; its tensors are moved to the CPU if needed.
        meta: extra JSON metadata to carry along (e.g. a sequence number).
        narrow: send int64 tensors whose values fit in int32 (lengths, inverse lookups, small
            ids) as int32; they are widened back to int64 on decode, so the round trip stays
            exact. Halves those tensors' bytes on the wire.

    Returns:
        The frame's buffers; ``b"".join(...)`` gives the frame as bytes.
    """
    from recpipe.ikjt import InverseKeyedJaggedTensor

    tensors: dict[str, torch.Tensor] = {}
    widen: list[str] = []
    _put(tensors, widen, "dense", batch.dense, narrow)
    _put(tensors, widen, "labels", batch.labels, narrow)
    if batch.session_ids is not None:
        _put(tensors, widen, "session_ids", batch.session_ids, narrow)
    _put(tensors, widen, "kjt.values", batch.kjt.values(), narrow)
    _put(tensors, widen, "kjt.lengths", batch.kjt.lengths(), narrow)
    groups = []
    for i, (name, group) in enumerate(batch.ikjts.items()):
        prefix = f"g{i}."
        _put(tensors, widen, prefix + "values", group.values(), narrow)
        if isinstance(group, InverseKeyedJaggedTensor):
            kind = "ikjt"
            _put(tensors, widen, prefix + "lengths", group.lengths(), narrow)
            _put(tensors, widen, prefix + "inverse", group.inverse_lookup, narrow)
        else:
            kind = "partial"
            _put(tensors, widen, prefix + "win_offsets", group.window_offsets, narrow)
            _put(tensors, widen, prefix + "win_lengths", group.window_lengths, narrow)
        groups.append({"name": name, "kind": kind, "keys": group.keys()})
    for i, tensor in enumerate(batch.extras.values()):
        _put(tensors, widen, f"x{i}", tensor, narrow)
    header = {
        **dict(meta or {}),
        "rows": batch.batch_size,
        "kjt": {"keys": batch.kjt.keys(), "stride": batch.kjt.stride()},
        "groups": groups,
        "widen": widen,
    }
    if batch.extras:
        header["extras"] = list(batch.extras)
    return encode_frame_buffers(FrameKind.BATCH, header, tensors)


def frame_to_batch(frame: Frame) -> Batch:
    """Decode a ``BATCH`` frame into the :class:`~recpipe.batch.Batch` it was made from.

    Raises:
        ProtocolError: the frame is not a ``BATCH`` frame or does not describe a valid batch.
    """
    from recpipe.batch import Batch
    from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
    from recpipe.jagged import KeyedJaggedTensor

    if frame.kind is not FrameKind.BATCH:
        msg = f"expected a BATCH frame, got {frame.kind.name}"
        raise ProtocolError(msg)
    meta, tensors = frame.meta, dict(frame.tensors)
    try:
        for name in meta.get("widen", []):
            tensors[name] = tensors[name].to(torch.int64)
        kjt_meta = meta["kjt"]
        kjt = KeyedJaggedTensor(
            kjt_meta["keys"],
            tensors["kjt.values"],
            tensors["kjt.lengths"],
            stride=kjt_meta["stride"],
        )
        ikjts: dict[str, Any] = {}
        for i, group in enumerate(meta["groups"]):
            prefix = f"g{i}."
            if group["kind"] == "ikjt":
                ikjts[group["name"]] = InverseKeyedJaggedTensor(
                    group["keys"],
                    tensors[prefix + "values"],
                    tensors[prefix + "lengths"],
                    tensors[prefix + "inverse"],
                )
            elif group["kind"] == "partial":
                ikjts[group["name"]] = PartialInverseKeyedJaggedTensor(
                    group["keys"],
                    tensors[prefix + "values"],
                    tensors[prefix + "win_offsets"],
                    tensors[prefix + "win_lengths"],
                )
            else:
                msg = f"unknown group kind {group['kind']!r:.50}"
                raise ProtocolError(msg)
        return Batch(
            dense=tensors["dense"],
            labels=tensors["labels"],
            kjt=kjt,
            ikjts=ikjts,
            session_ids=tensors.get("session_ids"),
            extras={name: tensors[f"x{i}"] for i, name in enumerate(meta.get("extras", []))},
        )
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, RecpipeError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        msg = f"BATCH frame does not describe a valid batch: {what}"
        raise ProtocolError(msg) from None
