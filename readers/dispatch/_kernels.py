"""Numba kernels of the dispatcher: the exact assignment, the greedy pass, session packing.

Each kernel works on plain NumPy arrays and reports a failure by its return code (the Python
wrappers in :mod:`readers.dispatch.assign` and :mod:`readers.dispatch.packs` raise).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__: list[str] = []  # private: used by readers.dispatch.assign and readers.dispatch.packs

OK = 0
NO_ROOM = -1
CYCLE = -2


@njit(cache=True, nogil=True)
def _refresh_edges(costs, members, count, j, edge, arg):
    """Edges out of rank ``j``: the cheapest move of one of its samples to each other rank."""
    w = costs.shape[1]
    for k in range(w):
        edge[j, k] = np.inf
        arg[j, k] = -1
    for m in range(count[j]):
        s = members[j, m]
        base = costs[s, j]
        for k in range(w):
            if k != j:
                d = costs[s, k] - base
                if d < edge[j, k]:
                    edge[j, k] = d
                    arg[j, k] = s


@njit(cache=True, nogil=True)
def transport(costs, capacity, tol, out):
    """Assign every row of ``costs`` [n, W] to a column, at most ``capacity[j]`` rows to column
    ``j``, at the least total cost (exact).

    Successive shortest paths over the W columns: rows are added one at a time, each along the
    cheapest chain "put row i on rank r1, move a sample of r1 to r2, ..., end on a rank with
    room" (Bellman-Ford over W nodes; the edge r -> r' is the cheapest move of one of r's samples,
    kept per rank and refreshed for the ranks a chain changed). After each addition the
    assignment is optimal for the rows added so far, so after the last one it is optimal.
    O(n * (W^3 + W * m)) for m rows per column.

    Returns:
        OK, NO_ROOM (capacities too small) or CYCLE (a negative cycle: costs not finite).
    """
    n, w = costs.shape
    members = np.empty((w, n), np.int64)
    count = np.zeros(w, np.int64)
    slot = np.empty(n, np.int64)
    edge = np.full((w, w), np.inf)
    arg = np.full((w, w), -1, np.int64)
    dist = np.empty(w)
    pred = np.empty(w, np.int64)
    changed = np.zeros(w, np.bool_)
    for i in range(n):
        for j in range(w):
            dist[j] = costs[i, j]
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
            if count[j] < capacity[j] and (end < 0 or dist[j] < dist[end] - tol):
                end = j
        if end < 0:
            return NO_ROOM
        changed[:] = False
        cur, hops = end, 0
        while pred[cur] >= 0:
            p = pred[cur]
            s = arg[p, cur]
            at = slot[s]  # take s out of p
            last = members[p, count[p] - 1]
            members[p, at] = last
            slot[last] = at
            count[p] -= 1
            members[cur, count[cur]] = s  # and into cur
            slot[s] = count[cur]
            count[cur] += 1
            out[s] = cur
            changed[cur] = True
            cur = p
            hops += 1
            if hops > w:
                return CYCLE
        members[cur, count[cur]] = i
        slot[i] = count[cur]
        count[cur] += 1
        out[i] = cur
        changed[cur] = True
        for j in range(w):
            if changed[j]:
                _refresh_edges(costs, members, count, j, edge, arg)
    return OK


@njit(cache=True, nogil=True)
def greedy(costs, order, remaining, out):
    """Rows in ``order``, each to the cheapest column with room (ties: the lowest column).

    ``remaining`` [W] is the room left, updated in place. Returns OK or NO_ROOM.
    """
    w = costs.shape[1]
    for i in order:
        best = -1
        for j in range(w):
            if remaining[j] > 0 and (best < 0 or costs[i, j] < costs[i, best]):
                best = j
        if best < 0:
            return NO_ROOM
        out[i] = best
        remaining[best] -= 1
    return OK


@njit(cache=True, nogil=True)
def first_fit(lengths, free, out):
    """First fit of pieces (``lengths``, longest first) into packs with ``free`` rows left
    (updated in place): ``out[p]`` = the pack of piece p, or -1 when none has room."""
    for p in range(lengths.size):
        out[p] = -1
        for b in range(free.size):
            if free[b] >= lengths[p]:
                out[p] = b
                free[b] -= lengths[p]
                break
