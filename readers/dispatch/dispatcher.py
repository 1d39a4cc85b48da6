"""The dispatcher: which rank trains which samples of a global batch, and what each moves.

A global batch of ``W * m`` rows is cut into session pieces
(:func:`~readers.dispatch.pieces.session_pieces`); a *policy* places the pieces on the ranks,
every rank taking exactly ``m`` rows and every piece whole except a few split at the edges of
the ranks' shares (:mod:`readers.dispatch.assign`); the placement is replayed on the cache
shadow, which says which rows each rank reads, pulls and pushes
(:class:`~readers.dispatch.shadow.StepTransfers`).

Policies (one function each, in :data:`POLICIES`):

===============  ===============================================================================
``esd``          HybridDis on ESD's cost model: the pieces of largest regret holding an ``alpha``
                 share of the rows placed exactly, the rest greedily
                 (:func:`~readers.dispatch.assign.hybrid_flow`)
``laia``         locality only: pieces in batch order, each to the rank holding the latest
                 versions of most of its rows, with room (bandwidths and pushes ignored)
``random``       the pieces in a seeded random order, dealt to rank 0 until it is full, then 1...
``round-robin``  piece ``k`` to rank ``k mod W`` (the next rank with room when that one is full)
===============  ===============================================================================

>>> import torch
>>> from recpipe.batch import Batch
>>> from recpipe.jagged import KeyedJaggedTensor
>>> kjt = KeyedJaggedTensor(["item"], torch.tensor([5, 6, 5, 7]), torch.tensor([1, 1, 1, 1]))
>>> batch = Batch(torch.zeros(4, 1), torch.zeros(4), kjt, session_ids=torch.tensor([0, 0, 1, 1]))
>>> d = Dispatcher(DispatchConfig(cache_rows=(8,)), world_size=2, micro_batch=2,
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

from readers.dispatch.assign import REGRETS, flow_cost, greedy_flow, hybrid_flow
from readers.dispatch.cost import piece_costs, piece_hits
from readers.dispatch.keys import PieceRows, RowIndex, TableMap, distinct, home_ranks, piece_rows
from readers.dispatch.pieces import Pieces, session_pieces
from readers.dispatch.shadow import CacheShadow, StepTransfers
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = ["POLICIES", "Dispatch", "DispatchConfig", "Dispatcher", "PiecedBatch", "Policy"]

Policy = Literal["esd", "laia", "random", "round-robin"]
_SHIFT = 40  # (rank << 40) | row
HOMES = ("server", "ranks")


@dataclass(frozen=True)
class DispatchConfig:
    """How global batches are dispatched to the ranks.

    Attributes:
        policy: ``esd`` (HybridDis on the cost model), ``laia`` (locality only), ``random``, or
            ``round-robin``.
        alpha: share of the rows (pieces of largest regret first) ``esd`` places exactly; the
            rest are placed greedily. 1: the exact optimum of the cost model; 0: pure greedy.
        max_piece_rows: a session longer than this is cut into pieces of this many rows; 1
            dispatches single samples.
        bandwidths: bytes/s of each rank's link to the rows' home, comma-separated (one value:
            every rank).
        row_bytes: bytes one row transfer moves (the embedding and its optimizer state).
        cache_rows: rows each rank's cache holds, comma-separated (one value: every rank).
        seed: seed of the ``random`` policy.
        id_modulus: the rows a batch reads are its ids modulo this (the trainer's tables of
            ``--num-embeddings`` rows with ``--hash-ids``, its default), so the costs count the
            rows the tables hold; 0: the ids as they are.
        regret: how ``esd`` orders pieces for its exact share and its greedy pass: ``mean``
            (mean minus smallest cost) or ``second`` (ESD's second-smallest minus smallest).
        homes: where the rows' homes are, for the cost model: ``server`` (a parameter server
            off the ranks, whose link is never the bottleneck: ESD's setting and the
            simulator's) or ``ranks`` (each row's home is its owner rank, as in the trainer's
            caches: a pull or push also crosses the home's link, and none crosses a link at
            home; see :mod:`readers.dispatch.cost`).
    """

    policy: Policy = "esd"
    alpha: float = 1.0
    max_piece_rows: int = 32
    bandwidths: tuple[float, ...] = (1e9,)
    row_bytes: int = 68
    cache_rows: tuple[int, ...] = (65536,)
    seed: int = 0
    id_modulus: int = 0
    regret: Literal["mean", "second"] = "mean"
    homes: Literal["server", "ranks"] = "server"

    def __post_init__(self) -> None:
        if self.regret not in REGRETS:
            msg = f"`regret` must be one of {list(REGRETS)}, got {self.regret!r}"
            raise DataError(msg)
        if self.homes not in HOMES:
            msg = f"`homes` must be one of {list(HOMES)}, got {self.homes!r}"
            raise DataError(msg)
        if self.policy not in POLICIES:
            msg = f"`policy` must be one of {sorted(POLICIES)}, got {self.policy!r}"
            raise DataError(msg)
        a = self.alpha
        if isinstance(a, bool) or not (isinstance(a, int | float) and 0.0 <= a <= 1.0):
            msg = f"`alpha` must be in [0, 1], got {a!r}"
            raise DataError(msg)
        for name in ("max_piece_rows", "row_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise DataError(msg)
        m = self.id_modulus
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            msg = f"`id_modulus` must be an integer >= 0 (0: ids as they are), got {m!r}"
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
class PiecedBatch:
    """A global batch cut into pieces, and the rows each piece reads.

    Attributes:
        batch: the global batch.
        pieces: its pieces.
        rows: the distinct rows each piece reads (hot rows included).
    """

    batch: Batch
    pieces: Pieces
    rows: PieceRows


@dataclass(frozen=True)
class Dispatch:
    """One global batch, dispatched.

    Attributes:
        step: the step (0, 1, ... over the dispatcher's life).
        rows: per rank, the batch rows it trains on (ascending): its micro-batch.
        flow: int64 [pieces, W] rows of each piece on each rank.
        model_cost: the cost model's total for the placement (seconds).
        transfers: what the step reads and moves, per rank (rows of the dispatcher's index;
            hot rows left out).
        seconds: time the policy and the shadow replay took.
    """

    step: int
    rows: tuple[np.ndarray, ...]
    flow: np.ndarray
    model_cost: float
    transfers: StepTransfers
    seconds: float = field(default=0.0, compare=False)

    @property
    def split_pieces(self) -> int:
        """Pieces placed on more than one rank."""
        return int(((self.flow > 0).sum(1) > 1).sum())


@dataclass
class _View:
    """What a policy may look at (costs are computed on first use)."""

    dispatcher: Dispatcher
    rows: PieceRows  # without the hot rows
    sizes: np.ndarray
    capacity: np.ndarray
    _costs: np.ndarray | None = None

    def costs(self) -> np.ndarray:
        if self._costs is None:
            d = self.dispatcher
            self._costs = piece_costs(d.shadow, self.rows, d.seconds_per_row, d.homes())
        return self._costs

    def hits(self) -> np.ndarray:
        return piece_hits(self.dispatcher.shadow, self.rows)


def _esd(view: _View) -> np.ndarray:
    config = view.dispatcher.config
    return hybrid_flow(view.costs(), view.sizes, capacity=view.capacity, alpha=config.alpha,
                       regret_kind=config.regret)  # fmt: skip


def _laia(view: _View) -> np.ndarray:
    return greedy_flow(-view.hits(), view.sizes, capacity=view.capacity)


def _random(view: _View) -> np.ndarray:
    n, w = view.sizes.size, view.capacity.size
    order = view.dispatcher.rng.permutation(n)
    return greedy_flow(np.zeros((n, w)), view.sizes, capacity=view.capacity, order=order)


def _round_robin(view: _View) -> np.ndarray:
    n, w = view.sizes.size, view.capacity.size
    turn = (np.arange(w)[None, :] - np.arange(n)[:, None]) % w  # piece k prefers rank k mod W
    return greedy_flow(turn.astype(np.float64), view.sizes, capacity=view.capacity)


POLICIES: dict[str, Callable[[_View], np.ndarray]] = {
    "esd": _esd,
    "laia": _laia,
    "random": _random,
    "round-robin": _round_robin,
}
"""Policy name -> the function placing the pieces of a batch (a flow [pieces, W])."""


class Dispatcher:
    """Dispatches global batches to ``world_size`` ranks (see the module docstring).

    Args:
        config: the policy and the ranks' caches and bandwidths.
        world_size: ranks W.
        micro_batch: rows per rank m; global batches have ``W * m`` rows.
        tables: which table each sparse feature reads.
        index: the row numbering to use (default: a new one); dispatchers sharing one can
            replay the same :class:`PiecedBatch` es.
    """

    def __init__(
        self,
        config: DispatchConfig,
        *,
        world_size: int,
        micro_batch: int,
        tables: TableMap,
        index: RowIndex | None = None,
    ) -> None:
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            msg = f"`micro_batch` must be a positive integer, got {micro_batch!r}"
            raise DataError(msg)
        if index is not None and index.tables != tables.tables:
            msg = f"`index` numbers the rows of tables {index.tables!r}, not {tables.tables!r}"
            raise DataError(msg)
        self.config = config
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.tables = tables
        self.index = RowIndex(tables.tables) if index is None else index
        self.shadow = CacheShadow(
            world_size=world_size,
            capacity=config.per_rank("cache_rows", world_size),
            index=self.index,
        )
        self.seconds_per_row = config.row_bytes / config.per_rank("bandwidths", world_size)
        self.capacity = np.full(world_size, micro_batch, dtype=np.int64)
        self.rng = np.random.default_rng(config.seed)
        self.policy = POLICIES[config.policy]
        self.hot = np.zeros(0, dtype=np.bool_)  # by row: replicated on every rank
        self._last_cold: tuple[PiecedBatch, np.ndarray, PieceRows] | None = None
        self._home = np.zeros(0, dtype=np.int64)  # home rank by row (homes="ranks")

    def homes(self) -> np.ndarray | None:
        """int64 over the index's rows: each row's home rank (``homes="ranks"``: the trainer's
        owner of its id); ``None`` with ``homes="server"``."""
        if self.config.homes == "server":
            return None
        have, n = self._home.size, self.index.num_rows
        if have < n:
            self._home = np.concatenate(
                [self._home, home_ranks(self.index.id_of_row[have:n], self.world_size)]
            )
        return self._home

    def set_hot(self, tables: np.ndarray, ids: np.ndarray) -> StepTransfers:
        """Make the rows ``(tables[k], ids[k])`` the hot set (every other row leaves it).

        Hot rows are replicated on every rank and kept equal by an all-reduce of their
        gradients (the trainer's hot set), so they cost the same wherever a sample goes: the
        dispatcher leaves them out of costs and caches. Rows entering the hot set leave the
        caches; a dirty copy is written home first.

        Returns:
            the rows each rank drops (``evictions``) and writes home (``evict_pushes``).
        """
        tables = np.asarray(tables, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        rows = [self.index.rows(int(t), ids[tables == t]) for t in np.unique(tables)]
        rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        hot = np.zeros(self.index.num_rows, dtype=np.bool_)
        hot[rows] = True
        self.hot = hot
        return self.shadow.drop(rows)

    def prepare(self, batch: Batch) -> PiecedBatch:
        """Cut ``batch`` into session pieces and list the rows each reads (numbering new rows).

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
        pieces = session_pieces(sessions, max_rows=self.config.max_piece_rows, rows=b)
        rows = piece_rows(
            batch,
            tables=self.tables,
            index=self.index,
            piece_of_row=pieces.piece_of_row,
            num_pieces=pieces.num_pieces,
        )
        return PiecedBatch(batch, pieces, rows)

    def _cold(self, prepared: PiecedBatch) -> PieceRows:
        """The rows each piece reads, hot rows left out (the last batch's kept)."""
        last = self._last_cold
        if last is None or last[0] is not prepared or last[1] is not self.hot:
            last = self._last_cold = (prepared, self.hot, prepared.rows.without(self.hot))
        return last[2]

    def decide(self, prepared: PiecedBatch) -> tuple[np.ndarray, float]:
        """The policy's placement (a flow [pieces, W]) and its cost-model total (hot rows left
        out: see :meth:`set_hot`)."""
        view = _View(self, self._cold(prepared), prepared.pieces.sizes, self.capacity)
        flow = np.asarray(self.policy(view), dtype=np.int64)
        return flow, flow_cost(view.costs(), prepared.pieces.sizes, flow)

    def place(self, prepared: PiecedBatch, flow: np.ndarray) -> np.ndarray:
        """int64 [B]: the rank of every row. A split piece gives its first rows to its lowest
        rank, and so on."""
        pieces = prepared.pieces
        rank_of_piece = flow.argmax(1)
        row_rank = rank_of_piece[pieces.piece_of_row]
        for i in np.flatnonzero((flow > 0).sum(1) > 1):
            row_rank[pieces.rows_of(i)] = np.repeat(np.arange(flow.shape[1]), flow[i])
        return row_rank

    def reads(
        self, prepared: PiecedBatch, flow: np.ndarray, row_rank: np.ndarray
    ) -> list[np.ndarray]:
        """The distinct cold rows each rank reads: its whole pieces' rows, and the rows of the
        parts of split pieces it trains on (read off the batch)."""
        rows = self._cold(prepared)
        split = (flow > 0).sum(1) > 1
        whole = ~split[rows.piece]
        keys = [(flow.argmax(1)[rows.piece[whole]] << _SHIFT) | rows.row[whole]]
        if split.any():
            parts = np.where(split[prepared.pieces.piece_of_row], row_rank, -1)
            extra = piece_rows(prepared.batch, tables=self.tables, index=self.index,
                               piece_of_row=parts, num_pieces=self.world_size)  # fmt: skip
            extra = extra.without(self.hot)
            keys.append((extra.piece << _SHIFT) | extra.row)
        keys = distinct(np.concatenate(keys))
        ranks, rows_read = keys >> _SHIFT, keys & ((1 << _SHIFT) - 1)
        cuts = np.searchsorted(ranks, np.arange(self.world_size + 1))
        return [rows_read[cuts[j] : cuts[j + 1]] for j in range(self.world_size)]

    def dispatch(self, batch: Batch | PiecedBatch) -> Dispatch:
        """Dispatch one global batch (a :class:`~recpipe.batch.Batch`, or one prepared)."""
        start = time.perf_counter()
        prepared = batch if isinstance(batch, PiecedBatch) else self.prepare(batch)
        step = self.shadow.steps
        flow, model_cost = self.decide(prepared)
        row_rank = self.place(prepared, flow)
        transfers = self.shadow.step(self.reads(prepared, flow, row_rank))
        rows = tuple(np.flatnonzero(row_rank == j) for j in range(self.world_size))
        return Dispatch(
            step=step,
            rows=rows,
            flow=flow,
            model_cost=model_cost,
            transfers=transfers,
            seconds=time.perf_counter() - start,
        )
