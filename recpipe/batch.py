"""The training batch: dense features, labels, plain and deduplicated sparse features.

A :class:`Batch` is what readers yield and trainers consume. It knows how to move
(``to(device, non_blocking=...)``, ``pin_memory()``), so a ``torch.utils.data.DataLoader`` with
``pin_memory=True`` pins it through its own method. ``pack()`` puts all its tensors in one
buffer (:class:`PackedBatch`), which crosses a process boundary, is pinned and is copied to a
device as one block; a batch unpacked from it moves that way too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from recpipe._tensors import move_tensor, pin_optional, pin_tensor, tensors_equal
from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor
from recpipe.packed import Layout, pack_tensors, shared_buffer, tensor_views

__all__ = ["Batch", "DedupFeatures", "PackedBatch"]

DedupFeatures = InverseKeyedJaggedTensor | PartialInverseKeyedJaggedTensor
"""A deduplicated group: an IKJT, or its partial (windowed) form."""


@dataclass(eq=False)
class Batch:
    """One training batch of B rows.

    Attributes:
        dense: ``[B, F]`` float32 dense features.
        labels: ``[B]`` labels.
        kjt: the sparse features that are not deduplicated (B rows per key; may have no keys).
        ikjts: ``{group name: IKJT}``, each group deduplicated together with its own inverse
            lookup (a :class:`~recpipe.ikjt.PartialInverseKeyedJaggedTensor` is accepted too).
        session_ids: ``[B]`` int64 session of each row (``None`` when unknown).
        extras: ``{name: tensor}`` of per-row columns carried along untouched (pass-through
            columns such as request or user ids, to join predictions back to requests): each
            tensor's first dimension is B. They move with ``to()`` / ``pin_memory()``, travel
            over the reader service's wire, and are kept by preprocessing and ``to_plain()``.

    Shapes are checked on construction (O(1), no pass over the data). Feature keys must be
    unique across ``kjt`` and all groups.

    Example::

        batch = Batch(dense, labels, kjt, ikjts={"user": ikjt}, session_ids=sessions)
        batch = batch.pin_memory().to("cuda", non_blocking=True)
        plain = batch.to_plain()  # the same batch without dedup: one KJT of every feature
    """

    dense: torch.Tensor
    labels: torch.Tensor
    kjt: KeyedJaggedTensor
    ikjts: dict[str, DedupFeatures] = field(default_factory=dict)
    session_ids: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.dense, torch.Tensor) or self.dense.dim() != 2:
            got = (
                tuple(self.dense.shape)
                if isinstance(self.dense, torch.Tensor)
                else type(self.dense).__name__
            )
            msg = f"`dense` must be a [B, F] tensor, got {got}"
            raise DataError(msg)
        if self.dense.dtype != torch.float32:
            msg = f"`dense` must be float32, got {self.dense.dtype}"
            raise DataError(msg)
        b = self.dense.shape[0]
        _check_rows("labels", self.labels, b)
        if self.session_ids is not None:
            _check_rows("session_ids", self.session_ids, b)
        for name, tensor in self.extras.items():
            if not isinstance(name, str) or not name:
                msg = f"`extras` keys must be non-empty strings, got {name!r}"
                raise DataError(msg)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1 or tensor.shape[0] != b:
                got = (
                    tuple(tensor.shape)
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                msg = f"`extras[{name!r}]` must be a tensor of B = {b} rows (rows of `dense`), got {got}"
                raise DataError(msg)
        if not isinstance(self.kjt, KeyedJaggedTensor):
            msg = f"`kjt` must be a KeyedJaggedTensor, got {type(self.kjt).__name__}"
            raise DataError(msg)
        if self.kjt.keys() and self.kjt.stride() != b:
            msg = f"`kjt` has stride {self.kjt.stride()} but the batch has {b} rows (`dense`)"
            raise DataError(msg)
        seen = {key: "kjt" for key in self.kjt.keys()}
        for name, group in self.ikjts.items():
            if not isinstance(group, InverseKeyedJaggedTensor | PartialInverseKeyedJaggedTensor):
                msg = f"`ikjts[{name!r}]` must be an IKJT, got {type(group).__name__}"
                raise DataError(msg)
            if group.batch_size != b:
                msg = f"`ikjts[{name!r}]` has batch size {group.batch_size}, the batch {b} rows"
                raise DataError(msg)
            for key in group.keys():
                if key in seen:
                    msg = f"feature {key!r} is in both `{seen[key]}` and `ikjts[{name!r}]`"
                    raise DataError(msg)
                seen[key] = f"ikjts[{name!r}]"

    @property
    def batch_size(self) -> int:
        """Rows in the batch, B."""
        return self.dense.shape[0]

    @property
    def sparse_keys(self) -> tuple[str, ...]:
        """Every sparse feature: the plain ones, then each group's, in group order."""
        return (*self.kjt.keys(), *(k for group in self.ikjts.values() for k in group.keys()))

    def to_plain(self) -> Batch:
        """The same batch without dedup: every group expanded into one KJT (key order as
        :attr:`sparse_keys`). This is the baseline a dedup-aware model must match."""
        if not self.ikjts:
            return self
        kjt = KeyedJaggedTensor.concat([self.kjt, *(g.to_kjt() for g in self.ikjts.values())])
        return dataclasses.replace(self, kjt=kjt, ikjts={})

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device``.

        A batch whose tensors are views into one packed buffer (:meth:`PackedBatch.unpack`)
        moves as one copy of that buffer; any other batch, tensor by tensor.
        """
        device = torch.device(device)
        if device != self.dense.device:
            packed = self._as_packed()
            if packed is not None:
                return packed.to(device, non_blocking=non_blocking).unpack()
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            kjt=self.kjt.to(device, non_blocking=non_blocking),
            ikjts={n: g.to(device, non_blocking=non_blocking) for n, g in self.ikjts.items()},
            session_ids=move_tensor(self.session_ids, device, non_blocking=non_blocking),
            extras={n: t.to(device, non_blocking=non_blocking) for n, t in self.extras.items()},
        )

    def pin_memory(self) -> Batch:
        """Page-locked copy for fast host -> accelerator copies.

        A no-op on a machine without an accelerator: torch 2.13 cannot pin memory there
        (``Tensor.pin_memory()`` raises), and there is nothing to copy to. A batch unpacked
        from a :class:`PackedBatch` pins its one buffer.
        """
        packed = self._as_packed()
        if packed is not None:
            return packed.pin_memory().unpack()
        return Batch(
            dense=pin_tensor(self.dense),
            labels=pin_tensor(self.labels),
            kjt=self.kjt.pin_memory(),
            ikjts={n: g.pin_memory() for n, g in self.ikjts.items()},
            session_ids=pin_optional(self.session_ids),
            extras={n: pin_tensor(t) for n, t in self.extras.items()},
        )

    def pack(self) -> PackedBatch:
        """Every tensor of the batch copied into one new CPU buffer (see :class:`PackedBatch`)."""
        spec, tensors = self._parts()
        buffer, layout = pack_tensors(tensors)
        return PackedBatch(buffer, layout, spec)

    def _as_packed(self) -> PackedBatch | None:
        """The packed batch this batch is a view of, without copying; ``None`` if it is not."""
        spec, tensors = self._parts()
        found = shared_buffer(tensors)
        return None if found is None else PackedBatch(found[0], found[1], spec)

    def _parts(self) -> tuple[_Spec, list[torch.Tensor]]:
        """Every tensor of the batch in a fixed order, and what rebuilds the batch from them
        (with what the jagged types know on the host, so a device copy reads nothing back)."""
        tensors = [self.dense, self.labels]
        if self.session_ids is not None:
            tensors.append(self.session_ids)
        kjt_spec = _KjtSpec.of(self.kjt, tensors)
        groups: list[tuple[str, _KjtSpec | _PartialSpec]] = []
        for name, group in self.ikjts.items():
            if isinstance(group, InverseKeyedJaggedTensor):
                groups.append((name, _KjtSpec.of(group.unique, tensors)))
                tensors.append(group.inverse_lookup)
            else:
                tensors += [group.values(), group.window_offsets, group.window_lengths]
                spans = group._host_spans()
                known = None if spans is None else tuple(spans.items())
                groups.append((name, _PartialSpec(tuple(group.keys()), known)))
        tensors += self.extras.values()
        spec = _Spec(kjt_spec, tuple(groups), self.session_ids is not None, tuple(self.extras))
        return spec, tensors

    def equals(self, other: object) -> bool:
        """Exact equality of every field (IKJTs compared in stored form)."""
        return (
            isinstance(other, Batch)
            and tensors_equal(self.dense, other.dense)
            and tensors_equal(self.labels, other.labels)
            and tensors_equal(self.session_ids, other.session_ids)
            and self.kjt.equals(other.kjt)
            and list(self.ikjts) == list(other.ikjts)
            and all(g.equals(other.ikjts[n]) for n, g in self.ikjts.items())
            and list(self.extras) == list(other.extras)
            and all(tensors_equal(t, other.extras[n]) for n, t in self.extras.items())
        )


@dataclass(frozen=True)
class _KjtSpec:
    """A KJT in :meth:`Batch._parts`: its keys and stride, whether its derived offsets travel
    (after values and lengths), and where each key starts when the host knows it."""

    keys: tuple[str, ...]
    stride: int
    offsets: bool
    offset_per_key: tuple[int, ...] | None

    @classmethod
    def of(cls, kjt: KeyedJaggedTensor, tensors: list[torch.Tensor]) -> _KjtSpec:
        offsets = kjt.offsets_or_none()
        tensors += [kjt.values(), kjt.lengths()]
        if offsets is not None:
            tensors.append(offsets)
        known = kjt._host_offset_per_key()
        per_key = None if known is None else tuple(known)
        return cls(tuple(kjt.keys()), kjt.stride(), offsets is not None, per_key)

    def build(self, parts: Iterator[torch.Tensor]) -> KeyedJaggedTensor:
        values, lengths = next(parts), next(parts)
        offsets = next(parts) if self.offsets else None
        kjt = KeyedJaggedTensor(
            self.keys, values, lengths, offsets=offsets, stride=self.stride, validate=False
        )
        if self.offset_per_key is not None:  # as KeyedJaggedTensor.to carries it
            kjt._offset_per_key = list(self.offset_per_key)
        return kjt


@dataclass(frozen=True)
class _PartialSpec:
    """A partial IKJT in :meth:`Batch._parts` (values, window offsets, window lengths): its
    keys and each key's host-known span (see ``PartialInverseKeyedJaggedTensor.to``)."""

    keys: tuple[str, ...]
    spans: tuple[tuple[str, tuple[int, int, int]], ...] | None

    def build(self, parts: Iterator[torch.Tensor]) -> PartialInverseKeyedJaggedTensor:
        values, starts, lengths = next(parts), next(parts), next(parts)
        group = PartialInverseKeyedJaggedTensor(self.keys, values, starts, lengths, validate=False)
        if self.spans is not None:
            group._host = dict(self.spans)
        return group


@dataclass(frozen=True)
class _Spec:
    """How a batch is rebuilt from its tensors in :meth:`Batch._parts` order (picklable)."""

    kjt: _KjtSpec
    groups: tuple[tuple[str, _KjtSpec | _PartialSpec], ...]
    session_ids: bool
    extras: tuple[str, ...]

    def build(self, tensors: list[torch.Tensor]) -> Batch:
        parts = iter(tensors)
        dense, labels = next(parts), next(parts)
        session_ids = next(parts) if self.session_ids else None
        kjt = self.kjt.build(parts)
        ikjts: dict[str, DedupFeatures] = {}
        for name, group in self.groups:
            if isinstance(group, _PartialSpec):
                ikjts[name] = group.build(parts)
            else:
                ikjts[name] = InverseKeyedJaggedTensor.from_unique(
                    group.build(parts), next(parts), validate=False
                )
        extras = {name: next(parts) for name in self.extras}
        return Batch(dense, labels, kjt, ikjts, session_ids, extras)


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """A :class:`Batch` whose tensors all lie in one contiguous byte buffer.

    What crosses from a ``DataLoader`` worker to the main process (one shared-memory segment
    instead of one per tensor), is pinned (one page-locked block) and copied to a device (one
    copy). :meth:`unpack` gives the batch back, exactly (every tensor, dtype, key, inverse
    lookup and derived offsets), its tensors views into the buffer (no copy); such a batch's
    own ``to()`` and ``pin_memory()`` move the one buffer as well. The views keep the whole
    buffer alive: a caller that keeps one field of many batches should clone it.

    Example::

        packed = batch.pack()                       # in a reader process
        packed = packed.pin_memory().to("cuda", non_blocking=True)
        assert packed.unpack().equals(batch)

    Attributes:
        buffer: 1-d uint8 tensor holding every tensor of the batch.
        layout: where each tensor lies in ``buffer`` (:class:`recpipe.packed.Slot`).
    """

    buffer: torch.Tensor
    layout: Layout
    spec: _Spec

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self.buffer.numel()

    def unpack(self) -> Batch:
        """The batch, its tensors views into :attr:`buffer` on the buffer's device."""
        return self.spec.build(tensor_views(self.buffer, self.layout))

    def pin_memory(self) -> PackedBatch:
        """The buffer page-locked (a no-op without an accelerator, as ``Batch.pin_memory``)."""
        return dataclasses.replace(self, buffer=pin_tensor(self.buffer))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedBatch:
        """The buffer on ``device``: one copy."""
        return dataclasses.replace(self, buffer=self.buffer.to(device, non_blocking=non_blocking))


def _check_rows(name: str, tensor: object, num_rows: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.shape[0] != num_rows:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        msg = f"`{name}` must be a [B] tensor with B = {num_rows} (rows of `dense`), got {got}"
        raise DataError(msg)
