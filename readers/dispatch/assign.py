"""Assigning packs to ranks: the exact assignment, the greedy pass, and HybridDis (ESD).

The problem of one global batch: ``n`` packs, ``W`` ranks, a cost matrix ``c`` [n, W] and the
number of packs each rank must take, ``capacity`` [W] (summing to ``n``: every rank gets exactly
its share). Minimise ``sum_i c[i, a(i)]``.

* :func:`exact_assign` solves it exactly: a transportation problem (the Hungarian method on the
  matrix with each rank's column repeated ``capacity[j]`` times is the same problem) solved by
  successive shortest paths over the W ranks (Numba; a batch of 1024 packs over 8 ranks takes
  milliseconds).
* :func:`greedy_assign` takes packs in a given order, each to its cheapest rank with room.
* :func:`hybrid_assign` is ESD's HybridDis: packs sorted by *regret* (second-smallest minus
  smallest cost), largest first; the top ``alpha`` share is assigned exactly, the rest greedily
  in that order with the room left. ``alpha = 1`` is the exact optimum, ``alpha = 0`` pure greedy.

The bound HybridDis keeps (proved in ``docs/dispatch.md``): with ``G`` the greedy part and
``a(i)`` its choice, ``cost <= OPT + sum_{i in G} (c[i, a(i)] - min_j c[i, j])
<= OPT + sum_{i in G} (max_j c[i, j] - min_j c[i, j])``; with two ranks the greedy pass in
regret order is optimal.

>>> import numpy as np
>>> c = np.array([[4.0, 3.0, 3.0], [1.0, 3.0, 4.0], [2.0, 2.0, 5.0]])
>>> one = np.array([1, 1, 1])
>>> exact = hybrid_assign(c, one, alpha=1.0)
>>> exact.tolist(), assignment_cost(c, exact)
([2, 0, 1], 6.0)
>>> greedy = hybrid_assign(c, one, alpha=0.0)  # row 1 first (regret 2): rank 0, then row 0...
>>> greedy.tolist(), assignment_cost(c, greedy)
([1, 0, 2], 9.0)
"""

from __future__ import annotations

import math

import numpy as np

from readers.dispatch import _kernels as K
from recpipe.errors import DataError

__all__ = ["assignment_cost", "exact_assign", "greedy_assign", "hybrid_assign", "regret"]


def _check(costs: np.ndarray, capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    capacity = np.ascontiguousarray(capacity, dtype=np.int64)
    if costs.ndim != 2 or costs.shape[1] < 1:
        msg = f"`costs` must be a [packs, ranks] matrix, got shape {costs.shape}"
        raise DataError(msg)
    if capacity.shape != (costs.shape[1],) or (capacity < 0).any():
        msg = (
            f"`capacity` must hold one non-negative count per rank ({costs.shape[1]}), got "
            f"{capacity.tolist()!r}"
        )
        raise DataError(msg)
    if not np.isfinite(costs).all():
        msg = "`costs` must be finite"
        raise DataError(msg)
    return costs, capacity


def regret(costs: np.ndarray) -> np.ndarray:
    """Second-smallest minus smallest cost of each row (0 with one rank)."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.shape[1] < 2:
        return np.zeros(costs.shape[0])
    two = np.partition(costs, 1, axis=1)[:, :2]
    return two[:, 1] - two[:, 0]


def assignment_cost(costs: np.ndarray, assign: np.ndarray) -> float:
    """``sum_i costs[i, assign[i]]``."""
    return float(np.asarray(costs)[np.arange(len(assign)), assign].sum())


def exact_assign(costs: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """The least-cost assignment of the rows of ``costs`` to ranks with ``capacity`` (see the
    module docstring); rows may be fewer than the room.

    Returns:
        int64 [n], the rank of each row.

    Raises:
        DataError: bad shapes, non-finite costs, or less room than rows.
    """
    costs, capacity = _check(costs, capacity)
    n = costs.shape[0]
    if capacity.sum() < n:
        msg = f"{n} packs do not fit ranks with room for {capacity.tolist()!r}"
        raise DataError(msg)
    out = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return out
    scale = float(np.abs(costs).max()) if costs.size else 0.0
    tol = 1e-12 * max(scale, 1e-300) * costs.shape[1]
    status = K.transport(costs, capacity, tol, out)
    if status != K.OK:  # pragma: no cover - finite costs admit no negative cycle
        msg = f"the exact assignment failed (status {status})"
        raise DataError(msg)
    return out


def greedy_assign(
    costs: np.ndarray, capacity: np.ndarray, *, order: np.ndarray | None = None
) -> np.ndarray:
    """Rows in ``order`` (default: as given), each to its cheapest rank with room (ties: the
    lowest rank).

    Returns:
        int64 [n], the rank of each row.

    Raises:
        DataError: bad shapes, non-finite costs, or less room than rows.
    """
    costs, capacity = _check(costs, capacity)
    n = costs.shape[0]
    order = np.arange(n, dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
    out = np.full(n, -1, dtype=np.int64)
    if K.greedy(costs, order, capacity.copy(), out) != K.OK:
        msg = f"{order.size} packs do not fit ranks with room for {capacity.tolist()!r}"
        raise DataError(msg)
    return out


def hybrid_assign(costs: np.ndarray, capacity: np.ndarray, *, alpha: float) -> np.ndarray:
    """HybridDis: the ``ceil(alpha * n)`` rows of largest regret assigned exactly, the rest
    greedily in regret order (ties in regret: the earlier row first).

    Args:
        costs: [n, W] cost of each row on each rank.
        capacity: [W] rows each rank takes; must sum to ``n``.
        alpha: share of rows assigned exactly, in [0, 1].

    Returns:
        int64 [n], the rank of each row; rank ``j`` gets exactly ``capacity[j]`` rows.

    Raises:
        DataError: ``alpha`` outside [0, 1], or ``capacity`` not summing to ``n``.
    """
    if isinstance(alpha, bool) or not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        msg = f"`alpha` must be in [0, 1], got {alpha!r}"
        raise DataError(msg)
    costs, capacity = _check(costs, capacity)
    n = costs.shape[0]
    if capacity.sum() != n:
        msg = f"`capacity` {capacity.tolist()!r} must sum to the {n} packs: every rank its share"
        raise DataError(msg)
    order = np.argsort(-regret(costs), kind="stable")
    k = math.ceil(alpha * n)
    out = np.full(n, -1, dtype=np.int64)
    top = order[:k]
    if k:
        out[top] = exact_assign(costs[top], capacity)
    room = capacity - np.bincount(out[top], minlength=capacity.size)
    rest = order[k:]
    if rest.size and K.greedy(costs, rest, room, out) != K.OK:  # pragma: no cover
        msg = "the greedy pass ran out of room"
        raise DataError(msg)
    return out
