"""ESD's cost model: what a piece of samples costs on each rank, read off the cache shadow.

The cost of piece ``i`` on rank ``j`` sums, over the distinct rows ``x`` the piece reads::

    [rank j does not hold x's latest version] * (T[j]                     miss pull
                                                 + [x dirty on rank d] * T[d])   update push

with ``T[j] = row_bytes / bandwidth[j]`` (a row dirty on ``j`` itself is ``j``'s latest version:
no cost). A row read by several samples of a piece counts once. The model is linear in the
pieces: two pieces on one rank that read the same missing row are charged twice here but pull it
once in the step (:meth:`~readers.dispatch.shadow.CacheShadow.step` counts what really moves).
"""

from __future__ import annotations

import numpy as np

from readers.dispatch import _kernels as K
from readers.dispatch.keys import PieceRows
from readers.dispatch.shadow import CacheShadow

__all__ = ["piece_costs", "piece_hits"]


def piece_costs(shadow: CacheShadow, rows: PieceRows, seconds_per_row: np.ndarray) -> np.ndarray:
    """float64 [pieces, W]: seconds of transfers each piece costs on each rank (see the module
    docstring)."""
    t = np.ascontiguousarray(seconds_per_row, dtype=np.float64)
    shadow.ensure()
    out = np.zeros((rows.num_pieces, shadow.world_size))
    K.piece_costs(shadow.state, shadow.dirty_on, rows.piece, rows.row, t, out)
    return out


def piece_hits(shadow: CacheShadow, rows: PieceRows) -> np.ndarray:
    """float64 [pieces, W]: rows of each piece whose latest version each rank holds."""
    shadow.ensure()
    out = np.zeros((rows.num_pieces, shadow.world_size))
    K.piece_hits(shadow.state, rows.piece, rows.row, out)
    return out
