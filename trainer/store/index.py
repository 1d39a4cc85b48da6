"""A collision-free, growing index from any int64 id to a dense row number.

Layout (one flat array, ``S = 2**shard_bits`` shards, each a power-of-two open-addressing table
with linear probing; a slot is an (id, row) pair, so a probe reads one cache line)::

    table [ shard 0: cap0 x (id, row) | shard 1: cap1 x (id, row) | ... ]   int64, row -1 = empty
    off   [S]  first slot of each shard        mask [S]  cap - 1        count [S]  entries

``splitmix64(id)``'s high bits pick the shard and its low bits the slot. When a shard's load would
pass 1/2 it doubles, together with every shard at least 3/8 full (one pass over the table per
doubling); the others are copied as they are. Keys are compared exactly: two ids never share a
row, whatever their hashes. Rows are handed out densely (0, 1, 2, ...) in order of first
appearance, which makes a store built from the same batches identical row for row.
"""

from __future__ import annotations

import numpy as np

from recpipe.errors import StoreError
from trainer.store import _kernels as K

__all__ = ["IdIndex"]


def _empty_table(slots: int) -> np.ndarray:
    table = np.zeros((slots, 2), dtype=np.int64)
    table[:, 1] = K.EMPTY
    return table.reshape(-1)


class IdIndex:
    """Sharded open-addressing hash index ``id -> row`` (batch API, Numba kernels).

    Args:
        num_shards: number of shards, a power of two.
        initial_capacity: slots per shard at the start, a power of two.

    Not thread-safe by itself: the store serialises writers with its lock.
    """

    def __init__(self, *, num_shards: int = 16, initial_capacity: int = 1024) -> None:
        if num_shards < 1 or num_shards & (num_shards - 1):
            msg = f"`num_shards` must be a power of two, got {num_shards!r}"
            raise StoreError(msg)
        if initial_capacity < 2 or initial_capacity & (initial_capacity - 1):
            msg = f"`initial_capacity` must be a power of two >= 2, got {initial_capacity!r}"
            raise StoreError(msg)
        bits = num_shards.bit_length() - 1
        self._shift = 64 - bits if bits else 64
        self._off = np.arange(num_shards, dtype=np.int64) * initial_capacity
        self._mask = np.full(num_shards, initial_capacity - 1, dtype=np.int64)
        self._count = np.zeros(num_shards, dtype=np.int64)
        self._table = _empty_table(num_shards * initial_capacity)
        self._next_row = 0

    @property
    def num_shards(self) -> int:
        return int(self._off.size)

    @property
    def num_rows(self) -> int:
        """Number of ids indexed (rows handed out)."""
        return self._next_row

    @property
    def capacity(self) -> int:
        """Total slots over all shards."""
        return int(self._table.size // 2)

    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (int64 [n]); -1 where an id is not indexed."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.size, dtype=np.int64)
        K.index_lookup(ids, self._table, self._off, self._mask, self._shift, out)
        return out

    def insert(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``ids``, adding the absent ones.

        Returns:
            ``(rows, first_new_row)``: rows >= ``first_new_row`` were created by this call, in
            order of the first appearance of their id.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.size, dtype=np.int64)
        first_new = self._next_row
        start = 0
        while True:
            start, self._next_row, shard = K.index_insert(
                ids,
                self._table,
                self._off,
                self._mask,
                self._count,
                self._shift,
                self._next_row,
                start,
                out,
            )
            if shard < 0:
                return out, first_new
            self._grow(int(shard))

    def _grow(self, shard: int) -> None:
        """Double the full shard and every shard at least 3/8 full, in one pass over the table
        (one copy per doubling of the table, not one per shard)."""
        caps = self._mask + 1
        grow = (self._count * 8 >= caps * 3) | (np.arange(caps.size) == shard)
        new_caps = np.where(grow, caps * 2, caps)
        new_off = np.concatenate([[0], np.cumsum(new_caps)[:-1]]).astype(np.int64)
        table = _empty_table(int(new_caps.sum()))
        for s in range(caps.size):
            lo, hi = int(self._off[s]), int(self._off[s] + caps[s])
            if grow[s]:
                K.index_rehash(self._table, lo, hi, table, int(new_off[s]), int(new_caps[s]) - 1)
            else:
                at = int(new_off[s])
                table[2 * at : 2 * (at + caps[s])] = self._table[2 * lo : 2 * hi]
        self._off = new_off
        self._mask = new_caps - 1
        self._table = table

    def frozen_view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The arrays as they are now, for :func:`saved_bytes` in another thread.

        Inserts only fill empty slots and growth builds new arrays, so these arrays keep every
        entry made so far; later entries (rows >= the row count now) are dropped when saving.
        """
        return self._off, self._mask, self._table, self._next_row

    @classmethod
    def from_bytes(
        cls, data: bytes | np.ndarray, info: dict[str, int], *, copy: bool = True
    ) -> IdIndex:
        """The index saved by :func:`saved_bytes`; StoreError if it does not match ``info``.

        Args:
            data: the saved words.
            info: what :func:`saved_bytes` returned beside them.
            copy: False: the index takes over ``data`` (a writable int64 array the caller
                drops, e.g. just read from the file) instead of copying it.
        """
        owned = (
            not copy
            and isinstance(data, np.ndarray)
            and data.dtype == np.int64
            and data.flags.writeable
            and data.flags.c_contiguous
        )
        words = data if owned else np.frombuffer(data, dtype=np.int64)
        shards, slots = info["shards"], info["slots"]
        count = np.zeros(max(shards, 0), dtype=np.int64)
        if words.size != 2 * shards + 2 * slots or shards < 1 or shards & (shards - 1):
            checksum, tiles = None, False
        else:  # one pass: the checksum and each shard's occupied slots
            checksum, tiles = K.index_words_check(words.view(np.uint64), shards, count)
        if checksum is None or int(checksum) != info["checksum"] or not tiles:
            msg = "the store's index file is corrupted or truncated (checksum mismatch)"
            raise StoreError(msg)
        index = cls(num_shards=shards, initial_capacity=2)
        index._off = words[:shards].copy()
        index._mask = words[shards : 2 * shards].copy()
        index._table = words[2 * shards :] if owned else words[2 * shards :].copy()
        index._count = count
        index._next_row = info["rows"]
        return index

    @classmethod
    def from_ids(cls, ids: np.ndarray, *, num_shards: int = 16) -> IdIndex:
        """Rebuild the index of a table whose row r holds ``ids[r]`` (ids must be distinct)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        per_shard = max(2, ids.size * 2 // num_shards + 1)
        cap = 1 << int(np.ceil(np.log2(per_shard)))
        index = cls(num_shards=num_shards, initial_capacity=max(cap, 1024))
        rows, _ = index.insert(ids)
        if index.num_rows != ids.size or not np.array_equal(rows, np.arange(ids.size)):
            msg = "the store's id file holds duplicate ids; it is corrupted"
            raise StoreError(msg)
        return index


def saved_bytes(
    view: tuple[np.ndarray, np.ndarray, np.ndarray, int],
) -> tuple[np.ndarray, dict[str, int]]:
    """The words of an index as it was at :meth:`IdIndex.frozen_view`, and what loading checks.

    Entries made after the view (rows >= its row count) are dropped; they were inserted after
    every kept entry, so no kept entry's probe sequence runs through them. One Numba pass that
    releases the GIL (the checkpoint writer calls it while training inserts new ids).

    Returns:
        (int64 words, a bytes-like object to write as is; the ``info`` of :meth:`from_bytes`).
    """
    off, mask, table, rows = view
    words = np.empty(2 * off.size + table.size, dtype=np.int64)
    K.index_image(off, mask, table, np.int64(rows), words)
    info = {
        "rows": int(rows),
        "shards": int(off.size),
        "slots": int(table.size // 2),
        "checksum": int(K.checksum64(words.view(np.uint64))),
    }
    return words, info
