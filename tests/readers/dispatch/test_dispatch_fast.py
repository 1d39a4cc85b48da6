"""The dispatcher's fast paths (Numba kernels, sort-based dedup, the (table, id) order key)
against the plain NumPy forms they replaced, and the decisions of a fixed replay against those
the plain implementation made."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch import DispatchConfig, Dispatcher, TableMap
from readers.dispatch.cost import piece_costs, piece_hits
from readers.dispatch.keys import PieceRows, RowIndex, distinct
from readers.dispatch.shadow import FRESH, CacheShadow
from tests.common.data import session_batch


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**62), 2**62), max_size=60))
def test_distinct_is_numpy_unique(values):
    values = np.array(values, dtype=np.int64)
    assert distinct(values).tolist() == np.unique(values).tolist()


def _plain_costs(shadow, rows, seconds):
    """The cost model in plain NumPy (the form the kernel replaced)."""
    fresh = shadow.state[:, rows.row] == FRESH
    holder = shadow.dirty_on[rows.row]
    push = np.where(holder >= 0, seconds[np.maximum(holder, 0)], 0.0)
    per_pair = np.where(fresh, 0.0, seconds[:, None] + push[None, :])
    out = np.empty((rows.num_pieces, shadow.world_size))
    for j in range(shadow.world_size):
        out[:, j] = np.bincount(rows.piece, weights=per_pair[j], minlength=rows.num_pieces)
    return out, np.stack(
        [np.bincount(rows.piece, weights=f, minlength=rows.num_pieces) for f in fresh], axis=1
    )


def test_cost_kernels_equal_the_plain_sums():
    rng = np.random.default_rng(0)
    index = RowIndex(["a", "b"])
    index.rows(0, np.arange(300))
    shadow = CacheShadow(world_size=4, capacity=60, index=index)
    seconds = np.array([0.5, 1.0, 3.0, 7.0])
    for _ in range(30):
        reads = [rng.choice(300, size=rng.integers(0, 50), replace=False) for _ in range(4)]
        shadow.step([np.sort(r) for r in reads])
        piece = np.sort(rng.integers(0, 20, 200))
        pairs = distinct((piece << 20) | rng.integers(0, 300, 200))
        rows = PieceRows(pairs >> 20, pairs & ((1 << 20) - 1), 20)
        costs, hits = _plain_costs(shadow, rows, seconds)
        assert np.array_equal(piece_costs(shadow, rows, seconds), costs)  # bit for bit
        assert np.array_equal(piece_hits(shadow, rows), hits)


def test_the_order_key_falls_back_to_table_and_id():
    """Ids outside the key's range (negative here) switch the recency order to a lexsort on
    (table, id): the same order."""
    index = RowIndex(["a", "b"])
    index.rows(1, np.array([5, 3]))
    index.rows(0, np.array([9]))
    assert index.order_key is not None
    shadow = CacheShadow(world_size=1, capacity=10, index=index)
    assert shadow._in_key_order(np.array([0, 1, 2])).tolist() == [2, 1, 0]
    index.rows(0, np.array([-4]))
    assert index.order_key is None
    assert shadow._in_key_order(np.array([0, 1, 2, 3])).tolist() == [3, 2, 1, 0]


# sha256 of every policy's flows, row shares and transfers over the replay below. Recorded with
# the plain implementation (NumPy shadow, np.unique, bincount costs) before the fast paths, as
# "ce87c842..." ; recorded again when the regret became mean minus smallest cost (instead of
# second-smallest minus smallest), which reorders esd's pieces on purpose (the fast paths made
# the old digest with the old regret; pieces by session id leave these run-sessions' decisions)
REPLAY_DIGEST = "0f295f5f673fc87f602b7d6862c0f030413a7ac96be42400557b2e62fb2046b2"
# the plain implementation's digest, with ESD's regret (``regret="second"``)
PLAIN_DIGEST_SECOND_REGRET = "ce87c842c842d83e35d1ecdf0505d67680a1d55fd39c0dcdd9321bf7d075ee0e"


def replay_digest(schema, *, regret: str = "mean") -> tuple[str, dict[str, int]]:
    """Every policy (and alpha 0.5, 0) over 8 ranks, fixed batches: a digest of the decisions,
    and how many split pieces, pushes and evict pushes the replay had."""
    world, micro = 8, 16
    digest = hashlib.sha256()
    seen = {"split": 0, "pushes": 0, "evict_pushes": 0}
    configs = [
        {"policy": "esd", "alpha": 1.0},
        {"policy": "esd", "alpha": 0.5},
        {"policy": "esd", "alpha": 0.0},
        {"policy": "laia"},
        {"policy": "random"},
        {"policy": "round-robin"},
    ]
    batches = [
        session_batch(schema, world * micro, seed=s, vocab=200, mean_session_len=3.0)
        for s in range(8)
    ]
    for config in configs:
        d = Dispatcher(
            DispatchConfig(
                max_piece_rows=4,
                bandwidths=(10.0,) * 4 + (1.0,) * 4,
                row_bytes=1,
                cache_rows=(40,),
                regret=regret,
                **config,
            ),
            world_size=world,
            micro_batch=micro,
            tables=TableMap.per_feature(schema.sparse_names),
        )
        for batch in batches:
            out = d.dispatch(batch)
            digest.update(out.flow.tobytes())
            digest.update(np.float64(out.model_cost).tobytes())
            seen["split"] += out.split_pieces
            for kind in ("pushes", "evict_pushes"):
                seen[kind] += sum(r.size for r in getattr(out.transfers, kind))
            for rows in out.rows:
                digest.update(rows.astype(np.int64).tobytes() + b"|")
            for kind in ("reads", "pulls", "pushes", "shared", "evictions", "evict_pushes"):
                for rows in getattr(out.transfers, kind):
                    digest.update(np.asarray(rows, dtype=np.int64).tobytes() + b"|")
    return digest.hexdigest(), seen


def test_the_fast_paths_make_the_plain_decisions(tiny_schema):
    digest, seen = replay_digest(tiny_schema)
    assert min(seen.values()) > 0, seen  # the replay splits pieces, pushes and evicts
    assert digest == REPLAY_DIGEST


def test_esds_own_regret_makes_the_plain_implementations_decisions(tiny_schema):
    assert replay_digest(tiny_schema, regret="second")[0] == PLAIN_DIGEST_SECOND_REGRET
