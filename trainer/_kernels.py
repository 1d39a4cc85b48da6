"""Numba CPU kernels of the trainer's own autograd functions (private).

One pass over the rows, no ``[n, D]`` intermediate. The sums run in row order, as torch's
single-threaded ``index_add_`` adds, so they give the same values.
"""

from __future__ import annotations

from numba import njit

__all__: list[str] = []  # private: used by trainer.modules and trainer.distributed


@njit(cache=True, nogil=True)
def add_rows(src, index, out):
    """``out[index[i]] += src[i]`` for every row ``i`` of ``[n, D]`` ``src``, in ``i`` order.

    The additions are in ``out``'s float type (a float32 ``src`` into a float64 ``out`` is
    widened exactly)."""
    dim = src.shape[1]
    for i in range(index.size):
        r = index[i]
        for j in range(dim):
            out[r, j] += src[i, j]
