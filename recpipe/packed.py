"""Many tensors in one contiguous byte buffer: one transfer instead of one per tensor.

A batch is a dozen or more tensors. Every step that moves it does so tensor by tensor unless
they share a buffer: a ``DataLoader`` worker sends each tensor as its own shared-memory segment
(and the main process fetches each segment's file descriptor from the worker in a round trip),
pinning copies each into its own page-locked block, and a host -> device move launches one copy
each. Packed, each of those happens once per batch. The layout is a tuple of :class:`Slot`
(dtype, shape, byte offset), small and picklable; the tensors are views into the buffer::

    buffer (uint8):  | dense [B, F] float32 |pad| labels [B] |pad| values [N] int64 | ...
    layout:          (Slot(float32, (B, F), 0), Slot(float32, (B,), 4BF + pad), ...)

Every slot starts at a multiple of :data:`ALIGN` bytes (a multiple of every element size, and
of a cache line), so each view is aligned on the host and, after one copy of the buffer, on a
device. :class:`recpipe.batch.Batch` builds on these (``Batch.pack()``,
:class:`~recpipe.batch.PackedBatch`).

Private to recpipe's types: the public surface is ``Batch.pack`` and ``PackedBatch``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from recpipe.errors import DataError

__all__ = ["ALIGN", "Layout", "Slot", "pack_tensors", "shared_buffer", "tensor_views"]

ALIGN = 64
"""Byte alignment of every tensor in a packed buffer."""


class Slot(NamedTuple):
    """Where one tensor lies in a packed buffer."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in bytes, a multiple of ALIGN when packed by pack_tensors

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


Layout = tuple[Slot, ...]


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def pack_tensors(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Layout]:
    """Copy ``tensors`` into one new 1-d uint8 CPU buffer; returns it and their layout.

    Each tensor starts at a multiple of :data:`ALIGN` bytes; the padding bytes are unspecified.
    Non-contiguous tensors are packed in row-major order (views come back contiguous).
    """
    slots = []
    end = 0
    for tensor in tensors:
        slot = Slot(tensor.dtype, tuple(tensor.shape), _aligned(end))
        slots.append(slot)
        end = slot.offset + slot.nbytes
    buffer = torch.empty(_aligned(end), dtype=torch.uint8)
    layout = tuple(slots)
    for tensor, view in zip(tensors, tensor_views(buffer, layout), strict=True):
        view.copy_(tensor.detach())
    return buffer, layout


def tensor_views(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors of ``layout`` as views into ``buffer`` (a 1-d uint8 tensor, any device)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        msg = f"a packed buffer must be a 1-d uint8 tensor, got {buffer.dtype}{tuple(buffer.shape)}"
        raise DataError(msg)
    if layout and layout[-1].offset + layout[-1].nbytes > buffer.numel():
        msg = (
            f"a packed buffer of {buffer.numel()} bytes is too short for its layout "
            f"(it needs {layout[-1].offset + layout[-1].nbytes})"
        )
        raise DataError(msg)
    return [buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in layout]


def shared_buffer(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Layout] | None:
    """The packed buffer that ``tensors`` are views into, with their layout, else ``None``.

    ``tensors`` qualify when they are contiguous CPU tensors in one storage that holds little
    besides them (at most :data:`ALIGN` bytes of padding per tensor, and one more): the buffer
    is then the whole storage, and copying it moves every tensor at once. What
    :func:`pack_tensors` makes always qualifies (also after pinning the buffer).
    """
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    if tensors[0].device.type != "cpu":
        return None
    ptr, slots, used = storage.data_ptr(), [], 0
    for tensor in tensors:
        if (
            tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != ptr
        ):
            return None
        offset = int(tensor.storage_offset()) * tensor.itemsize
        slot = Slot(tensor.dtype, tuple(tensor.shape), offset)
        slots.append(slot)
        used += slot.nbytes
    if storage.nbytes() > used + ALIGN * (len(tensors) + 1):
        return None  # views into something larger: copying it all would move more than them
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)  # the whole storage, as bytes
    return buffer, tuple(slots)
