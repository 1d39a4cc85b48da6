"""ESD's cost model: what a pack of samples costs on each rank, read off the cache shadow.

The cost of pack ``i`` on rank ``j`` sums, over the distinct rows ``x`` the pack reads::

    [rank j does not hold x's latest version] * (T[j]                     miss pull
                                                 + [x dirty on rank d] * T[d])   update push

with ``T[j] = row_bytes / bandwidth[j]`` (a row dirty on ``j`` itself is ``j``'s latest version:
no cost). A row read by several samples of a pack counts once. The model is linear in the packs:
two packs on one rank that read the same missing row are charged twice here but pull it once
in the step (:meth:`~readers.dispatch.shadow.CacheShadow.step` counts what really moves).
"""

from __future__ import annotations

import numpy as np

from readers.dispatch.keys import PackRows
from readers.dispatch.shadow import CacheShadow

__all__ = ["pack_costs", "pack_hits"]


def _per_pack(rows: PackRows, per_pair: np.ndarray) -> np.ndarray:
    """[packs, W] sums of ``per_pair`` [W, pairs] over each pack's pairs."""
    w = per_pair.shape[0]
    out = np.empty((rows.num_packs, w), dtype=np.float64)
    for j in range(w):
        out[:, j] = np.bincount(rows.pack, weights=per_pair[j], minlength=rows.num_packs)
    return out


def pack_costs(shadow: CacheShadow, rows: PackRows, seconds_per_row: np.ndarray) -> np.ndarray:
    """float64 [packs, W]: seconds of transfers each pack costs on each rank (module docstring)."""
    t = np.asarray(seconds_per_row, dtype=np.float64)
    fresh = shadow.fresh(rows.row)  # (W, pairs)
    holder = shadow.dirty_on[rows.row]
    push = np.where(holder >= 0, t[np.maximum(holder, 0)], 0.0)  # (pairs,)
    return _per_pack(rows, np.where(fresh, 0.0, t[:, None] + push[None, :]))


def pack_hits(shadow: CacheShadow, rows: PackRows) -> np.ndarray:
    """float64 [packs, W]: rows of each pack whose latest version each rank holds."""
    return _per_pack(rows, shadow.fresh(rows.row).astype(np.float64))
