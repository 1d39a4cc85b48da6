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
                           its state) from home; every row read is now a fresh copy in the cache
    step      a row read by one rank only: that rank applies the optimizer to its copy (the
              latest version now, dirty on it); a row read by several ranks: each sends its
              float64 gradient home, the home sums, rounds once and applies it (every cached
              copy is stale now)
    trim      a cache over its capacity drops its least recently used rows (rows last used in
              the same step in (table, id) order, the tables in ``table_order``); a dirty row
              dropped is sent home (evict push)

Every update applies the sum of the global batch's gradients of the row to its latest version,
rounded once, so the tables are those of one process. Nothing is random: a
:class:`readers.dispatch.shadow.CacheShadow` replaying the same reads predicts every pull and
push, and each step's :class:`CacheRecord` lists what this rank's cache did, to check it.
"""

from __future__ import annotations

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

_PULL, _SHARED = 1, 2  # flags a home answers a read with


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
    def _send(self, key: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Send order of items keyed ``dest * T + table``, the counts ``[W, T]`` each rank
        receives from each (exchanged), and the rows sent per rank."""
        w, n_t = self.comm.world_size, len(self.tables)
        order = _group_order(key, groups)
        counts = np.bincount(key, minlength=w * n_t).reshape(w, n_t)
        recv = self.comm.all_to_all_counts(torch.from_numpy(counts), what="the caches' counts")
        return order, counts, recv.numpy()

    def _a2a(self, payload: torch.Tensor, send: np.ndarray, recv: np.ndarray, what: str):
        return self.comm.all_to_all(payload, send, recv, what=what)

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

    def _fetch_from_holders(
        self, tables: np.ndarray, ids: np.ndarray, holders: np.ndarray, *, commit: bool
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The home asks each holder for its dirty copy of (table, id); returns the copies in
        the given order (collective). ``commit``: the holder's copy becomes clean (an update
        push) and the home stores it; otherwise nothing changes (a read for evaluation).
        Returns also, on this rank as a holder, the (table, id) rows it sent."""
        w, n_t = self.comm.world_size, len(self.tables)
        order, counts, recv = self._send(holders * n_t + tables, w * n_t)
        send_rows, recv_rows = counts.sum(1), recv.sum(1)
        asked = self._a2a(torch.from_numpy(ids[order]), send_rows, recv_rows,
                          what="the caches' push requests").numpy()  # fmt: skip
        asked_table = np.repeat(np.tile(np.arange(n_t), w), recv.reshape(-1))
        slots = np.zeros(asked.size, dtype=np.int64)
        for t in np.unique(asked_table):
            sel = np.flatnonzero(asked_table == t)
            slots[sel] = self.cache.find(int(t), asked[sel])
        if (slots < 0).any() or not self.cache.dirty[slots].all():
            msg = (
                f"rank {self.comm.rank}: a home asked for a dirty copy this cache does not hold "
                "(the caches' version records disagree)"
            )
            raise DistributedError(msg)
        reply = self.cache.packed(slots)
        if commit:
            self.cache.dirty[slots] = False
        got = self._a2a(reply, recv_rows, send_rows, what="the caches' update pushes")
        out = torch.empty_like(got)
        out[torch.from_numpy(order)] = got
        return out, _pairs(self._rank_of_table[asked_table], asked)

    # -- forward ------------------------------------------------------------------------------------
    def prepare(self, batch: Batch, *, train: bool = True) -> PlannedBatch:
        """Bring the latest version of every row ``batch`` reads (collective); returns the
        batch with its id plan (:meth:`ShardedEmbeddings.plan`), to run the model on."""
        w, n_t = self.comm.world_size, len(self.tables)
        planned = self.base.plan(batch)
        uniq = list(planned.plan.ids)
        sizes = np.array([u.size for u in uniq], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        ids = np.concatenate(uniq)
        table_of = np.repeat(np.arange(n_t), sizes)
        slots = np.zeros(ids.size, dtype=np.int64)
        for t in range(n_t):
            slots[starts[t] : starts[t + 1]] = self.cache.find(t, uniq[t])
        held = np.full(ids.size, -1, dtype=np.int64)  # evaluation: every row from its home
        if train:
            cached = slots >= 0
            held[cached] = self.cache.version[slots[cached]]
        # 1. the reads, with the versions held, to their homes
        order, counts, recv = self._send(owner_of(ids, w) * n_t + table_of, w * n_t)
        send_rows, recv_rows = counts.sum(1), recv.sum(1)
        request = torch.from_numpy(np.stack([ids[order], held[order]], axis=1))
        got = self._a2a(request, send_rows, recv_rows, what="the caches' reads").numpy()
        got_table = np.repeat(np.tile(np.arange(n_t), w), recv.reshape(-1))
        got_src = np.repeat(np.arange(w), recv_rows)
        got_row = self._home_rows(got_table, got[:, 0], create=train)
        # 2. the home's answer: readers per row, pulls, update pushes
        key = got_table * (int(got_row.max(initial=0)) + 2) + got_row + 1
        _, inverse, readers = np.unique(key, return_inverse=True, return_counts=True)
        got_shared = readers[inverse] >= 2
        latest, dirty_on = self._home_records(got_table, got_row)
        pull = got[:, 1] != latest
        # a row dirty on another rank is fetched from it (for evaluation, from the reader too)
        needs = (dirty_on >= 0) & pull & ((dirty_on != got_src) | (not train))
        push_at = np.flatnonzero(needs)
        push_at = push_at[np.unique(inverse[push_at], return_index=True)[1]]  # once per row
        pushed, pushed_rows = self._fetch_from_holders(
            got_table[push_at], got[push_at, 0], dirty_on[push_at], commit=train
        )
        fresh_home = self._home_packed(got_table, got_row, got[:, 0])
        if push_at.size:  # the pushed copies are the latest: serve them (and keep them if training)
            pick = np.full(readers.size, -1, dtype=np.int64)
            pick[inverse[push_at]] = np.arange(push_at.size)
            sel = np.flatnonzero(pick[inverse] >= 0)
            fresh_home[torch.from_numpy(sel)] = pushed[torch.from_numpy(pick[inverse[sel]])]
            if train:
                self._write_home(got_table[push_at], got_row[push_at], pushed)
                self._set_dirty(got_table[push_at], got_row[push_at], -1)
        flags = np.where(pull, _PULL, 0) | np.where(got_shared, _SHARED, 0)
        answer = torch.from_numpy(np.stack([flags, latest], axis=1))
        back = self._a2a(answer, recv_rows, send_rows, what="the caches' answers").numpy()
        # 3. the pulls
        pulls_out = np.flatnonzero(pull)
        pull_src = np.bincount(got_src[pulls_out], minlength=w)
        my_flags = np.empty_like(back)
        my_flags[order] = back
        mine = np.flatnonzero(my_flags[order][:, 0] & _PULL)  # in send order
        pull_dst = np.bincount(owner_of(ids[order][mine], w), minlength=w)
        rows = self._a2a(fresh_home[torch.from_numpy(pulls_out)], pull_src, pull_dst,
                         what="the caches' pulls")  # fmt: skip
        pulled = order[mine]  # positions in the batch's reads
        if not train:
            values = torch.empty(ids.size, self.dim, dtype=self.dtype)
            values[torch.from_numpy(pulled)] = rows[:, : self.dim]
            place_rows(self.tables, planned.plan, values, None)
            self._prepared = None
            return planned
        for t in range(n_t):
            sel = np.flatnonzero(table_of == t)
            slots[sel] = self.cache.install(t, ids[sel], slots[sel])
        self.cache.write(slots[pulled], rows)
        self.cache.version[slots[pulled]] = my_flags[pulled, 1]
        values = self.cache.values.index_select(0, torch.from_numpy(slots))
        grad = values.new_zeros(values.shape, dtype=GRAD_DTYPE)
        place_rows(self.tables, planned.plan, values, grad)
        pairs_t = self._rank_of_table[table_of]
        shared = (my_flags[:, 0] & _SHARED) > 0
        record = {
            "reads": _pairs(pairs_t, ids),
            "pulls": _pairs(pairs_t[pulled], ids[pulled]),
            "pushes": pushed_rows,
            "shared": _pairs(pairs_t[shared], ids[shared]),
        }
        self.stats.steps += 1
        self.stats.accesses += ids.size
        self.stats.cold_rows += ids.size
        self._prepared = _Step(
            grad=grad, slots=slots, shared=shared, latest=my_flags[:, 1], order=order,
            got_table=got_table, got_row=got_row, got_src=got_src, got_shared=got_shared,
            record=record,
        )  # fmt: skip
        return planned

    # -- backward -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Update every row the global batch read, then trim the caches (collective; after
        ``loss.backward()``)."""
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
        # rows read by several ranks: gradients home, summed in float64, rounded once
        shared_sent = prep.order[prep.shared[prep.order]]
        send = np.bincount(owner_of(self.cache.ids[prep.slots[shared_sent]], w), minlength=w)
        recv = np.bincount(prep.got_src[prep.got_shared], minlength=w)
        got = self._a2a(prep.grad.index_select(0, torch.from_numpy(shared_sent)), send, recv,
                        what="the caches' shared gradients")  # fmt: skip
        home_sel = np.flatnonzero(prep.got_shared)
        for t in np.unique(prep.got_table[home_sel]):
            sel = np.flatnonzero(prep.got_table[home_sel] == t)
            rows = prep.got_row[home_sel[sel]]
            table = self.tables[int(t)]
            slot = self.base._scratch(int(t), table.shard.num_rows)  # all -1, and again after
            uniq, sums = K.sum_by_row(got.numpy(), sel, rows, slot)
            table.shard.apply(self.optimizer, uniq, torch.from_numpy(sums).to(self.dtype))
            self.home.version[int(t)][uniq] += 1
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
        """Drop the least recently used rows over capacity; dirty ones go home (collective)."""
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
        got_table, got_ids, got = self._copies_home(dirty, what="the caches' evict pushes")
        rows = self._home_rows(got_table, got_ids, create=True)
        self._write_home(got_table, rows, got)
        self._set_dirty(got_table, rows, -1)
        evictions = _pairs(self._rank_of_table[cache.table[gone]], cache.ids[gone])
        pushes = _pairs(self._rank_of_table[tables], ids)
        if gone.size:
            cache.release(gone)
        return evictions, pushes

    def _copies_home(
        self, slots: np.ndarray, *, what: str
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """Send the cached copies in ``slots`` to their homes (collective); on each home, the
        (table, id, packed row) of the copies it received."""
        cache, w, n_t = self.cache, self.comm.world_size, len(self.tables)
        tables, ids = cache.table[slots], cache.ids[slots]
        order, counts, recv = self._send(owner_of(ids, w) * n_t + tables, w * n_t)
        send_rows, recv_rows = counts.sum(1), recv.sum(1)
        got_ids = self._a2a(torch.from_numpy(ids[order]), send_rows, recv_rows, what=what).numpy()
        got = self._a2a(cache.packed(slots[order]), send_rows, recv_rows, what=what)
        got_table = np.repeat(np.tile(np.arange(n_t), w), recv.reshape(-1))
        return got_table, got_ids, got

    # -- the rows -----------------------------------------------------------------------------------
    def owned_rows(self) -> dict[str, dict[str, Any]]:
        """Every row this rank owns at its latest version (collective: dirty copies are read from
        their caches, which keep them dirty)."""
        dirty = np.flatnonzero(self.cache.used & self.cache.dirty)
        got_table, got_ids, got = self._copies_home(dirty, what="the caches' dirty rows")
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
        """Restore saved rows (the caches start empty)."""
        self.base.load_owned_rows(parts)

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
