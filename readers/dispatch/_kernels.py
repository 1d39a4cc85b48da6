"""Numba kernels of the dispatcher: the exact transportation solver and the greedy pass.

Both place *pieces* of ``sizes[i]`` rows on ranks with ``room[j]`` rows, as a flow
``flow[i, j]`` (rows of piece i on rank j), at ``unit[i, j]`` per row. They report a failure by
their return code (the Python wrappers in :mod:`readers.dispatch.assign` raise).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recpipe.kernels.splitmix import GOLDEN, mix64

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


# -- the cache shadow's step (readers.dispatch.shadow) -------------------------------------------

_GOLDEN = np.uint64(GOLDEN)
_ABSENT, _STALE, _FRESH = 0, 1, 2  # readers.dispatch.shadow's states


@njit(cache=True, nogil=True)
def shadow_update(state, dirty_on, last_use, rows, offsets, step, count):
    """The state change of one step: rank ``j`` reads ``rows[offsets[j]:offsets[j + 1]]``
    (distinct). In the order of the shadow's protocol: a dirty row another rank reads is pushed
    home; misses are pulled; rows read by one rank become its dirty latest version, rows read
    by several go home (every cached copy of a read row is stale first). ``count`` is an int32
    scratch over the rows, all zero (left zero).

    Returns:
        ``(miss, shared, absent_before, pushed, pushed_by)``: per read, whether it was a miss
        pull and whether another rank read the row too; per rank, the reads its cache did not
        hold; the rows pushed home and by which rank (in the order found).
    """
    w = offsets.size - 1
    n = rows.size
    miss = np.empty(n, np.bool_)
    shared = np.empty(n, np.bool_)
    absent = np.zeros(w, np.int64)
    pushed = np.empty(n, np.int64)
    pushed_by = np.empty(n, np.int64)
    npushed = 0
    for j in range(w):
        for p in range(offsets[j], offsets[j + 1]):
            r = rows[p]
            h = dirty_on[r]
            if h >= 0 and h != j:  # update push (once: the row is clean from here on)
                pushed[npushed] = r
                pushed_by[npushed] = h
                npushed += 1
                dirty_on[r] = -1
            before = state[j, r]
            miss[p] = before != _FRESH
            if before == _ABSENT:
                absent[j] += 1
            count[r] += 1
    for j in range(w):  # the misses are pulled; then every cached copy of a read row is stale
        for p in range(offsets[j], offsets[j + 1]):
            r = rows[p]
            shared[p] = count[r] > 1
            if miss[p]:
                state[j, r] = _FRESH
    for p in range(n):
        r = rows[p]
        if count[r] != 0:
            count[r] = 0
            for k in range(w):
                if state[k, r] == _FRESH:
                    state[k, r] = _STALE
    for j in range(w):  # sole readers hold the new version dirty
        for p in range(offsets[j], offsets[j + 1]):
            r = rows[p]
            last_use[j, r] = step
            if not shared[p]:
                state[j, r] = _FRESH
                dirty_on[r] = j
    return miss, shared, absent, pushed[:npushed], pushed_by[:npushed]


@njit(cache=True, nogil=True)
def lru_pop(queue_rows, queue_steps, head, tail, k, state, last_use):
    """The ``k`` oldest live entries of one rank's recency queue (a row still cached, last read
    in the entry's step), from ``head`` on.

    Returns:
        ``(rows, head)``: the rows (fewer than ``k`` if the queue ran out) and the position
        after the last one taken.
    """
    out = np.empty(k, np.int64)
    n = 0
    h = head
    while n < k and h < tail:
        r = queue_rows[h]
        if state[r] != _ABSENT and last_use[r] == queue_steps[h]:
            out[n] = r
            n += 1
        h += 1
    return out[:n], h


@njit(cache=True, nogil=True)
def lru_live(queue_rows, queue_steps, state, last_use):
    """bool mask of the live entries of a recency queue segment."""
    out = np.empty(queue_rows.size, np.bool_)
    for p in range(queue_rows.size):
        r = queue_rows[p]
        out[p] = state[r] != _ABSENT and last_use[r] == queue_steps[p]
    return out


@njit(cache=True, nogil=True)
def piece_costs(state, dirty_on, home, piece, row, seconds, out):
    """``out[i, j] +=`` the cost of piece i's rows on rank j (readers.dispatch.cost), summed
    over the (piece, row) pairs in their order. ``home``: the rank of each row's home, or an
    empty array (homes off the ranks: only the reader's and the pusher's links are charged)."""
    w = state.shape[0]
    on_ranks = home.size > 0
    for p in range(piece.size):
        r = row[p]
        d = dirty_on[r]
        i = piece[p]
        if not on_ranks:
            push = seconds[d] if d >= 0 else 0.0
            for j in range(w):
                if state[j, r] != _FRESH:
                    out[i, j] += seconds[j] + push
            continue
        h = home[r]
        th = seconds[h]
        push = seconds[d] + th if d >= 0 and d != h else 0.0  # d's link and the home's
        for j in range(w):
            if state[j, r] != _FRESH:  # a pull from home over both links; none at home
                out[i, j] += (seconds[j] + th if j != h else 0.0) + push


@njit(cache=True, nogil=True)
def piece_hits(state, piece, row, out):
    """``out[i, j] +=`` 1 for each row of piece i whose latest version rank j holds."""
    w = state.shape[0]
    for p in range(piece.size):
        r = row[p]
        i = piece[p]
        for j in range(w):
            if state[j, r] == _FRESH:
                out[i, j] += 1.0


# -- the row index's hash table (readers.dispatch.keys.RowIndex) -----------------------------------


@njit(cache=True, nogil=True, inline="always")
def _slot(table, x, mask):
    return np.int64(mix64(np.uint64(x) + np.uint64(table) * _GOLDEN) & np.uint64(mask))


@njit(cache=True, nogil=True)
def index_rows(slots, table, ids, first_row, insert, out, new_ids):
    """Rows of ``ids`` in table ``table`` in an open-addressing hash table: ``slots`` int64
    [size, 3] of (table, id, row) side by side, so that a probe reads one cache line (row -1:
    empty; the size a power of two, at most half full after the call). With ``insert``, ids
    not found are numbered ``first_row, first_row + 1, ...`` in order of first appearance and
    written to ``new_ids``; without, they get -1.

    Returns:
        the number of new ids.
    """
    mask = slots.shape[0] - 1
    fresh = 0
    for p in range(ids.size):
        x = ids[p]
        h = _slot(table, x, mask)
        while True:
            r = slots[h, 2]
            if r < 0:
                if insert:
                    r = first_row + fresh
                    slots[h, 0] = table
                    slots[h, 1] = x
                    slots[h, 2] = r
                    new_ids[fresh] = x
                    fresh += 1
                out[p] = r
                break
            if slots[h, 1] == x and slots[h, 0] == table:
                out[p] = r
                break
            h = (h + 1) & mask
    return fresh


@njit(cache=True, nogil=True)
def index_rehash(slots, new_slots):
    """Move every entry of a hash table (:func:`index_rows`) into a larger empty one."""
    mask = new_slots.shape[0] - 1
    for s in range(slots.shape[0]):
        if slots[s, 2] >= 0:
            h = _slot(slots[s, 0], slots[s, 1], mask)
            while new_slots[h, 2] >= 0:
                h = (h + 1) & mask
            new_slots[h, 0] = slots[s, 0]
            new_slots[h, 1] = slots[s, 1]
            new_slots[h, 2] = slots[s, 2]


# -- sorting the dispatcher's int64 keys (readers.dispatch.keys.distinct, the recency order) -------

_DIGIT_BITS = 11
_DIGITS = 1 << _DIGIT_BITS


@njit(cache=True, nogil=True)
def radix_order(keys, with_order):
    """``keys`` (int64, all >= 0) sorted by a least-significant-digit radix sort (11-bit
    digits; a digit every key shares is skipped), and with ``with_order`` the stable
    permutation that sorts them (``keys[order]`` is the sorted array; else an empty array).
    Linear in the length: the dispatcher's ~100k-key arrays sort several times faster than
    with NumPy's comparison sort."""
    n = keys.size
    a = keys.copy()
    b = np.empty(n, np.int64)
    ia = np.arange(n) if with_order else np.empty(0, np.int64)
    ib = np.empty(n if with_order else 0, np.int64)
    top = 0
    for p in range(n):
        top |= a[p]
    count = np.empty(_DIGITS, np.int64)
    shift = 0
    while shift < 63 and (top >> shift) != 0:
        count[:] = 0
        for p in range(n):
            count[(a[p] >> shift) & (_DIGITS - 1)] += 1
        if count.max() < n:  # the keys differ in this digit
            at = 0
            for d in range(_DIGITS):
                c = count[d]
                count[d] = at
                at += c
            for p in range(n):
                d = (a[p] >> shift) & (_DIGITS - 1)
                q = count[d]
                b[q] = a[p]
                if with_order:
                    ib[q] = ia[p]
                count[d] = q + 1
            a, b = b, a
            ia, ib = ib, ia
        shift += _DIGIT_BITS
    return a, ia


@njit(cache=True, nogil=True)
def sorted_distinct(keys):
    """The distinct values of ``keys`` (int64, all >= 0), ascending."""
    a, _ = radix_order(keys, False)
    n = 0
    for p in range(a.size):
        if p == 0 or a[p] != a[n - 1]:
            a[n] = a[p]
            n += 1
    return a[:n]
