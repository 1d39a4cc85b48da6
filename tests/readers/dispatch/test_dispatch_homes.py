"""The cost model with the rows' homes on the ranks (``DispatchConfig.homes="ranks"``): the
home map is the trainer's owner, the kernel equals its NumPy form, a rank pulls the rows it is
home to for free, and the placement is still the model's optimum and bounds what moves."""

from __future__ import annotations

import numpy as np
import pytest

from readers.dispatch import DispatchConfig, Dispatcher, TableMap, piece_costs
from readers.dispatch.assign import flow_cost
from readers.dispatch.keys import PieceRows, RowIndex, home_ranks
from readers.dispatch.shadow import FRESH, CacheShadow
from recpipe.errors import DataError
from tests.common.data import session_batch
from tests.readers.dispatch.brute import brute_force
from trainer.distributed import owner_of

WORLD, MICRO = 3, 4


def test_home_ranks_is_the_trainers_owner_of():
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64),
                          np.arange(-50, 50), [np.iinfo(np.int64).min, np.iinfo(np.int64).max]])  # fmt: skip
    for world in (1, 2, 3, 4, 7, 8):
        assert np.array_equal(home_ranks(ids, world), owner_of(ids, world))


def _plain_costs(shadow, rows, seconds, home):
    """The cost model with homes on ranks in plain NumPy, pair by pair, summed per piece."""
    fresh = shadow.state[:, rows.row] == FRESH
    h = home[rows.row]
    d = shadow.dirty_on[rows.row].astype(np.int64)
    th = seconds[h]
    push = np.where((d >= 0) & (d != h), seconds[np.maximum(d, 0)] + th, 0.0)
    ranks = np.arange(shadow.world_size)[:, None]
    pull = np.where(ranks != h[None, :], seconds[:, None] + th[None, :], 0.0)
    per_pair = np.where(fresh, 0.0, pull + push[None, :])
    out = np.empty((rows.num_pieces, shadow.world_size))
    for j in range(shadow.world_size):
        out[:, j] = np.bincount(rows.piece, weights=per_pair[j], minlength=rows.num_pieces)
    return out


def test_cost_kernel_with_homes_equals_the_plain_sums(tiny_schema):
    """Over a replay (caches filling, rows dirty on one rank and read by another), bit for bit."""
    d = _dispatcher(tiny_schema, cache_rows=(10,), bandwidths=(0.5, 3.0, 7.0))
    dirty_off_home = 0
    for batch in _batches(tiny_schema, 12):
        prepared = d.prepare(batch)
        home = d.homes()
        got = piece_costs(d.shadow, prepared.rows, d.seconds_per_row, home)  # grows the shadow
        want = _plain_costs(d.shadow, prepared.rows, d.seconds_per_row, home)
        assert np.array_equal(got, want)
        dirty = d.shadow.dirty_on[prepared.rows.row]
        dirty_off_home += int(((dirty >= 0) & (dirty != home[prepared.rows.row])).sum())
        d.dispatch(prepared)
    assert dirty_off_home > 0  # the pushes' term was exercised


def test_a_home_rank_pulls_for_free_and_others_pay_both_links():
    """One row homed on rank 1, cached nowhere: a parameter server charges the reader's link
    only (1 on rank 0, 10 on rank 1); homes on the ranks charge rank 0's pull over both links
    (1 + 10) and rank 1's pull nothing. Once dirty on rank 0, rank 1 reading it costs the
    push over both links, rank 2 the push and its own pull."""
    index = RowIndex(["t"])
    row = index.rows(0, np.array([2]))  # home_ranks(2, 3) == 1
    assert home_ranks(np.array([2]), 3).tolist() == [1]
    shadow = CacheShadow(world_size=3, capacity=8, index=index)
    shadow.ensure()
    seconds = np.array([1.0, 10.0, 100.0])
    home = home_ranks(index.id_of_row, 3)
    rows = PieceRows(np.zeros(1, np.int64), row, 1)
    assert piece_costs(shadow, rows, seconds).tolist() == [[1.0, 10.0, 100.0]]
    assert piece_costs(shadow, rows, seconds, home).tolist() == [[11.0, 0.0, 110.0]]
    shadow.step([row, row[:0], row[:0]])  # rank 0 alone reads it: dirty on rank 0
    assert shadow.dirty_on[row].tolist() == [0]
    assert piece_costs(shadow, rows, seconds).tolist() == [[0.0, 11.0, 101.0]]
    assert piece_costs(shadow, rows, seconds, home).tolist() == [[0.0, 11.0, 121.0]]


def test_homes_must_cover_the_rows_read():
    index = RowIndex(["t"])
    index.rows(0, np.arange(5))
    shadow = CacheShadow(world_size=2, capacity=8, index=index)
    rows = PieceRows(np.zeros(1, np.int64), np.array([4]), 1)
    with pytest.raises(DataError, match="`home` covers 3 rows"):
        piece_costs(shadow, rows, np.ones(2), np.zeros(3, np.int64))


def test_homes_is_server_or_ranks():
    assert DispatchConfig().homes == "server"  # ESD's setting; the simulator's figures
    with pytest.raises(DataError, match="`homes` must be one of"):
        DispatchConfig(homes="nowhere")


def _dispatcher(schema, *, micro_batch: int = MICRO, **config) -> Dispatcher:
    config = {"max_piece_rows": 2, "bandwidths": (1.0, 3.0, 10.0), "row_bytes": 1,
              "cache_rows": (12,), "homes": "ranks", **config}  # fmt: skip
    return Dispatcher(DispatchConfig(**config), world_size=WORLD, micro_batch=micro_batch,
                      tables=TableMap.per_feature(schema.sparse_names))  # fmt: skip


def _batches(schema, n: int, *, rows: int = WORLD * MICRO, mean: float = 3.0):
    return [session_batch(schema, rows, seed=s, vocab=12, mean_session_len=mean) for s in range(n)]


def test_the_dispatchers_homes_are_the_owners_of_its_rows(tiny_schema):
    d = _dispatcher(tiny_schema)
    assert _dispatcher(tiny_schema, homes="server").homes() is None
    for batch in _batches(tiny_schema, 3):
        d.dispatch(batch)
        home = d.homes()
        assert home is not None and home.size == d.index.num_rows > 0
        assert np.array_equal(home, owner_of(d.index.id_of_row, WORLD))


def test_alpha_1_is_the_optimum_of_the_model_with_homes(tiny_schema):
    d = _dispatcher(tiny_schema, alpha=1.0, micro_batch=2)
    checked = differs = 0
    for batch in _batches(tiny_schema, 10, rows=WORLD * 2, mean=2.0):
        prepared = d.prepare(batch)
        costs = piece_costs(d.shadow, prepared.rows, d.seconds_per_row, d.homes())
        server = piece_costs(d.shadow, prepared.rows, d.seconds_per_row)
        differs += not np.array_equal(costs, server)
        best = brute_force(costs, prepared.pieces.sizes, d.capacity)
        out = d.dispatch(prepared)
        assert out.model_cost == pytest.approx(best, rel=1e-12)
        assert flow_cost(costs, prepared.pieces.sizes, out.flow) == pytest.approx(best, rel=1e-12)
        checked += best > 0
    assert checked >= 5 and differs >= 5  # the homes changed the costs, the caches the choices


@pytest.mark.parametrize("policy", ["esd", "laia", "random"])
def test_the_model_with_homes_bounds_the_link_time_of_what_moves(tiny_schema, policy):
    """A pull or push of a row by rank j away from its home h takes T[j] + T[h] of link time
    (none at home); the linear model charges a row once per piece that misses it, so what the
    step moves never costs more than the pieces' costs on the ranks they went to."""
    d = _dispatcher(tiny_schema, policy=policy)
    t = d.seconds_per_row
    for batch in _batches(tiny_schema, 8):
        prepared = d.prepare(batch)
        costs = piece_costs(d.shadow, prepared.rows, t, d.homes())
        out = d.dispatch(prepared)
        home = d.homes()
        moved = 0.0
        for j in range(WORLD):
            for kind in ("pulls", "pushes"):
                h = home[getattr(out.transfers, kind)[j]]
                moved += float(np.where(h != j, t[j] + t[h], 0.0).sum())
        assert moved <= costs[out.flow > 0].sum() + 1e-9
