"""ESD's cost model: what a piece of samples costs on each rank, read off the cache shadow.

The cost of piece ``i`` on rank ``j`` sums, over the distinct rows ``x`` the piece reads::

    [rank j does not hold x's latest version] * (T[j]                     miss pull
                                                 + [x dirty on rank d] * T[d])   update push

with ``T[j] = row_bytes / bandwidth[j]`` (a row dirty on ``j`` itself is ``j``'s latest version:
no cost): the homes are a parameter server off the ranks whose link is never the bottleneck
(ESD's setting). When the homes are ranks (the trainer's caches: a row's home is its owner rank
``h``), a transfer crosses the home's link too, and none crosses a link when it stays on one rank::

    [rank j does not hold x's latest version] * ([j != h] * (T[j] + T[h])          miss pull
                                                 + [x dirty on d, d != h] * (T[d] + T[h]))

so a rank that is the home of a piece's rows pulls them for free, and a slow rank's link is
charged for the rows others pull from it. A row read by several samples of a piece counts once. The model is linear in the
pieces: two pieces on one rank that read the same missing row are charged twice here but pull it
once in the step (:meth:`~readers.dispatch.shadow.CacheShadow.step` counts what really moves).
"""

from __future__ import annotations

import numpy as np

from readers.dispatch import _kernels as K
from readers.dispatch.keys import PieceRows
from readers.dispatch.shadow import CacheShadow
from recpipe.errors import DataError

__all__ = ["piece_costs", "piece_hits"]

_NO_HOMES = np.zeros(0, dtype=np.int64)


def piece_costs(
    shadow: CacheShadow,
    rows: PieceRows,
    seconds_per_row: np.ndarray,
    home: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [pieces, W]: seconds of transfers each piece costs on each rank (see the module
    docstring).

    Args:
        shadow: the caches' state before the step.
        rows: the distinct rows each piece reads.
        seconds_per_row: ``T[j]``, seconds one row takes over rank j's link.
        home: int64 over the shadow's rows (at least those in ``rows``): the rank that is each
            row's home; ``None``: the homes are off the ranks (a parameter server).
    """
    t = np.ascontiguousarray(seconds_per_row, dtype=np.float64)
    shadow.ensure()
    homes = _NO_HOMES if home is None else np.ascontiguousarray(home, dtype=np.int64)
    if home is not None and rows.row.size and int(rows.row.max()) >= homes.size:
        msg = f"`home` covers {homes.size} rows, the pieces read row {int(rows.row.max())}"
        raise DataError(msg)
    out = np.zeros((rows.num_pieces, shadow.world_size))
    K.piece_costs(shadow.state, shadow.dirty_on, homes, rows.piece, rows.row, t, out)
    return out


def piece_hits(shadow: CacheShadow, rows: PieceRows) -> np.ndarray:
    """float64 [pieces, W]: rows of each piece whose latest version each rank holds."""
    shadow.ensure()
    out = np.zeros((rows.num_pieces, shadow.world_size))
    K.piece_hits(shadow.state, rows.piece, rows.row, out)
    return out
