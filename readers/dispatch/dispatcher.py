"""The dispatcher: which rank trains which samples of a global batch, and what each moves.

A global batch of ``W * m`` rows is cut into session packs of ``P`` rows
(:func:`~readers.dispatch.packs.session_packs`); a *policy* gives every pack a rank, each rank
taking exactly ``m / P`` packs; the chosen split is replayed on the cache shadow, which says
which rows each rank pulls and pushes (:class:`~readers.dispatch.shadow.StepTransfers`).

Policies (one function each, in :data:`POLICIES`):

============  ==================================================================================
``esd``       HybridDis on ESD's cost model: the top ``alpha`` share of packs by regret assigned
              exactly, the rest greedily (:func:`~readers.dispatch.assign.hybrid_assign`)
``laia``      locality only: packs in batch order, each to the rank holding most of its rows'
              latest versions, with room (bandwidths and pushes ignored)
``random``    a seeded random split
``round-robin``  pack ``p`` to rank ``p mod W``
============  ==================================================================================

>>> import torch
>>> from recpipe.batch import Batch
>>> from recpipe.jagged import KeyedJaggedTensor
>>> kjt = KeyedJaggedTensor(["item"], torch.tensor([5, 6, 5, 7]), torch.tensor([1, 1, 1, 1]))
>>> batch = Batch(torch.zeros(4, 1), torch.zeros(4), kjt, session_ids=torch.tensor([0, 0, 1, 1]))
>>> d = Dispatcher(DispatchConfig(pack_size=2, cache_rows=(8,)), world_size=2, micro_batch=2,
...                tables=TableMap.per_feature(["item"]))
>>> first = d.dispatch(batch)
>>> [r.tolist() for r in first.rows], [r.tolist() for r in first.transfers.pulls]
([[0, 1], [2, 3]], [[0, 1], [0, 2]])
>>> [r.tolist() for r in d.dispatch(batch).transfers.pulls]  # only item 5, read by both
[[0], [0]]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from readers.dispatch.assign import assignment_cost, greedy_assign, hybrid_assign
from readers.dispatch.cost import pack_costs, pack_hits
from readers.dispatch.keys import PackRows, RowIndex, TableMap, pack_rows
from readers.dispatch.packs import session_packs
from readers.dispatch.shadow import CacheShadow, StepTransfers
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = ["POLICIES", "Dispatch", "DispatchConfig", "Dispatcher", "PackedBatch", "Policy"]

Policy = Literal["esd", "laia", "random", "round-robin"]


@dataclass(frozen=True)
class DispatchConfig:
    """How global batches are dispatched to the ranks.

    Attributes:
        policy: ``esd`` (HybridDis on the cost model), ``laia`` (locality only), ``random``, or
            ``round-robin``.
        alpha: share of packs (largest regret first) ``esd`` assigns exactly; the rest are
            assigned greedily. 1: the exact optimum of the cost model; 0: pure greedy.
        pack_size: rows per session pack (the unit of dispatch); must divide the rows per rank.
            1 dispatches single samples.
        bandwidths: bytes/s of each rank's link to the rows' home, comma-separated (one value:
            every rank).
        row_bytes: bytes one row transfer moves (the embedding and its optimizer state).
        cache_rows: rows each rank's cache holds, comma-separated (one value: every rank).
        seed: seed of the ``random`` policy.
    """

    policy: Policy = "esd"
    alpha: float = 1.0
    pack_size: int = 16
    bandwidths: tuple[float, ...] = (1e9,)
    row_bytes: int = 68
    cache_rows: tuple[int, ...] = (65536,)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            msg = f"`policy` must be one of {sorted(POLICIES)}, got {self.policy!r}"
            raise DataError(msg)
        a = self.alpha
        if isinstance(a, bool) or not (isinstance(a, int | float) and 0.0 <= a <= 1.0):
            msg = f"`alpha` must be in [0, 1], got {a!r}"
            raise DataError(msg)
        for name in ("pack_size", "row_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise DataError(msg)
        object.__setattr__(self, "bandwidths", tuple(float(b) for b in self.bandwidths))
        object.__setattr__(self, "cache_rows", tuple(int(c) for c in self.cache_rows))
        if not self.bandwidths or not all(np.isfinite(b) and b > 0 for b in self.bandwidths):
            msg = f"`bandwidths` must be positive bytes/s, got {list(self.bandwidths)!r}"
            raise DataError(msg)
        if not self.cache_rows or any(c < 0 for c in self.cache_rows):
            msg = f"`cache_rows` must be >= 0 rows, got {list(self.cache_rows)!r}"
            raise DataError(msg)

    def per_rank(self, name: str, world_size: int) -> np.ndarray:
        """``bandwidths`` or ``cache_rows`` for each of ``world_size`` ranks.

        Raises:
            DataError: a list of another length than 1 or ``world_size``.
        """
        values = getattr(self, name)
        if len(values) not in (1, world_size):
            msg = (
                f"`{name}` has {len(values)} values for {world_size} ranks: give 1 or {world_size}"
            )
            raise DataError(msg)
        return np.broadcast_to(np.asarray(values), (world_size,)).copy()


@dataclass(frozen=True)
class PackedBatch:
    """A global batch cut into packs, and the rows each pack reads.

    Attributes:
        pack_of_row: int64 [B] the pack of each row.
        rows: the distinct rows each pack reads.
    """

    pack_of_row: np.ndarray
    rows: PackRows


@dataclass(frozen=True)
class Dispatch:
    """One global batch, dispatched.

    Attributes:
        step: the step (0, 1, ... over the dispatcher's life).
        rows: per rank, the batch rows it trains on (ascending): its micro-batch.
        pack_rank: int64 [packs] the rank of each pack.
        model_cost: the cost model's total for the chosen split (seconds).
        transfers: what the step reads and moves, per rank (rows of the dispatcher's index).
        seconds: time the policy and the shadow replay took.
    """

    step: int
    rows: tuple[np.ndarray, ...]
    pack_rank: np.ndarray
    model_cost: float
    transfers: StepTransfers
    seconds: float = field(default=0.0, compare=False)


@dataclass
class _View:
    """What a policy may look at (costs are computed on first use)."""

    dispatcher: Dispatcher
    packed: PackedBatch
    capacity: np.ndarray
    _costs: np.ndarray | None = None

    @property
    def num_packs(self) -> int:
        return self.packed.rows.num_packs

    def costs(self) -> np.ndarray:
        if self._costs is None:
            d = self.dispatcher
            self._costs = pack_costs(d.shadow, self.packed.rows, d.seconds_per_row)
        return self._costs

    def hits(self) -> np.ndarray:
        return pack_hits(self.dispatcher.shadow, self.packed.rows)


def _esd(view: _View) -> np.ndarray:
    return hybrid_assign(view.costs(), view.capacity, alpha=view.dispatcher.config.alpha)


def _laia(view: _View) -> np.ndarray:
    return greedy_assign(-view.hits(), view.capacity)


def _random(view: _View) -> np.ndarray:
    deal = np.repeat(np.arange(view.capacity.size), view.capacity)
    return deal[view.dispatcher.rng.permutation(view.num_packs)]


def _round_robin(view: _View) -> np.ndarray:
    return np.arange(view.num_packs) % view.capacity.size  # every rank has the same room


POLICIES: dict[str, Callable[[_View], np.ndarray]] = {
    "esd": _esd,
    "laia": _laia,
    "random": _random,
    "round-robin": _round_robin,
}
"""Policy name -> the function giving every pack of a batch its rank."""


class Dispatcher:
    """Dispatches global batches to ``world_size`` ranks (see the module docstring).

    Args:
        config: the policy and the ranks' caches and bandwidths.
        world_size: ranks W.
        micro_batch: rows per rank m; global batches have ``W * m`` rows.
        tables: which table each sparse feature reads.
    """

    def __init__(
        self, config: DispatchConfig, *, world_size: int, micro_batch: int, tables: TableMap
    ) -> None:
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            msg = f"`micro_batch` must be a positive integer, got {micro_batch!r}"
            raise DataError(msg)
        if micro_batch % config.pack_size:
            msg = f"`pack_size` {config.pack_size} must divide the {micro_batch} rows per rank"
            raise DataError(msg)
        self.config = config
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.tables = tables
        self.index = RowIndex(tables.tables)
        self.shadow = CacheShadow(
            world_size=world_size,
            capacity=config.per_rank("cache_rows", world_size),
            index=self.index,
        )
        self.seconds_per_row = config.row_bytes / config.per_rank("bandwidths", world_size)
        self.capacity = np.full(world_size, micro_batch // config.pack_size, dtype=np.int64)
        self.rng = np.random.default_rng(config.seed)
        self.policy = POLICIES[config.policy]

    def pack(self, batch: Batch) -> PackedBatch:
        """Cut ``batch`` into session packs and list the rows each reads (numbering new rows).

        Raises:
            DataError: the batch does not have ``W * m`` rows.
        """
        b = batch.batch_size
        if b != self.world_size * self.micro_batch:
            msg = (
                f"a global batch of {b} rows: the dispatcher needs W * m = {self.world_size} * "
                f"{self.micro_batch} = {self.world_size * self.micro_batch}"
            )
            raise DataError(msg)
        sessions = None if batch.session_ids is None else batch.session_ids.numpy()
        pack_of_row = session_packs(sessions, pack_size=self.config.pack_size, rows=b)
        rows = pack_rows(batch, tables=self.tables, index=self.index, pack_of_row=pack_of_row)
        return PackedBatch(pack_of_row, rows)

    def decide(self, packed: PackedBatch) -> tuple[np.ndarray, float]:
        """The rank of every pack (the policy's choice) and its cost-model total."""
        view = _View(self, packed, self.capacity)
        pack_rank = np.asarray(self.policy(view), dtype=np.int64)
        return pack_rank, assignment_cost(view.costs(), pack_rank)

    def commit(self, packed: PackedBatch, pack_rank: np.ndarray) -> StepTransfers:
        """Replay the step on the shadow: what every rank reads and moves."""
        reads = [
            packed.rows.rows_of(np.flatnonzero(pack_rank == j)) for j in range(self.world_size)
        ]
        return self.shadow.step(reads)

    def dispatch(self, batch: Batch | PackedBatch) -> Dispatch:
        """Dispatch one global batch (a :class:`~recpipe.batch.Batch` or one already packed)."""
        start = time.perf_counter()
        packed = batch if isinstance(batch, PackedBatch) else self.pack(batch)
        step = self.shadow.steps
        pack_rank, model_cost = self.decide(packed)
        transfers = self.commit(packed, pack_rank)
        row_rank = pack_rank[packed.pack_of_row]
        rows = tuple(np.flatnonzero(row_rank == j) for j in range(self.world_size))
        return Dispatch(
            step=step,
            rows=rows,
            pack_rank=pack_rank,
            model_cost=model_cost,
            transfers=transfers,
            seconds=time.perf_counter() - start,
        )
