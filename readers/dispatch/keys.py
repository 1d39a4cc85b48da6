"""Embedding rows of a batch: which (table, id) rows each piece of samples reads.

A model reads one embedding row per (table, id). :class:`TableMap` says which table each sparse
feature reads (by default one table per feature, as the trainer's DLRM builds them);
:class:`RowIndex` numbers the (table, id) pairs densely as they are first seen (the dispatcher's
state is kept in arrays over these numbers); :func:`piece_rows` lists the distinct rows each
piece reads, counting a row once per piece however many of its samples read it (a deduplicated
group's unique rows are expanded once per piece, not once per sample)::

    piece 0: samples 0-3 (one session)     user_follows [7, 9] in all four  -> rows (follows, 7), (follows, 9)
                                          item_id 11, 12, 11, 40          -> (item, 11), (item, 12), (item, 40)

>>> import numpy as np
>>> index = RowIndex(["item", "user"])
>>> index.rows(0, np.array([11, 12, 11])).tolist(), index.rows(1, np.array([11])).tolist()
([0, 1, 0], [2])
>>> index.keys(np.array([2, 1]))
(array([1, 0]), array([11, 12]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from readers.dispatch import _kernels as K
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = ["PieceRows", "RowIndex", "TableMap", "distinct", "home_ranks", "piece_rows"]

_SHIFT = 40  # (piece << 40) | row: rows below 2**40, pieces below 2**23
_RADIX_MIN = 512  # keys from which distinct() sorts by radix (NumPy's sort below)


def home_ranks(ids: np.ndarray, world_size: int) -> np.ndarray:
    """int64: the rank that is each id's home when rows live on the ranks: their owner,
    :func:`recpipe.kernels.splitmix.owner_of`, the map the trainer's caches and shards use.

    >>> home_ranks(np.arange(6), 4).tolist()
    [3, 3, 2, 1, 0, 0]
    """
    from recpipe.kernels.splitmix import owner_of

    return owner_of(ids, world_size)


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, ascending: ``np.unique`` by a sort (NumPy's hash-based unique of
    int64 is several times slower on the dispatcher's arrays of ~100k keys; non-negative int64
    keys, as the dispatcher's are, sort by radix in a Numba kernel).

    >>> distinct(np.array([5, 1, 5, 3])).tolist()
    [1, 3, 5]
    """
    values = np.asarray(values).ravel()
    if values.size >= _RADIX_MIN and values.dtype == np.int64 and values.min() >= 0:
        return K.sorted_distinct(values)  # a radix sort: linear in the length
    values = np.sort(values)
    if values.size < 2:
        return values
    keep = np.empty(values.size, dtype=np.bool_)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


@dataclass(frozen=True)
class TableMap:
    """Which table each sparse feature reads.

    Attributes:
        tables: table names, in order (a row's table is its index here).
        features: ``{feature: table index}``; features not listed are read by no table (they
            cost nothing).
        id_modulus: a feature's ids read rows ``id mod id_modulus`` (tables that hash ids into
            that many rows); 0: the ids are the rows.
    """

    tables: tuple[str, ...]
    features: Mapping[str, int]
    id_modulus: int = 0

    def __post_init__(self) -> None:
        if len(set(self.tables)) != len(self.tables) or not self.tables:
            msg = f"`tables` must be distinct names, at least one, got {list(self.tables)!r}"
            raise DataError(msg)
        bad = {f: t for f, t in self.features.items() if not 0 <= t < len(self.tables)}
        if bad:
            msg = f"`features` map to tables that do not exist: {bad!r}"
            raise DataError(msg)

    @classmethod
    def per_feature(cls, features: Sequence[str], *, id_modulus: int = 0) -> TableMap:
        """One table per feature, named after it (the trainer's default tables)."""
        return cls(tuple(features), {f: t for t, f in enumerate(features)}, id_modulus)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Sequence[str]]) -> TableMap:
        """``{table: [features]}``, tables that several features share."""
        names = tuple(tables)
        features: dict[str, int] = {}
        for t, name in enumerate(names):
            for f in tables[name]:
                if f in features:
                    msg = f"feature {f!r} is read by tables {names[features[f]]!r} and {name!r}"
                    raise DataError(msg)
                features[f] = t
        return cls(names, features)


def _empty_slots(size: int) -> np.ndarray:
    """An empty hash table of ``size`` slots for :class:`RowIndex`: (table, id, row), row -1."""
    slots = np.zeros((size, 3), dtype=np.int64)
    slots[:, 2] = -1
    return slots


class RowIndex:
    """(table, id) -> a dense row number, in order of first appearance; it only grows.

    Lookups probe an open-addressing hash table (a Numba kernel; kept at most half full,
    doubled as it fills).

    Args:
        tables: the table names.
    """

    def __init__(self, tables: Sequence[str]) -> None:
        self.tables = tuple(tables)
        self._slots = _empty_slots(1024)  # (table, id, row) per slot
        self._table_of_row = np.zeros(1024, dtype=np.int64)
        self._id_of_row = np.zeros(1024, dtype=np.int64)
        self._order_key = np.zeros(1024, dtype=np.int64)
        self._id_bits = 63 - max(1, (len(self.tables) - 1).bit_length())
        self._keys_fit = True  # every id in [0, 2**_id_bits): (table, id) fits one int64
        self.num_rows = 0

    @property
    def table_of_row(self) -> np.ndarray:
        """int64 [num_rows]: the table of each row."""
        return self._table_of_row[: self.num_rows]

    @property
    def id_of_row(self) -> np.ndarray:
        """int64 [num_rows]: the id of each row."""
        return self._id_of_row[: self.num_rows]

    @property
    def order_key(self) -> np.ndarray | None:
        """int64 [num_rows] ``(table << b) | id``, ordered as (table, id), or ``None`` once an
        id falls outside ``[0, 2**b)`` (``b = 63 - bits of the table count``)."""
        return self._order_key[: self.num_rows] if self._keys_fit else None

    def keys(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(tables, ids)`` of ``rows``."""
        return self._table_of_row[rows], self._id_of_row[rows]

    def lookup(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` in table ``table``, -1 for ids never seen."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.size, dtype=np.int64)
        K.index_rows(self._slots, table, ids, 0, False, out, out[:0])
        return out

    def rows(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` in table ``table``, numbering the new ones (in order of appearance)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        while 2 * (self.num_rows + ids.size) > self._slots.shape[0]:
            self._rehash()
        out = np.empty(ids.size, dtype=np.int64)
        new_ids = np.empty(ids.size, dtype=np.int64)
        fresh = K.index_rows(self._slots, table, ids, self.num_rows, True, out, new_ids)
        if not fresh:
            return out
        fresh_ids = new_ids[:fresh]
        rows = np.arange(self.num_rows, self.num_rows + fresh, dtype=np.int64)
        self._grow(self.num_rows + fresh)
        self._table_of_row[rows] = table
        self._id_of_row[rows] = fresh_ids
        if self._keys_fit and (fresh_ids.min() < 0 or fresh_ids.max() >= 1 << self._id_bits):
            self._keys_fit = False
        if self._keys_fit:
            self._order_key[rows] = (table << self._id_bits) | fresh_ids
        self.num_rows += fresh
        return out

    def _rehash(self) -> None:
        slots = _empty_slots(2 * self._slots.shape[0])
        K.index_rehash(self._slots, slots)
        self._slots = slots

    def _grow(self, rows: int) -> None:
        if rows <= self._table_of_row.size:
            return
        size = max(rows, 2 * self._table_of_row.size)
        for name in ("_table_of_row", "_id_of_row", "_order_key"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=np.int64)
            new[: old.size] = old
            setattr(self, name, new)


@dataclass(frozen=True)
class PieceRows:
    """The distinct rows each piece of a batch reads.

    Attributes:
        piece: int64 [pairs] the piece, ascending.
        row: int64 [pairs] a row it reads (ascending within a piece; each once per piece).
        num_pieces: pieces in the batch.
    """

    piece: np.ndarray
    row: np.ndarray
    num_pieces: int

    def without(self, rows: np.ndarray) -> PieceRows:
        """The pairs whose row is not flagged in ``rows`` (bool, indexed by row)."""
        if not rows.size:
            return self
        flagged = np.zeros(self.row.size, dtype=np.bool_)
        inside = self.row < rows.size
        flagged[inside] = rows[self.row[inside]]
        if not flagged.any():
            return self
        return PieceRows(self.piece[~flagged], self.row[~flagged], self.num_pieces)

    def select(self, pieces: np.ndarray) -> np.ndarray:
        """bool [pairs]: the pairs of the pieces ``pieces``."""
        mask = np.zeros(self.num_pieces, dtype=np.bool_)
        mask[pieces] = True
        return mask[self.piece]


def _expand_rows(offsets: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value positions of the jagged rows ``sel`` (and which entry of ``sel`` each one is)."""
    lengths = offsets[sel + 1] - offsets[sel]
    which = np.repeat(np.arange(sel.size), lengths)
    inside = np.arange(which.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return offsets[sel][which] + inside, which


def piece_rows(
    batch: Batch,
    *,
    tables: TableMap,
    index: RowIndex,
    piece_of_row: np.ndarray,
    num_pieces: int | None = None,
) -> PieceRows:
    """The distinct (table, id) rows each piece of ``batch`` reads (see the module docstring).

    Args:
        batch: the global batch.
        tables: which table each feature reads.
        index: numbers the rows (new ones are added).
        piece_of_row: [B] the piece of each batch row; rows of piece -1 are left out.
        num_pieces: pieces (default: the largest piece number + 1).

    Raises:
        DataError: a feature of ``tables`` is not in the batch.
    """
    piece_of_row = np.asarray(piece_of_row, dtype=np.int64)
    if num_pieces is None:
        num_pieces = int(piece_of_row.max()) + 1 if piece_of_row.size else 0
    parts: list[np.ndarray] = []
    found: set[str] = set()

    def add(key: str, values: np.ndarray, pieces: np.ndarray) -> None:
        found.add(key)
        t = tables.features.get(key)
        keep = pieces >= 0
        if t is None or not keep.any():
            return
        ids = values[keep]
        if tables.id_modulus:
            ids = np.remainder(ids, tables.id_modulus)
        rows = index.rows(t, ids)
        parts.append((pieces[keep] << _SHIFT) | rows)

    kjt = batch.kjt
    groups = {}
    for name, group in batch.ikjts.items():
        if hasattr(group, "inverse_lookup"):
            groups[name] = group
        else:  # a partial IKJT: its rows expanded
            kjt = type(kjt).concat([kjt, group.to_kjt()]) if kjt.keys() else group.to_kjt()
    for key in kjt.keys():
        jt = kjt[key]
        lengths = jt.lengths().numpy()
        add(key, jt.values().numpy(), piece_of_row[np.repeat(np.arange(lengths.size), lengths)])
    for group in groups.values():
        inverse = group.inverse_lookup.numpy()
        wanted = piece_of_row >= 0
        pairs = distinct((piece_of_row[wanted] << _SHIFT) | inverse[wanted])
        pieces, uniq = pairs >> _SHIFT, pairs & ((1 << _SHIFT) - 1)
        for key in group.keys():
            jt = group[key]
            pos, which = _expand_rows(jt.offsets().numpy(), uniq)
            add(key, jt.values().numpy()[pos], pieces[which])
    missing = sorted(set(tables.features) - found)
    if missing:
        msg = f"the batch has no feature(s) {missing!r} that the tables read"
        raise DataError(msg)
    pairs = distinct(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    return PieceRows(pairs >> _SHIFT, pairs & ((1 << _SHIFT) - 1), num_pieces)
