"""Session pieces: the units a global batch is dispatched in.

The samples of a session share their user features, so sending them to one rank pulls those
rows once. A global batch's rows (sessions are runs of equal session id, as the readers cut
them) become *pieces*::

    sessions (runs)       s0: 37 rows      s1: 5     s2: 1     s3: 12 ...
    pieces (P = 16)       16 | 16 | 5      5         1         12

A session of at most ``P = max_rows`` rows is one piece; a longer one is cut into consecutive
chunks of P rows and its remainder. The placement (:mod:`readers.dispatch.assign`) keeps every
piece whole except at most ``W - 1`` of them per pass, which it splits to give every rank
exactly its share of rows. ``P = 1`` dispatches single samples; a batch without session ids is
cut into runs of P rows.

>>> import numpy as np
>>> pieces = session_pieces(np.array([7, 7, 7, 7, 7, 3, 3, 9]), max_rows=4)
>>> pieces.piece_of_row.tolist(), pieces.sizes.tolist()
([0, 0, 0, 0, 1, 2, 2, 3], [4, 1, 2, 1])
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
        piece_of_row: int64 [B] the piece of each row (pieces are runs of rows, in order).
        sizes: int64 [pieces] rows of each piece.
    """

    piece_of_row: np.ndarray
    sizes: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        """int64 [pieces] the first row of each piece."""
        return np.cumsum(self.sizes) - self.sizes

    @property
    def num_pieces(self) -> int:
        return int(self.sizes.size)


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
        run_starts = np.zeros(1 if b else 0, dtype=np.int64)
    else:
        sessions = np.asarray(session_ids)
        run_starts = (
            np.flatnonzero(np.r_[True, sessions[1:] != sessions[:-1]]) if b else sessions[:0]
        )
    run_lengths = np.diff(np.r_[run_starts, b]).astype(np.int64)
    chunks = -(-run_lengths // max_rows)  # pieces per run
    inside = np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    sizes = np.minimum(np.repeat(run_lengths, chunks) - inside * max_rows, max_rows)
    piece_of_row = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
    return Pieces(piece_of_row, sizes.astype(np.int64))
