"""Numba CPU kernels of the exchange: gradients of the prepared rows and of the rows an owner
receives, summed in float64, the row-wise Adagrad update, and the copies of rows into and out of
the exchange's buffers.

One pass over the ids, no ``[ids, D]`` intermediate; the sums run in id order, as
``index_add_`` does, so they give the same float64 values as the torch form (used on CUDA).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__: list[str] = []  # private: used by trainer.distributed.exchange and .shard


@njit(cache=True, nogil=True)
def pool_backward(grad, pos, offsets, mean, out):
    """out[pos[i]] += grad[b] (/ the bag's length when ``mean``) for every id i of bag b."""
    dim = grad.shape[1]
    for b in range(offsets.size - 1):
        lo, hi = offsets[b], offsets[b + 1]
        if hi == lo:
            continue
        scale = 1.0 / (hi - lo) if mean else 1.0
        for i in range(lo, hi):
            r = pos[i]
            for j in range(dim):
                out[r, j] += np.float64(grad[b, j]) * scale


@njit(cache=True, nogil=True)
def copy_rows(src, src_index, out, out_index):
    """``out[out_index[i]] = src[src_index[i]]`` for every ``i``: a gather and a scatter of rows
    in one pass (torch's ``index_copy_`` of an ``index_select`` takes two, the first into a
    temporary)."""
    dim = src.shape[1]
    for i in range(src_index.size):
        s, d = src_index[i], out_index[i]
        for j in range(dim):
            out[d, j] = src[s, j]


@njit(cache=True, nogil=True)
def scatter_rows(src, index, out):
    """``out[index[i]] = src[i]`` for every row ``i`` (``index_copy_`` in one compiled loop)."""
    dim = src.shape[1]
    for i in range(index.size):
        d = index[i]
        for j in range(dim):
            out[d, j] = src[i, j]


@njit(cache=True, nogil=True)
def sum_by_row(got, sel, rows, slot):
    """The distinct ``rows`` (in order of first appearance) and, for each, the float64 sum of
    ``got[sel[i]]`` over the ``i`` with ``rows[i]`` equal to it, added in ``i`` order (as
    ``index_add_`` adds). ``slot`` is scratch of at least ``max(rows) + 1`` entries, all -1;
    they are -1 again on return."""
    dim = got.shape[1]
    n = sel.size
    uniq = np.empty(n, dtype=np.int64)
    k = 0
    for i in range(n):
        r = rows[i]
        if slot[r] < 0:
            slot[r] = k
            uniq[k] = r
            k += 1
    out = np.zeros((k, dim), dtype=np.float64)
    for i in range(n):
        s = slot[rows[i]]
        src = sel[i]
        for j in range(dim):
            out[s, j] += got[src, j]
    for q in range(k):
        slot[uniq[q]] = -1
    return uniq[:k], out
