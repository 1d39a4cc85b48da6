"""Session pieces: whole sessions of at most P rows, longer ones cut into P-row chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch.pieces import session_pieces
from recpipe.errors import DataError


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(1, 16))
def test_pieces_are_sessions_cut_every_p_rows(lengths, p):
    sessions = np.repeat(np.arange(len(lengths)) * 7 + 3, lengths)
    pieces = session_pieces(sessions, max_rows=p)
    assert pieces.sizes.sum() == sessions.size
    assert (pieces.sizes >= 1).all() and (pieces.sizes <= p).all()
    assert (
        pieces.piece_of_row.tolist()
        == np.repeat(np.arange(pieces.num_pieces), pieces.sizes).tolist()
    )
    for s, length in zip(np.unique(sessions), lengths, strict=False):
        of_session = np.unique(pieces.piece_of_row[sessions == s])
        assert of_session.size == -(-length // p)  # ceil(L / P) pieces
        assert (pieces.sizes[of_session][:-1] == p).all()  # all but the last are full


def test_a_session_that_reappears_later_joins_its_piece():
    pieces = session_pieces(np.array([1, 1, 2, 1]), max_rows=8)
    assert pieces.piece_of_row.tolist() == [0, 0, 1, 0]
    assert pieces.rows_of(0).tolist() == [0, 1, 3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(1, 16), st.randoms())
def test_interleaved_sessions_are_cut_in_batch_order(lengths, p, random):
    """A batch in time order interleaves its sessions: each still gives ceil(L / P) pieces,
    the first P of its rows (in batch order), the next P, ...; pieces numbered by first row."""
    sessions = np.repeat(np.arange(len(lengths)) * 7 + 3, lengths)
    random.shuffle(sessions)
    pieces = session_pieces(sessions, max_rows=p)
    assert pieces.sizes.tolist() == np.bincount(pieces.piece_of_row).tolist()
    firsts = [pieces.rows_of(i)[0] for i in range(pieces.num_pieces)]
    assert firsts == sorted(firsts)
    for s, length in zip(np.arange(len(lengths)) * 7 + 3, lengths, strict=True):
        rows = np.flatnonzero(sessions == s)
        expected = np.repeat(np.arange(-(-length // p)), p)[:length]
        got = pieces.piece_of_row[rows]
        assert np.unique(got).size == -(-length // p)
        assert (np.unique(got, return_inverse=True)[1] == expected).all()


def test_single_samples_and_no_sessions():
    assert session_pieces(np.array([5, 5, 6]), max_rows=1).sizes.tolist() == [1, 1, 1]
    assert session_pieces(None, max_rows=4, rows=10).sizes.tolist() == [4, 4, 2]
    assert session_pieces(np.zeros(0), max_rows=4).num_pieces == 0


@pytest.mark.parametrize("max_rows", [0, True, 2.0])
def test_bad_max_rows(max_rows):
    with pytest.raises(DataError, match="`max_rows`"):
        session_pieces(np.zeros(8), max_rows=max_rows)
