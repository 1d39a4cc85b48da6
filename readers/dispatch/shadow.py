"""The ranks' embedding caches and where each row's latest version is, kept step by step.

Every rank ``j`` caches at most ``capacity[j]`` rows; every row has a home (a parameter server,
or its owner rank) and a *latest version*, held clean by the home or dirty by one rank. A step,
given the distinct rows each rank reads (``reads[j]``)::

    before   update push  a row dirty on rank d that another rank reads: d writes it home
                          (once per row; d's copy stays, clean)
             miss pull    rank j reads a row whose latest version it does not hold: it pulls
                          the row from home (after the pushes)
    after    update       a row read by one rank only: that rank updates its copy, which is now
                          the latest version, dirty on it; every other cached copy is stale
             shared       a row read by several ranks: each sends its gradient home, the home
                          applies their sum; every cached copy is stale, the row is clean
             trim         a cache over its capacity drops its least recently used rows (rows last
                          used in the same step in (table, id) order); a dirty row dropped is
                          written home (evict push)

Stale copies stay in a cache (they hold a slot, they are not hits) until they are read again
(pulled afresh) or trimmed. Nothing here is random, so a *shadow* that replays the same reads
holds exactly what the ranks' caches hold: the dispatcher reads costs off it before a step and
replays the step after it. Costs are per row moved: ``T[j] = row_bytes / bandwidth[j]``.

State, over the dense rows of a :class:`~readers.dispatch.keys.RowIndex`::

    state     uint8 [W, rows]   ABSENT / STALE / FRESH (holds the latest version)
    dirty_on  int32 [rows]      the rank holding the latest version dirty, -1: home has it
    last_use  int64 [W, rows]   the step each rank last read the row
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from readers.dispatch import _kernels as K
from readers.dispatch.keys import RowIndex, distinct
from recpipe.errors import DataError

__all__ = ["ABSENT", "FRESH", "STALE", "CacheShadow", "StepTransfers"]

ABSENT, STALE, FRESH = 0, 1, 2

KINDS = ("pulls", "pushes", "shared", "evict_pushes")
"""The transfers a step makes, each one row over rank ``j``'s link (``T[j]``)."""


@dataclass(frozen=True)
class StepTransfers:
    """What one step reads and moves, per rank (dense rows, ascending).

    Attributes:
        reads: the distinct rows each rank reads.
        pulls: miss pulls: rows it reads without holding their latest version.
        pushes: update pushes: rows dirty on it that another rank reads (before the step).
        shared: rows it reads that another rank reads too (their gradients go home).
        evictions: rows its cache drops after the step.
        evict_pushes: those of them that were dirty on it (written home).
    """

    reads: tuple[np.ndarray, ...]
    pulls: tuple[np.ndarray, ...]
    pushes: tuple[np.ndarray, ...]
    shared: tuple[np.ndarray, ...]
    evictions: tuple[np.ndarray, ...]
    evict_pushes: tuple[np.ndarray, ...]

    def counts(self) -> dict[str, np.ndarray]:
        """``{kind: int64 [W] rows per rank}`` for every field."""
        fields = ("reads", "pulls", "pushes", "shared", "evictions", "evict_pushes")
        return {k: np.array([r.size for r in getattr(self, k)], dtype=np.int64) for k in fields}

    def seconds(self, seconds_per_row: np.ndarray) -> dict[str, np.ndarray]:
        """``{kind: float64 [W]}`` seconds each rank's link spends on each transfer kind."""
        counts = self.counts()
        return {k: counts[k] * np.asarray(seconds_per_row, dtype=np.float64) for k in KINDS}


def _distinct(rows: np.ndarray) -> np.ndarray:
    """``rows`` as distinct ascending int64 (as given when they already are)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size < 2 or bool((rows[1:] > rows[:-1]).all()):
        return rows
    return distinct(rows)


class _Lru:
    """One rank's recency queue: (row, step) entries in the order they were read, the rows of
    a step in (table, id) order. An entry is live while the row is cached and was last read in
    that step; dead entries are skipped and compacted away."""

    def __init__(self) -> None:
        self.rows = np.zeros(1024, dtype=np.int64)
        self.steps = np.zeros(1024, dtype=np.int64)
        self.head = self.tail = 0

    @staticmethod
    def _live(rows, steps, state, last_use) -> np.ndarray:
        return K.lru_live(rows, steps, state, last_use)

    def push(self, rows: np.ndarray, step: int, state: np.ndarray, last_use: np.ndarray) -> None:
        n = rows.size
        if self.tail + n > self.rows.size:
            seg = slice(self.head, self.tail)
            keep = self._live(self.rows[seg], self.steps[seg], state, last_use)
            live_rows, live_steps = self.rows[seg][keep], self.steps[seg][keep]
            size = max(self.rows.size, 2 * (live_rows.size + n))
            self.rows = np.zeros(size, dtype=np.int64)
            self.steps = np.zeros(size, dtype=np.int64)
            self.rows[: live_rows.size], self.steps[: live_rows.size] = live_rows, live_steps
            self.head, self.tail = 0, live_rows.size
        self.rows[self.tail : self.tail + n] = rows
        self.steps[self.tail : self.tail + n] = step
        self.tail += n

    def pop(self, k: int, state: np.ndarray, last_use: np.ndarray) -> np.ndarray:
        """The ``k`` least recently used cached rows, oldest first (taken off the queue)."""
        out, self.head = K.lru_pop(self.rows, self.steps, self.head, self.tail, k, state, last_use)
        if out.size < k:  # pragma: no cover - the counts are kept in step
            msg = "the cache shadow lost track of its rows"
            raise DataError(msg)
        return out


class CacheShadow:
    """The caches of ``world_size`` ranks, step by step (see the module docstring).

    Args:
        world_size: ranks W.
        capacity: rows each rank's cache holds (one value: every rank).
        index: numbers the rows; gives their (table, id) for the eviction order.
    """

    def __init__(self, *, world_size: int, capacity: int | Sequence[int], index: RowIndex) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            msg = f"`world_size` must be a positive integer, got {world_size!r}"
            raise DataError(msg)
        cap = np.broadcast_to(np.asarray(capacity, dtype=np.int64), (world_size,)).copy()
        if (cap < 0).any():
            msg = f"`capacity` must be >= 0 rows per rank, got {np.asarray(capacity).tolist()!r}"
            raise DataError(msg)
        self.world_size = world_size
        self.capacity = cap
        self.index = index
        self.state = np.zeros((world_size, 0), dtype=np.uint8)
        self.last_use = np.zeros((world_size, 0), dtype=np.int64)
        self.dirty_on = np.zeros(0, dtype=np.int32)
        self.cached = np.zeros(world_size, dtype=np.int64)
        self.steps = 0
        self._lru = [_Lru() for _ in range(world_size)]
        self._count = np.zeros(0, dtype=np.int32)  # scratch of the step kernel, over the rows

    def ensure(self) -> None:
        """Make room for every row the index has numbered."""
        n, have = self.index.num_rows, self.dirty_on.size
        if n <= have:
            return
        size = max(n, 2 * have, 1024)
        state = np.zeros((self.world_size, size), dtype=np.uint8)
        last_use = np.full((self.world_size, size), -1, dtype=np.int64)
        dirty = np.full(size, -1, dtype=np.int32)
        state[:, :have], last_use[:, :have], dirty[:have] = self.state, self.last_use, self.dirty_on
        self.state, self.last_use, self.dirty_on = state, last_use, dirty

    def fresh(self, rows: np.ndarray) -> np.ndarray:
        """bool [W, n]: which ranks hold the latest version of ``rows``."""
        self.ensure()
        return self.state[:, rows] == FRESH

    def drop(self, rows: np.ndarray) -> StepTransfers:
        """Take ``rows`` out of every cache (between steps); a dirty copy is written home.

        Returns:
            only ``evictions`` (the rows each rank held) and ``evict_pushes`` (the dirty ones).
        """
        self.ensure()
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        evictions, pushes = [], []
        for j in range(self.world_size):
            held = rows[self.state[j, rows] != ABSENT]
            self.state[j, held] = ABSENT
            self.cached[j] -= held.size
            evictions.append(held)
            pushes.append(held[self.dirty_on[held] == j])
        self.dirty_on[rows] = -1
        none = tuple(np.zeros(0, dtype=np.int64) for _ in range(self.world_size))
        return StepTransfers(none, none, none, none, tuple(evictions), tuple(pushes))

    def _in_key_order(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` in (table, id) order."""
        key = self.index.order_key
        if key is not None:  # distinct keys >= 0: the radix sort's order is argsort's
            return rows[K.radix_order(key[rows], True)[1]]
        tables, ids = self.index.table_of_row, self.index.id_of_row
        return rows[np.lexsort((ids[rows], tables[rows]))]

    def step(self, reads: Sequence[np.ndarray]) -> StepTransfers:
        """Replay one step in which rank ``j`` reads the rows ``reads[j]``; returns what it
        moves (see the module docstring)."""
        w = self.world_size
        if len(reads) != w:
            msg = f"`reads` must hold one array per rank ({w}), got {len(reads)}"
            raise DataError(msg)
        self.ensure()
        t = self.steps
        reads = tuple(_distinct(r) for r in reads)
        rows = np.concatenate(reads)
        offsets = np.zeros(w + 1, dtype=np.int64)
        np.cumsum([r.size for r in reads], out=offsets[1:])
        if self._count.size < self.dirty_on.size:
            self._count = np.zeros(self.dirty_on.size, dtype=np.int32)
        miss, many, absent, pushed, pushed_by = K.shadow_update(
            self.state, self.dirty_on, self.last_use, rows, offsets, t, self._count
        )
        by_rank = np.lexsort((pushed, pushed_by))
        pushed, pushed_by = pushed[by_rank], pushed_by[by_rank]
        push_cuts = np.searchsorted(pushed_by, np.arange(w + 1))
        # recency and the trim
        evictions, evict_pushes = [], []
        for j, r in enumerate(reads):
            self.cached[j] += int(absent[j])
            self._lru[j].push(self._in_key_order(r), t, self.state[j], self.last_use[j])
            over = int(self.cached[j] - self.capacity[j])
            gone = self._lru[j].pop(over, self.state[j], self.last_use[j]) if over > 0 else rows[:0]
            self.state[j, gone] = ABSENT
            self.cached[j] -= gone.size
            gone = np.sort(gone)
            dirty = gone[self.dirty_on[gone] == j]
            self.dirty_on[dirty] = -1
            evictions.append(gone)
            evict_pushes.append(dirty)
        self.steps += 1
        return StepTransfers(
            reads=reads,
            pulls=tuple(
                r[miss[a:b]] for r, a, b in zip(reads, offsets[:-1], offsets[1:], strict=True)
            ),
            pushes=tuple(pushed[push_cuts[j] : push_cuts[j + 1]] for j in range(w)),
            shared=tuple(
                r[many[a:b]] for r, a, b in zip(reads, offsets[:-1], offsets[1:], strict=True)
            ),
            evictions=tuple(evictions),
            evict_pushes=tuple(evict_pushes),
        )
