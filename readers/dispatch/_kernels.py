"""Numba kernels of the dispatcher: the exact transportation solver and the greedy pass.

Both place *pieces* of ``sizes[i]`` rows on ranks with ``room[j]`` rows, as a flow
``flow[i, j]`` (rows of piece i on rank j), at ``unit[i, j]`` per row. They report a failure by
their return code (the Python wrappers in :mod:`readers.dispatch.assign` raise).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__: list[str] = []  # private: used by readers.dispatch.assign

OK = 0
NO_ROOM = -1
CYCLE = -2


@njit(cache=True, nogil=True)
def _refresh(unit, flow, members, count, j, edge, arg):
    """Edges out of rank ``j``: the cheapest move of a row of one of its pieces to each rank."""
    w = unit.shape[1]
    for k in range(w):
        edge[j, k] = np.inf
        arg[j, k] = -1
    for m in range(count[j]):
        s = members[j, m]
        base = unit[s, j]
        for k in range(w):
            if k != j:
                d = unit[s, k] - base
                if d < edge[j, k]:
                    edge[j, k] = d
                    arg[j, k] = s


@njit(cache=True, nogil=True)
def _add(flow, members, count, slot, s, j, amount):
    """flow[s, j] += amount (may be negative), keeping rank j's member list (pieces with flow)."""
    before = flow[s, j]
    flow[s, j] = before + amount
    if before == 0 and flow[s, j] > 0:
        members[j, count[j]] = s
        slot[s, j] = count[j]
        count[j] += 1
    elif before > 0 and flow[s, j] == 0:
        at = slot[s, j]
        last = members[j, count[j] - 1]
        members[j, at] = last
        slot[last, j] = at
        count[j] -= 1


@njit(cache=True, nogil=True)
def transport(unit, sizes, room, tol, flow):
    """The least-cost flow of every piece's rows to ranks within their room (exact).

    Successive shortest paths over the W ranks: each piece's rows are routed along the cheapest
    chain "put rows of piece i on rank r1, move as many rows of some piece from r1 to r2, ...,
    end on a rank with room" (Bellman-Ford over W nodes; the edge r -> r' is the cheapest move
    of one row of a piece on r, kept per rank and refreshed for the ranks a chain changed), as
    many rows at a time as the chain carries. After each piece the flow is optimal for the
    pieces routed so far, so the final flow is optimal. ``room`` is updated in place.

    Returns:
        OK, NO_ROOM (less room than rows) or CYCLE (non-finite costs).
    """
    n, w = unit.shape
    members = np.empty((w, n), np.int64)
    count = np.zeros(w, np.int64)
    slot = np.zeros((n, w), np.int64)
    edge = np.full((w, w), np.inf)
    arg = np.full((w, w), -1, np.int64)
    dist = np.empty(w)
    pred = np.empty(w, np.int64)
    changed = np.zeros(w, np.bool_)
    for i in range(n):
        left = sizes[i]
        while left > 0:
            for j in range(w):
                dist[j] = unit[i, j]
                pred[j] = -1
            for _ in range(w):
                relaxed = False
                for j in range(w):
                    if count[j] == 0:
                        continue
                    dj = dist[j]
                    for k in range(w):
                        if k != j:
                            nd = dj + edge[j, k]
                            if nd < dist[k] - tol:
                                dist[k] = nd
                                pred[k] = j
                                relaxed = True
                if not relaxed:
                    break
            end = -1
            for j in range(w):
                if room[j] > 0 and (end < 0 or dist[j] < dist[end] - tol):
                    end = j
            if end < 0:
                return NO_ROOM
            amount = min(left, room[end])  # what the chain carries
            cur, hops = end, 0
            while pred[cur] >= 0:
                amount = min(amount, flow[arg[pred[cur], cur], pred[cur]])
                cur = pred[cur]
                hops += 1
                if hops > w:
                    return CYCLE
            changed[:] = False
            cur = end
            while pred[cur] >= 0:
                p = pred[cur]
                s = arg[p, cur]
                _add(flow, members, count, slot, s, p, -amount)
                _add(flow, members, count, slot, s, cur, amount)
                changed[p] = True
                changed[cur] = True
                cur = p
            _add(flow, members, count, slot, i, cur, amount)
            changed[cur] = True
            room[end] -= amount
            left -= amount
            for j in range(w):
                if changed[j]:
                    _refresh(unit, flow, members, count, j, edge, arg)
    return OK


@njit(cache=True, nogil=True)
def greedy(unit, sizes, order, room, flow):
    """Pieces in ``order``, each to its cheapest rank with room (ties: the lowest rank), the
    rows that do not fit to the next cheapest, and so on (``room`` updated in place).

    Returns OK or NO_ROOM.
    """
    w = unit.shape[1]
    for i in order:
        left = sizes[i]
        while left > 0:
            best = -1
            for j in range(w):
                if room[j] > 0 and (best < 0 or unit[i, j] < unit[i, best]):
                    best = j
            if best < 0:
                return NO_ROOM
            amount = min(left, room[best])
            flow[i, best] += amount
            room[best] -= amount
            left -= amount
    return OK
