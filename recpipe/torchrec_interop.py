"""Conversion between recpipe's jagged types and TorchRec's (``torchrec.sparse.jagged_tensor``).

recpipe's :class:`~recpipe.jagged.KeyedJaggedTensor` uses TorchRec's key-major layout, so the
conversions share the tensors (no copies). TorchRec is optional: it is imported here, lazily,
through :func:`recpipe._deps.optional_import`, whose error says how to install it.

What maps onto what:

* ``KeyedJaggedTensor`` <-> TorchRec ``KeyedJaggedTensor`` (:func:`to_torchrec`,
  :func:`from_torchrec`), ``JaggedTensor`` <-> TorchRec ``JaggedTensor``.
* ``InverseKeyedJaggedTensor`` <-> a *variable-batch* TorchRec KJT (:func:`ikjt_to_torchrec`,
  :func:`ikjt_from_torchrec`): every key has stride U (``stride_per_key_per_rank``) and
  ``inverse_indices = (keys, [len(keys), B])`` expands it to B rows. TorchRec's
  ``EmbeddingBagCollection`` pools the U rows and expands the pooled output with them.
* ``Batch`` -> TorchRec's ``datasets.utils.Batch`` (:func:`batch_to_torchrec`), expanded.

What TorchRec cannot express:

* A *grouped* IKJT's one inverse lookup shared by all keys: TorchRec keeps one inverse row per
  key. :func:`ikjt_to_torchrec` passes a ``[len(keys), B]`` view of the single inverse lookup
  (no copy), but nothing in TorchRec knows or keeps those rows equal, and the invariant that
  rows are unique by the tuple of the group's lists is lost. :func:`ikjt_from_torchrec` checks
  that the rows are equal and refuses otherwise.
* Inverse indices on sequence (unpooled) features: TorchRec applies them only to pooled
  embedding-bag outputs; recpipe expands jagged rows with jagged index select (RecD O6).
* The partial IKJT (RecD §7, overlapping ``[offset, length]`` windows): TorchRec rows cannot
  overlap, so expand it with ``to_kjt()`` first.
* Dense features, labels and several dedup groups in one batch: TorchRec's ``Batch`` has one
  sparse KJT, so :func:`batch_to_torchrec` hands it the expanded (no-dedup) view.
* Weighted KJTs (``weights``) have no recpipe counterpart; :func:`from_torchrec` refuses them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from recpipe._deps import optional_import
from recpipe.batch import Batch
from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor

__all__ = [
    "batch_to_torchrec",
    "from_torchrec",
    "ikjt_from_torchrec",
    "ikjt_to_torchrec",
    "jagged_from_torchrec",
    "jagged_to_torchrec",
    "to_torchrec",
]


def _sparse() -> ModuleType:
    return optional_import(
        "torchrec.sparse.jagged_tensor", purpose="conversion to and from TorchRec tensors"
    )


def to_torchrec(kjt: KeyedJaggedTensor) -> Any:
    """A TorchRec ``KeyedJaggedTensor`` sharing ``kjt``'s values, lengths and offsets."""
    return _sparse().KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
        stride=kjt.stride(),
    )


def from_torchrec(kjt: Any, *, validate: bool = True) -> KeyedJaggedTensor:
    """A recpipe KJT sharing a TorchRec KJT's tensors (int32 lengths are widened to int64).

    Args:
        kjt: a TorchRec ``KeyedJaggedTensor`` with one stride for all keys and no weights.
        validate: check the layout.

    Raises:
        DataError: weighted, or variable batch per key (use :func:`ikjt_from_torchrec`).
    """
    _check_torchrec_kjt(kjt)
    if kjt.weights_or_none() is not None:
        msg = "`kjt` has weights; recpipe's KeyedJaggedTensor has no weights"
        raise DataError(msg)
    if kjt.variable_stride_per_key():
        msg = (
            f"`kjt` has a variable batch per key (stride_per_key {kjt.stride_per_key()}); "
            "convert it with `ikjt_from_torchrec`"
        )
        raise DataError(msg)
    offsets = kjt.offsets_or_none()
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        kjt.lengths().to(torch.int64),
        offsets=None if offsets is None else offsets.to(torch.int64),
        stride=kjt.stride(),
        validate=validate,
    )


def jagged_to_torchrec(jt: JaggedTensor) -> Any:
    """A TorchRec ``JaggedTensor`` sharing ``jt``'s values and offsets."""
    return _sparse().JaggedTensor(values=jt.values(), offsets=jt.offsets())


def jagged_from_torchrec(jt: Any, *, validate: bool = True) -> JaggedTensor:
    """A recpipe JaggedTensor sharing a TorchRec ``JaggedTensor``'s values and offsets."""
    if jt.weights_or_none() is not None:
        msg = "`jt` has weights; recpipe's JaggedTensor has no weights"
        raise DataError(msg)
    return JaggedTensor(jt.values(), jt.offsets().to(torch.int64), validate=validate)


def ikjt_to_torchrec(ikjt: InverseKeyedJaggedTensor) -> Any:
    """A variable-batch TorchRec KJT: the U unique rows per key plus ``inverse_indices``.

    The values and lengths are shared; ``inverse_indices`` is a ``[len(keys), B]`` view of
    the one inverse lookup (see the module docstring for what TorchRec loses of a group).
    """
    if isinstance(ikjt, PartialInverseKeyedJaggedTensor):
        msg = "TorchRec cannot express a partial IKJT (overlapping windows); pass `ikjt.to_kjt()`"
        raise DataError(msg)
    keys = ikjt.keys()
    inverse = ikjt.inverse_lookup.unsqueeze(0).expand(len(keys), -1)  # (K, B), a view
    return _sparse().KeyedJaggedTensor(
        keys=keys,
        values=ikjt.values(),
        lengths=ikjt.lengths(),
        offsets=ikjt.offsets(),
        stride=ikjt.batch_size,
        stride_per_key_per_rank=[[ikjt.num_unique] for _ in keys],
        inverse_indices=(keys, inverse),
    )


def ikjt_from_torchrec(kjt: Any, *, validate: bool = True) -> InverseKeyedJaggedTensor:
    """An IKJT from a variable-batch TorchRec KJT with ``inverse_indices``.

    Every key must have the same stride U and the same inverse row (a group shares one
    inverse lookup). Keys that TorchRec deduplicated separately form one IKJT each: build one
    TorchRec KJT per key and convert each.

    Args:
        kjt: a TorchRec ``KeyedJaggedTensor`` with ``inverse_indices``.
        validate: check the layout and the inverse range.

    Raises:
        DataError: no inverse indices, weights, or keys with different strides or inverses.
    """
    _check_torchrec_kjt(kjt)
    inverse_info = kjt.inverse_indices_or_none()
    if inverse_info is None:
        msg = "`kjt` has no `inverse_indices`; use `from_torchrec` for a plain KJT"
        raise DataError(msg)
    if kjt.weights_or_none() is not None:
        msg = "`kjt` has weights; recpipe's InverseKeyedJaggedTensor has no weights"
        raise DataError(msg)
    keys = kjt.keys()
    if not keys:
        msg = "`kjt` has no keys; an InverseKeyedJaggedTensor needs at least one, got []"
        raise DataError(msg)
    inv_keys, inv = inverse_info
    strides = kjt.stride_per_key() if kjt.variable_stride_per_key() else [kjt.stride()] * len(keys)
    if len(set(strides)) > 1:
        msg = (
            f"every key of `kjt` must have the same number of unique rows to form one group, "
            f"got stride_per_key {dict(zip(keys, strides))}"
        )
        raise DataError(msg)
    missing = [k for k in keys if k not in inv_keys]
    if missing:
        msg = f"`inverse_indices` name no inverse row for keys {missing!r} (they name {inv_keys!r})"
        raise DataError(msg)
    if inv.dim() != 2:
        msg = f"`inverse_indices` must be [len(keys), B], got shape {tuple(inv.shape)}"
        raise DataError(msg)
    rows = inv[[list(inv_keys).index(k) for k in keys]]  # (K, B)
    if rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
        msg = (
            f"the keys {keys!r} have different inverse indices; a grouped IKJT shares one "
            "inverse lookup. Convert each key's own KJT separately"
        )
        raise DataError(msg)
    offsets = kjt.offsets_or_none()
    return InverseKeyedJaggedTensor(
        keys,
        kjt.values(),
        kjt.lengths().to(torch.int64),
        rows[0].to(torch.int64),
        offsets=None if offsets is None else offsets.to(torch.int64),
        validate=validate,
    )


def batch_to_torchrec(batch: Batch) -> Any:
    """TorchRec's ``datasets.utils.Batch`` of the expanded (no-dedup) view of ``batch``."""
    utils = optional_import("torchrec.datasets.utils", purpose="conversion to a TorchRec Batch")
    plain = batch.to_plain()
    return utils.Batch(
        dense_features=plain.dense,
        sparse_features=to_torchrec(plain.kjt),
        labels=plain.labels,
    )


def _check_torchrec_kjt(kjt: Any) -> None:
    cls = _sparse().KeyedJaggedTensor
    if not isinstance(kjt, cls):
        msg = f"`kjt` must be a torchrec KeyedJaggedTensor, got {type(kjt).__name__}"
        raise DataError(msg)
