"""Session packs: the units a global batch is dispatched in, each exactly ``pack_size`` rows.

The samples of a session share their user features, so sending them to one rank pulls those rows
once. Every pack holds ``P = pack_size`` rows and every rank takes ``m / P`` packs (``m``: rows
per rank), so every rank gets exactly ``m`` rows. A global batch's rows are cut into packs so
that as few sessions as possible are split::

    sessions (runs of equal session id)     s0: 37 rows   s1: 5   s2: 12   s3: 9   s4: 1 ...
    1. a session of L >= P rows gives L // P whole packs of its own (consecutive rows) and a
       piece of L % P rows:                 s0 -> 2 packs of 16 + a piece of 5
    2. the pieces (< P rows), longest first, go to the first pack with room (first fit
       decreasing):                         [s2 12 | s4 1 ...] [s3 9 | s1 5 | ...] ...
    3. the pieces no pack had room for are cut to fill the room left, pack by pack, in order

So a session is split only when it is longer than P (into P-row chunks and its remainder) or
when it is one of the pieces of step 3. ``P = 1`` dispatches single samples; a batch without
session ids is cut into consecutive runs of P rows.

>>> import numpy as np
>>> session_packs(np.array([7, 7, 7, 7, 7, 3, 3, 9]), pack_size=4).tolist()
[0, 0, 0, 0, 1, 1, 1, 1]
>>> session_packs(np.array([1, 2, 2, 3, 3, 3, 4, 4]), pack_size=4).tolist()
[0, 1, 1, 0, 0, 0, 1, 1]
"""

from __future__ import annotations

import numpy as np

from readers.dispatch import _kernels as K
from recpipe.errors import DataError

__all__ = ["session_packs"]


def session_packs(
    session_ids: np.ndarray | None, *, pack_size: int, rows: int | None = None
) -> np.ndarray:
    """The pack of every row of a batch (see the module docstring).

    Args:
        session_ids: [B] the session of each row, or ``None`` (consecutive runs of rows).
        pack_size: rows per pack P; must divide B.
        rows: B when ``session_ids`` is ``None``.

    Returns:
        int64 [B]: pack of each row, in ``[0, B // P)``; every pack has exactly P rows.

    Raises:
        DataError: ``pack_size`` is not a positive divisor of B.
    """
    b = int(rows if session_ids is None else len(session_ids))
    if isinstance(pack_size, bool) or not isinstance(pack_size, int) or pack_size < 1:
        msg = f"`pack_size` must be a positive integer, got {pack_size!r}"
        raise DataError(msg)
    if b % pack_size:
        msg = f"`pack_size` {pack_size} must divide the batch's {b} rows"
        raise DataError(msg)
    if session_ids is None or pack_size == 1:
        return np.arange(b, dtype=np.int64) // pack_size
    sessions = np.asarray(session_ids)
    starts = np.flatnonzero(np.r_[True, sessions[1:] != sessions[:-1]])
    lengths = np.diff(np.r_[starts, b])
    out = np.empty(b, dtype=np.int64)
    # 1. whole packs of the long sessions
    whole = lengths // pack_size
    first_rows = np.repeat(starts, whole) + _ranks_within(whole) * pack_size
    num_whole = int(whole.sum())
    for p, row in enumerate(first_rows):
        out[row : row + pack_size] = p
    # 2. the pieces, longest first (ties: batch order), first fit
    piece_len = lengths % pack_size
    piece_start = starts + whole * pack_size
    keep = piece_len > 0
    piece_len, piece_start = piece_len[keep], piece_start[keep]
    order = np.argsort(-piece_len, kind="stable")
    piece_len, piece_start = piece_len[order], piece_start[order]
    free = np.full(b // pack_size - num_whole, pack_size, dtype=np.int64)
    where = np.empty(piece_len.size, dtype=np.int64)
    K.first_fit(piece_len, free, where)
    for start, n, pack in zip(piece_start, piece_len, where, strict=True):
        if pack >= 0:
            out[start : start + n] = num_whole + pack
    # 3. the rest, cut to fill the room left
    left = [
        int(s) + k
        for s, n, p in zip(piece_start, piece_len, where, strict=True)
        if p < 0
        for k in range(int(n))
    ]
    room = np.repeat(np.arange(free.size), free) + num_whole
    out[np.asarray(left, dtype=np.int64)] = room
    return out


def _ranks_within(counts: np.ndarray) -> np.ndarray:
    """``[0, 1, ..., c-1]`` for every count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
