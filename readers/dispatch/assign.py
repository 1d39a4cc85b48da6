"""Placing pieces of a global batch on ranks: the exact solver, the greedy pass, HybridDis.

The problem of one global batch: ``n`` pieces (sessions, see :mod:`readers.dispatch.pieces`) of
``sizes[i]`` rows, ``W`` ranks that take exactly ``capacity[j]`` rows each (every rank its
share), and the cost ``costs[i, j]`` of piece ``i`` on rank ``j``. A placement is a flow
``flow[i, j]``: rows of piece ``i`` on rank ``j``; a piece on one rank is *whole*, on several
*split*, and costs ``sum_j costs[i, j] * flow[i, j] / sizes[i]``.

* :func:`exact_flow`: the least-cost placement, exactly. A transportation problem (the
  Hungarian method on the matrix with each rank's column repeated by its capacity is the same
  problem for single rows), solved by successive shortest paths over the W ranks in Numba
  (milliseconds for 1024 rows on 8 ranks). Its cycles of split pieces are then cancelled at no
  cost, so at most ``W - 1`` pieces end up split.
* :func:`greedy_flow`: pieces in a given order, each to its cheapest rank with room; a piece
  that does not fit spills into the next cheapest. Each spill fills a rank, so at most ``W - 1``
  pieces are split.
* :func:`hybrid_flow`: ESD's HybridDis. Pieces sorted by *regret* per row (:func:`regret`:
  mean minus smallest cost, over the piece's rows), largest first; the leading pieces holding an
  ``alpha`` share of the rows are placed exactly, the rest greedily in that order. The rest
  enter the exact pass as bulk pieces (:func:`reserve`: grouped by cheapest rank), so the exact
  share leaves them the room they need; the greedy pass fills that room. The pure greedy
  placement is kept when it costs less. ``alpha = 1``: the optimum; ``alpha = 0``: pure greedy.

Theorem 1 (the bound HybridDis keeps; proof in ``docs/dispatch.md``): with ``G`` the greedy
pieces, ``G_k`` their groups, ``C_k[j]`` what ``G_k`` costs together on rank ``j`` and OPT the
optimum, ``cost <= OPT + sum_{i in G} (max_j costs[i, j] - min_j costs[i, j])
+ sum_k (max_j C_k[j] - min_j C_k[j])``, the last sum at most the one before; never more than
the pure greedy pass; on two ranks the greedy pass in regret order is optimal.

>>> import numpy as np
>>> c = np.array([[0.0, 0.0, 4.0], [3.0, 0.0, 4.0], [4.0, 0.0, 5.0]])
>>> one = np.array([1, 1, 1])
>>> exact = hybrid_flow(c, one, capacity=one, alpha=1.0)
>>> exact.argmax(1).tolist(), flow_cost(c, one, exact)
([0, 2, 1], 4.0)
>>> greedy = hybrid_flow(c, one, capacity=one, alpha=0.0)  # row 2 first (regret 3) takes rank 1
>>> greedy.argmax(1).tolist(), flow_cost(c, one, greedy)
([2, 0, 1], 7.0)
"""

from __future__ import annotations

import math

import numpy as np

from readers.dispatch import _kernels as K
from recpipe.errors import DataError

__all__ = [
    "REGRETS",
    "exact_flow",
    "flow_cost",
    "greedy_flow",
    "hybrid_flow",
    "regret",
    "reserve",
]


def _check(
    costs: np.ndarray, sizes: np.ndarray, capacity: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    if costs.ndim != 2 or costs.shape[1] < 1:
        msg = f"`costs` must be a [pieces, ranks] matrix, got shape {costs.shape}"
        raise DataError(msg)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    if sizes.shape != (costs.shape[0],) or (sizes < 1).any():
        msg = f"`sizes` must hold one positive row count per piece ({costs.shape[0]})"
        raise DataError(msg)
    capacity = np.ascontiguousarray(capacity, dtype=np.int64)
    if capacity.shape != (costs.shape[1],) or (capacity < 0).any():
        msg = (
            f"`capacity` must hold one non-negative row count per rank ({costs.shape[1]}), got "
            f"{capacity.tolist()!r}"
        )
        raise DataError(msg)
    if not np.isfinite(costs).all():
        msg = "`costs` must be finite"
        raise DataError(msg)
    if capacity.sum() < sizes.sum():
        msg = f"{sizes.sum()} rows do not fit ranks with room for {capacity.tolist()!r}"
        raise DataError(msg)
    return costs, sizes, capacity


REGRETS = ("mean", "second")
"""How :func:`regret` measures what a piece loses away from its cheapest rank."""


def regret(costs: np.ndarray, *, kind: str = "mean") -> np.ndarray:
    """What each piece loses away from its cheapest rank (0 with one rank).

    ``second``: ESD's regret, the second-smallest minus the smallest cost. With ranks of equal
    bandwidth that is 0 for every piece whose rows no rank holds (it costs the same on every
    fast rank), so the greedy pass placed those pieces last, on the slow ranks the others left.
    ``mean`` (the default): mean minus smallest cost, which counts every rank; on two ranks both
    give the same order.
    """
    if kind not in REGRETS:
        msg = f"`regret` must be one of {list(REGRETS)}, got {kind!r}"
        raise DataError(msg)
    costs = np.asarray(costs, dtype=np.float64)
    if costs.shape[1] < 2:
        return np.zeros(costs.shape[0])
    if kind == "second":
        low = np.partition(costs, 1, axis=1)
        return low[:, 1] - low[:, 0]
    return costs.mean(1) - costs.min(1)


def flow_cost(costs: np.ndarray, sizes: np.ndarray, flow: np.ndarray) -> float:
    """What a placement costs: ``sum_ij costs[i, j] * flow[i, j] / sizes[i]``."""
    sizes = np.asarray(sizes, dtype=np.float64)
    return float((np.asarray(costs) * flow / sizes[:, None]).sum())


def _unit(costs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    return costs / sizes[:, None]


def _cancel_cycles(flow: np.ndarray, unit: np.ndarray) -> None:
    """Shift rows around cycles of split pieces (piece - rank - piece - ... - piece) until there
    is none, each time the way that does not cost more (an optimum has only zero-cost
    cycles), so at most W - 1 pieces stay split (a forest on split pieces and ranks)."""
    while True:
        split = np.flatnonzero((flow > 0).sum(1) > 1)
        cycle = _find_cycle(flow, split)
        if cycle is None:
            return
        # cycle: [(piece, rank_in, rank_out), ...]: piece moves rows from rank_out to rank_in
        gain = sum(unit[p, a] - unit[p, b] for p, a, b in cycle)
        if gain > 0:  # the other way round
            cycle = [(p, b, a) for p, a, b in cycle]
        amount = min(flow[p, b] for p, _, b in cycle)
        for p, a, b in cycle:
            flow[p, b] -= amount
            flow[p, a] += amount


def _find_cycle(flow: np.ndarray, split: np.ndarray) -> list[tuple[int, int, int]] | None:
    """A cycle through split pieces and ranks, as (piece, rank before, rank after) steps."""
    ranks_of = {int(p): [int(r) for r in np.flatnonzero(flow[p] > 0)] for p in split}
    pieces_of: dict[int, list[int]] = {}
    for p, ranks in ranks_of.items():
        for r in ranks:
            pieces_of.setdefault(r, []).append(p)
    seen_rank: dict[int, tuple[int, int] | None] = {}  # rank -> (piece, previous rank)
    for root in pieces_of:
        if root in seen_rank:
            continue
        seen_rank[root] = None
        stack = [(root, None)]
        while stack:
            rank, via = stack.pop()
            for p in pieces_of[rank]:
                if p == via:
                    continue
                for nxt in ranks_of[p]:
                    if nxt == rank:
                        continue
                    if nxt in seen_rank:
                        return _close(seen_rank, rank, p, nxt)
                    seen_rank[nxt] = (p, rank)
                    stack.append((nxt, p))
    return None


def _close(seen, rank, piece, back) -> list[tuple[int, int, int]]:
    """The cycle closed by the edge rank -piece- back, from the two tree paths to their meeting."""

    def path(r):
        out = [r]
        while seen[r] is not None:
            r = seen[r][1]
            out.append(r)
        return out

    a, b = path(rank), path(back)
    common = next(r for r in a if r in set(b))
    a, b = a[: a.index(common) + 1], b[: b.index(common) + 1]
    # walk: back -> ... -> common (tree edges in b, reversed direction) then common -> ... -> rank
    steps = [(piece, back, rank)]  # piece takes rows from rank, gives them to back
    for r in a[:-1]:  # rank up to common: the piece joining r to its parent gives to r
        p, parent = seen[r]
        steps.append((p, r, parent))
    for r in b[:-1]:  # back up to common, the other way
        p, parent = seen[r]
        steps.append((p, parent, r))
    return steps


def exact_flow(costs: np.ndarray, sizes: np.ndarray, *, capacity: np.ndarray) -> np.ndarray:
    """The least-cost placement of the pieces (see the module docstring); the rows may be fewer
    than the room.

    Returns:
        int64 [n, W] the rows of each piece on each rank; at most W - 1 pieces split.

    Raises:
        DataError: bad shapes, non-finite costs, or less room than rows.
    """
    costs, sizes, capacity = _check(costs, sizes, capacity)
    n, w = costs.shape
    flow = np.zeros((n, w), dtype=np.int64)
    if n == 0:
        return flow
    unit = _unit(costs, sizes)
    tol = 1e-12 * max(float(np.abs(unit).max()), 1e-300) * w
    status = K.transport(unit, sizes, capacity.copy(), tol, flow)
    if status != K.OK:  # pragma: no cover - finite costs admit no negative cycle
        msg = f"the exact placement failed (status {status})"
        raise DataError(msg)
    _cancel_cycles(flow, unit)
    return flow


def greedy_flow(
    costs: np.ndarray,
    sizes: np.ndarray,
    *,
    capacity: np.ndarray,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """Pieces in ``order`` (default: as given), each to its cheapest rank with room (ties: the
    lowest rank), spilling into the next cheapest when it does not fit.

    Returns:
        int64 [n, W] the rows of each piece on each rank; at most W - 1 pieces split.

    Raises:
        DataError: bad shapes, non-finite costs, or less room than rows.
    """
    costs, sizes, capacity = _check(costs, sizes, capacity)
    n, w = costs.shape
    order = np.arange(n, dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
    flow = np.zeros((n, w), dtype=np.int64)
    K.greedy(_unit(costs, sizes), sizes, order, capacity.copy(), flow)
    return flow


def hybrid_flow(
    costs: np.ndarray,
    sizes: np.ndarray,
    *,
    capacity: np.ndarray,
    alpha: float,
    regret_kind: str = "mean",
) -> np.ndarray:
    """HybridDis (see the module docstring).

    Args:
        costs: [n, W] cost of each piece on each rank.
        sizes: [n] rows of each piece.
        capacity: [W] rows each rank takes; must sum to the rows.
        alpha: share of the rows (pieces of largest regret per row first) placed exactly.
        regret_kind: how the regret is measured (:func:`regret`).

    Returns:
        int64 [n, W] the rows of each piece on each rank: rank ``j`` gets exactly
        ``capacity[j]`` rows.

    Raises:
        DataError: ``alpha`` outside [0, 1], or ``capacity`` not summing to the rows.
    """
    if isinstance(alpha, bool) or not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        msg = f"`alpha` must be in [0, 1], got {alpha!r}"
        raise DataError(msg)
    costs, sizes, capacity = _check(costs, sizes, capacity)
    if capacity.sum() != sizes.sum():
        msg = (
            f"`capacity` {capacity.tolist()!r} must sum to the {sizes.sum()} rows: every rank "
            "its share"
        )
        raise DataError(msg)
    order = np.argsort(-regret(costs, kind=regret_kind) / sizes, kind="stable")
    rows = np.cumsum(sizes[order])
    k = int(np.searchsorted(rows, math.ceil(alpha * sizes.sum()))) + 1 if alpha > 0 else 0
    top, rest = order[:k], order[k:]
    unit = _unit(costs, sizes)
    flow = np.zeros(costs.shape, dtype=np.int64)
    if top.size:
        bulk_costs, bulk_sizes = reserve(costs[rest], sizes[rest])
        both = exact_flow(
            np.concatenate([costs[top], bulk_costs]),
            np.concatenate([sizes[top], bulk_sizes]),
            capacity=capacity,
        )
        flow[top] = both[: top.size]
    room = capacity - flow.sum(0)  # what the exact pass left: the room it reserved for the rest
    K.greedy(unit, sizes, rest, room, flow)
    if top.size and rest.size:  # never worse than the pure greedy pass
        greedy = np.zeros(costs.shape, dtype=np.int64)
        K.greedy(unit, sizes, order, capacity.copy(), greedy)
        if flow_cost(costs, sizes, greedy) < flow_cost(costs, sizes, flow):
            return greedy
    return flow


def reserve(costs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The greedy share as *bulk* pieces for the exact pass: its pieces grouped by their
    cheapest rank (ties: the lowest), each group one piece of all its rows that costs on each
    rank what its pieces cost there together.

    Returns:
        ``(costs [groups, W], sizes [groups])``, the empty groups left out.
    """
    costs = np.asarray(costs, dtype=np.float64)
    n, w = costs.shape
    if n == 0:
        return np.zeros((0, w)), np.zeros(0, dtype=np.int64)
    group = (costs / sizes[:, None]).argmin(1)
    bulk_sizes = np.bincount(group, weights=sizes, minlength=w).astype(np.int64)
    bulk_costs = np.zeros((w, w))
    np.add.at(bulk_costs, group, costs)
    used = bulk_sizes > 0
    return bulk_costs[used], bulk_sizes[used]
