"""Per-rank embedding caches: ESD's transfer model run as a real exchange.

With caches a job keeps no hot set. Every row has a *home*, its owner rank (``owner_of(id)``, as
in the 2FP exchange), which keeps the row's optimizer state with it and two numbers: the row's
*version* (bumped by every update) and ``dirty_on``, the rank holding the latest version when
the home does not. Each rank caches at most ``capacity`` rows (all tables together): a copy of
the values and the state, the version it copied, whether it is dirty. A step, for the distinct
rows each rank reads (collective; see ``docs/dispatch.md`` for the model it follows)::

    prepare   every rank sends (id, version it holds or -1) of each row it reads to its home
              update push: a row dirty on rank d that another rank reads: d sends it home
              miss pull:   a reader whose version is not the home's latest gets the row (and
                           its state) from home (a pushed row straight from d); every row read
                           is now a fresh copy in the cache
    step      a row read by one rank only: that rank applies the optimizer to its copy (the
              latest version now, dirty on it); a row read by several ranks: each sends its
              float64 gradient home, the home sums, rounds once and applies it (every cached
              copy is stale now)
    trim      a cache over its capacity drops its least recently used rows (rows last used in
              the same step in (table, id) order, the tables in ``table_order``); a dirty row
              dropped is sent home (evict push)

The messages (every rank the same collectives; counts before payloads)::

    1 counts   to each home: per table, the reads and the evict pushes owed (all-to-all)
    2 reads    to each home, in one all-to-all: the reads (id, version held), the evict
               pushes of the rank's last step (id, values, state) and its gradients of that
               step's shared rows (counts both sides know); the home applies the gradient
               sums, then the evict pushes, then looks the reads up
    3 answers  to each reader, per read: flags (pull, shared, pushed, and the holder pushing
               it) and the latest version; with it, to every rank: the home's totals of pulls
               it serves and of push requests, and how many it asks of that rank
    4 pulls    the rows the homes serve (each reader knows how many from the answers) and the
               push requests (table, id, the rank the row goes to) to the holders; skipped
               when no home serves a pull nor asks a push (every rank has every home's totals)
    5 pushes   update pushes: each holder sends each row asked of it to the readers pulling it
               and, training, to its home, which keeps it (one copy when the home reads it);
               skipped when no home asked one

So a step makes 4 all-to-alls, 5 with update pushes (the 2FP exchange makes 4); ``step()`` and
the trim make none: a step's evict pushes and shared gradients travel with the next exchange
with the homes (the next ``prepare``, an evaluation's included, or :meth:`~CachedEmbeddings.
owned_rows`, which sends the dirty copies with them in 2), and nothing reads a home's rows
before it. The step's :class:`CacheRecord` lists its evict pushes all the same.

Every update applies the sum of the global batch's gradients of the row to its latest version,
rounded once, so the tables are those of one process. Nothing is random: a
:class:`readers.dispatch.shadow.CacheShadow` replaying the same reads predicts every pull and
push, and each step's :class:`CacheRecord` lists what this rank's cache did, to check it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from recpipe.errors import RecpipeError
from trainer.distributed import _kernels as K
from trainer.distributed.comm import Comm, DistributedError
from trainer.distributed.exchange import (
    GRAD_DTYPE,
    ExchangeStats,
    ShardedEmbeddings,
    _group_order,
    place_rows,
)
from trainer.distributed.shard import SparseOptimizer, owner_of, pack_rows, unpack_state
from trainer.store.index import IdIndex

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from trainer.modules import PlannedBatch

__all__ = ["RECORD_KINDS", "CacheRecord", "CachedEmbeddings"]

RECORD_KINDS = ("reads", "pulls", "pushes", "shared", "evictions", "evict_pushes")
"""What a :class:`CacheRecord` lists (the fields of the shadow's ``StepTransfers``)."""

_PULL, _SHARED, _PUSHED = 1, 2, 4  # flags a home answers a read with (_PUSHED: the pulled
# row comes from the rank holding it dirty, in the update pushes, not from the home; that
# rank in the bits above _HOLDER)
_HOLDER = 3


@dataclass(frozen=True)
class CacheRecord:
    """What one rank's cache did in one step: for each kind of :data:`RECORD_KINDS`, an int64
    ``[n, 2]`` array of (table position in ``table_order``, id), sorted."""

    reads: np.ndarray
    pulls: np.ndarray
    pushes: np.ndarray
    shared: np.ndarray
    evictions: np.ndarray
    evict_pushes: np.ndarray

    def counts(self) -> dict[str, int]:
        return {k: int(getattr(self, k).shape[0]) for k in RECORD_KINDS}


def _labels(counts: np.ndarray) -> np.ndarray:
    """The table of each row of a buffer laid out by (rank, table) with ``counts`` [W, T]."""
    w, n_t = counts.shape
    return np.repeat(np.tile(np.arange(n_t), w), counts.reshape(-1))


def _pairs(tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[n, 2]`` (table, id) sorted by table, then id."""
    order = np.lexsort((ids, tables))
    return np.stack([tables[order], ids[order]], axis=1).astype(np.int64, copy=False)


class _Home:
    """Version and dirty holder of every row this rank owns, per table (by shard row)."""

    def __init__(self, n_tables: int) -> None:
        self.version = [np.zeros(0, dtype=np.int64) for _ in range(n_tables)]
        self.dirty_on = [np.zeros(0, dtype=np.int64) for _ in range(n_tables)]

    def ensure(self, t: int, rows: int) -> None:
        have = self.version[t].size
        if rows <= have:
            return
        size = max(rows, 2 * have, 1024)
        self.version[t] = np.concatenate([self.version[t], np.zeros(size - have, np.int64)])
        self.dirty_on[t] = np.concatenate([self.dirty_on[t], np.full(size - have, -1, np.int64)])


class _Cache:
    """One rank's cached copies: a pool of slots (values, state, version, dirty, last use), and
    per table an id index whose entries point at slots (-1: not cached)."""

    def __init__(
        self, n_tables: int, *, dim: int, dtype: torch.dtype, state_shape: tuple[int, ...] | None
    ) -> None:
        self.dim, self.dtype = dim, dtype
        self.index = [IdIndex() for _ in range(n_tables)]
        self.slot_of = [np.zeros(0, dtype=np.int64) for _ in range(n_tables)]
        self.values = torch.zeros(0, dim, dtype=dtype)
        self.state = None if state_shape is None else torch.zeros(0, *state_shape, dtype=dtype)
        self.used = np.zeros(0, dtype=np.bool_)
        self.table = np.zeros(0, dtype=np.int64)
        self.ids = np.zeros(0, dtype=np.int64)
        self.entry = np.zeros(0, dtype=np.int64)
        self.version = np.zeros(0, dtype=np.int64)
        self.dirty = np.zeros(0, dtype=np.bool_)
        self.last_use = np.zeros(0, dtype=np.int64)
        self.free = np.zeros(0, dtype=np.int64)  # a stack of free slots: free[:n_free]
        self.n_free = 0

    @property
    def size(self) -> int:
        return int(self.used.sum())

    def find(self, t: int, ids: np.ndarray) -> np.ndarray:
        """Slots of table ``t``'s ``ids`` (-1: not cached)."""
        entries = self.index[t].lookup(np.ascontiguousarray(ids, dtype=np.int64))
        out = np.full(ids.size, -1, dtype=np.int64)
        known = entries >= 0
        slot_of = self.slot_of[t]
        inside = known.copy()
        inside[known] = entries[known] < slot_of.size
        out[inside] = slot_of[entries[inside]]
        return out

    def _grow(self, extra: int) -> None:
        have = self.used.size
        size = max(have + extra, 2 * have, 256)
        grow = size - have
        self.values = torch.cat([self.values, self.values.new_zeros(grow, self.dim)])
        if self.state is not None:
            self.state = torch.cat([self.state, self.state.new_zeros(grow, *self.state.shape[1:])])
        self.used = np.concatenate([self.used, np.zeros(grow, np.bool_)])
        for name in ("table", "ids", "entry", "version", "last_use"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow, np.int64)]))
        self.dirty = np.concatenate([self.dirty, np.zeros(grow, np.bool_)])
        self._push_free(np.arange(have, size, dtype=np.int64))

    def _push_free(self, slots: np.ndarray) -> None:
        need = self.n_free + slots.size
        if need > self.free.size:
            self.free = np.concatenate([self.free, np.zeros(need - self.free.size, np.int64)])
        self.free[self.n_free : need] = slots
        self.n_free = need

    def install(self, t: int, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Slots for table ``t``'s ``ids`` (``slots``: their current slots, -1 where absent,
        which get a free slot)."""
        slots = slots.copy()
        absent = np.flatnonzero(slots < 0)
        if not absent.size:
            return slots
        if self.n_free < absent.size:
            self._grow(absent.size - self.n_free)
        self.n_free -= absent.size
        new = self.free[self.n_free : self.n_free + absent.size].copy()
        entries, _ = self.index[t].insert(np.ascontiguousarray(ids[absent], dtype=np.int64))
        if self.index[t].num_rows > self.slot_of[t].size:
            grown = np.full(max(self.index[t].num_rows, 2 * self.slot_of[t].size), -1, np.int64)
            grown[: self.slot_of[t].size] = self.slot_of[t]
            self.slot_of[t] = grown
        self.slot_of[t][entries] = new
        self.used[new] = True
        self.table[new], self.ids[new], self.entry[new] = t, ids[absent], entries
        self.dirty[new] = False
        slots[absent] = new
        return slots

    def release(self, slots: np.ndarray) -> None:
        for t in np.unique(self.table[slots]):
            mine = slots[self.table[slots] == t]
            self.slot_of[int(t)][self.entry[mine]] = -1
        self.used[slots] = False
        self.dirty[slots] = False
        self._push_free(slots)

    def packed(self, slots: np.ndarray) -> torch.Tensor:
        """``[n, D + S]`` values of ``slots`` and their state (:func:`shard.pack_rows`)."""
        at = torch.from_numpy(slots)
        state = None if self.state is None else self.state.index_select(0, at)
        return pack_rows(self.values.index_select(0, at), state)

    def write(self, slots: np.ndarray, packed: torch.Tensor) -> None:
        at = torch.from_numpy(slots)
        self.values.index_copy_(0, at, packed[:, : self.dim].to(self.dtype))
        if self.state is not None:
            self.state.index_copy_(0, at, unpack_state(packed, self.dim, self.state))


@dataclass
class _Step:
    """What :meth:`CachedEmbeddings.step` needs of the prepare() of the same batch."""

    grad: torch.Tensor  # float64 [U, D]
    slots: np.ndarray  # [U] cache slot of each read
    shared: np.ndarray  # bool [U]
    latest: np.ndarray  # [U] the home's version before the step
    order: np.ndarray  # [U] reads in send order (by owner, then table)
    # the home's side: the reads it received, in receive order
    got_table: np.ndarray
    got_row: np.ndarray  # shard rows
    got_src: np.ndarray  # the reader
    got_shared: np.ndarray  # bool
    record: dict[str, np.ndarray]


@dataclass
class _Owed:
    """What a step leaves for the rank's next exchange with the homes (:meth:`CachedEmbeddings.
    _to_homes`, with the next reads): as a cache, its evict pushes and its gradients of shared
    rows; as a home, where the gradients it is to receive go."""

    evict_ids: np.ndarray  # [e] by (home, table)
    evict_rows: torch.Tensor  # [e, D + S] packed
    evict_counts: np.ndarray  # [W, T] rows to each home, per table
    grads: torch.Tensor  # float64 [g, D] by home, in the reads' send order
    grad_send: np.ndarray  # [W]
    grad_recv: np.ndarray  # [W] (as a home)
    grad_table: np.ndarray  # [G] table of each gradient received, in receive order
    grad_row: np.ndarray  # [G] its shard row


@dataclass
class _Inbox:
    """What :meth:`CachedEmbeddings._to_homes` returns: the reads sent (``order``: their send
    order, by home then table; rows per home) and, as a home, those received and the copies."""

    order: np.ndarray
    send_rows: np.ndarray  # [W]
    recv_rows: np.ndarray  # [W]
    got: np.ndarray  # [n, 2] (id, version held) in receive order
    got_table: np.ndarray
    got_src: np.ndarray
    copy_table: np.ndarray
    copy_ids: np.ndarray
    copy_rows: torch.Tensor


class CachedEmbeddings:
    """Per-rank caches over the owner-sharded tables of a model (see the module docstring);
    used in place of :class:`~trainer.distributed.exchange.ShardedEmbeddings` (same
    ``prepare``/``step``), without a hot set.

    Args:
        model: a model whose table modules are ``ShardedTable`` s.
        comm: the process group.
        optimizer: the row update of every table.
        capacity: rows this rank's cache holds (all tables).
        table_order: the tables' names in the order that breaks recency ties at eviction
            (default: the model's order); the dispatcher's shadow must use the same.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        comm: Comm,
        optimizer: SparseOptimizer,
        capacity: int,
        table_order: Sequence[str] | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            msg = f"`capacity` must be a non-negative integer of rows, got {capacity!r}"
            raise RecpipeError(msg)
        self.base = ShardedEmbeddings(
            model, comm=comm, optimizer=optimizer, hot_budget_rows=1, count_steps=0
        )
        self.comm, self.optimizer, self.capacity = comm, optimizer, capacity
        self.tables, self.names = self.base.tables, self.base.names
        self.dim, self.dtype = self.base.dim, self.base.dtype
        if self.base.device.type != "cpu":
            msg = "per-rank caches run on CPU tables only"
            raise RecpipeError(msg)
        table_names = [t.config.name for t in self.tables]
        order = list(table_names) if table_order is None else list(table_order)
        if sorted(order) != sorted(table_names):
            msg = f"`table_order` must name the model's tables {table_names}, got {order}"
            raise RecpipeError(msg)
        self.table_order = order
        self._rank_of_table = np.array([order.index(n) for n in table_names], dtype=np.int64)
        n = len(self.tables)
        self.home = _Home(n)
        self.cache = _Cache(n, dim=self.dim, dtype=self.dtype,
                            state_shape=optimizer.state_shape(self.dim))  # fmt: skip
        self.steps = 0
        self.records: list[CacheRecord] = []
        self.keep_records = False  # keep every step's record in ``records`` (tests, debugging)
        self.last_record: CacheRecord | None = None
        self._totals = np.zeros(len(RECORD_KINDS), dtype=np.int64)
        self.stats = ExchangeStats()
        self._prepared: _Step | None = None
        self._owed = self._nothing_owed()

    @property
    def num_hot(self) -> int:
        return 0

    @property
    def count_left(self) -> int:
        return 0

    @count_left.setter
    def count_left(self, value: int) -> None:  # the trainer's resume sets it; nothing to count
        del value

    # -- messages ---------------------------------------------------------------------------------
    def _a2a_many(
        self, parts: Sequence[tuple[torch.Tensor, Any, Any]], *, what: str
    ) -> list[torch.Tensor]:
        """One all-to-all that carries several messages. ``parts``: for each, its rows
        ``[n, ...]`` laid out by destination, the rows sent to each rank ``[W]`` and the rows
        received from each ``[W]`` (both known on both sides beforehand); returns each
        message's rows received, laid out by source, as an all-to-all of its own would. The
        rows travel as bytes, each rank's messages one after another."""
        w, k = self.comm.world_size, len(parts)
        flat, width = [], []
        for rows, _, _ in parts:
            flat.append(rows.contiguous().view(-1).view(torch.uint8) if rows.numel()
                        else torch.zeros(0, dtype=torch.uint8))  # fmt: skip
            width.append(rows.element_size() * math.prod(rows.shape[1:]))
        nbytes = np.array(width, dtype=np.int64)[:, None]
        send = np.stack([np.asarray(s, dtype=np.int64) for _, s, _ in parts]) * nbytes  # [K, W]
        recv = np.stack([np.asarray(r, dtype=np.int64) for _, _, r in parts]) * nbytes
        starts = np.concatenate([np.zeros((k, 1), np.int64), np.cumsum(send, 1)], 1).tolist()
        payload = torch.cat([flat[m][starts[m][d] : starts[m][d + 1]]
                             for d in range(w) for m in range(k)])  # fmt: skip
        got = self.comm.all_to_all(payload, send.sum(0), recv.sum(0), what=what)
        bounds = np.concatenate([[0], np.cumsum(recv.T.reshape(-1))]).tolist()  # source-major
        out = []
        for m, (rows, _, got_rows) in enumerate(parts):
            chunk = torch.cat([got[bounds[s * k + m] : bounds[s * k + m + 1]] for s in range(w)])
            n = int(np.sum(got_rows))
            out.append(chunk.view(rows.dtype).reshape(n, *rows.shape[1:]))
        return out

    def _to_homes(
        self, reads: np.ndarray, key: np.ndarray, copies: np.ndarray, *, what: str
    ) -> _Inbox:
        """Every rank sends its homes, in one all-to-all after one of counts: ``reads`` [n, 2]
        (id, version held) keyed ``home * T + table``; the cached copies in the slots
        ``copies`` (read, the cache unchanged: :meth:`owned_rows`); and what it owes since its
        last step (:class:`_Owed`). Each home first applies what it was owed, as the last step
        would have: the shared rows' gradient sums, then the evict pushes (collective)."""
        w, n_t, cache = self.comm.world_size, len(self.tables), self.cache
        owed, self._owed = self._owed, self._nothing_owed()
        order = _group_order(key, w * n_t)
        counts = np.bincount(key, minlength=w * n_t).reshape(w, n_t)
        copy_key = owner_of(cache.ids[copies], w) * n_t + cache.table[copies]
        copies = copies[_group_order(copy_key, w * n_t)]
        copy_counts = np.bincount(copy_key, minlength=w * n_t).reshape(w, n_t)
        mine = np.concatenate([counts, owed.evict_counts, copy_counts], axis=1)
        theirs = self.comm.all_to_all_counts(torch.from_numpy(mine), what=what).numpy()
        got_counts, evict_counts = theirs[:, :n_t], theirs[:, n_t : 2 * n_t]
        got_copy_counts = theirs[:, 2 * n_t :]
        got, evict_ids, evict_rows, grads, copy_ids, copy_rows = self._a2a_many([
            (torch.from_numpy(reads[order]), counts.sum(1), got_counts.sum(1)),
            (torch.from_numpy(owed.evict_ids), owed.evict_counts.sum(1), evict_counts.sum(1)),
            (owed.evict_rows, owed.evict_counts.sum(1), evict_counts.sum(1)),
            (owed.grads, owed.grad_send, owed.grad_recv),
            (torch.from_numpy(cache.ids[copies]), copy_counts.sum(1), got_copy_counts.sum(1)),
            (cache.packed(copies), copy_counts.sum(1), got_copy_counts.sum(1)),
        ], what=what)  # fmt: skip
        # the last step's shared rows: the gradients summed in float64 (in the order the
        # readers sent them), rounded once, applied (their versions were bumped then)
        for t in np.unique(owed.grad_table):
            sel = np.flatnonzero(owed.grad_table == t)
            shard = self.tables[int(t)].shard
            slot = self.base._scratch(int(t), shard.num_rows)  # all -1, and again after
            uniq, sums = K.sum_by_row(grads.numpy(), sel, owed.grad_row[sel], slot)
            shard.apply(self.optimizer, uniq, torch.from_numpy(sums).to(self.dtype))
        # the last step's evict pushes: the latest versions, home now
        evict_table = _labels(evict_counts)
        rows = self._home_rows(evict_table, evict_ids.numpy(), create=True)
        self._write_home(evict_table, rows, evict_rows)
        self._set_dirty(evict_table, rows, -1)
        return _Inbox(
            order=order, send_rows=counts.sum(1), recv_rows=got_counts.sum(1), got=got.numpy(),
            got_table=_labels(got_counts), got_src=np.repeat(np.arange(w), got_counts.sum(1)),
            copy_table=_labels(got_copy_counts), copy_ids=copy_ids.numpy(), copy_rows=copy_rows,
        )  # fmt: skip

    def _nothing_owed(self) -> _Owed:
        w, n_t = self.comm.world_size, len(self.tables)
        none = np.zeros(0, dtype=np.int64)
        return _Owed(
            none, torch.zeros(0, self._packed_width(), dtype=self.dtype),
            np.zeros((w, n_t), np.int64), torch.zeros(0, self.dim, dtype=GRAD_DTYPE),
            np.zeros(w, np.int64), np.zeros(w, np.int64), none, none,
        )  # fmt: skip

    def _packed_width(self) -> int:
        shape = self.optimizer.state_shape(self.dim)
        return self.dim + (0 if shape is None else int(np.prod(shape, dtype=np.int64)))

    def _home_rows(self, tables: np.ndarray, ids: np.ndarray, *, create: bool) -> np.ndarray:
        """Shard rows of (table, id) pairs this rank owns; ``create``: new ones are created
        (otherwise -1)."""
        rows = np.zeros(ids.size, dtype=np.int64)
        for t in np.unique(tables):
            sel = np.flatnonzero(tables == t)
            shard = self.tables[int(t)].shard
            rows[sel] = shard.rows(ids[sel]) if create else shard.index.lookup(ids[sel])
            self.home.ensure(int(t), shard.num_rows)
        return rows

    def _home_records(self, tables: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The home's (version, dirty holder) of shard rows (a row not created yet: 0, -1)."""
        version = np.zeros(rows.size, dtype=np.int64)
        dirty_on = np.full(rows.size, -1, dtype=np.int64)
        for t in np.unique(tables):
            sel = np.flatnonzero((tables == t) & (rows >= 0))
            version[sel] = self.home.version[int(t)][rows[sel]]
            dirty_on[sel] = self.home.dirty_on[int(t)][rows[sel]]
        return version, dirty_on

    def _set_dirty(self, tables: np.ndarray, rows: np.ndarray, holders: Any) -> None:
        holders = np.broadcast_to(np.asarray(holders, dtype=np.int64), rows.shape)
        for t in np.unique(tables):
            sel = np.flatnonzero(tables == t)
            self.home.dirty_on[int(t)][rows[sel]] = holders[sel]

    def _write_home(self, tables: np.ndarray, rows: np.ndarray, packed: torch.Tensor) -> None:
        for t in np.unique(tables):
            sel = np.flatnonzero(tables == t)
            shard = self.tables[int(t)].shard
            at = torch.from_numpy(rows[sel])
            src = packed[torch.from_numpy(sel)]
            shard.values.index_copy_(0, at, src[:, : self.dim].to(self.dtype))
            if shard.state is not None:
                shard.state.index_copy_(0, at, unpack_state(src, self.dim, shard.state))

    def _home_packed(self, tables: np.ndarray, rows: np.ndarray, ids: np.ndarray) -> torch.Tensor:
        """``[n, D + S]`` the home's values and state of shard rows (-1: a row not created
        yet, its initial values)."""
        out = torch.zeros(rows.size, self._packed_width(), dtype=self.dtype)
        for t in np.unique(tables):
            sel = np.flatnonzero(tables == t)
            shard = self.tables[int(t)].shard
            at = torch.from_numpy(sel)
            known = rows[sel] >= 0
            if known.all():
                idx = torch.from_numpy(rows[sel])
                out[at] = pack_rows(shard.values.index_select(0, idx),
                                    None if shard.state is None else shard.state.index_select(0, idx))  # fmt: skip
            else:  # evaluation: rows nobody trained yet read as their initial values
                out[at, : self.dim] = shard.lookup(ids[sel])
        return out

    # -- forward ------------------------------------------------------------------------------------
    def prepare(self, batch: Batch, *, train: bool = True) -> PlannedBatch:
        """Bring the latest version of every row ``batch`` reads (collective: 3 to 5
        all-to-alls, see the module docstring); returns the batch with its id plan
        (:meth:`ShardedEmbeddings.plan`), to run the model on."""
        w, n_t, me, cache = self.comm.world_size, len(self.tables), self.comm.rank, self.cache
        planned = self.base.plan(batch)
        uniq = list(planned.plan.ids)
        sizes = np.array([u.size for u in uniq], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        ids = np.concatenate(uniq)
        table_of = np.repeat(np.arange(n_t), sizes)
        slots = np.zeros(ids.size, dtype=np.int64)
        for t in range(n_t):
            slots[starts[t] : starts[t + 1]] = cache.find(t, uniq[t])
        held = np.full(ids.size, -1, dtype=np.int64)  # evaluation: every row from its home
        if train:
            cached = slots >= 0
            held[cached] = cache.version[slots[cached]]
        # 1-2. the reads, with the versions held, to their homes (and what this rank owes them
        # since its last step, which they apply first)
        owner = owner_of(ids, w)
        inbox = self._to_homes(np.stack([ids, held], axis=1), owner * n_t + table_of,
                               np.zeros(0, dtype=np.int64), what="the caches' reads")  # fmt: skip
        order, got, got_table, got_src = inbox.order, inbox.got, inbox.got_table, inbox.got_src
        got_row = self._home_rows(got_table, got[:, 0], create=train)
        # 3. the home's answers: readers per row, pulls, and who serves each pull
        key = got_table * (int(got_row.max(initial=0)) + 2) + got_row + 1
        _, inverse, readers = np.unique(key, return_inverse=True, return_counts=True)
        got_shared = readers[inverse] >= 2
        latest, dirty_on = self._home_records(got_table, got_row)
        pull = got[:, 1] != latest
        # a row dirty on another rank is pushed by it (for evaluation, to the reader too)
        needs = (dirty_on >= 0) & pull & ((dirty_on != got_src) | (not train))
        push_at = np.flatnonzero(needs)
        push_at = push_at[np.unique(inverse[push_at], return_index=True)[1]]  # once per row
        holder = np.full(readers.size, -1, dtype=np.int64)
        holder[inverse[push_at]] = dirty_on[push_at]
        via = pull & (holder[inverse] >= 0)  # pulls the holder serves, in its update push
        # the push requests: (table, id, rank it goes to), one per reader pulling the row and,
        # training, one for the home, which keeps it (a home reading it gets that one)
        ent = np.flatnonzero(via & ((got_src != me) | (not train)))
        keep = push_at if train else push_at[:0]
        ent_holder = np.concatenate([holder[inverse[ent]], dirty_on[keep]])
        ent_order = _group_order(ent_holder, w)
        requests = np.stack([np.concatenate([got[ent, 0], got[keep, 0]]),  # (id, table·W + to)
                             np.concatenate([got_table[ent] * w + got_src[ent],
                                             got_table[keep] * w + me])], axis=1)  # fmt: skip
        request_rows = np.bincount(ent_holder, minlength=w)
        from_home = np.flatnonzero(pull & ~via)
        flags = (np.where(pull, _PULL, 0) | np.where(got_shared, _SHARED, 0)
                 | np.where(via, _PUSHED | (holder[inverse] << _HOLDER), 0))  # fmt: skip
        answer = np.stack([flags, latest], axis=1)
        # every home tells every rank its totals: all know whether the next rounds happen
        header = np.zeros((w, 3), dtype=np.int64)
        header[:, 0], header[:, 1], header[:, 2] = from_home.size, ent_holder.size, request_rows
        ones = np.ones(w, dtype=np.int64)
        back, heads_t = self._a2a_many([(torch.from_numpy(answer), inbox.recv_rows,
                                         inbox.send_rows), (torch.from_numpy(header), ones, ones)],
                                       what="the caches' answers")  # fmt: skip
        mine, heads = np.empty((ids.size, 2), dtype=np.int64), heads_t.numpy()
        mine[order] = back.numpy()  # per read: flags (and a pushed row's holder), latest version
        # 4. the pulls the homes serve, with the push requests to the holders
        sent_flags = mine[order, 0] & (_PULL | _PUSHED)
        pulled_home = order[np.flatnonzero(sent_flags == _PULL)]  # by home, in send order
        rows_home = torch.zeros(0, self._packed_width(), dtype=self.dtype)
        asked = np.zeros((0, 2), dtype=np.int64)
        if heads[:, :2].any():
            fresh = self._home_packed(got_table[from_home], got_row[from_home], got[from_home, 0])
            rows_home, asked_t = self._a2a_many([
                (fresh, np.bincount(got_src[from_home], minlength=w),
                 np.bincount(owner[pulled_home], minlength=w)),
                (torch.from_numpy(requests[ent_order]), request_rows, heads[:, 2]),
            ], what="the caches' pulls and push requests")  # fmt: skip
            asked = asked_t.numpy()
        # 5. the update pushes: each holder sends the rows asked of it to the ranks named
        pulled_push = np.flatnonzero(((mine[:, 0] & _PUSHED) > 0) & ((owner != me) | (not train)))
        rows_push = torch.zeros(0, self._packed_width(), dtype=self.dtype)
        pushes = np.zeros((0, 2), dtype=np.int64)
        pulled_own = np.zeros(0, dtype=np.int64)
        rows_own = rows_push
        if heads[:, 1].any():
            pushes, got_push = self._update_pushes(
                asked, np.repeat(np.arange(w), heads[:, 2]), commit=train,
                expect=(np.concatenate([mine[pulled_push, 0] >> _HOLDER, dirty_on[keep]]),
                        np.concatenate([owner[pulled_push], np.full(keep.size, me)]),
                        np.concatenate([table_of[pulled_push], got_table[keep]]),
                        np.concatenate([ids[pulled_push], got[keep, 0]])),
            )  # fmt: skip
            rows_push, kept = got_push[: pulled_push.size], got_push[pulled_push.size :]
            if train:  # the home keeps the pushed rows, and serves them to itself
                self._write_home(got_table[keep], got_row[keep], kept)
                self._set_dirty(got_table[keep], got_row[keep], -1)
                pick = np.full(readers.size, -1, dtype=np.int64)
                pick[inverse[keep]] = np.arange(keep.size)
                block = np.arange(inbox.recv_rows[:me].sum(), inbox.recv_rows[: me + 1].sum())
                sent = order[inbox.send_rows[:me].sum() : inbox.send_rows[: me + 1].sum()]
                own = np.flatnonzero(via[block])
                pulled_own = sent[own]
                rows_own = kept[torch.from_numpy(pick[inverse[block[own]]])]
        pulled = np.concatenate([pulled_home, pulled_push, pulled_own])
        rows = torch.cat([rows_home, rows_push, rows_own])
        if not train:
            values = torch.empty(ids.size, self.dim, dtype=self.dtype)
            values[torch.from_numpy(pulled)] = rows[:, : self.dim]
            place_rows(self.tables, planned.plan, values, None)
            self._prepared = None
            return planned
        for t in range(n_t):
            sel = np.flatnonzero(table_of == t)
            slots[sel] = cache.install(t, ids[sel], slots[sel])
        cache.write(slots[pulled], rows)
        cache.version[slots[pulled]] = mine[pulled, 1]
        values = cache.values.index_select(0, torch.from_numpy(slots))
        grad = values.new_zeros(values.shape, dtype=GRAD_DTYPE)
        place_rows(self.tables, planned.plan, values, grad)
        pairs_t = self._rank_of_table[table_of]
        shared = (mine[:, 0] & _SHARED) > 0
        record = {
            "reads": _pairs(pairs_t, ids),
            "pulls": _pairs(pairs_t[pulled], ids[pulled]),
            "pushes": pushes,
            "shared": _pairs(pairs_t[shared], ids[shared]),
        }
        self.stats.steps += 1
        self.stats.accesses += ids.size
        self.stats.cold_rows += ids.size
        self._prepared = _Step(
            grad=grad, slots=slots, shared=shared, latest=mine[:, 1], order=order,
            got_table=got_table, got_row=got_row, got_src=got_src, got_shared=got_shared,
            record=record,
        )  # fmt: skip
        return planned

    def _update_pushes(
        self,
        asked: np.ndarray,
        asked_home: np.ndarray,
        *,
        commit: bool,
        expect: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> tuple[np.ndarray, torch.Tensor]:
        """As a holder, send each row asked of it (``asked`` [m, 2]: id, table · W + the rank
        it goes to; ``asked_home``: the home that asked) to that rank; ``commit``: its copy is
        clean now (an update push), otherwise unchanged (a read for evaluation). As a
        recipient, return the rows ``expect``\\ed (holder, home, table, id), in that order
        (collective; both sides order a holder's rows to a rank by (home, table, id)). Returns
        also the (table, id) this rank pushed, for its record."""
        w, cache = self.comm.world_size, self.cache
        a_id, a_table, a_to = asked[:, 0], asked[:, 1] // w, asked[:, 1] % w
        slots = np.zeros(a_id.size, dtype=np.int64)
        for t in np.unique(a_table):
            sel = np.flatnonzero(a_table == t)
            slots[sel] = cache.find(int(t), a_id[sel])
        if (slots < 0).any() or not cache.dirty[slots].all():
            msg = (
                f"rank {self.comm.rank}: a home asked for a dirty copy this cache does not hold "
                "(the caches' version records disagree)"
            )
            raise DistributedError(msg)
        out = np.lexsort((a_id, a_table, asked_home, a_to))
        reply = cache.packed(slots[out])
        if commit:
            cache.dirty[slots] = False
        e_holder, e_home, e_table, e_id = expect
        back = np.lexsort((e_id, e_table, e_home, e_holder))
        got = self._a2a_many([(reply, np.bincount(a_to, minlength=w),
                               np.bincount(e_holder, minlength=w))],
                             what="the caches' update pushes")[0]  # fmt: skip
        rows = torch.empty_like(got)
        rows[torch.from_numpy(back)] = got
        pushed = np.unique(_pairs(self._rank_of_table[a_table], a_id), axis=0)
        return pushed, rows

    # -- backward -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Update every row the global batch read, then trim the caches (after
        ``loss.backward()``; no collective: the shared rows' gradients and the evict pushes go
        home with the next exchange, :meth:`_to_homes`)."""
        prep = self._prepared
        if prep is None:
            msg = "step() without a prepare(batch, train=True) before it"
            raise RecpipeError(msg)
        self._prepared = None
        w = self.comm.world_size
        cache = self.cache
        step = self.base.advance_step()  # every rank, every step: Adam's count never drifts
        # rows read by this rank only: its copy is updated, the latest version, dirty on it
        sole = np.flatnonzero(~prep.shared)
        if sole.size:
            at = torch.from_numpy(cache_slots := prep.slots[sole])
            grad = prep.grad.index_select(0, torch.from_numpy(sole)).to(self.dtype)
            self.optimizer.apply(cache.values, cache.state, at, grad, step=step)
            cache.version[cache_slots] = prep.latest[sole] + 1
            cache.dirty[cache_slots] = True
        # rows read by several ranks: the gradients go home with the next exchange, where the
        # home sums them in float64, rounds once and applies them; the versions move now
        owed = self._owed
        shared_sent = prep.order[prep.shared[prep.order]]
        owed.grads = prep.grad.index_select(0, torch.from_numpy(shared_sent))
        owed.grad_send = np.bincount(owner_of(cache.ids[prep.slots[shared_sent]], w), minlength=w)
        home_sel = np.flatnonzero(prep.got_shared)
        owed.grad_recv = np.bincount(prep.got_src[home_sel], minlength=w)
        owed.grad_table, owed.grad_row = prep.got_table[home_sel], prep.got_row[home_sel]
        for t in np.unique(owed.grad_table):
            self.home.version[int(t)][np.unique(owed.grad_row[owed.grad_table == t])] += 1
        # the home's records of the rows read by one rank: updated there, dirty on it
        for t in np.unique(prep.got_table):
            sel = np.flatnonzero((prep.got_table == t) & ~prep.got_shared)
            rows = prep.got_row[sel]
            self.home.version[int(t)][rows] += 1
            self.home.dirty_on[int(t)][rows] = prep.got_src[sel]
        for table in self.tables:
            table._batch.clear()
        # recency, then the trim
        cache.last_use[prep.slots] = self.steps
        evictions, evict_pushes = self._trim()
        self.steps += 1
        record = CacheRecord(**prep.record, evictions=evictions, evict_pushes=evict_pushes)
        self._totals += np.array([record.counts()[k] for k in RECORD_KINDS], dtype=np.int64)
        self.last_record = record
        if self.keep_records:
            self.records.append(record)

    def totals(self) -> list[dict[str, int]]:
        """Rows of each kind of :data:`RECORD_KINDS` over all steps, one dict per rank
        (collective)."""
        every = self.comm.all_gather(
            torch.from_numpy(self._totals.copy()), what="the caches' totals"
        )
        return [dict(zip(RECORD_KINDS, (int(v) for v in t.tolist()), strict=True)) for t in every]

    def _trim(self) -> tuple[np.ndarray, np.ndarray]:
        """Drop the least recently used rows over capacity; dirty ones are owed to their homes
        (evict pushes, sent with the next exchange)."""
        cache = self.cache
        used = np.flatnonzero(cache.used)
        over = used.size - self.capacity
        gone = np.zeros(0, dtype=np.int64)
        if over > 0:
            tie = self._rank_of_table[cache.table[used]]
            order = np.lexsort((cache.ids[used], tie, cache.last_use[used]))
            gone = used[order[:over]]
        dirty = gone[cache.dirty[gone]]
        tables, ids = cache.table[dirty], cache.ids[dirty]
        w, n_t = self.comm.world_size, len(self.tables)
        key = owner_of(ids, w) * n_t + tables
        order = _group_order(key, w * n_t)
        owed = self._owed
        owed.evict_ids, owed.evict_rows = ids[order], cache.packed(dirty[order])
        owed.evict_counts = np.bincount(key, minlength=w * n_t).reshape(w, n_t)
        evictions = _pairs(self._rank_of_table[cache.table[gone]], cache.ids[gone])
        pushes = _pairs(self._rank_of_table[tables], ids)
        if gone.size:
            cache.release(gone)
        return evictions, pushes

    # -- the rows -----------------------------------------------------------------------------------
    def owned_rows(self) -> dict[str, dict[str, Any]]:
        """Every row this rank owns at its latest version (collective: what the last step owes
        the homes goes home, dirty copies are read from their caches, which keep them dirty)."""
        dirty = np.flatnonzero(self.cache.used & self.cache.dirty)
        none = np.zeros(0, dtype=np.int64)
        inbox = self._to_homes(none.reshape(0, 2), none, dirty, what="the caches' dirty rows")
        got_table, got_ids, got = inbox.copy_table, inbox.copy_ids, inbox.copy_rows
        out = self.base.owned_rows()
        for t, name in enumerate(self.names):
            sel = np.flatnonzero(got_table == t)
            if not sel.size:
                continue
            entry = out[name]
            at = torch.searchsorted(entry["ids"], torch.from_numpy(got_ids[sel]))  # ids sorted
            entry["values"].index_copy_(0, at, got[sel, : self.dim].to(self.dtype))
            if entry["state"] is not None:
                entry["state"].index_copy_(0, at, unpack_state(got[sel], self.dim, entry["state"]))
        return out

    def load_owned_rows(self, parts: Iterable[Mapping[str, Mapping[str, Any]]]) -> None:
        """Restore saved rows (the caches start empty, owing nothing)."""
        self.base.load_owned_rows(parts)
        self._owed = self._nothing_owed()

    def set_hot(self, hot_ids: Sequence[Any]) -> None:
        """Only an empty hot set (a checkpoint of a job with caches)."""
        if any(len(ids) for ids in hot_ids):
            msg = "the checkpoint has a hot set: resume it without `cache_rows`"
            raise RecpipeError(msg)

    def hot_sets(self) -> list[np.ndarray]:
        return [np.zeros(0, dtype=np.int64) for _ in self.tables]

    def gather_counts(self, *, budget: int | None = None) -> Any:
        msg = "a job with per-rank caches keeps no hot set"
        raise RecpipeError(msg)

    def reshard(self, num_hot: int) -> int:
        if num_hot:
            msg = f"a job with per-rank caches keeps no hot set, asked for {num_hot} hot rows"
            raise RecpipeError(msg)
        return 0
