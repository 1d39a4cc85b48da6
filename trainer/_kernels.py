"""Numba CPU kernels of the trainer's own autograd functions and of a batch's id plan (private).

One pass over the rows, no ``[n, D]`` intermediate. The sums run in row order, as torch's
single-threaded ``index_add_`` adds, so they give the same values.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recpipe.kernels.splitmix import GOLDEN, mix64

# private: used by trainer.modules, trainer.idplan, trainer.store and trainer.distributed
__all__: list[str] = []

_GOLDEN = np.uint64(GOLDEN)
_S40 = np.uint64(40)


def init_rows(ids: np.ndarray, dim: int, *, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """The initial rows of ``ids`` in every table backend: uniform(-scale, scale) from a hash of
    (seed, id), so an id gets the same row whichever backend, rank or order creates it.

    Returns:
        float32 [len(ids), dim].
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty((ids.size, dim), dtype=np.float32)
    _init_rows(ids, np.int64(seed), float(scale), out)
    return out


@njit(cache=True, nogil=True)
def _init_rows(ids, seed, scale, out):
    """Deterministic uniform(-scale, scale) rows: row i depends only on (seed, ids[i])."""
    sd = mix64(np.uint64(seed) ^ _GOLDEN)
    dim = out.shape[1]
    for i in range(ids.size):
        x = mix64(np.uint64(ids[i]) ^ sd)
        for j in range(dim):
            r = mix64(x + np.uint64(j + 1) * _GOLDEN)
            u = np.float64(r >> _S40) * (1.0 / 16777216.0)  # 24 random bits in [0, 1)
            out[i, j] = np.float32((2.0 * u - 1.0) * scale)


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


@njit(cache=True, nogil=True)
def rowwise_adagrad(values, state, rows, grads, lr, eps, dim):
    """fbgemm's row-wise Adagrad on ``values[rows[i]]`` with ``grads[i]`` (rows distinct):
    ``s += sum(g²) / dim``; ``w -= g · lr / (sqrt(s) + eps)``. ``lr``, ``eps`` and ``dim`` come
    in the values' own float type, so every operation rounds as the torch form's does."""
    for i in range(rows.size):
        r = rows[i]
        acc = grads[i, 0] * grads[i, 0]
        for j in range(1, grads.shape[1]):
            acc += grads[i, j] * grads[i, j]
        s = state[r] + acc / dim
        state[r] = s
        mult = lr / (np.sqrt(s) + eps)
        for j in range(grads.shape[1]):
            values[r, j] -= grads[i, j] * mult


@njit(cache=True, nogil=True)
def first_unique(ids, sizes, tables, shift):
    """The distinct keys ``ids[i] + (table << shift)`` (``ids`` one feature after the other,
    ``sizes[f]`` values of feature ``f`` reading table ``tables[f]``) in order of first
    appearance, and for each value the index of its key among them: one pass over an
    open-addressing hash table. ``ok`` is False when an id leaves no room for the table's
    number (negative, or ``>= 2**shift``); the rest is then meaningless."""
    n = ids.size
    size = 16
    while size < 2 * n:
        size *= 2
    mask = size - 1
    slots = np.full(size, -1, dtype=np.int64)
    keys = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    limit = np.int64(1) << shift
    k = 0
    i = 0
    for f in range(sizes.size):
        high = tables[f] << shift
        for _ in range(sizes[f]):
            v = ids[i]
            if v < 0 or v >= limit:
                return keys[:0], inverse, False
            key = v + high
            h = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
            j = np.int64((h ^ (h >> np.uint64(29))) & np.uint64(mask))
            while True:
                s = slots[j]
                if s < 0:
                    slots[j] = k
                    keys[k] = key
                    inverse[i] = k
                    k += 1
                    break
                if keys[s] == key:
                    inverse[i] = s
                    break
                j = (j + 1) & mask
            i += 1
    return keys[:k], inverse, True
