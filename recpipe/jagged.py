"""Jagged tensors: :class:`JaggedTensor` (one feature) and :class:`KeyedJaggedTensor` (many).

Both are small value classes in the layout of TorchRec's ``sparse/jagged_tensor.py``: a flat
``values`` tensor and per-row ``lengths``/``offsets``, named constructors, derived fields computed
once when missing, exact ``equals``, and ``to(device)``/``pin_memory()``. The fields TorchRec
reads through methods are methods here too, with TorchRec's names and return types
(``kjt.values()``, ``kjt.keys()`` a list, ``kjt.lengths()``, ``kjt.offsets()``, ``kjt.stride()``,
``kjt.length_per_key()``, ``kjt.offset_per_key()``, ``jt.values()``, ...), so code written for
TorchRec runs unchanged on a recpipe batch; recpipe's own fields (``batch_size``,
``num_values``, ``device``, ``dtype``) are properties. The row gathers run in
:func:`recpipe.kernels.jagged_index_select` (autograd-aware); nothing here loops over rows.

The deduplicated forms live in :mod:`recpipe.ikjt`; conversion to and from TorchRec in
:mod:`recpipe.torchrec_interop`.

One concept, over 600 lines: the two jagged value types (TorchRec keeps them in one file too);
most of the length is :class:`KeyedJaggedTensor`'s TorchRec-compatible API.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from recpipe._tensors import (
    as_index_tensor,
    as_tensor,
    move_tensor,
    pin_optional,
    pin_tensor,
    quote,
    tensors_equal,
)
from recpipe.errors import DataError
from recpipe.kernels import jagged_index_select

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "arrow_list_arrays", "lengths_to_offsets"]


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int64, ``lengths.numel() + 1`` long."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def _check_lengths(lengths: torch.Tensor, *, name: str) -> None:
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        msg = (
            f"`{name}` must be non-negative, got {int(lengths[bad])} at row {bad}: {quote(lengths)}"
        )
        raise DataError(msg)


def _check_offsets(offsets: torch.Tensor, num_values: int, *, name: str) -> None:
    if offsets.numel() == 0:
        msg = f"`{name}` must hold at least one element (B + 1 offsets for B rows), got []"
        raise DataError(msg)
    if int(offsets[0]) != 0:
        msg = f"`{name}` must start at 0, got {int(offsets[0])}: {quote(offsets)}"
        raise DataError(msg)
    steps = offsets[1:] - offsets[:-1]
    if steps.numel() and bool((steps < 0).any()):
        bad = int(torch.nonzero(steps < 0)[0, 0])
        msg = (
            f"`{name}` must be non-decreasing, got {int(offsets[bad])} then "
            f"{int(offsets[bad + 1])} at rows {bad}..{bad + 1}: {quote(offsets)}"
        )
        raise DataError(msg)
    if int(offsets[-1]) != num_values:
        msg = (
            f"`{name}` must end at the number of values ({num_values}), "
            f"got {int(offsets[-1])}: {quote(offsets)}"
        )
        raise DataError(msg)


def _check_values(values: Any, *, name: str = "values") -> torch.Tensor:
    tensor = as_tensor(values, name=name)
    if tensor.dim() not in (1, 2):
        msg = f"`{name}` must be [N] or [N, D], got shape {tuple(tensor.shape)}"
        raise DataError(msg)
    return tensor


class _ValuesFields:
    """``num_values``/``device``/``dtype`` of a type whose ``values()`` is its storage."""

    __slots__ = ()

    if TYPE_CHECKING:

        def values(self) -> torch.Tensor: ...

    @property
    def num_values(self) -> int:
        """Number of stored values (the first dimension of ``values()``)."""
        return self.values().shape[0]

    @property
    def device(self) -> torch.device:
        """Device of the values."""
        return self.values().device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the values."""
        return self.values().dtype


class _NoWeights:
    """TorchRec's weight accessors on a type that has no weights (recpipe's jagged types)."""

    __slots__ = ()

    def weights_or_none(self) -> None:
        """``None``: recpipe's jagged types carry no per-value weights (TorchRec's accessor)."""
        return None

    def weights(self) -> torch.Tensor:
        """TorchRec's accessor; always raises, as recpipe's jagged types carry no weights.

        Raises:
            DataError: always.
        """
        msg = (
            f"a recpipe {type(self).__name__} has no weights; "
            "hint: check `weights_or_none()` first, as for an unweighted TorchRec tensor"
        )
        raise DataError(msg)


class JaggedTensor(_ValuesFields, _NoWeights):
    """One jagged feature: B rows of variable length over a flat ``values`` tensor.

    Row ``i`` is ``values[offsets[i]:offsets[i + 1]]``; ``lengths`` are derived (once) from the
    offsets. ``values`` may be ``[N]`` (ids) or ``[N, D]`` (e.g. sequence embeddings)::

        row:       0         1     2      3
        lists:     [7, 3]    []    [5]    [9, 9, 1]

        values:    [7, 3, 5, 9, 9, 1]          N = 6
        lengths:   [2, 0, 1, 3]                B = 4
        offsets:   [0, 2, 2, 3, 6]             B + 1, int64, offsets[-1] == N

    Args:
        values: ``[N]`` or ``[N, D]`` tensor.
        offsets: ``[B + 1]`` integer tensor (stored as int64), non-decreasing, from 0 to N.
        lengths: ``[B]``, when already known (else derived from ``offsets`` on first use).
        validate: check the invariants above (leave on at the edges; the library's own
            derived tensors pass ``validate=False``).

    Example::

        jt = JaggedTensor.from_lengths(torch.tensor([7, 3, 5, 9, 9, 1]), torch.tensor([2, 0, 1, 3]))
        jt.to_dense_list()[3]  # tensor([9, 9, 1])
    """

    __slots__ = ("_lengths", "_offsets", "_values")

    def __init__(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        validate: bool = True,
    ) -> None:
        if validate:
            values = _check_values(values)
            offsets = as_index_tensor(offsets, name="offsets", device=values.device)
            _check_offsets(offsets, values.shape[0], name="offsets")
            if lengths is not None:
                lengths = as_index_tensor(lengths, name="lengths", device=values.device)
                if not torch.equal(lengths, offsets[1:] - offsets[:-1]):
                    msg = f"`lengths` {quote(lengths)} disagree with `offsets` {quote(offsets)}"
                    raise DataError(msg)
        self._values = values
        self._offsets = offsets
        self._lengths = lengths

    # -- named constructors -------------------------------------------------------------------
    @classmethod
    def from_offsets(
        cls, values: torch.Tensor, offsets: torch.Tensor, *, validate: bool = True
    ) -> JaggedTensor:
        """Build from ``values`` and ``[B + 1]`` ``offsets``."""
        return cls(values, offsets, validate=validate)

    @classmethod
    def from_lengths(
        cls, values: torch.Tensor, lengths: torch.Tensor, *, validate: bool = True
    ) -> JaggedTensor:
        """Build from ``values`` and ``[B]`` ``lengths`` (offsets are computed here, once)."""
        if validate:
            values = _check_values(values)
            lengths = as_index_tensor(lengths, name="lengths", device=values.device)
            _check_lengths(lengths, name="lengths")
        offsets = lengths_to_offsets(lengths)
        if validate and int(offsets[-1]) != values.shape[0]:
            msg = (
                f"`lengths` sum to {int(offsets[-1])} but `values` holds {values.shape[0]} "
                f"elements: {quote(lengths)}"
            )
            raise DataError(msg)
        return cls(values, offsets, lengths=lengths, validate=False)

    @classmethod
    def from_dense_list(
        cls, rows: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None
    ) -> JaggedTensor:
        """Build from a list of per-row tensors (``[n_i]`` or ``[n_i, D]``); copies them.

        Args:
            rows: one tensor per row.
            dtype: dtype of ``values``; needed only when ``rows`` is empty (default int64).
        """
        if len(rows) == 0:
            return cls(
                torch.empty(0, dtype=dtype or torch.int64),
                torch.zeros(1, dtype=torch.int64),
                validate=False,
            )
        rows = [as_tensor(r, name="rows") for r in rows]
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        values = torch.cat(rows)
        if dtype is not None:
            values = values.to(dtype)
        return cls.from_lengths(values, lengths.to(values.device))

    # -- fields (TorchRec's accessor methods) --------------------------------------------------
    def values(self) -> torch.Tensor:
        """``[N]`` or ``[N, D]`` values of all rows, back to back."""
        return self._values

    def offsets(self) -> torch.Tensor:
        """``[B + 1]`` int64 row boundaries."""
        return self._offsets

    def lengths(self) -> torch.Tensor:
        """``[B]`` int64 row lengths (derived from ``offsets()`` on first use, then cached)."""
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def offsets_or_none(self) -> torch.Tensor:
        """``offsets()``: always stored here (TorchRec's accessor)."""
        return self._offsets

    def lengths_or_none(self) -> torch.Tensor | None:
        """The lengths when already known, else ``None`` (TorchRec's accessor)."""
        return self._lengths

    @property
    def batch_size(self) -> int:
        """Number of rows B."""
        return self._offsets.numel() - 1

    # -- operations ----------------------------------------------------------------------------
    def to_dense_list(self) -> list[torch.Tensor]:
        """One tensor per row (views into ``values``, no copy)."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def index_select(self, indices: torch.Tensor, *, validate: bool = True) -> JaggedTensor:
        """Rows ``indices`` (repeats allowed) as a new JaggedTensor; differentiable in values.

        Args:
            indices: ``[M]`` row numbers in ``[0, B)``.
            validate: check that every index is in range.
        """
        indices = as_index_tensor(indices, name="indices", device=self.device)
        if validate:
            _check_row_indices(indices, self.batch_size, name="indices")
        values, offsets = jagged_index_select(self._values, self._offsets, indices)
        return JaggedTensor(values, offsets, validate=False)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> JaggedTensor:
        """A copy on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if device == self.device and self._offsets.device == device:
            return self
        return JaggedTensor(
            self._values.to(device, non_blocking=non_blocking),
            self._offsets.to(device, non_blocking=non_blocking),
            lengths=move_tensor(self._lengths, device, non_blocking=non_blocking),
            validate=False,
        )

    def pin_memory(self) -> JaggedTensor:
        """Page-locked copy for fast host -> accelerator copies.

        A no-op without an accelerator (torch cannot pin memory there); see
        :func:`recpipe._tensors.can_pin_memory`.
        """
        return JaggedTensor(
            pin_tensor(self._values),
            pin_tensor(self._offsets),
            lengths=pin_optional(self._lengths),
            validate=False,
        )

    def equals(self, other: object) -> bool:
        """Exact equality of offsets and values (dtype included)."""
        return (
            isinstance(other, JaggedTensor)
            and tensors_equal(self._offsets, other._offsets)
            and tensors_equal(self._values, other._values)
        )

    def __repr__(self) -> str:
        return (
            f"JaggedTensor(batch_size={self.batch_size}, values={quote(self._values)}, "
            f"offsets={quote(self._offsets)})"
        )


def _check_row_indices(indices: torch.Tensor, num_rows: int, *, name: str) -> None:
    if indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        msg = f"`{name}` must lie in [0, {num_rows}), got {bad}: {quote(indices)}"
        raise DataError(msg)


class KeyedJaggedTensor(_ValuesFields, _NoWeights):
    """Several jagged features over the same B rows, key-major (TorchRec's KJT layout).

    ``lengths`` holds ``len(keys) * B`` entries: all B rows of the first key, then all B rows
    of the next; ``values`` follows the same order. ``offsets`` (``len(keys) * B + 1``) are
    computed once from the lengths when not given::

        batch row:          0        1       2
        "user_items"        [7, 3]   []      [5]
        "item_id"           [9]      [9]     [1, 4]

        keys:     ["user_items", "item_id"]                 stride B = 3
        values:   [7, 3, 5, 9, 9, 1, 4]
        lengths:  [2, 0, 1,  1, 1, 2]                       key-major, len(keys) * B
        offsets:  [0, 2, 2, 3, 4, 5, 7]                     len(keys) * B + 1
        offset_per_key: [0, 3, 7]                           where each key's values start

    Conversion to and from TorchRec's ``KeyedJaggedTensor`` shares these tensors
    (:mod:`recpipe.torchrec_interop`).

    Args:
        keys: feature names, unique.
        values: ``[N]`` (or ``[N, D]``) values of all keys.
        lengths: ``[len(keys) * B]`` integer lengths (stored as int64); may be omitted when
            ``offsets`` is given.
        offsets: ``[len(keys) * B + 1]`` offsets, when already known.
        stride: B; required only when there are no keys (else ``lengths.numel() // len(keys)``).
        validate: check the invariants (leave on at the edges).
    """

    __slots__ = ("_keys", "_lengths", "_offset_per_key", "_offsets", "_stride", "_values")

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor | None = None,
        *,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        validate: bool = True,
    ) -> None:
        keys = tuple(keys)
        if validate:
            values = _check_values(values)
            _check_keys(keys)
            if lengths is None and offsets is None:
                msg = "`lengths` or `offsets` must be given, got neither"
                raise DataError(msg)
            if offsets is not None:
                offsets = as_index_tensor(offsets, name="offsets", device=values.device)
                _check_offsets(offsets, values.shape[0], name="offsets")
            if lengths is not None:
                lengths = as_index_tensor(lengths, name="lengths", device=values.device)
                _check_lengths(lengths, name="lengths")
                if offsets is None and int(lengths.sum()) != values.shape[0]:
                    msg = (
                        f"`lengths` sum to {int(lengths.sum())} but `values` holds "
                        f"{values.shape[0]} elements"
                    )
                    raise DataError(msg)
                if offsets is not None and not torch.equal(lengths, offsets[1:] - offsets[:-1]):
                    msg = f"`lengths` {quote(lengths)} disagree with `offsets` {quote(offsets)}"
                    raise DataError(msg)
        if lengths is None:
            if offsets is None:  # reached only with validate=False
                msg = "`lengths` or `offsets` must be given, got neither"
                raise DataError(msg)
            lengths = offsets[1:] - offsets[:-1]
        num_rows = lengths.numel()
        if keys:
            if validate and num_rows % len(keys):
                msg = (
                    f"`lengths` holds {num_rows} entries, not a multiple of the "
                    f"{len(keys)} keys {list(keys)!r}"
                )
                raise DataError(msg)
            derived = num_rows // len(keys)
            if validate and stride is not None and stride != derived:
                msg = f"`stride` is {stride!r} but `lengths` imply {derived} rows per key"
                raise DataError(msg)
            stride = derived
        else:
            if validate and (num_rows or values.shape[0]):
                msg = f"a KeyedJaggedTensor without keys must be empty, got {num_rows} lengths"
                raise DataError(msg)
            stride = int(stride or 0)
        self._keys = keys
        self._values = values
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._offset_per_key: list[int] | None = None

    # -- named constructors -------------------------------------------------------------------
    @classmethod
    def from_lengths(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        *,
        stride: int | None = None,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Build from key-major ``lengths`` (offsets are derived once, when first needed)."""
        return cls(keys, values, lengths, stride=stride, validate=validate)

    @classmethod
    def from_offsets(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        *,
        stride: int | None = None,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Build from key-major ``offsets`` (``len(keys) * B + 1``)."""
        return cls(keys, values, offsets=offsets, stride=stride, validate=validate)

    @classmethod
    def from_jagged_dict(
        cls, features: Mapping[str, JaggedTensor], *, stride: int | None = None
    ) -> KeyedJaggedTensor:
        """Build from ``{key: JaggedTensor}`` with the same B rows each.

        The values are concatenated once (not copied when there is one key).

        Args:
            features: the features, in key order.
            stride: B, needed only when ``features`` is empty.
        """
        keys = list(features)
        jts = list(features.values())
        if not jts:
            return cls(
                [],
                torch.empty(0, dtype=torch.int64),
                torch.empty(0, dtype=torch.int64),
                stride=stride or 0,
                validate=False,
            )
        _check_keys(tuple(keys))
        sizes = {k: jt.batch_size for k, jt in features.items()}
        if len(set(sizes.values())) != 1 or (stride is not None and stride != jts[0].batch_size):
            rows = f"`stride` {stride!r} rows" if stride is not None else "the same number of rows"
            msg = f"every feature must have {rows}, got rows per key {sizes}"
            raise DataError(msg)
        _check_same_dtype({k: jt.values() for k, jt in features.items()})
        if len(jts) == 1:
            values, lengths = jts[0].values(), jts[0].lengths()
        else:
            values = torch.cat([jt.values() for jt in jts])
            lengths = torch.cat([jt.lengths() for jt in jts])
        return cls(keys, values, lengths, stride=jts[0].batch_size, validate=False)

    @classmethod
    def from_arrays(
        cls,
        keys: Sequence[str],
        values: Sequence[Any],
        offsets: Sequence[Any],
        *,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Build from per-key flat ``values`` and ``offsets`` arrays (numpy, torch, Arrow buffers).

        This is the shape of an Arrow ``list`` column (a flat child array and B + 1 offsets,
        which need not start at 0 for a sliced column). numpy arrays are shared with
        ``torch.from_numpy``; with one key the values are not copied at all, with several they
        are concatenated once into the key-major layout.

        Args:
            keys: feature names.
            values: one flat ``[N_k]`` (or ``[N_k, D]``) array per key.
            offsets: one ``[B + 1]`` integer array per key, into that key's values.
            validate: check monotonic offsets and equal row counts.
        """
        features = _features_from_arrays(keys, values, offsets, validate=validate)
        return cls.from_jagged_dict(features, stride=None)

    @classmethod
    def from_arrow(cls, columns: Mapping[str, Any], *, validate: bool = True) -> KeyedJaggedTensor:
        """Build from Arrow ``list``/``large_list`` columns of integers, sharing their buffers.

        A null list reads as an empty list. Null ids inside a list are refused.

        Args:
            columns: ``{key: pyarrow.Array | pyarrow.ChunkedArray}`` of the same length.
            validate: check the offsets.
        """
        keys, values, offsets = arrow_list_arrays(columns)
        return cls.from_arrays(keys, values, offsets, validate=validate)

    # -- fields (TorchRec's accessor methods) --------------------------------------------------
    def keys(self) -> list[str]:
        """Feature names, in storage order (a new list, as TorchRec's ``keys()``)."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """``[N]`` (or ``[N, D]``) values of every key, key-major."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """``[len(keys) * B]`` int64 lengths, key-major."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """``[len(keys) * B + 1]`` int64 offsets (computed once from the lengths)."""
        if self._offsets is None:
            self._offsets = lengths_to_offsets(self._lengths)
        return self._offsets

    def lengths_or_none(self) -> torch.Tensor:
        """``lengths()``: always stored here (TorchRec's accessor)."""
        return self._lengths

    def offsets_or_none(self) -> torch.Tensor | None:
        """The offsets when already computed, else ``None`` (TorchRec's accessor)."""
        return self._offsets

    def stride(self) -> int:
        """Rows per key, B."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        """B for every key: one stride for all keys (TorchRec's accessor)."""
        return [self._stride] * len(self._keys)

    def variable_stride_per_key(self) -> bool:
        """``False``: every key has B rows (TorchRec's accessor)."""
        return False

    @property
    def batch_size(self) -> int:
        """Rows per key, B (the same as ``stride()``)."""
        return self._stride

    def offset_per_key(self) -> list[int]:
        """Where each key's values start in ``values()``, plus the end (``len(keys) + 1``)."""
        if self._offset_per_key is None:
            if self._offsets is not None:
                bounds = torch.arange(len(self._keys) + 1, device=self.device) * self._stride
                self._offset_per_key = self._offsets[bounds].tolist()
            else:  # the keys' sums: no offsets built for this
                sums = self._lengths.view(len(self._keys), self._stride).sum(1)
                self._offset_per_key = [0, *torch.cumsum(sums, 0).tolist()]
        return self._offset_per_key

    def length_per_key(self) -> list[int]:
        """Number of values of each key."""
        return [b - a for a, b in itertools.pairwise(self.offset_per_key())]

    # -- per key -------------------------------------------------------------------------------
    def key_index(self, key: str) -> int:
        """Position of ``key`` in ``keys``; raises :class:`DataError` for an unknown key."""
        try:
            return self._keys.index(key)
        except ValueError:
            msg = f"unknown key {key!r}; the keys are {list(self._keys)!r}"
            raise DataError(msg) from None

    def __getitem__(self, key: str) -> JaggedTensor:
        """The B rows of ``key`` as a JaggedTensor (views of ``values``; offsets rebased)."""
        k = self.key_index(key)
        b = self._stride
        opk = self.offset_per_key()
        start, end = opk[k], opk[k + 1]
        lengths = self._lengths[k * b : (k + 1) * b]
        offsets = self.offsets()[k * b : (k + 1) * b + 1] - start
        return JaggedTensor(self._values[start:end], offsets, lengths=lengths, validate=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` in key order."""
        return {key: self[key] for key in self._keys}

    def select(self, keys: Sequence[str]) -> KeyedJaggedTensor:
        """The features ``keys`` (in that order) as a new KJT; views when they are adjacent."""
        keys = tuple(keys)
        if keys == self._keys:
            return self
        _check_keys(keys)
        idx = [self.key_index(key) for key in keys]
        b = self._stride
        if idx and idx == list(range(idx[0], idx[0] + len(idx))):
            opk = self.offset_per_key()
            values = self._values[opk[idx[0]] : opk[idx[-1] + 1]]
            lengths = self._lengths[idx[0] * b : (idx[-1] + 1) * b]
            return KeyedJaggedTensor(keys, values, lengths, stride=b, validate=False)
        return KeyedJaggedTensor.from_jagged_dict({key: self[key] for key in keys}, stride=b)

    def split(self, groups: Sequence[Sequence[str]]) -> list[KeyedJaggedTensor]:
        """One KJT per group of keys (see :meth:`select`)."""
        return [self.select(group) for group in groups]

    @staticmethod
    def concat(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Concatenate KJTs with the same stride and disjoint keys along the key dimension."""
        kjts = list(kjts)
        if not kjts:
            msg = "`kjts` must hold at least one KeyedJaggedTensor, got []"
            raise DataError(msg)
        strides = sorted({k.stride() for k in kjts if k.keys()})
        if len(strides) > 1:
            msg = f"`kjts` must share one stride, got strides {strides}"
            raise DataError(msg)
        keys = tuple(key for k in kjts for key in k.keys())
        _check_keys(keys)
        parts = [k for k in kjts if k.keys()]
        if not parts:
            return kjts[0]
        if len(parts) == 1:
            return parts[0]
        _check_same_dtype({",".join(k.keys()): k.values() for k in parts})
        values = torch.cat([k.values() for k in parts])
        lengths = torch.cat([k.lengths() for k in parts])
        return KeyedJaggedTensor(keys, values, lengths, stride=strides[0], validate=False)

    # -- whole-batch operations ----------------------------------------------------------------
    def index_select(self, rows: torch.Tensor, *, validate: bool = True) -> KeyedJaggedTensor:
        """Batch rows ``rows`` (repeats allowed) of every key, in one jagged index select.

        Args:
            rows: ``[M]`` row numbers in ``[0, B)``.
            validate: check that every row is in range.

        Returns:
            A KJT of stride M; differentiable in ``values``.
        """
        rows = as_index_tensor(rows, name="rows", device=self.device)
        if validate:
            _check_row_indices(rows, self._stride, name="rows")
        starts = torch.arange(len(self._keys), device=self.device) * self._stride
        indices = (starts[:, None] + rows[None, :]).reshape(-1)  # (K * M,)
        values, offsets = jagged_index_select(self._values, self.offsets(), indices)
        lengths = offsets[1:] - offsets[:-1]
        return KeyedJaggedTensor(
            self._keys, values, lengths, offsets=offsets, stride=rows.numel(), validate=False
        )

    def map_values(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KeyedJaggedTensor:
        """Apply an element-wise ``fn`` to all values at once; lengths are kept.

        ``fn`` must return one value per input value (the dtype may change, e.g. hashing).
        """
        out = fn(self._values)
        _check_mapped(out, self._values.shape[0], what="map_values")
        return KeyedJaggedTensor(
            self._keys,
            out,
            self._lengths,
            offsets=self._offsets,
            stride=self._stride,
            validate=False,
        )

    def map_jagged(
        self,
        fn: Callable[[JaggedTensor], JaggedTensor],
        *,
        keys: Iterable[str] | None = None,
    ) -> KeyedJaggedTensor:
        """Rewrite the features ``keys`` (all by default) with ``fn``, which may change lengths.

        Args:
            fn: maps one feature's JaggedTensor to a JaggedTensor with the same number of rows
                (e.g. truncation, vocabulary lookup dropping unknown ids).
            keys: the features to rewrite; the others are kept as they are.
        """
        chosen = set(self._keys if keys is None else keys)
        for key in chosen:
            self.key_index(key)
        features = self.to_dict()
        for key in self._keys:
            if key in chosen:
                out = fn(features[key])
                if not isinstance(out, JaggedTensor) or out.batch_size != self._stride:
                    got = out.batch_size if isinstance(out, JaggedTensor) else type(out).__name__
                    msg = f"`fn` must return a JaggedTensor of {self._stride} rows for {key!r}"
                    msg += f", got {got}"
                    raise DataError(msg)
                features[key] = out
        return KeyedJaggedTensor.from_jagged_dict(features, stride=self._stride)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> KeyedJaggedTensor:
        """A copy on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if device == self.device and self._lengths.device == device:
            return self
        moved = KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            offsets=move_tensor(self._offsets, device, non_blocking=non_blocking),
            stride=self._stride,
            validate=False,
        )
        moved._offset_per_key = self._host_offset_per_key()
        return moved

    def _host_offset_per_key(self) -> list[int] | None:
        """:meth:`offset_per_key` where reading it costs no device sync (on the CPU, or known
        already), for a copy to carry: on a GPU, splitting a batch by key reads nothing back."""
        if self._offset_per_key is None and self.device.type == "cpu":
            return self.offset_per_key()
        return self._offset_per_key

    def pin_memory(self) -> KeyedJaggedTensor:
        """Page-locked copy for fast host -> accelerator copies.

        A no-op without an accelerator (torch cannot pin memory there); see
        :func:`recpipe._tensors.can_pin_memory`.
        """
        pinned = KeyedJaggedTensor(
            self._keys,
            pin_tensor(self._values),
            pin_tensor(self._lengths),
            offsets=pin_optional(self._offsets),
            stride=self._stride,
            validate=False,
        )
        pinned._offset_per_key = self._host_offset_per_key()
        return pinned

    def equals(self, other: object) -> bool:
        """Exact equality: keys, stride, lengths and values (dtype included)."""
        return (
            isinstance(other, KeyedJaggedTensor)
            and self._keys == other._keys
            and self._stride == other._stride
            and tensors_equal(self._lengths, other._lengths)
            and tensors_equal(self._values, other._values)
        )

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={list(self._keys)!r}, stride={self._stride}, "
            f"values={quote(self._values)}, lengths={quote(self._lengths)})"
        )


def _check_keys(keys: tuple[str, ...]) -> None:
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        msg = f"`keys` must be strings, got {bad[0]!r}"
        raise DataError(msg)
    if len(set(keys)) != len(keys):
        dups = sorted({k for k in keys if keys.count(k) > 1})
        msg = f"`keys` must be unique, got duplicates {dups!r}"
        raise DataError(msg)


def _check_same_dtype(values: Mapping[str, torch.Tensor]) -> None:
    dtypes = {key: v.dtype for key, v in values.items()}
    if len(set(dtypes.values())) > 1:
        msg = f"every feature must have the same values dtype, got {dtypes}"
        raise DataError(msg)
    shapes = {key: tuple(v.shape[1:]) for key, v in values.items()}
    if len(set(shapes.values())) > 1:
        msg = f"every feature must have the same value width, got {shapes}"
        raise DataError(msg)


def _check_mapped(out: Any, num_values: int, *, what: str) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != num_values:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        msg = f"`fn` of {what} must return a tensor of {num_values} values, got {got}"
        raise DataError(msg)


def _jagged_from_arrays(key: str, values: Any, offsets: Any, *, validate: bool) -> JaggedTensor:
    """One key's (values, offsets) arrays as a JaggedTensor, rebasing sliced offsets to 0."""
    vals = _check_values(values, name=f"values[{key!r}]")
    offs = as_index_tensor(offsets, name=f"offsets[{key!r}]", device=vals.device)
    if offs.numel() == 0:
        msg = f"`offsets[{key!r}]` must hold B + 1 entries, got []"
        raise DataError(msg)
    start, end = int(offs[0]), int(offs[-1])
    if validate and not (0 <= start <= end <= vals.shape[0]):
        msg = (
            f"`offsets[{key!r}]` span [{start}, {end}) outside the {vals.shape[0]} values: "
            f"{quote(offs)}"
        )
        raise DataError(msg)
    if start != 0 or end != vals.shape[0]:
        vals = vals[start:end]
        offs = offs - start
    return JaggedTensor(vals, offs, validate=validate)


def _features_from_arrays(
    keys: Sequence[str], values: Sequence[Any], offsets: Sequence[Any], *, validate: bool
) -> dict[str, JaggedTensor]:
    """``{key: JaggedTensor}`` from per-key flat arrays (see :meth:`KeyedJaggedTensor.from_arrays`).

    The keys are always checked (a repeated key would otherwise silently drop a feature).
    """
    if not (len(keys) == len(values) == len(offsets)):
        msg = (
            f"`keys`, `values` and `offsets` must have one entry per key, got "
            f"{len(keys)}, {len(values)} and {len(offsets)}"
        )
        raise DataError(msg)
    _check_keys(tuple(keys))
    return {
        key: _jagged_from_arrays(key, vals, offs, validate=validate)
        for key, vals, offs in zip(keys, values, offsets)
    }


def arrow_list_arrays(
    columns: Mapping[str, Any],
) -> tuple[list[str], list[Any], list[Any]]:
    """Per-key ``(keys, values, offsets)`` numpy views of Arrow ``list`` columns, no copies.

    The offsets are the column's own (a sliced column's do not start at 0); a null list reads as
    an empty list; null ids inside a list are refused. A chunked column is combined first (a
    copy when it has several chunks).

    Args:
        columns: ``{key: pyarrow.Array | pyarrow.ChunkedArray}`` of ``list``/``large_list``.
    """
    import pyarrow as pa

    keys, values, offsets = [], [], []
    for key, column in columns.items():
        arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            msg = f"column `{key}` must be a list column, got type {arr.type}"
            raise DataError(msg)
        offs = arr.offsets.to_numpy()
        start = int(offs[0])
        window = arr.values.slice(start, int(offs[-1]) - start)
        if window.null_count:
            msg = f"column `{key}` holds {window.null_count} null ids inside its lists"
            raise DataError(msg)
        if arr.null_count:
            nulls = arr.is_null().to_numpy(zero_copy_only=False)
            if (offs[1:] - offs[:-1])[nulls].any():
                msg = f"column `{key}` has null lists that span values; expected empty null lists"
                raise DataError(msg)
        keys.append(key)
        values.append(window.to_numpy(zero_copy_only=True))
        offsets.append(offs - start if start else offs)
    return keys, values, offsets
