"""Numba CPU kernels of the exchange: gradients of the prepared rows, summed in float64.

One pass over the looked-up ids, no ``[ids, D]`` intermediate; the sums run in id order, as
``index_add_`` does, so they give the same float64 values as the torch form (used on CUDA).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__: list[str] = []  # private: used by trainer.distributed.exchange


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
def add_rows(grad, pos, out):
    """out[pos[i]] += grad[i] for every looked-up row i."""
    dim = grad.shape[1]
    for i in range(pos.size):
        r = pos[i]
        for j in range(dim):
            out[r, j] += np.float64(grad[i, j])
