"""The dispatcher: exact shares, the optimum at alpha = 1, the cost model against the transfers
it predicts, every policy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from readers.dispatch import DispatchConfig, Dispatcher, TableMap, pack_costs
from readers.dispatch.dispatcher import POLICIES
from recpipe.errors import DataError
from tests.common.data import session_batch

WORLD, MICRO = 3, 4


def _dispatcher(schema, **config) -> Dispatcher:
    config = {
        "pack_size": 2,
        "bandwidths": (1.0, 3.0, 10.0),
        "row_bytes": 1,
        "cache_rows": (12,),
        **config,
    }
    return Dispatcher(
        DispatchConfig(**config),
        world_size=WORLD,
        micro_batch=MICRO,
        tables=TableMap.per_feature(schema.sparse_names),
    )


def _batches(schema, n: int):
    return [
        session_batch(schema, WORLD * MICRO, seed=s, vocab=12, mean_session_len=3.0)
        for s in range(n)
    ]


@pytest.mark.parametrize(
    "config",
    [{"policy": p} for p in POLICIES]
    + [{"alpha": 0.0}, {"alpha": 0.5}, {"pack_size": 1}, {"pack_size": 4}],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_every_rank_gets_exactly_its_share_and_every_row_goes_once(tiny_schema, config):
    d = _dispatcher(tiny_schema, **config)
    for step, batch in enumerate(_batches(tiny_schema, 6)):
        out = d.dispatch(batch)
        assert out.step == step
        assert [r.size for r in out.rows] == [MICRO] * WORLD
        assert np.sort(np.concatenate(out.rows)).tolist() == list(range(WORLD * MICRO))
        for r in out.rows:  # whole packs, ascending rows
            assert (np.diff(r) > 0).all()


def test_alpha_1_is_the_brute_force_optimum_of_the_cost_model(tiny_schema):
    d = _dispatcher(tiny_schema, alpha=1.0)
    checked = 0
    for batch in _batches(tiny_schema, 8):
        packed = d.pack(batch)
        costs = pack_costs(d.shadow, packed.rows, d.seconds_per_row)
        best = min(
            costs[np.arange(6), list(a)].sum()
            for a in itertools.product(range(WORLD), repeat=6)
            if np.bincount(a, minlength=WORLD).tolist() == [2, 2, 2]
        )
        out = d.dispatch(packed)
        assert out.model_cost == pytest.approx(best, rel=1e-12)
        checked += best > 0
    assert checked >= 4  # the caches made the choices matter


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_cost_model_bounds_what_the_step_moves(tiny_schema, policy):
    """The linear model charges a row once per pack that misses it; the step pulls it once per
    rank and pushes it once: what moves never costs more than the model says."""
    d = _dispatcher(tiny_schema, policy=policy)
    t = d.seconds_per_row
    for batch in _batches(tiny_schema, 8):
        out = d.dispatch(batch)
        moved = out.transfers.seconds(t)
        assert moved["pulls"].sum() + moved["pushes"].sum() <= out.model_cost + 1e-9


def test_reads_are_the_rows_of_each_ranks_packs(tiny_schema):
    d = _dispatcher(tiny_schema, policy="random", seed=3)
    for batch in _batches(tiny_schema, 3):
        packed = d.pack(batch)
        out = d.dispatch(packed)
        for j in range(WORLD):
            mine = np.isin(packed.rows.pack, np.flatnonzero(out.pack_rank == j))
            assert out.transfers.reads[j].tolist() == np.unique(packed.rows.row[mine]).tolist()


def test_random_policy_is_seeded(tiny_schema):
    runs = []
    for _ in range(2):
        d = _dispatcher(tiny_schema, policy="random", seed=5)
        runs.append([d.dispatch(b).pack_rank.tolist() for b in _batches(tiny_schema, 4)])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1


def test_bandwidth_pulls_misses_to_the_fast_rank(tiny_schema):
    """Cold caches: every pack misses everything, so ESD puts the packs reading most rows on
    the fastest rank; round-robin does not look."""
    d = _dispatcher(tiny_schema, bandwidths=(1.0, 1.0, 100.0))
    batch = _batches(tiny_schema, 1)[0]
    packed = d.pack(batch)
    rows_per_pack = np.bincount(packed.rows.pack, minlength=6)
    out = d.dispatch(packed)
    fast = rows_per_pack[out.pack_rank == 2].sum()
    assert fast == np.sort(rows_per_pack)[-2:].sum()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"policy": "fastest"}, "`policy`"),
        ({"alpha": -0.1}, "`alpha`"),
        ({"pack_size": 0}, "`pack_size`"),
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
    with pytest.raises(DataError, match="must divide the 6 rows per rank"):
        Dispatcher(DispatchConfig(pack_size=4), world_size=3, micro_batch=6, tables=tables)
    d = _dispatcher(tiny_schema)
    with pytest.raises(DataError, match="W \\* m = 3 \\* 4 = 12"):
        d.dispatch(session_batch(tiny_schema, 10))
