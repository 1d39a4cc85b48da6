"""Deduplicated jagged tensors: :class:`InverseKeyedJaggedTensor` and its partial form.

RecD (MLSys'23) stores a session's repeated user features once. An
:class:`InverseKeyedJaggedTensor` (IKJT) keeps only the U unique rows of a *group* of keys and
one ``inverse_lookup`` [B], shared by every key of the group, that maps each batch row to its
unique row. A :class:`PartialInverseKeyedJaggedTensor` (RecD §7) stores each row as an
``[offset, length]`` window into shared values, so lists that shifted by one id cost one value.

Dedup runs in :func:`recpipe.kernels.dedup_rows` / :func:`recpipe.kernels.partial_dedup` and
expansion in :func:`recpipe.kernels.jagged_index_select`; nothing here loops over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from recpipe._tensors import as_index_tensor, pin_tensor, quote, tensors_equal
from recpipe.errors import DataError
from recpipe.jagged import (
    JaggedTensor,
    KeyedJaggedTensor,
    _check_row_indices,
    _features_from_arrays,
    _ValuesFields,
    arrow_list_arrays,
    lengths_to_offsets,
)
from recpipe.kernels import dedup_rows, partial_dedup

__all__ = ["InverseKeyedJaggedTensor", "PartialInverseKeyedJaggedTensor"]


def _check_group(features: Mapping[str, JaggedTensor]) -> int:
    """Check a dedup group (at least one key, same B everywhere); return B."""
    if not features:
        msg = "a dedup group needs at least one key, got none"
        raise DataError(msg)
    sizes = {key: jt.batch_size for key, jt in features.items()}
    if len(set(sizes.values())) != 1:
        msg = f"every key of a dedup group must have the same number of rows, got {sizes}"
        raise DataError(msg)
    return next(iter(sizes.values()))


class _DedupFields(_ValuesFields):
    """``dedup_factor`` (from ``num_expanded_values``) plus the fields of :class:`_ValuesFields`."""

    __slots__ = ()

    if TYPE_CHECKING:

        @property
        def num_expanded_values(self) -> int: ...

    @property
    def dedup_factor(self) -> float:
        """Expanded values / stored values (1.0 when nothing is stored)."""
        stored = self.num_values
        return self.num_expanded_values / stored if stored else 1.0


class InverseKeyedJaggedTensor(_DedupFields):
    """A group of keys deduplicated together: U unique rows plus a shared inverse lookup.

    A batch row is unique when the *tuple* of all the group's lists differs from every other
    row's (RecD: rows whose keys changed out of step are not merged). ``values``/``lengths``
    hold the unique rows only, key-major as in :class:`~recpipe.jagged.KeyedJaggedTensor`;
    ``inverse_lookup`` [B] maps each batch row to its unique row, for every key::

        batch row:        0        1        2        3
        "liked_items"     [7, 3]   [7, 3]   [7, 3]   [5]
        "liked_sellers"   [1]      [1]      [2]      [2]

        unique rows:      u0 = batch 0, u1 = batch 2, u2 = batch 3     (U = 3)
        keys:             ["liked_items", "liked_sellers"]
        values:           [7, 3, 7, 3, 5,  1, 2, 2]
        lengths:          [2, 2, 1,  1, 1, 1]                  key-major, len(keys) * U
        inverse_lookup:   [0, 0, 1, 2]                         B, shared by the group
        dedup_factor:     (7 + 4) / 8 = 1.375                  expanded / stored values

    ``to_kjt()`` expands back to the B-row :class:`~recpipe.jagged.KeyedJaggedTensor`, exactly.

    Args:
        keys: the group's feature names.
        values: ``[N_unique]`` (or ``[N_unique, D]``) values of the unique rows, key-major.
        lengths: ``[len(keys) * U]`` lengths of the unique rows.
        inverse_lookup: ``[B]`` integers in ``[0, U)``.
        offsets: ``[len(keys) * U + 1]``, when already known.
        validate: check the invariants (leave on at the edges).
    """

    __slots__ = ("_inverse", "_unique")

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        inverse_lookup: torch.Tensor,
        *,
        offsets: torch.Tensor | None = None,
        validate: bool = True,
    ) -> None:
        unique = KeyedJaggedTensor(keys, values, lengths, offsets=offsets, validate=validate)
        self._init(unique, inverse_lookup, validate=validate)

    def _init(self, unique: KeyedJaggedTensor, inverse: torch.Tensor, *, validate: bool) -> None:
        if validate:
            if not unique.keys():
                msg = "`keys` of an InverseKeyedJaggedTensor must name at least one key, got []"
                raise DataError(msg)
            inverse = as_index_tensor(inverse, name="inverse_lookup", device=unique.device)
            _check_row_indices(inverse, unique.stride(), name="inverse_lookup")
        self._unique = unique
        self._inverse = inverse

    @classmethod
    def from_unique(
        cls, unique: KeyedJaggedTensor, inverse_lookup: torch.Tensor, *, validate: bool = True
    ) -> InverseKeyedJaggedTensor:
        """Wrap a KJT of the U unique rows (stride U) and the ``[B]`` inverse lookup."""
        ikjt = cls.__new__(cls)
        ikjt._init(unique, inverse_lookup, validate=validate)
        return ikjt

    # -- named constructors (dedup) ------------------------------------------------------------
    @classmethod
    def from_kjt(
        cls, kjt: KeyedJaggedTensor, keys: Sequence[str] | None = None
    ) -> InverseKeyedJaggedTensor:
        """Deduplicate the features ``keys`` (all by default) of ``kjt`` as one group.

        Args:
            kjt: the batch, B rows per key.
            keys: the group; rows are merged only when all of these lists are equal.
        """
        group = kjt.select(kjt.keys() if keys is None else keys)
        if not group.keys():
            msg = "`keys` must name at least one key of the group, got []"
            raise DataError(msg)
        features = group.to_dict()
        unique_rows, inverse = dedup_rows(
            [jt.values() for jt in features.values()], [jt.offsets() for jt in features.values()]
        )
        unique = group.index_select(unique_rows, validate=False)
        return cls.from_unique(unique, inverse, validate=False)

    @classmethod
    def from_jagged(cls, features: Mapping[str, JaggedTensor]) -> InverseKeyedJaggedTensor:
        """Deduplicate ``{key: JaggedTensor}`` (same B rows each) as one group.

        Only the unique rows are gathered; the expanded KJT is never built.
        """
        _check_group(features)
        jts = list(features.values())
        unique_rows, inverse = dedup_rows([jt.values() for jt in jts], [jt.offsets() for jt in jts])
        unique = KeyedJaggedTensor.from_jagged_dict(
            {key: jt.index_select(unique_rows, validate=False) for key, jt in features.items()},
            stride=unique_rows.numel(),
        )
        return cls.from_unique(unique, inverse, validate=False)

    @classmethod
    def from_arrays(
        cls,
        keys: Sequence[str],
        values: Sequence[Any],
        offsets: Sequence[Any],
        *,
        validate: bool = True,
    ) -> InverseKeyedJaggedTensor:
        """Deduplicate per-key flat ``values``/``offsets`` arrays (numpy, torch) as one group.

        See :meth:`KeyedJaggedTensor.from_arrays` for the array contract.
        """
        return cls.from_jagged(_features_from_arrays(keys, values, offsets, validate=validate))

    @classmethod
    def from_arrow(
        cls, columns: Mapping[str, Any], *, validate: bool = True
    ) -> InverseKeyedJaggedTensor:
        """Deduplicate Arrow ``list`` columns as one group (see :func:`arrow_list_arrays`)."""
        keys, values, offsets = arrow_list_arrays(columns)
        return cls.from_arrays(keys, values, offsets, validate=validate)

    # -- fields (methods where TorchRec's KJT has a method of that name) -----------------------
    def keys(self) -> list[str]:
        """The group's feature names."""
        return self._unique.keys()

    def values(self) -> torch.Tensor:
        """Values of the unique rows, key-major."""
        return self._unique.values()

    def lengths(self) -> torch.Tensor:
        """``[len(keys) * U]`` lengths of the unique rows, key-major."""
        return self._unique.lengths()

    def offsets(self) -> torch.Tensor:
        """``[len(keys) * U + 1]`` offsets of the unique rows."""
        return self._unique.offsets()

    @property
    def inverse_lookup(self) -> torch.Tensor:
        """``[B]`` int64: the unique row of each batch row, shared by all keys."""
        return self._inverse

    @property
    def unique(self) -> KeyedJaggedTensor:
        """The unique rows as a KJT of stride U."""
        return self._unique

    @property
    def batch_size(self) -> int:
        """Rows in the batch, B."""
        return self._inverse.numel()

    @property
    def num_unique(self) -> int:
        """Unique rows, U."""
        return self._unique.stride()

    @property
    def num_expanded_values(self) -> int:
        """Values of the expanded batch (what :meth:`to_kjt` would hold)."""
        if self.num_unique == 0:
            return 0
        row_totals = self.lengths().view(len(self.keys()), self.num_unique).sum(0)  # (U,)
        return int(row_totals[self._inverse].sum())

    # -- operations ----------------------------------------------------------------------------
    def __getitem__(self, key: str) -> JaggedTensor:
        """The U unique rows of ``key`` (index with ``inverse_lookup`` for the batch rows)."""
        return self._unique[key]

    def __contains__(self, key: object) -> bool:
        return key in self._unique

    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor of the U unique rows}``."""
        return self._unique.to_dict()

    def to_kjt(self) -> KeyedJaggedTensor:
        """Expand to the B-row KJT (jagged index select; differentiable in values)."""
        return self._unique.index_select(self._inverse, validate=False)

    def map_values(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> InverseKeyedJaggedTensor:
        """Apply an element-wise ``fn`` to the unique values only; the inverse lookup is kept."""
        return self.from_unique(self._unique.map_values(fn), self._inverse, validate=False)

    def map_jagged(
        self,
        fn: Callable[[JaggedTensor], JaggedTensor],
        *,
        keys: Iterable[str] | None = None,
    ) -> InverseKeyedJaggedTensor:
        """Rewrite the unique rows of ``keys`` (all by default) with ``fn`` (may change lengths).

        ``fn`` sees and must return U rows; the inverse lookup is kept, so a transform written
        against jagged values/offsets runs once per unique row (RecD O4).
        """
        unique = self._unique.map_jagged(fn, keys=keys)
        return self.from_unique(unique, self._inverse, validate=False)

    def to(
        self, device: torch.device | str, *, non_blocking: bool = False
    ) -> InverseKeyedJaggedTensor:
        """A copy on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if device == self.device and self._inverse.device == device:
            return self
        return self.from_unique(
            self._unique.to(device, non_blocking=non_blocking),
            self._inverse.to(device, non_blocking=non_blocking),
            validate=False,
        )

    def pin_memory(self) -> InverseKeyedJaggedTensor:
        """Page-locked copy for fast host -> accelerator copies.

        A no-op without an accelerator (torch cannot pin memory there); see
        :func:`recpipe._tensors.can_pin_memory`.
        """
        return self.from_unique(
            self._unique.pin_memory(), pin_tensor(self._inverse), validate=False
        )

    def equals(self, other: object) -> bool:
        """Exact equality of the stored form: keys, unique rows and inverse lookup.

        Two IKJTs that expand to the same batch but were deduplicated differently are not
        ``equals``; compare ``a.to_kjt().equals(b.to_kjt())`` for that.
        """
        return (
            isinstance(other, InverseKeyedJaggedTensor)
            and self._unique.equals(other._unique)
            and tensors_equal(self._inverse, other._inverse)
        )

    def __repr__(self) -> str:
        return (
            f"InverseKeyedJaggedTensor(keys={self.keys()!r}, batch_size={self.batch_size}, "
            f"num_unique={self.num_unique}, values={quote(self.values())}, "
            f"lengths={quote(self.lengths())}, inverse_lookup={quote(self._inverse)})"
        )


class PartialInverseKeyedJaggedTensor(_DedupFields):
    """Rows stored as ``[offset, length]`` windows into shared values (RecD §7, partial dedup).

    A user's history list often changes by one id between consecutive samples of a session
    (an id appended, or appended while the oldest drops out). Storing each row as a window
    into packed values lets such a row cost one value instead of a whole list. Each key is
    packed independently (:func:`recpipe.kernels.partial_dedup`); windows are absolute
    positions in the key-major ``values``::

        batch row:       0            1            2            3
        "history"        [1, 2, 3]    [1, 2, 3]    [2, 3, 4]    [8]

        values:          [1, 2, 3, 4, 8]                        packed, P = 5
        window_offsets:  [0, 0, 1, 4]                           len(keys) * B, key-major
        window_lengths:  [3, 3, 3, 1]                           len(keys) * B
        row r:           values[window_offsets[r] : window_offsets[r] + window_lengths[r]]
        dedup_factor:    10 / 5 = 2.0                           expanded / stored values

    TorchRec has no equivalent (its rows cannot overlap); expand with :meth:`to_kjt` first.
    Embedding modules can look up a key's packed ids once and gather the rows' values from them
    (:meth:`key_windows`), so a shifted list costs one lookup per new id.

    Args:
        keys: feature names.
        values: packed ``[P]`` values of every key.
        window_offsets: ``[len(keys) * B]`` start of each row's window in ``values``.
        window_lengths: ``[len(keys) * B]`` length of each row's window.
        validate: check that every window lies inside ``values``.
    """

    __slots__ = ("_host", "_keys", "_stride", "_values", "_win_lengths", "_win_offsets")

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        window_offsets: torch.Tensor,
        window_lengths: torch.Tensor,
        *,
        validate: bool = True,
    ) -> None:
        keys = tuple(keys)
        if validate:
            if not keys or len(set(keys)) != len(keys):
                msg = f"`keys` must name at least one key, each once, got {list(keys)!r}"
                raise DataError(msg)
            if not isinstance(values, torch.Tensor) or values.dim() != 1:
                msg = f"`values` must be a 1-d tensor, got {type(values).__name__}"
                raise DataError(msg)
            window_offsets = as_index_tensor(
                window_offsets, name="window_offsets", device=values.device
            )
            window_lengths = as_index_tensor(
                window_lengths, name="window_lengths", device=values.device
            )
            _check_windows(window_offsets, window_lengths, values.shape[0], len(keys))
        self._keys = keys
        self._values = values
        self._win_offsets = window_offsets
        self._win_lengths = window_lengths
        self._stride = window_lengths.numel() // len(keys)
        self._host: dict[str, tuple[int, int, int]] | None = None  # see _host_spans

    # -- named constructors (partial dedup) ----------------------------------------------------
    @classmethod
    def from_jagged(cls, features: Mapping[str, JaggedTensor]) -> PartialInverseKeyedJaggedTensor:
        """Pack ``{key: JaggedTensor}`` (1-d ids, same B rows each) into windows, per key."""
        _check_group(features)
        packed, win_offsets, win_lengths = [], [], []
        base = 0
        for jt in features.values():
            vals, offs, lens = partial_dedup(jt.values(), jt.offsets())
            packed.append(vals)
            win_offsets.append(offs + base if base else offs)
            win_lengths.append(lens)
            base += vals.shape[0]
        return cls(
            list(features),
            _cat(packed),
            _cat(win_offsets),
            _cat(win_lengths),
            validate=False,
        )

    @classmethod
    def from_kjt(
        cls, kjt: KeyedJaggedTensor, keys: Sequence[str] | None = None
    ) -> PartialInverseKeyedJaggedTensor:
        """Pack the features ``keys`` (all by default) of ``kjt``."""
        return cls.from_jagged(kjt.select(kjt.keys() if keys is None else keys).to_dict())

    @classmethod
    def from_arrays(
        cls,
        keys: Sequence[str],
        values: Sequence[Any],
        offsets: Sequence[Any],
        *,
        validate: bool = True,
    ) -> PartialInverseKeyedJaggedTensor:
        """Pack per-key flat ``values``/``offsets`` arrays (numpy, torch)."""
        return cls.from_jagged(_features_from_arrays(keys, values, offsets, validate=validate))

    @classmethod
    def from_arrow(
        cls, columns: Mapping[str, Any], *, validate: bool = True
    ) -> PartialInverseKeyedJaggedTensor:
        """Pack Arrow ``list`` columns, each key on its own (see :func:`arrow_list_arrays`)."""
        keys, values, offsets = arrow_list_arrays(columns)
        return cls.from_arrays(keys, values, offsets, validate=validate)

    # -- fields (methods where TorchRec's KJT has a method of that name) -----------------------
    def keys(self) -> list[str]:
        """Feature names."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """``[P]`` packed values."""
        return self._values

    @property
    def window_offsets(self) -> torch.Tensor:
        """``[len(keys) * B]`` window starts, key-major."""
        return self._win_offsets

    @property
    def window_lengths(self) -> torch.Tensor:
        """``[len(keys) * B]`` window lengths (the rows' lengths), key-major."""
        return self._win_lengths

    @property
    def batch_size(self) -> int:
        """Rows per key, B."""
        return self._stride

    @property
    def num_expanded_values(self) -> int:
        """Values of the expanded batch."""
        return int(self._win_lengths.sum())

    # -- operations ----------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def key_windows(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Key ``key``'s packed ids and how its B rows read them.

        Returns:
            ``(ids [P_k], positions [N_k], offsets [B + 1])``: ``ids[positions]`` are the
            values of the key's expanded rows, cut by ``offsets``. ``ids`` is the stretch of
            ``values`` the key's windows cover (its own packed ids when built by
            :meth:`from_jagged`), so a lookup of ``ids`` touches each stored id once.

        Raises:
            DataError: ``key`` is not a key of the group.
        """
        if key not in self._keys:
            msg = f"`key` {key!r} is not a key of the partial IKJT {list(self._keys)!r}"
            raise DataError(msg)
        positions, offsets = self._key_positions(key)
        if positions.numel() == 0:
            return self._values[:0], positions, offsets
        lo, hi = self._key_span(key) or (0, 0)  # not None: some window is used
        return self._values[lo:hi], positions - lo if lo else positions, offsets

    def _key_positions(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions [N_k], offsets [B + 1])`` of key ``key``'s expanded values in ``values``."""
        k, b = self._keys.index(key), self._stride
        starts = self._win_offsets[k * b : (k + 1) * b]
        lengths = self._win_lengths[k * b : (k + 1) * b]
        total = None if self._host is None else self._host[key][0]
        return _window_positions(starts, lengths, total=total)

    def _host_spans(self) -> dict[str, tuple[int, int, int]] | None:
        """Per key, ``(values its rows expand to, lo, hi)`` (:meth:`_key_span`, ``(0, 0)`` when
        every window is empty), where reading them costs no device sync (on the CPU, or known
        already): a copy carries them, so on a GPU expanding a key's windows reads no size
        back."""
        if self._host is None and self._values.device.type == "cpu":
            b = self._stride
            self._host = {
                key: (int(self._win_lengths[k * b : (k + 1) * b].sum()),
                      *(self._key_span(key) or (0, 0)))
                for k, key in enumerate(self._keys)
            }  # fmt: skip
        return self._host

    def _key_span(self, key: str) -> tuple[int, int] | None:
        """``[lo, hi)`` of the packed ids key ``key``'s windows read (``None``: all empty), from
        the window starts and lengths alone (no per-value positions), or from the spans a copy
        carries (:meth:`_host_spans`)."""
        if key not in self._keys:
            msg = f"`key` {key!r} is not a key of the partial IKJT {list(self._keys)!r}"
            raise DataError(msg)
        if self._host is not None:
            total, lo, hi = self._host[key]
            return (lo, hi) if total else None
        k, b = self._keys.index(key), self._stride
        starts = self._win_offsets[k * b : (k + 1) * b]
        lengths = self._win_lengths[k * b : (k + 1) * b]
        used = lengths > 0
        if not bool(used.any()):
            return None
        return int(starts[used].min()), int((starts + lengths)[used].max())

    def map_key_values(
        self, key: str, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> PartialInverseKeyedJaggedTensor:
        """Apply an element-wise ``fn`` to the packed ids key ``key``'s windows read.

        ``fn`` maps each id on its own (``fn(ids)[i]`` depends on ``ids[i]`` only) and keeps the
        count, so every row of ``key`` reads what applying ``fn`` to its expanded list gives.

        Raises:
            DataError: ``key`` is not a key of the group, or another key's windows reach into
                the stretch of packed ids ``key``'s windows read (``fn`` would rewrite them too).
        """
        span = self._key_span(key)
        if span is None:
            return self
        lo, hi = span
        for other in self._keys:
            theirs = None if other == key else self._key_span(other)
            if theirs is not None and theirs[0] < hi and lo < theirs[1]:
                msg = f"keys {key!r} and {other!r} of the partial IKJT read the same packed ids"
                raise DataError(msg)
        ids = self._values[lo:hi]
        mapped = fn(ids)
        if mapped.shape != ids.shape:
            msg = f"`fn` must keep the {ids.numel()} ids of key {key!r}, got {tuple(mapped.shape)}"
            raise DataError(msg)
        values = self._values.to(mapped.dtype, copy=True)
        values[lo:hi] = mapped
        return PartialInverseKeyedJaggedTensor(
            self._keys, values, self._win_offsets, self._win_lengths, validate=False
        )

    def map_values(
        self, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> PartialInverseKeyedJaggedTensor:
        """Apply an element-wise ``fn`` to the packed values only; the windows are kept."""
        return PartialInverseKeyedJaggedTensor(
            self._keys, fn(self._values), self._win_offsets, self._win_lengths, validate=False
        )

    def to_kjt(self) -> KeyedJaggedTensor:
        """Expand every window into the B-row KJT (one vectorised gather)."""
        lengths = self._win_lengths
        positions, offsets = _window_positions(self._win_offsets, lengths)
        return KeyedJaggedTensor(
            self._keys,
            self._values[positions],
            lengths,
            offsets=offsets,
            stride=self._stride,
            validate=False,
        )

    def to(
        self, device: torch.device | str, *, non_blocking: bool = False
    ) -> PartialInverseKeyedJaggedTensor:
        """A copy on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if device == self.device and self._win_offsets.device == device:
            return self
        moved = PartialInverseKeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._win_offsets.to(device, non_blocking=non_blocking),
            self._win_lengths.to(device, non_blocking=non_blocking),
            validate=False,
        )
        moved._host = self._host_spans()
        return moved

    def pin_memory(self) -> PartialInverseKeyedJaggedTensor:
        """Page-locked copy for fast host -> accelerator copies.

        A no-op without an accelerator (torch cannot pin memory there); see
        :func:`recpipe._tensors.can_pin_memory`.
        """
        pinned = PartialInverseKeyedJaggedTensor(
            self._keys,
            pin_tensor(self._values),
            pin_tensor(self._win_offsets),
            pin_tensor(self._win_lengths),
            validate=False,
        )
        pinned._host = self._host_spans()
        return pinned

    def equals(self, other: object) -> bool:
        """Exact equality of the stored form: keys, packed values and windows."""
        return (
            isinstance(other, PartialInverseKeyedJaggedTensor)
            and self._keys == other._keys
            and tensors_equal(self._values, other._values)
            and tensors_equal(self._win_offsets, other._win_offsets)
            and tensors_equal(self._win_lengths, other._win_lengths)
        )

    def __repr__(self) -> str:
        return (
            f"PartialInverseKeyedJaggedTensor(keys={list(self._keys)!r}, "
            f"batch_size={self._stride}, values={quote(self._values)}, "
            f"window_offsets={quote(self._win_offsets)}, "
            f"window_lengths={quote(self._win_lengths)})"
        )


def _window_positions(
    starts: torch.Tensor, lengths: torch.Tensor, *, total: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each value of the rows ``[starts[r], starts[r] + lengths[r])`` lies in the packed
    values, and the rows' offsets: ``(positions [sum(lengths)], offsets [R + 1])``. ``total``:
    ``sum(lengths)`` when the caller knows it (else read from the offsets: a sync on a GPU)."""
    offsets = lengths_to_offsets(lengths)
    if total is None:
        total = int(offsets[-1])
    # output value j of row r reads values[j + (starts[r] - offsets[r])]
    shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
    return torch.arange(total, device=starts.device) + shift, offsets  # (total,), (R + 1,)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` that does not copy a single part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_windows(
    offsets: torch.Tensor, lengths: torch.Tensor, num_values: int, num_keys: int
) -> None:
    if offsets.shape != lengths.shape or lengths.numel() % num_keys:
        msg = (
            f"`window_offsets` ({offsets.numel()}) and `window_lengths` ({lengths.numel()}) "
            f"must both hold len(keys) * B = {num_keys} * B entries"
        )
        raise DataError(msg)
    if lengths.numel() == 0:
        return
    ends = offsets + lengths
    bad = (offsets < 0) | (lengths < 0) | (ends > num_values)
    if bool(bad.any()):
        r = int(torch.nonzero(bad)[0, 0])
        msg = (
            f"window {r} (`window_offsets` {int(offsets[r])}, `window_lengths` "
            f"{int(lengths[r])}) lies outside the {num_values} values"
        )
        raise DataError(msg)
