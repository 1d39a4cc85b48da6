"""Readers for the ranks of a distributed job: equal batch counts, one global stream, resume."""

from __future__ import annotations

import pytest

from readers.dataset import ParquetBatchDataset
from readers.ranks import RankBatchDataset, RankLoader
from readers.source import ReaderConfig, plan_splits
from recpipe.errors import DataError

BATCH = 16


def _config(**kw):
    base = {"batch_size": BATCH, "shuffle": True, "seed": 3, "shuffle_buffer": 12}
    base.update(kw)
    return ReaderConfig(**base)


def _single_stream(root, schema, config, epoch=0):
    ds = ParquetBatchDataset(str(root), schema=schema, config=config)
    ds.set_epoch(epoch)
    return [b for b in ds if b.batch_size == config.batch_size]


def _ranks(root, schema, world, config, **kw):
    return [
        RankBatchDataset(str(root), schema=schema, config=config, rank=r, world_size=world, **kw)
        for r in range(world)
    ]


@pytest.fixture
def ten_groups(make_dataset):
    """A dataset of 10 row groups of different sizes (one file)."""
    return make_dataset(num_sessions=60, files=1, row_group_rows=25)


def test_round_robin_is_uneven_and_ranks_are_even(ten_groups, tiny_schema):
    config = _config()
    splits = ParquetBatchDataset(str(ten_groups), schema=tiny_schema, config=config).source.splits
    assert len(splits) == 10
    # the problem: dealing row groups round-robin gives ranks different batch counts
    rows = [sum(s.num_rows for s in plan_splits(splits, config=config, rank=r, world_size=3))
            for r in range(3)]  # fmt: skip
    assert len({n // BATCH for n in rows}) > 1
    single = _single_stream(ten_groups, tiny_schema, config)
    for world in (1, 2, 3, 4):
        ranks = _ranks(ten_groups, tiny_schema, world, config)
        per_rank = [list(ds) for ds in ranks]
        n = len(single) // world
        assert [len(b) for b in per_rank] == [n] * world
        assert all(b.batch_size == BATCH for batches in per_rank for b in batches)
        # the ranks' batches are the single reader's first W*n batches, in contiguous ranges
        flat = [b for batches in per_rank for b in batches]
        assert all(a.equals(b) for a, b in zip(flat, single[: world * n], strict=True))
        layout = ranks[0].layout
        total = sum(s.num_rows for s in splits)
        assert layout.remainder_rows == total - world * n * BATCH
        assert layout.remainder_batches == len(single) - world * n
        assert 0 <= layout.remainder_rows < world * BATCH + BATCH
        # iterating moved every rank to the next epoch, whose stream is reshuffled
        assert all(ds.epoch == 1 for ds in ranks)


def test_unshuffled_and_later_epochs_match_the_single_reader(ten_groups, tiny_schema):
    for config, epoch in ((_config(shuffle=False), 0), (_config(), 2)):
        single = _single_stream(ten_groups, tiny_schema, config, epoch)
        ranks = _ranks(ten_groups, tiny_schema, 3, config)
        for ds in ranks:
            ds.set_epoch(epoch)
        flat = [b for ds in ranks for b in ds]
        assert len(flat) == 3 * (len(single) // 3)
        assert all(a.equals(b) for a, b in zip(flat, single, strict=False))


def test_resume_at_the_same_world_size_continues_exactly(ten_groups, tiny_schema):
    config = _config()
    whole = [list(ds) for ds in _ranks(ten_groups, tiny_schema, 2, config)]
    first = _ranks(ten_groups, tiny_schema, 2, config)
    seen = [[b for _, b in zip(range(2), ds, strict=False)] for ds in first]
    state = first[0].state_dict()
    assert state == first[1].state_dict()  # one state for every rank
    again = _ranks(ten_groups, tiny_schema, 2, config)
    for ds in again:
        ds.load_state_dict(state)
    for r, ds in enumerate(again):
        rest = list(ds)
        assert all(a.equals(b) for a, b in zip(seen[r] + rest, whole[r], strict=True))


def test_resume_at_another_world_size_redeals_what_is_left(ten_groups, tiny_schema):
    config = _config()
    single = _single_stream(ten_groups, tiny_schema, config)
    two = _ranks(ten_groups, tiny_schema, 2, config)
    taken = [[k for k, _ in zip(range(3), ds.iter_indexed(), strict=False)] for ds in two]
    for ds in two:
        ds.delivered = 3
    state = two[0].state_dict()
    three = _ranks(ten_groups, tiny_schema, 3, config)
    for ds in three:
        ds.load_state_dict(state)
    layout = three[0].layout
    later = [[k for k, _ in ds.iter_indexed()] for ds in three]
    assert len({len(x) for x in later}) == 1 and len(later[0]) == layout.batches_per_rank
    before = sorted(k for ks in taken for k in ks)
    after = sorted(k for ks in later for k in ks)
    assert not set(before) & set(after)  # nothing delivered twice
    dropped = layout.remainder_batches - two[0].layout.remainder_batches
    assert len(before) + len(after) + dropped == 2 * two[0].layout.batches_per_rank
    assert 0 <= dropped < 3
    # the re-dealt batches are the same batches as the single reader's
    for ds, ks in zip(three, later, strict=True):
        ds.load_state_dict(state)
        for (k, batch), want in zip(ds.iter_indexed(), ks, strict=True):
            assert k == want and batch.equals(single[k])


def test_workers_keep_the_rank_order(ten_groups, tiny_schema):
    config = _config(read_ahead=0)
    ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config, rank=1, world_size=2)
    want = list(_ranks(ten_groups, tiny_schema, 2, config)[1])
    loader = RankLoader(ds, num_workers=2)
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == 2:
            break
    state = loader.state_dict()
    assert state["delivered"] == 2
    ds2 = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config, rank=1, world_size=2)
    loader2 = RankLoader(ds2, num_workers=2)
    loader2.load_state_dict(state)
    got += list(loader2)
    assert len(got) == len(want)
    assert all(a.equals(b) for a, b in zip(got, want, strict=True))
    assert ds2.epoch == 1


def test_bad_arguments(ten_groups, tiny_schema):
    with pytest.raises(DataError, match="`on_error` must be 'raise'"):
        RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config(on_error="skip"))
    with pytest.raises(DataError, match=r"`rank` must be in \[0, world_size=2\), got 2"):
        RankBatchDataset(str(ten_groups), schema=tiny_schema, rank=2, world_size=2)
    ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config())
    with pytest.raises(DataError, match="saved with batch_size=8"):
        ds.load_state_dict({**ds.state_dict(), "batch_size": 8})
    with pytest.raises(DataError, match="not a rank reader state_dict"):
        ds.load_state_dict({"version": 1, "epoch": 0})
