"""The training batch: dense features, labels, plain and deduplicated sparse features.

A :class:`Batch` is what readers yield and trainers consume. It knows how to move
(``to(device, non_blocking=...)``, ``pin_memory()``), so a ``torch.utils.data.DataLoader`` with
``pin_memory=True`` pins it through its own method.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from recpipe._tensors import move_tensor, pin_optional, pin_tensor, tensors_equal
from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor

__all__ = ["Batch", "DedupFeatures"]

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
        """A copy with every tensor on ``device``."""
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
        (``Tensor.pin_memory()`` raises), and there is nothing to copy to.
        """
        return Batch(
            dense=pin_tensor(self.dense),
            labels=pin_tensor(self.labels),
            kjt=self.kjt.pin_memory(),
            ikjts={n: g.pin_memory() for n, g in self.ikjts.items()},
            session_ids=pin_optional(self.session_ids),
            extras={n: pin_tensor(t) for n, t in self.extras.items()},
        )

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


def _check_rows(name: str, tensor: object, num_rows: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.shape[0] != num_rows:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        msg = f"`{name}` must be a [B] tensor with B = {num_rows} (rows of `dense`), got {got}"
        raise DataError(msg)
