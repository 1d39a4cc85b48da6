"""Session pieces: the units a global batch is dispatched in.

The samples of a session share their user features, so sending them to one rank pulls those
rows once, and leaves them fresh on that rank (read by two ranks in one step, a row goes home
and every cached copy goes stale). A global batch's rows become *pieces* by their session id,
wherever the session's rows are in the batch (a batch in time order interleaves its sessions)::

    sessions (rows)       s0: 37 rows      s1: 5     s2: 1     s3: 12 ...
    pieces (P = 16)       16 | 16 | 5      5         1         12

A session of at most ``P = max_rows`` rows in the batch is one piece; a longer one is cut into
chunks of P of its rows (in batch order) and its remainder. Pieces are numbered by their first
row. The placement (:mod:`readers.dispatch.assign`) keeps every piece whole except at most
``W - 1`` of them per pass, which it splits to give every rank exactly its share of rows.
``P = 1`` dispatches single samples; a batch without session ids is cut into runs of P rows.

>>> import numpy as np
>>> pieces = session_pieces(np.array([7, 7, 7, 7, 7, 3, 3, 9]), max_rows=4)
>>> pieces.piece_of_row.tolist(), pieces.sizes.tolist()
([0, 0, 0, 0, 1, 2, 2, 3], [4, 1, 2, 1])
>>> session_pieces(np.array([5, 8, 5, 6, 8]), max_rows=4).piece_of_row.tolist()  # interleaved
[0, 1, 0, 2, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recpipe.errors import DataError

__all__ = ["Pieces", "session_pieces"]


@dataclass(frozen=True)
class Pieces:
    """A batch cut into pieces.

    Attributes:
        piece_of_row: int64 [B] the piece of each row (pieces numbered by their first row; the
            rows of a piece need not be adjacent).
        sizes: int64 [pieces] rows of each piece.
    """

    piece_of_row: np.ndarray
    sizes: np.ndarray

    @property
    def num_pieces(self) -> int:
        return int(self.sizes.size)

    def rows_of(self, piece: int) -> np.ndarray:
        """int64: the rows of piece ``piece``, ascending."""
        return np.flatnonzero(self.piece_of_row == piece)


def session_pieces(
    session_ids: np.ndarray | None, *, max_rows: int, rows: int | None = None
) -> Pieces:
    """Cut a batch into session pieces of at most ``max_rows`` rows (see the module docstring).

    Args:
        session_ids: [B] the session of each row, or ``None`` (runs of ``max_rows`` rows).
        max_rows: rows per piece at most, P.
        rows: B when ``session_ids`` is ``None``.

    Raises:
        DataError: ``max_rows`` is not a positive integer.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        msg = f"`max_rows` must be a positive integer, got {max_rows!r}"
        raise DataError(msg)
    b = int(rows if session_ids is None else len(session_ids))
    if session_ids is None:
        chunk = np.arange(b, dtype=np.int64) // max_rows
    else:
        _, session = np.unique(np.asarray(session_ids), return_inverse=True)
        session = session.reshape(-1).astype(np.int64)
        order = np.argsort(session, kind="stable")  # rows by session, in batch order within
        ordered = session[order]
        first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if b else order
        seen = np.arange(b) - np.repeat(first, np.diff(np.r_[first, b]))  # rank in its session
        chunk = np.empty(b, dtype=np.int64)
        chunk[order] = seen // max_rows
        chunk = session * (b // max_rows + 1) + chunk  # (session, chunk) as one key
    _, first_row, key = np.unique(chunk, return_index=True, return_inverse=True)
    number = np.empty(first_row.size, dtype=np.int64)
    number[np.argsort(first_row, kind="stable")] = np.arange(first_row.size)
    piece_of_row = number[key.reshape(-1)] if b else np.zeros(0, dtype=np.int64)
    sizes = np.bincount(piece_of_row, minlength=first_row.size).astype(np.int64)
    return Pieces(piece_of_row.astype(np.int64), sizes)
