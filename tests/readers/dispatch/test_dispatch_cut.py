"""Dispatch as a rank cut: every rank exactly its share, every row of the global batch once, the
ranks' copies of the cut in agreement, and the dispatcher's placement used."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest

from readers.dispatch import DispatchConfig
from readers.dispatch.cut import DISPATCH_CHOICES, DispatchCut, rank_cut
from readers.ranks import ContiguousCut, GlobalBatch, RankBatchDataset
from readers.source import ReaderConfig
from recpipe.errors import DataError

WORLD, BATCH, STEPS = 3, 8, 5


def _rank_streams(root, schema, cuts, *, shuffle: bool = True):
    config = ReaderConfig(batch_size=BATCH, shuffle=shuffle, seed=3)
    out = []
    for rank, cut in enumerate(cuts):
        ds = RankBatchDataset(str(root), schema=schema, config=config, rank=rank,
                              world_size=WORLD, cut=cut)  # fmt: skip
        out.append([b for _, b in zip(range(STEPS), ds, strict=False)])
    return out


def _rows(batch):
    """(session id, label, dense values) per row, sorted: what tells rows apart."""
    dense = np.nan_to_num(batch.dense.numpy(), nan=-1.0).tolist()
    return sorted(zip(batch.session_ids.tolist(), batch.labels.tolist(), map(tuple, dense),
                      strict=True))  # fmt: skip


@pytest.mark.parametrize("policy", ["esd", "laia", "random", "round-robin"])
def test_each_rank_gets_its_share_and_the_global_batch_is_kept(make_dataset, tiny_schema, policy):
    root = make_dataset(num_sessions=80, row_group_rows=40)
    plain = _rank_streams(root, tiny_schema, [ContiguousCut()] * WORLD)
    cut = rank_cut(policy, schema=tiny_schema, alpha=0.5, max_piece_rows=3, cache_rows=(16,))
    # every rank its own copy, as every process has
    cuts = [pickle.loads(pickle.dumps(cut)) for _ in range(WORLD)]
    dispatched = _rank_streams(root, tiny_schema, cuts)
    assert len(plain[0]) == STEPS
    for step in range(STEPS):
        assert [len(s[step].labels) for s in dispatched] == [BATCH] * WORLD
        got = [row for s in dispatched for row in _rows(s[step])]
        want = [row for s in plain for row in _rows(s[step])]
        assert sorted(got) == sorted(want)


def test_the_copies_agree_and_follow_the_dispatcher(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=80, row_group_rows=40)
    cut = rank_cut("esd", schema=tiny_schema, alpha=1.0, max_piece_rows=2, cache_rows=(16,),
                   bandwidths=(1.0, 1.0, 10.0))  # fmt: skip
    shared = _rank_streams(root, tiny_schema, [cut] * WORLD)  # one object for all ranks
    copies = _rank_streams(root, tiny_schema, [pickle.loads(pickle.dumps(cut)) for _ in "abc"])
    plain = _rank_streams(root, tiny_schema, [ContiguousCut()] * WORLD)
    moved = 0
    for step in range(STEPS):
        for r in range(WORLD):
            assert _rows(shared[r][step]) == _rows(copies[r][step])
        moved += sum(_rows(copies[r][step]) != _rows(plain[r][step]) for r in range(WORLD))
    assert moved > 0  # the cut is not the contiguous one


def test_the_shadow_continues_only_over_consecutive_steps(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=80, row_group_rows=40)
    table = pq.read_table(sorted(root.glob("*.parquet"))[0])
    parts = tuple(table.slice(r * BATCH, BATCH) for r in range(WORLD))
    cut = DispatchCut(DispatchConfig(cache_rows=(1000,)), schema=tiny_schema)
    first = cut.dispatch(GlobalBatch(0, (0, 1, 2), parts))
    second = cut.dispatch(GlobalBatch(1, (3, 4, 5), parts))  # continues: the caches are warm
    assert first.step == 0 and second.step == 1
    assert sum(p.size for p in second.transfers.pulls) < sum(p.size for p in first.transfers.pulls)
    assert cut.dispatch(GlobalBatch(0, (0, 1, 2), parts)) is first  # the memo
    # the same step and stream batch numbers in another epoch (other rows): dispatched anew
    later = tuple(table.slice((WORLD + r) * BATCH, BATCH) for r in range(WORLD))
    again = cut.dispatch(GlobalBatch(0, (0, 1, 2), later))
    assert again is not first and again.step == 0
    restart = cut.dispatch(GlobalBatch(7, (9, 10, 11), parts))  # a jump: empty caches
    assert restart.step == 0 and restart is not first
    assert [r.tolist() for r in restart.rows] == [r.tolist() for r in first.rows]


def test_bad_choices(tiny_schema):
    assert DISPATCH_CHOICES[0] == "contiguous"
    assert isinstance(rank_cut("contiguous", schema=tiny_schema), ContiguousCut)
    with pytest.raises(DataError, match="`dispatch` must be one of"):
        rank_cut("nearest", schema=tiny_schema)
    with pytest.raises(DataError, match="`alpha` must be in"):
        rank_cut("esd", schema=tiny_schema, alpha=1.5)
    assert np.isclose(rank_cut("esd", schema=tiny_schema, alpha=0.25).config.alpha, 0.25)
