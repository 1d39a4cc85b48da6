"""Session packs: exactly P rows each, sessions split only as the packing rule says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch.packs import session_packs
from recpipe.errors import DataError


@st.composite
def batches(draw):
    """Session runs (lengths), a pack size and a batch size that it divides."""
    pack = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    packs = draw(st.integers(1, 12))
    total = pack * packs
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(draw(st.integers(1, 3 * pack + 2)), total - sum(lengths)))
    return np.repeat(np.arange(len(lengths)) * 7 + 3, lengths), pack


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_pack_has_pack_size_rows_and_few_sessions_are_split(case):
    sessions, pack = case
    out = session_packs(sessions, pack_size=pack)
    packs = sessions.size // pack
    assert np.bincount(out, minlength=packs).tolist() == [pack] * packs
    # a session spans ceil(L / P) packs unless it was cut to fill the room left (step 3):
    # every such extra cut ends at the boundary of a pack with room, so there are fewer than
    # the packs
    extra = 0
    for s in np.unique(sessions):
        rows = np.flatnonzero(sessions == s)
        extra += np.unique(out[rows]).size - -(-rows.size // pack)
    assert 0 <= extra < packs
    assert session_packs(sessions, pack_size=pack).tolist() == out.tolist()  # deterministic


def test_sessions_that_fit_are_not_split():
    # 4 sessions of 2 rows and 2 of 4: packs of 4 hold them whole
    sessions = np.repeat([1, 2, 3, 4, 5, 6], [2, 4, 2, 2, 4, 2])
    out = session_packs(sessions, pack_size=4)
    for s in range(1, 7):
        assert np.unique(out[sessions == s]).size == 1


def test_a_long_session_gives_whole_packs_and_a_piece():
    sessions = np.repeat([1, 2, 3], [9, 2, 1])
    out = session_packs(sessions, pack_size=4)
    assert out.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def test_single_samples_and_no_sessions():
    assert session_packs(np.array([5, 5, 6]), pack_size=1).tolist() == [0, 1, 2]
    assert session_packs(None, pack_size=2, rows=6).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("pack_size", [0, 3, True])
def test_bad_pack_size(pack_size):
    with pytest.raises(DataError, match="`pack_size`"):
        session_packs(np.zeros(8), pack_size=pack_size)
