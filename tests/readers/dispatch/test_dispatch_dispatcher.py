"""The dispatcher: exact shares, whole sessions, the optimum at alpha = 1, the rows each rank
reads against the expanded batch, the cost model against what moves, every policy."""

from __future__ import annotations

import numpy as np
import pytest

from readers.dispatch import DispatchConfig, Dispatcher, TableMap, piece_costs
from readers.dispatch.assign import flow_cost
from readers.dispatch.dispatcher import POLICIES
from recpipe.errors import DataError
from tests.common.data import session_batch
from tests.readers.dispatch.brute import brute_force

WORLD, MICRO = 3, 4


def _dispatcher(schema, *, micro_batch: int = MICRO, **config) -> Dispatcher:
    config = {
        "max_piece_rows": 2,
        "bandwidths": (1.0, 3.0, 10.0),
        "row_bytes": 1,
        "cache_rows": (12,),
        **config,
    }
    return Dispatcher(
        DispatchConfig(**config),
        world_size=WORLD,
        micro_batch=micro_batch,
        tables=TableMap.per_feature(schema.sparse_names),
    )


def _batches(schema, n: int, *, rows: int = WORLD * MICRO, mean: float = 3.0):
    return [session_batch(schema, rows, seed=s, vocab=12, mean_session_len=mean) for s in range(n)]


CONFIGS = [{"policy": p} for p in POLICIES] + [
    {"alpha": 0.0},
    {"alpha": 0.5},
    {"max_piece_rows": 1},
    {"max_piece_rows": 5},
]


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_every_rank_gets_exactly_its_share_and_sessions_stay_whole(tiny_schema, config):
    d = _dispatcher(tiny_schema, **config)
    for step, batch in enumerate(_batches(tiny_schema, 6, mean=4.0)):
        prepared = d.prepare(batch)
        out = d.dispatch(prepared)
        assert out.step == step
        assert [r.size for r in out.rows] == [MICRO] * WORLD
        assert np.sort(np.concatenate(out.rows)).tolist() == list(range(WORLD * MICRO))
        assert out.flow.sum(1).tolist() == prepared.pieces.sizes.tolist()
        assert out.split_pieces <= 2 * (WORLD - 1)
        rank_of_row = np.empty(WORLD * MICRO, dtype=np.int64)
        for j, rows in enumerate(out.rows):
            rank_of_row[rows] = j
        for i in range(prepared.pieces.num_pieces):
            ranks = np.unique(rank_of_row[prepared.pieces.rows_of(i)])
            assert ranks.tolist() == np.flatnonzero(out.flow[i]).tolist()


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_each_rank_reads_the_rows_of_its_samples(tiny_schema, config):
    """Against the expanded batch read row by row: the rows of the samples a rank trains on,
    split pieces included, hot rows left out."""
    d = _dispatcher(tiny_schema, **config)
    d.set_hot(np.array([0, 2]), np.array([3, 5]))  # user_items 3, user_segment 5
    for batch in _batches(tiny_schema, 4, mean=4.0):
        out = d.dispatch(batch)
        plain = batch.to_plain().kjt
        for j, rows in enumerate(out.rows):
            want = set()
            for t, feature in enumerate(d.tables.tables):
                lists = plain[feature].to_dense_list()
                want |= {(t, int(x)) for r in rows for x in lists[r]}
            want -= {(0, 3), (2, 5)}
            tables, ids = d.index.keys(out.transfers.reads[j])
            assert set(zip(tables.tolist(), ids.tolist(), strict=True)) == want


def test_alpha_1_is_the_brute_force_optimum_of_the_cost_model(tiny_schema):
    d = _dispatcher(tiny_schema, alpha=1.0, micro_batch=2)
    checked = 0
    for batch in _batches(tiny_schema, 10, rows=WORLD * 2, mean=2.0):
        prepared = d.prepare(batch)
        costs = piece_costs(d.shadow, prepared.rows, d.seconds_per_row)
        best = brute_force(costs, prepared.pieces.sizes, d.capacity)
        out = d.dispatch(prepared)
        assert out.model_cost == pytest.approx(best, rel=1e-12)
        assert flow_cost(costs, prepared.pieces.sizes, out.flow) == pytest.approx(best, rel=1e-12)
        checked += best > 0
    assert checked >= 5  # the caches made the choices matter


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_cost_model_bounds_what_the_step_moves(tiny_schema, policy):
    """The linear model charges a row once per piece that misses it; the step pulls it once per
    rank and pushes it once: what moves never costs more than the pieces' costs on the ranks
    they went to (a split piece counted whole on each of its ranks)."""
    d = _dispatcher(tiny_schema, policy=policy)
    t = d.seconds_per_row
    for batch in _batches(tiny_schema, 8):
        prepared = d.prepare(batch)
        costs = piece_costs(d.shadow, prepared.rows, t)
        out = d.dispatch(prepared)
        moved = out.transfers.seconds(t)
        assert moved["pulls"].sum() + moved["pushes"].sum() <= costs[out.flow > 0].sum() + 1e-9


def test_hot_rows_cost_nothing_and_leave_the_caches(tiny_schema):
    d = _dispatcher(tiny_schema, cache_rows=(1000,))
    batches = _batches(tiny_schema, 3)
    for batch in batches:
        d.dispatch(batch)
    held = d.shadow.state.copy()
    dirty = d.shadow.dirty_on.copy()
    rows = np.flatnonzero((held > 0).any(0))[:5]
    tables, ids = d.index.keys(rows)
    dropped = d.set_hot(tables, ids)
    for j in range(WORLD):
        assert dropped.evictions[j].tolist() == np.sort(rows[held[j, rows] > 0]).tolist()
        assert dropped.evict_pushes[j].tolist() == np.sort(rows[dirty[rows] == j]).tolist()
    assert (d.shadow.state[:, rows] == 0).all()
    prepared = d.prepare(batches[0])
    out = d.dispatch(prepared)
    for reads in out.transfers.reads:
        assert not np.isin(reads, rows).any()


def test_random_policy_is_seeded(tiny_schema):
    runs = []
    for _ in range(2):
        d = _dispatcher(tiny_schema, policy="random", seed=5)
        runs.append([d.dispatch(b).flow.tolist() for b in _batches(tiny_schema, 4)])
    assert runs[0] == runs[1]
    other = _dispatcher(tiny_schema, policy="random", seed=6)
    assert [other.dispatch(b).flow.tolist() for b in _batches(tiny_schema, 4)] != runs[0]


def test_bandwidth_sends_the_heaviest_sessions_to_the_fast_rank(tiny_schema):
    """Cold caches: every piece misses everything, so ESD puts the pieces reading most rows
    per sample on the fastest rank."""
    d = _dispatcher(tiny_schema, bandwidths=(1.0, 1.0, 100.0), max_piece_rows=1)
    batch = _batches(tiny_schema, 1)[0]
    prepared = d.prepare(batch)
    rows_per_piece = np.bincount(prepared.rows.piece, minlength=prepared.pieces.num_pieces)
    out = d.dispatch(prepared)
    fast = rows_per_piece[out.flow[:, 2] > 0].sum()
    assert fast == np.sort(rows_per_piece)[-MICRO:].sum()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"policy": "fastest"}, "`policy`"),
        ({"alpha": -0.1}, "`alpha`"),
        ({"max_piece_rows": 0}, "`max_piece_rows`"),
        ({"bandwidths": (1.0, 0.0, 2.0)}, "`bandwidths`"),
        ({"cache_rows": (-1,)}, "`cache_rows`"),
    ],
)
def test_bad_config(config, match):
    with pytest.raises(DataError, match=match):
        DispatchConfig(**config)


def test_bad_shapes(tiny_schema):
    tables = TableMap.per_feature(tiny_schema.sparse_names)
    with pytest.raises(DataError, match="`bandwidths` has 2 values for 3 ranks"):
        Dispatcher(
            DispatchConfig(bandwidths=(1.0, 2.0)), world_size=3, micro_batch=16, tables=tables
        )
    with pytest.raises(DataError, match="`index` numbers"):
        from readers.dispatch import RowIndex

        Dispatcher(
            DispatchConfig(), world_size=3, micro_batch=4, tables=tables, index=RowIndex(["x"])
        )
    d = _dispatcher(tiny_schema)
    with pytest.raises(DataError, match="W \\* m = 3 \\* 4 = 12"):
        d.dispatch(session_batch(tiny_schema, 10))


def test_a_session_interleaved_with_others_stays_on_one_rank():
    """A batch in time order: the rows of sessions 0 and 1 alternate. Each session is one
    piece (its user row pulled once, by one rank), not one piece per row."""
    import torch

    from recpipe.batch import Batch
    from recpipe.jagged import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(  # user 10, 20, 10, 20; items 1, 2, 3, 4
        ["user", "item"],
        torch.tensor([10, 20, 10, 20, 1, 2, 3, 4]),
        torch.ones(8, dtype=torch.int64),
    )
    batch = Batch(torch.zeros(4, 1), torch.zeros(4), kjt, session_ids=torch.tensor([0, 1, 0, 1]))
    d = Dispatcher(DispatchConfig(cache_rows=(8,)), world_size=2, micro_batch=2,
                   tables=TableMap.per_feature(["user", "item"]))  # fmt: skip
    out = d.dispatch(batch)
    assert sorted(r.tolist() for r in out.rows) == [[0, 2], [1, 3]]
    assert sorted(r.size for r in out.transfers.pulls) == [3, 3]  # its user once, two items
