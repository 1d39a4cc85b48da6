"""HypeReca's two-stage embedding exchange (2FP) over ``torch.distributed``, for every table.

Every rank trains on its own micro-batch; the job's step is the global batch they make together.
Per table, the rows are split in two::

    hot set   the R ids accessed most (measured), a replica on every rank   gradients all-reduced
    cold      every other row, owned by rank owner_of(id, W)                rows and gradients
                                                                             travel by all-to-all

A step, with every rank calling the same collectives in the same order (all tables at once)::

    prepare(batch)   the batch's id plan (trainer.idplan: unique ids u of each table in the
                     rank's batch, IKJT rows unique already, ids deduplicated again across
                     rows and features; computed here unless the batch carries it)
                     hot ids: rows from the replica
                     cold ids, grouped by owner:
                       1. all_to_all counts [W, T]      (sizes first: gloo aborts on mismatches)
                       2. all_to_all ids                owners create unseen rows (hash init)
                       3. all_to_all rows               back to the requesting ranks
                     -> [U, D] rows per table, and the batch with its plan: the model's
                        lookups gather from the rows at the plan's positions
    forward/backward (the model reads tables through pool()/rows(); gradients land in the leaves)
    step()           (gradients are accumulated and exchanged in float64, rounded once)
                     hot:  one all_reduce of [R, D] gradients + a [R] touched-rows mask;
                           every rank applies the optimizer to the touched rows only
                     cold: 4. all_to_all gradients to the owners (the sizes of step 3 reversed);
                           owners sum them per row and apply the optimizer (state stays there)

Both ways apply the same update to the same summed gradient, so ``W`` ranks compute what one
process computes on the global batch (up to the order of floating-point sums). The hot set is
chosen by the cost model ``R·C_ar + N·(1−ρ(R))·C_a2a`` (:mod:`trainer.distributed.costs`) from
access counts gathered on their owners, and :meth:`ShardedEmbeddings.reshard` changes it at a
step boundary: leaving rows go back to their owner with their optimizer state, entering rows
are read from their owner and broadcast, so no update is lost. See ``docs/distributed.md``.

One concept, over 600 lines: the exchange's step (:class:`ShardedEmbeddings`); everything else
here (the table view, the counters, the hot candidates) exists only for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recpipe.errors import RecpipeError
from trainer._kernels import add_rows
from trainer.distributed import _kernels as K
from trainer.distributed.comm import Comm
from trainer.distributed.shard import (
    RowShard,
    SparseOptimizer,
    owner_of,
    pack_rows,
    unpack_state,
)
from trainer.idplan import plan_batch
from trainer.modules import IdPlan, PlannedBatch, PoolingMode, TableConfig, dedup_batch
from trainer.store.hotset import rho_curve

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = ["ExchangeStats", "HotCandidates", "ShardedEmbeddings", "ShardedTable"]


# -------------------------------------------------------------------------------------------
# one table


GRAD_DTYPE = torch.float64
"""Gradients of the tables are accumulated, exchanged and summed in float64 and rounded once
before the update: sums over several ranks then give the float32 gradient one process computes
(float32 partial sums in another order differ in the last bits, and row-wise Adagrad, which
divides by the gradient's own size, turns a cancelling sum's few wrong bits into a visible
difference)."""


class _Lookup(torch.autograd.Function):
    """``rows[pos]`` of the prepared rows; backward adds the gradient into the table's float64
    accumulator (nothing flows to torch's own leaves)."""

    @staticmethod
    def forward(ctx, anchor, table, pos):
        ctx.table, ctx.pos = table, pos
        return table._batch.rows.index_select(0, pos)  # (n, D)

    @staticmethod
    def backward(ctx, grad):
        acc = ctx.table._batch.grad
        if acc is not None and acc.device.type == "cpu":
            add_rows(grad.contiguous().numpy(), ctx.pos.numpy(), acc.numpy())
        elif acc is not None:
            acc.index_add_(0, ctx.pos, grad.to(GRAD_DTYPE))
        return None, None, None


class _Pool(torch.autograd.Function):
    """Pooled bags of the prepared rows (one fused ``embedding_bag``); backward adds each bag's
    gradient (divided by its length for ``mean``) to its ids' rows in float64."""

    @staticmethod
    def forward(ctx, anchor, table, pos, offsets, mean):
        ctx.table, ctx.pos, ctx.offsets, ctx.mean = table, pos, offsets, mean
        mode = "mean" if mean else "sum"
        return F.embedding_bag(pos, table._batch.rows, offsets, mode=mode, include_last_offset=True)

    @staticmethod
    def backward(ctx, grad):
        acc = ctx.table._batch.grad
        if acc is not None and acc.device.type == "cpu":
            K.pool_backward(grad.contiguous().numpy(), ctx.pos.numpy(), ctx.offsets.numpy(),
                            ctx.mean, acc.numpy())  # fmt: skip
        elif acc is not None:
            lengths = ctx.offsets[1:] - ctx.offsets[:-1]  # (R,)
            bag = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=grad.device), lengths
            )
            g = grad.to(GRAD_DTYPE)
            if ctx.mean:
                g = g / lengths.clamp(min=1).unsqueeze(1).to(GRAD_DTYPE)
            acc.index_add_(0, ctx.pos, g.index_select(0, bag))
        return None, None, None, None, None


class _TableBatch:
    """What :meth:`ShardedEmbeddings.prepare` leaves a table for the batch's lookups."""

    __slots__ = ("grad", "plan", "rows")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.rows: torch.Tensor | None = None  # [U, D] their rows
        self.grad: torch.Tensor | None = None  # [U, D] float64 gradient (when training)
        self.plan: int | None = None  # the serial of the IdPlan the rows were fetched for

    def set(self, plan: IdPlan, rows: torch.Tensor, grad: torch.Tensor | None) -> None:
        """The table's rows (and gradient accumulator) of ``plan``."""
        self.rows, self.grad, self.plan = rows, grad, plan.serial


class ShardedTable(nn.Module):
    """One embedding table of a multi-rank job: the rank's own rows and the hot replica.

    Plugs into the model's collections as a table backend that reads id plans
    (:class:`~trainer.modules.PlannedTable`: ``pool_planned``/``rows_planned`` look a feature up
    at its positions in the batch's plan; ``pool``/``rows``, a batch without its plan, are
    refused). Lookups read the rows that
    :meth:`ShardedEmbeddings.prepare` fetched for the current batch, and their gradients
    collect in a float64 ``[U, D]`` accumulator that :meth:`ShardedEmbeddings.step` exchanges.
    It holds no ``nn.Parameter`` (DDP sees only the dense model).

    Args:
        config: the table (``num_embeddings`` only sets the init scale, as in the store: ids
            index rows directly, the id index grows).
        shard: the rows this rank owns.
    """

    def __init__(self, config: TableConfig, shard: RowShard) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.hot_ids = np.zeros(0, dtype=np.int64)  # sorted
        self.hot_values = torch.zeros(0, shard.dim, dtype=shard.dtype, device=shard.device)
        self.hot_state = _empty_state(shard)
        self._batch = _TableBatch()  # the prepared batch (a plain object: cheap to set)
        # a zero-size tensor that requires grad, so autograd records the lookups
        self._anchor = torch.zeros(0, requires_grad=True)

    @property
    def num_hot(self) -> int:
        return int(self.hot_ids.size)

    def hot_index(self, ids: np.ndarray) -> np.ndarray:
        """Index in the hot replica of each id, -1 for cold ids."""
        if not self.hot_ids.size:
            return np.full(ids.size, -1, dtype=np.int64)
        pos = np.searchsorted(self.hot_ids, ids)
        clipped = np.minimum(pos, self.hot_ids.size - 1)
        return np.where(self.hot_ids[clipped] == ids, clipped, -1)

    def _planned(self, plan: IdPlan, feature: str) -> torch.Tensor:
        """``feature``'s positions in ``plan``, whose rows this table holds."""
        if self._batch.plan != plan.serial:
            msg = (
                f"table {self.config.name!r}: the batch's id plan is not the one whose rows were "
                "prepared; run the model on the batch ShardedEmbeddings.prepare(batch) returns"
            )
            raise RecpipeError(msg)
        return plan.positions[feature]

    def pool(self, ids: torch.Tensor, offsets: torch.Tensor, *, mode: PoolingMode) -> torch.Tensor:
        """Refused: the table reads a batch through its id plan (:meth:`pool_planned`)."""
        raise self._unplanned()

    def pool_planned(
        self, plan: IdPlan, feature: str, offsets: torch.Tensor, *, mode: PoolingMode
    ) -> torch.Tensor:
        """Pooled ``[R, D]`` bags of ``feature``'s ids, at their positions in ``plan``."""
        return self._pool(self._planned(plan, feature), offsets, mode)

    def _pool(self, pos: torch.Tensor, offsets: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
        offsets = offsets.to(pos.device, torch.int64)
        return _Pool.apply(self._anchor, self, pos, offsets, mode == "mean")  # (R, D)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Refused: the table reads a batch through its id plan (:meth:`rows_planned`)."""
        raise self._unplanned()

    def _unplanned(self) -> RecpipeError:
        msg = (
            f"table {self.config.name!r}: the batch carries no id plan; run the model on the "
            "batch ShardedEmbeddings.prepare(batch) returns"
        )
        return RecpipeError(msg)

    def rows_planned(self, plan: IdPlan, feature: str) -> torch.Tensor:
        """``[n, D]`` rows of ``feature``'s ids, at their positions in ``plan``."""
        return _Lookup.apply(self._anchor, self, self._planned(plan, feature))  # (n, D)

    def extra_repr(self) -> str:
        c = self.config
        return f"{c.name!r}, dim={c.dim}, own rows={self.shard.num_rows}, hot={self.num_hot}"


# -------------------------------------------------------------------------------------------
# counters


@dataclass
class ExchangeStats:
    """What the exchange of this rank did (sums over steps).

    Attributes:
        steps: training steps exchanged.
        accesses: unique ids this rank looked up (its share of N, all tables).
        hot_accesses: those served by the hot replica.
        cold_rows: ids requested by all-to-all (rows moved forward, gradients back), own
            rows included: ``accesses - hot_accesses``.
        remote_rows: of those, rows owned by another rank.
        a2a_bytes: bytes this rank sent to other ranks by all-to-all (counts, ids, rows,
            gradients).
        allreduce_bytes: bytes of hot gradients and masks this rank all-reduced.
    """

    steps: int = 0
    accesses: int = 0
    hot_accesses: int = 0
    cold_rows: int = 0
    remote_rows: int = 0
    a2a_bytes: int = 0
    allreduce_bytes: int = 0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, k) for k in self.__dataclass_fields__])

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> ExchangeStats:
        return cls(*(int(v) for v in values.tolist()))


class _Counter:
    """Access counts of ids (unique per step), merged now and then."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._ids = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(0, dtype=np.int64)

    def add(self, uniq: np.ndarray) -> None:
        self._parts.append(uniq)
        if len(self._parts) >= 32:
            self._merge()

    def _merge(self) -> None:
        if not self._parts:
            return
        ids = np.concatenate([self._ids, *self._parts])
        weights = np.concatenate([self._counts, *(np.ones(p.size, np.int64) for p in self._parts)])
        uniq, inv = torch.unique(torch.from_numpy(ids), return_inverse=True)
        self._ids, inv = uniq.numpy(), inv.numpy()
        self._counts = np.bincount(inv, weights=weights, minlength=self._ids.size).astype(np.int64)
        self._parts = []

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        self._merge()
        return self._ids, self._counts


@dataclass(frozen=True)
class HotCandidates:
    """The most accessed (table, id) pairs of the job, most first (identical on every rank).

    Attributes:
        counts: int64 [K] accesses of each pair over the counted steps.
        tables: int64 [K] table index.
        ids: int64 [K] id.
        total: accesses of every id counted (all tables, all ranks).
        steps: steps counted.
    """

    counts: np.ndarray
    tables: np.ndarray
    ids: np.ndarray
    total: int
    steps: int

    @property
    def accesses_per_step(self) -> float:
        """N, unique-id accesses per global step."""
        return self.total / max(self.steps, 1)

    def rho(self) -> np.ndarray:
        """``rho[R]``: share of accesses the top R pairs serve (``rho[0] = 0``)."""
        return rho_curve(self.counts, total=self.total)


def _empty_state(shard: RowShard) -> torch.Tensor | None:
    """A replica's state of no rows, shaped as ``shard``'s (``None``: it keeps none)."""
    shape = shard.row_state_shape
    return None if shape is None else torch.zeros(0, *shape, dtype=shard.dtype, device=shard.device)


def place_rows(
    tables: Sequence[ShardedTable], plan: IdPlan, rows: torch.Tensor, grad: torch.Tensor | None
) -> None:
    """Hand each table its slice of ``rows`` (and ``grad``): every table's plan ids' rows,
    tables one after the other."""
    at = 0
    for t, table in enumerate(tables):
        n = int(plan.ids[t].size)
        table._batch.set(plan, rows[at : at + n], None if grad is None else grad[at : at + n])
        at += n


def _group_order(key: np.ndarray, groups: int) -> np.ndarray:
    """A stable order of ``key`` (values in ``[0, groups)``): numpy sorts small integer types
    with a radix sort, linear in the length."""
    small = np.int16 if groups <= np.iinfo(np.int16).max else np.int32
    return np.argsort(key.astype(small), kind="stable")


def _table_slices(counts: np.ndarray, n_tables: int) -> list[np.ndarray]:
    """Positions of each table's rows in a buffer laid out by (rank, table) with ``counts``
    [W, T] rows per block: ``out[t]`` lists table ``t``'s positions, rank by rank."""
    label = np.repeat(np.tile(np.arange(n_tables), counts.shape[0]), counts.reshape(-1))
    order = _group_order(label, n_tables)  # stable: block by block, in buffer order
    bounds = np.concatenate([[0], np.cumsum(counts.sum(0))])
    return [order[bounds[t] : bounds[t + 1]] for t in range(n_tables)]


def _saved_state(part: Mapping[str, Any], name: str, row_shape: tuple[int, ...]) -> torch.Tensor:
    """The optimizer state of a saved table part, checked against a row's state here."""
    state, n = part.get("state"), part["ids"].numel()
    if state is None or tuple(state.shape) != (n, *row_shape):
        got = "none" if state is None else f"{list(state.shape)}"
        msg = (
            f"table {name!r}: the saved rows hold optimizer state {got}, this run's optimizer "
            f"keeps {[n, *row_shape]}; resume with the `--optimizer` the checkpoint was written "
            "with"
        )
        raise RecpipeError(msg)
    return state


def _top_pairs(counts: np.ndarray, tables: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest counts, ties by (table, id): the same order on every rank."""
    order = np.lexsort((ids, tables, -counts))
    return order[:k]


# -------------------------------------------------------------------------------------------
# the exchange of a model's tables


@dataclass
class _Prepared:
    """What step() needs of the prepare() of the same batch. Every table's unique ids sit in
    one buffer, tables one after the other (table ``t`` at ``starts[t]:starts[t + 1]``)."""

    grad: torch.Tensor  # float64 [U, D] the gradient accumulator of every table's ids
    hot_pos: np.ndarray  # positions in the buffer of the hot ids
    hot_idx: np.ndarray  # their index in the packed replica of every table
    send_pos: np.ndarray  # positions in the buffer of the ids sent, in the send order
    send_counts: np.ndarray  # [W] rows sent to each rank
    recv_counts: np.ndarray  # [W] rows received from each rank
    recv_sel: list[np.ndarray]  # per table: positions in the receive buffer
    owner_rows: list[np.ndarray]  # per table: rows of the shard those ids are


class ShardedEmbeddings:
    """The 2FP exchange for every :class:`ShardedTable` of a model (see the module docstring).

    Args:
        model: a model whose table modules are :class:`ShardedTable` (see :func:`table_factory`).
        comm: the process group of the exchange (world size 1: everything local).
        optimizer: the row update of every table.
        hot_budget_rows: most hot rows (all tables together) the planner may choose.
        count_steps: training steps whose accesses are counted for the hot set (``None``: all).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        comm: Comm,
        optimizer: SparseOptimizer,
        hot_budget_rows: int = 65536,
        count_steps: int | None = None,
    ) -> None:
        self.comm = comm
        self.optimizer = optimizer
        self.hot_budget_rows = int(hot_budget_rows)
        self.model = model  # its dedup groups: the batch its collections read
        self.names: list[str] = []
        self.tables: list[ShardedTable] = []
        for name, module in model.named_modules():
            if isinstance(module, ShardedTable):
                self.names.append(name)
                self.tables.append(module)
        if not self.tables:
            msg = "`model` has no ShardedTable: build it with trainer.distributed.table_factory"
            raise RecpipeError(msg)
        dims = {t.config.dim for t in self.tables}
        if len(dims) != 1:
            msg = f"every table of the exchange must have one dim, got {sorted(dims)}"
            raise RecpipeError(msg)
        self.dim = dims.pop()
        want = optimizer.state_shape(self.dim)
        for table in self.tables:
            shape = table.shard.row_state_shape
            if shape != want:
                got = "none" if shape is None else f"{list(shape)} per row"
                msg = (
                    f"table {table.config.name!r} keeps optimizer state {got}, {optimizer.kind!r} "
                    f"needs {'none' if want is None else f'{list(want)} per row'}: build the "
                    "tables with sharded_table_factory(optimizer=...) of the same optimizer"
                )
                raise RecpipeError(msg)
        self.dtype = self.tables[0].shard.dtype
        self.device = self.tables[0].shard.device
        self.counters = [_Counter() for _ in self.tables]
        self.count_left = count_steps
        self.counted_steps = 0
        # the optimizer's step (Adam's bias correction): one count for every table, advanced
        # by every rank at every step (a rank owning no touched row too), saved with the rows
        self.optimizer_step = max(t.shard.step for t in self.tables)
        self.stats = ExchangeStats()
        self._prepared: _Prepared | None = None
        self._slots = [np.zeros(0, dtype=np.int64) for _ in self.tables]
        self._buffers: dict[str, torch.Tensor] = {}
        self._pack_hot()
        self.candidates: HotCandidates | None = None

    @property
    def num_hot(self) -> int:
        """Hot rows of all tables, R."""
        return sum(t.num_hot for t in self.tables)

    # -- forward --------------------------------------------------------------------------------
    def plan(self, batch: Batch) -> PlannedBatch:
        """``batch`` as the model's collections read it (deduplicated as the model deduplicates
        it) with its id plan over this exchange's tables; a batch that carries one is kept."""
        if isinstance(batch, PlannedBatch) and self._plans(batch.plan):
            return batch
        groups = getattr(self.model, "dedup_groups", ())
        partial = getattr(self.model, "dedup_partial", ())
        if groups or partial:
            batch = dedup_batch(batch, groups, partial)
        tables = [table.config for table in self.tables]
        return plan_batch(batch, tables, device=self.device)

    def _plans(self, plan: IdPlan) -> bool:
        """Whether ``plan`` is over this exchange's tables."""
        return plan.tables == tuple(t.config.name for t in self.tables) and all(
            plan.table_of.get(f) == t
            for t, table in enumerate(self.tables)
            for f in table.config.features
        )

    def count(self, batch: Batch) -> PlannedBatch:
        """Count ``batch``'s accesses for the hot set without training on it; the batch with
        its plan."""
        planned = self.plan(batch)
        for counter, uniq in zip(self.counters, planned.plan.ids, strict=True):
            counter.add(uniq)
        self.counted_steps += 1
        return planned

    def prepare(self, batch: Batch, *, train: bool = True) -> PlannedBatch:
        """Fetch the rows of every table's unique ids in ``batch`` (collective: every rank calls
        it once per step, in the same order as :meth:`step`).

        Returns:
            the batch with its id plan (:meth:`plan`): run the model on it, and its lookups
            read the fetched rows at the plan's positions.
        """
        comm, n_tables, device = self.comm, len(self.tables), self.device
        planned = self.plan(batch)
        plan = planned.plan
        uniq = list(plan.ids)
        if train and (self.count_left is None or self.count_left > 0):
            for counter, u in zip(self.counters, uniq, strict=True):
                counter.add(u)
            self.counted_steps += 1
            if self.count_left is not None:
                self.count_left -= 1
        # every table's ids in one buffer, tables one after the other
        sizes = np.array([u.size for u in uniq], dtype=np.int64)
        all_ids = np.concatenate(uniq)
        table_of = np.repeat(np.arange(n_tables), sizes)
        hot_pos = hot_idx = cold = None
        if self.num_hot:  # every table's hot ids: their index in the packed replica
            local = np.concatenate([t.hot_index(u) for t, u in zip(self.tables, uniq, strict=True)])
            is_hot = local >= 0
            hot_pos, cold = np.flatnonzero(is_hot), np.flatnonzero(~is_hot)
            hot_idx = local[hot_pos] + self._hot_starts[table_of[hot_pos]]
        cold_ids = all_ids if cold is None else all_ids[cold]
        cold_tab = table_of if cold is None else table_of[cold]
        key = owner_of(cold_ids, comm.world_size) * n_tables + cold_tab
        order = _group_order(key, comm.world_size * n_tables)  # by owner, then table
        send_ids = cold_ids[order]
        send_pos = order if cold is None else cold[order]  # their positions in the buffer
        counts = np.bincount(key, minlength=comm.world_size * n_tables).reshape(-1, n_tables)
        recv = comm.all_to_all_counts(torch.from_numpy(counts), what="the exchange's counts")
        recv_counts = recv.numpy()
        send_rows, recv_rows = counts.sum(1), recv_counts.sum(1)
        got_ids = comm.all_to_all(
            torch.from_numpy(send_ids), send_rows, recv_rows, what="the exchange's ids"
        ).numpy()
        recv_sel = _table_slices(recv_counts, n_tables)  # positions in the receive buffer
        response = self._buffer("response", got_ids.size, self.dtype)
        owner_rows = []
        for table, sel in zip(self.tables, recv_sel, strict=True):
            if not sel.size:
                owner_rows.append(np.zeros(0, np.int64))
                continue
            ids = got_ids[sel]
            if train:
                rows = table.shard.rows(ids)
                table.shard.gather_into(rows, response, sel)
            else:
                rows = np.zeros(0, np.int64)
                response.index_copy_(0, torch.from_numpy(sel).to(device), table.shard.lookup(ids))
            owner_rows.append(rows)
        fetched = comm.all_to_all(response, recv_rows, send_rows, what="the exchange's rows",
                                  out=self._buffer("fetched", int(send_rows.sum()), self.dtype))  # fmt: skip
        rows = self._buffer("rows", all_ids.size, self.dtype)
        if device.type == "cpu":  # one compiled pass each
            if hot_pos is not None and hot_pos.size:
                K.copy_rows(self._hot_values.numpy(), hot_idx, rows.numpy(), hot_pos)
            K.scatter_rows(fetched.numpy(), send_pos, rows.numpy())
        else:
            if hot_pos is not None and hot_pos.size:
                idx = torch.from_numpy(hot_idx).to(device)
                rows.index_copy_(0, torch.from_numpy(hot_pos).to(device),
                                 self._hot_values.index_select(0, idx))  # fmt: skip
            rows.index_copy_(0, torch.from_numpy(send_pos).to(device), fetched)
        grad = self._buffer("grad", all_ids.size, GRAD_DTYPE).zero_() if train else None
        place_rows(self.tables, plan, rows, grad)
        self._account_forward(all_ids.size, send_ids.size, counts, recv_counts, train=train)
        if grad is None:
            self._prepared = None
            return planned
        self._prepared = _Prepared(
            grad=grad,
            hot_pos=np.zeros(0, np.int64) if hot_pos is None else hot_pos,
            hot_idx=np.zeros(0, np.int64) if hot_idx is None else hot_idx,
            send_pos=send_pos,
            send_counts=send_rows,
            recv_counts=recv_rows,
            recv_sel=recv_sel,
            owner_rows=owner_rows,
        )
        return planned

    def _account_forward(self, accesses, cold, counts, recv_counts, *, train: bool) -> None:
        if not train:
            return
        st, rank = self.stats, self.comm.rank
        st.steps += 1
        st.accesses += accesses
        st.hot_accesses += accesses - cold
        st.cold_rows += cold
        own = int(counts[rank].sum())
        served_remote = int(recv_counts.sum() - recv_counts[rank].sum())
        row_bytes = self.dim * self.values_itemsize
        grad_bytes = self.dim * torch.empty(0, dtype=GRAD_DTYPE).element_size()
        st.remote_rows += cold - own
        # counts (to the other ranks), ids sent, rows served to others, gradients sent back
        st.a2a_bytes += (self.comm.world_size - 1) * counts.shape[1] * 8
        st.a2a_bytes += (cold - own) * (8 + grad_bytes) + served_remote * row_bytes

    @property
    def values_itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    # -- backward -------------------------------------------------------------------------------
    def step(self) -> None:
        """Reduce hot gradients, send cold gradients to their owners, and update every row the
        global batch touched (collective; after ``loss.backward()``)."""
        prep = self._prepared
        if prep is None:
            msg = "step() without a prepare(batch, train=True) before it"
            raise RecpipeError(msg)
        self._prepared = None
        self.advance_step()
        self._hot_step(prep)
        self._cold_step(prep)
        for table in self.tables:
            table._batch.clear()

    def advance_step(self) -> int:
        """Count the optimizer step about to be applied, on every table (each rank calls this
        once per training step, whatever rows it owns); returns it."""
        self.optimizer_step += 1
        for table in self.tables:
            table.shard.step = self.optimizer_step
        return self.optimizer_step

    def _hot_step(self, prep: _Prepared) -> None:
        rows = self.num_hot
        if not rows:
            return
        # [R, D] gradients and a [R] touched mask, every table's replica rows one after another
        flat = torch.zeros(rows * (self.dim + 1), dtype=GRAD_DTYPE, device=self.device)
        grads, mask = flat[: rows * self.dim].view(rows, self.dim), flat[rows * self.dim :]
        if prep.hot_idx.size:
            idx = torch.from_numpy(prep.hot_idx).to(self.device)
            pos = torch.from_numpy(prep.hot_pos).to(self.device)
            grads.index_copy_(0, idx, prep.grad.index_select(0, pos))
            mask[idx] = 1
        self.comm.all_reduce(flat, what="the hot rows' gradient all-reduce")
        self.stats.allreduce_bytes += flat.numel() * flat.element_size()
        touched = torch.nonzero(mask > 0).squeeze(1)  # rows some rank touched
        grad = grads.index_select(0, touched).to(self.dtype)  # rounded once
        self.optimizer.apply(
            self._hot_values, self._hot_state, touched, grad, step=self.optimizer_step
        )

    def _cold_step(self, prep: _Prepared) -> None:
        at = torch.from_numpy(prep.send_pos).to(self.device)
        send = self._buffer("send", at.numel(), GRAD_DTYPE)
        torch.index_select(prep.grad, 0, at, out=send)
        got = self.comm.all_to_all(
            send, prep.send_counts, prep.recv_counts, what="the exchange's gradients",
            out=self._buffer("got", int(prep.recv_counts.sum()), GRAD_DTYPE),
        )  # fmt: skip
        for t, table in enumerate(self.tables):
            rows = prep.owner_rows[t]
            if not rows.size:
                continue
            if got.device.type == "cpu":  # one pass: the distinct rows and their sums
                slot = self._scratch(t, table.shard.num_rows)
                uniq, sums = K.sum_by_row(got.numpy(), prep.recv_sel[t], rows, slot)
                summed = torch.from_numpy(sums)
            else:
                uniq_t, inv = torch.unique(torch.from_numpy(rows), return_inverse=True)
                summed = got.new_zeros(uniq_t.numel(), self.dim)
                at = torch.from_numpy(prep.recv_sel[t]).to(self.device)
                summed.index_add_(0, inv.to(self.device), got.index_select(0, at))
                uniq = uniq_t.numpy()
            table.shard.apply(self.optimizer, uniq, summed.to(self.dtype))  # rounded once

    def _buffer(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, D]`` of the exchange's buffer ``name``, kept from step to step, so that a
        step does not allocate (and first-touch) a few MB of fresh tensors. The views handed
        out are valid until the next call for the same name: nothing of a step outlives it
        (``step`` clears the tables' views; a ``prepare`` overwrites them)."""
        buf = self._buffers.get(name)
        need = rows * self.dim
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            size = max(need, int(buf.numel() * 1.25) if buf is not None else 0)
            buf = self._buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:need].view(rows, self.dim)

    def _scratch(self, t: int, rows: int) -> np.ndarray:
        """Table ``t``'s scratch of -1 for :func:`_kernels.sum_by_row` (at least ``rows``)."""
        slot = self._slots[t]
        if slot.size < rows:
            slot = self._slots[t] = np.full(max(rows, 2 * slot.size), -1, dtype=np.int64)
        return slot

    # -- the hot set ----------------------------------------------------------------------------
    def gather_counts(self, *, budget: int | None = None) -> HotCandidates:
        """Bring every id's access counts to its owner and keep the job's top ``budget``
        (table, id) pairs (collective). Sets and returns :attr:`candidates`."""
        comm, n_tables = self.comm, len(self.tables)
        k = self.hot_budget_rows if budget is None else int(budget)
        totals = [c.totals() for c in self.counters]
        ids = np.concatenate([i for i, _ in totals])
        cnt = np.concatenate([c for _, c in totals])
        tab = np.repeat(np.arange(n_tables), [i.size for i, _ in totals])
        key = owner_of(ids, comm.world_size) * n_tables + tab
        order = _group_order(key, comm.world_size * n_tables)
        counts = np.bincount(key, minlength=comm.world_size * n_tables).reshape(-1, n_tables)
        recv = comm.all_to_all_counts(torch.from_numpy(counts), what="the hot-set counts").numpy()
        payload = torch.from_numpy(np.stack([ids[order], cnt[order], tab[order]], axis=1))
        got = comm.all_to_all(payload, counts.sum(1), recv.sum(1), what="the hot-set counts")
        got = got.numpy()
        own_ids, own_tab = got[:, 0], got[:, 2]
        pair = np.stack([own_tab, own_ids], axis=1)
        uniq, inv = np.unique(pair, axis=0, return_inverse=True)
        summed = np.bincount(inv.reshape(-1), weights=got[:, 1], minlength=len(uniq))
        summed = summed.astype(np.int64)
        top = _top_pairs(summed, uniq[:, 0], uniq[:, 1], k)
        mine = torch.from_numpy(np.stack([summed[top], uniq[top, 0], uniq[top, 1]], axis=1))
        every = torch.cat(comm.all_gather_rows(mine, what="the hot-set candidates")).numpy()
        best = _top_pairs(every[:, 0], every[:, 1], every[:, 2], k)
        total = torch.tensor([int(cnt.sum())], dtype=torch.int64)
        comm.all_reduce(total, what="the hot-set counts")
        self.candidates = HotCandidates(
            counts=every[best, 0].copy(),
            tables=every[best, 1].copy(),
            ids=every[best, 2].copy(),
            total=int(total.item()),
            steps=self.counted_steps,
        )
        return self.candidates

    def reshard(self, num_hot: int) -> int:
        """Make the ``num_hot`` most accessed (table, id) pairs of :attr:`candidates` the hot
        set (collective, at a step boundary). Rows leaving it go back to their owners with
        their optimizer state; rows entering it are read from their owners and replicated.

        Returns:
            the new R (at most the number of candidates).
        """
        if self._prepared is not None:
            msg = "reshard() between prepare() and step(): reshard at a step boundary"
            raise RecpipeError(msg)
        if isinstance(num_hot, bool) or not isinstance(num_hot, int) or num_hot < 0:
            msg = f"`num_hot` must be a non-negative integer, got {num_hot!r}"
            raise RecpipeError(msg)
        cand = self.candidates
        if cand is None:
            if num_hot:
                msg = "reshard() to R > 0 needs access counts: call gather_counts() first"
                raise RecpipeError(msg)
            cand = HotCandidates(*(np.zeros(0, np.int64),) * 3, total=0, steps=0)
        take = min(num_hot, cand.counts.size)
        wanted = [
            np.sort(cand.ids[:take][cand.tables[:take] == t]) for t in range(len(self.tables))
        ]
        self.set_hot(wanted)
        return take

    def _pack_hot(self) -> None:
        """Every table's replica in one tensor (the tables' ``hot_values``/``hot_state``
        become views of it), so a step reads and updates all hot rows with one call each."""
        sizes = [t.num_hot for t in self.tables]
        self._hot_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._hot_values = torch.cat([t.hot_values for t in self.tables])
        states = [t.hot_state for t in self.tables]
        self._hot_state = None if states[0] is None else torch.cat(states)
        for t, table in enumerate(self.tables):
            lo, hi = int(self._hot_starts[t]), int(self._hot_starts[t + 1])
            table.hot_values = self._hot_values[lo:hi]
            if self._hot_state is not None:
                table.hot_state = self._hot_state[lo:hi]

    def set_hot(self, hot_ids: Sequence[np.ndarray]) -> None:
        """Make ``hot_ids[t]`` (sorted, distinct) table ``t``'s hot set (collective)."""
        comm = self.comm
        new_sets = [np.asarray(h, dtype=np.int64) for h in hot_ids]
        keys, rows = [], []
        for t, (table, new) in enumerate(zip(self.tables, new_sets, strict=True)):
            self._demote(table, new)
            entering = new[~np.isin(new, table.hot_ids)]
            mine = entering[owner_of(entering, comm.world_size) == comm.rank]
            rows.append(pack_rows(*table.shard.read(mine)))
            keys.append(np.stack([np.full(mine.size, t, dtype=np.int64), mine], axis=1))
        what = "the reshard's rows"
        got_keys = torch.cat(
            comm.all_gather_rows(torch.from_numpy(np.concatenate(keys)), what=what)
        )
        got_rows = torch.cat(comm.all_gather_rows(torch.cat(rows), what=what)).to(self.device)
        got_keys = got_keys.numpy()
        for t, (table, new) in enumerate(zip(self.tables, new_sets, strict=True)):
            sel = np.flatnonzero(got_keys[:, 0] == t)
            self._install(table, new, got_keys[sel, 1], got_rows[torch.from_numpy(sel)])
        self._pack_hot()

    def _demote(self, table: ShardedTable, new: np.ndarray) -> None:
        """Rows leaving the hot set go back to their owner, with their optimizer state."""
        old = table.hot_ids
        back = ~np.isin(old, new) & (owner_of(old, self.comm.world_size) == self.comm.rank)
        if back.any():
            sel = torch.from_numpy(np.flatnonzero(back)).to(self.device)
            state = None if table.hot_state is None else table.hot_state[sel]
            table.shard.write(old[back], table.hot_values[sel], state)

    def _install(
        self, table: ShardedTable, new: np.ndarray, in_ids: np.ndarray, in_rows: torch.Tensor
    ) -> None:
        """The replica of ``new``: rows staying hot, and ``in_rows`` of the entering ``in_ids``."""
        values = table.hot_values.new_empty(new.size, self.dim)
        hot_state = table.hot_state
        state = None if hot_state is None else hot_state.new_empty(new.size, *hot_state.shape[1:])
        stay = np.isin(new, table.hot_ids)
        if int(stay.sum()) + in_ids.size != new.size:
            msg = f"table {table.config.name!r}: the reshard lost rows ({new.size} wanted)"
            raise RecpipeError(msg)
        if stay.any():
            src = torch.from_numpy(table.hot_index(new[stay])).to(self.device)
            dst = torch.from_numpy(np.flatnonzero(stay)).to(self.device)
            values[dst] = table.hot_values.index_select(0, src)
            if state is not None:
                state[dst] = table.hot_state.index_select(0, src)
        if in_ids.size:
            dst = torch.from_numpy(np.searchsorted(new, in_ids)).to(self.device)
            values[dst] = in_rows[:, : self.dim].to(values.dtype)
            if state is not None:
                state[dst] = unpack_state(in_rows, self.dim, state)
        table.hot_ids, table.hot_values, table.hot_state = new, values, state

    def hot_sets(self) -> list[np.ndarray]:
        """Each table's hot ids (sorted)."""
        return [t.hot_ids.copy() for t in self.tables]

    # -- state ----------------------------------------------------------------------------------
    def owned_rows(self) -> dict[str, dict[str, Any]]:
        """Every row this rank owns, per table (hot rows from the replica): what a checkpoint
        saves. ``{table key: {"ids", "values", "state", "step"}}``, CPU tensors (``state``
        ``[n]`` for row-wise Adagrad, ``[n, 2D]`` for Adam, ``None`` for SGD; ``step`` the
        optimizer's)."""
        out = {}
        rank, world = self.comm.rank, self.comm.world_size
        for name, table in zip(self.names, self.tables, strict=True):
            ids, values, state = table.shard.export()
            hot_own = table.hot_ids[owner_of(table.hot_ids, world) == rank]
            if hot_own.size:
                cold = ~np.isin(ids, hot_own)
                idx = torch.from_numpy(table.hot_index(hot_own)).to(self.device)
                ids = np.concatenate([ids[cold], hot_own])
                keep = torch.from_numpy(np.flatnonzero(cold)).to(values.device)
                values = torch.cat([values[keep], table.hot_values.index_select(0, idx)])
                if state is not None:
                    state = torch.cat([state[keep], table.hot_state.index_select(0, idx)])
            order = np.argsort(ids, kind="stable")
            sel = torch.from_numpy(order).to(values.device)
            out[name] = {
                "ids": torch.from_numpy(ids[order]),
                "values": values[sel].cpu(),
                "state": None if state is None else state[sel].cpu(),
                "step": table.shard.step,
            }
        return out

    def load_owned_rows(self, parts: Iterable[Mapping[str, Mapping[str, Any]]]) -> None:
        """Rebuild this rank's shards from the :meth:`owned_rows` of every rank of a saved job
        (any world size): each rank keeps the rows it owns now. The hot sets are emptied."""
        rank, world = self.comm.rank, self.comm.world_size
        pieces: dict[str, list[Mapping[str, Any]]] = {name: [] for name in self.names}
        for part in parts:
            for name in self.names:
                if name not in part:
                    msg = f"the saved rows have no table {name!r} (they hold {sorted(part)!r})"
                    raise RecpipeError(msg)
                pieces[name].append(part[name])
        steps = {int(p.get("step", 0)) for piece in pieces.values() for p in piece}
        if len(steps) > 1:
            msg = f"the saved rows are at optimizer steps {sorted(steps)}: parts of different checkpoints"
            raise RecpipeError(msg)
        step = steps.pop() if steps else 0
        for name, table in zip(self.names, self.tables, strict=True):
            ids = np.concatenate([p["ids"].numpy() for p in pieces[name]])
            values = torch.cat([p["values"] for p in pieces[name]])
            mine = owner_of(ids, world) == rank
            order = np.flatnonzero(mine)[np.argsort(ids[mine], kind="stable")]
            shard = table.shard.emptied()
            state = None
            if (row_shape := shard.row_state_shape) is not None:
                state = torch.cat([_saved_state(p, name, row_shape) for p in pieces[name]])
                state = state[torch.from_numpy(order)]
            shard.write(ids[order], values[torch.from_numpy(order)], state)
            shard.step = step
            table.shard = shard
            table.hot_ids = np.zeros(0, dtype=np.int64)
            table.hot_values = torch.zeros(0, shard.dim, dtype=shard.dtype, device=shard.device)
            table.hot_state = _empty_state(shard)
        self.optimizer_step = step
        self._pack_hot()
