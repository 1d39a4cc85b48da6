"""The batch stream of the ranks of a job: equal batch counts, global batches of consecutive rows
(W ranks at B read one process's batches at W*B), one elastic position, exact resume."""

from __future__ import annotations

import pytest
import torch

from readers.dataset import ParquetBatchDataset
from readers.ranks import RankBatchDataset, RankLoader
from readers.source import DatasetSource, ReaderConfig, plan_splits
from recpipe.errors import DataError

BATCH = 16


def _config(**kw):
    base = {"batch_size": BATCH, "shuffle": True, "seed": 3, "shuffle_buffer": 12}
    base.update(kw)
    return ReaderConfig(**base)


def _single_stream(root, schema, config, epoch=0):
    """The library's one-process stream, whole batches only."""
    ds = ParquetBatchDataset(str(root), schema=schema, config=config)
    ds.set_epoch(epoch)
    return [b for b in ds if b.batch_size == config.batch_size]


def _ranks(root, schema, world, config, **kw):
    return [
        RankBatchDataset(str(root), schema=schema, config=config, rank=r, world_size=world, **kw)
        for r in range(world)
    ]


def _rows(batches) -> torch.Tensor:
    """(rows, 2 dense + session) of batches in order: which rows, in which order."""
    return torch.cat(
        [torch.cat([b.dense, b.session_ids.to(b.dense.dtype)[:, None]], 1) for b in batches]
    )


def _same_rows(got, want) -> bool:
    """The same rows in the same order (NaN equal to NaN)."""
    a, b = _rows(got), _rows(want)
    return (
        a.shape == b.shape
        and bool(torch.equal(a.isnan(), b.isnan()))
        and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
    )


def _same(got, want) -> bool:
    return len(got) == len(want) and all(a.equals(b) for a, b in zip(got, want, strict=True))


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
    total = sum(s.num_rows for s in splits)
    for world in (1, 2, 3, 4):
        ranks = _ranks(ten_groups, tiny_schema, world, config)
        per_rank = [list(ds) for ds in ranks]
        n = total // (world * BATCH)
        assert [len(b) for b in per_rank] == [n] * world
        assert all(b.batch_size == BATCH for batches in per_rank for b in batches)
        # step t's global batch is W*B consecutive rows: the single reader's batches tW..tW+W-1
        for r in range(world):
            assert _same(per_rank[r], single[r : world * n : world])
        assert ranks[0].remainder_rows == total - world * n * BATCH < world * BATCH
        # iterating moved every rank to the next epoch, whose stream is reshuffled
        assert all(ds.epoch == 1 for ds in ranks)


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_at_b_read_the_batches_of_one_process_at_w_times_b(ten_groups, tiny_schema, shuffle):
    """`--nproc W --batch-size B` reads exactly the global batches of `--batch-size W*B`."""
    for world in (2, 4):
        one = list(RankBatchDataset(str(ten_groups), schema=tiny_schema,
                                    config=_config(batch_size=world * 4, shuffle=shuffle)))  # fmt: skip
        ranks = [list(ds) for ds in _ranks(ten_groups, tiny_schema, world,
                                            _config(batch_size=4, shuffle=shuffle))]  # fmt: skip
        assert len(one) == len(ranks[0]) > 3
        for t, whole in enumerate(one):
            assert _same_rows([ranks[r][t] for r in range(world)], [whole])


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_rank_is_the_library_stream(ten_groups, tiny_schema, shuffle):
    """Rank 0 of 1 yields ParquetBatchDataset's batches (0 workers), the tail included with
    drop_remainder=False and dropped as with last_batch="drop" otherwise; later epochs too."""
    for last_batch, drop in (("partial", False), ("drop", True)):
        config = _config(batch_size=12, shuffle=shuffle, last_batch=last_batch)
        want = ParquetBatchDataset(str(ten_groups), schema=tiny_schema, config=config)
        ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config,
                              drop_remainder=drop)  # fmt: skip
        for _ in range(2):  # epochs 0 and 1
            expected = list(want)
            assert expected[-1].batch_size != 12 or drop  # the tail is short
            assert len(ds) == len(expected) and _same(list(ds), expected)


def test_the_evaluation_stream_delivers_every_row(ten_groups, tiny_schema):
    """Every rank of a W-rank job evaluates the same whole batches: rank 0 of 1 at the global
    batch size, the last partial batch included."""
    config = _config(batch_size=3 * BATCH, shuffle=False)
    ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config,
                          drop_remainder=False)  # fmt: skip
    total = sum(s.num_rows for s in ds.source.splits)
    assert total % (3 * BATCH)  # there is a partial batch
    batches = list(ds)
    assert sum(b.batch_size for b in batches) == total and ds.remainder_rows == 0
    assert len(batches) == len(ds) == -(-total // (3 * BATCH))
    with pytest.raises(DataError, match=r"`drop_remainder=False` needs world_size=1, got 2"):
        RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config, rank=0,
                         world_size=2, drop_remainder=False)  # fmt: skip


def test_a_rank_reads_only_the_row_groups_its_parts_touch(ten_groups, tiny_schema, monkeypatch):
    """Unshuffled, every row group is a window: rank r reads the ones holding its rows."""
    read: list[int] = []
    original = DatasetSource.read_split

    def spy(self, split, **kw):
        read.append(split.index)
        return original(self, split, **kw)

    monkeypatch.setattr(DatasetSource, "read_split", spy)
    config = _config(shuffle=False, read_ahead=0)
    world = 4
    for rank in range(world):
        ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config, rank=rank,
                              world_size=world)  # fmt: skip
        starts, at = [], 0
        for split in ds.source.splits:
            starts.append((at, at + split.num_rows, split.index))
            at += split.num_rows
        rows = [(t * world + rank) * BATCH for t in range(len(ds))]
        touched = {i for a, b, i in starts for r in rows if a < r + BATCH and r < b}
        read.clear()
        assert len(list(ds)) > 1
        assert set(read) == touched and len(read) == len(touched)
        assert len(touched) < len(ds.source.splits)


def test_resume_at_the_same_world_size_continues_exactly(ten_groups, tiny_schema):
    config = _config()
    whole = [list(ds) for ds in _ranks(ten_groups, tiny_schema, 2, config)]
    first = _ranks(ten_groups, tiny_schema, 2, config)
    seen = [[b for _, b in zip(range(2), ds, strict=False)] for ds in first]
    state = first[0].state_dict()
    assert state == first[1].state_dict()  # one state for every rank
    assert state["sample_in_epoch"] == 2 * 2 * BATCH and state["global_batch_size"] == 2 * BATCH
    again = _ranks(ten_groups, tiny_schema, 2, config)
    for ds in again:
        ds.load_state_dict(state)
    for r, ds in enumerate(again):
        rest = list(ds)
        assert _same(seen[r] + rest, whole[r])


def test_a_position_is_elastic_across_ranks_at_the_same_global_batch(ten_groups, tiny_schema):
    """Saved at 2 ranks of B/2, resumed at 1 rank of B and at 4 of B/4 (and back): the rest
    of the epoch is the uninterrupted one-process run's, row for row."""
    whole = list(RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config()))
    two = _ranks(ten_groups, tiny_schema, 2, _config(batch_size=BATCH // 2))
    for ds in two:
        assert len([b for _, b in zip(range(3), ds, strict=False)]) == 3
    state = two[0].state_dict()
    one = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config())
    one.load_state_dict(state)
    assert len(one) == len(whole) - 3 and _same(list(one), whole[3:])
    four = _ranks(ten_groups, tiny_schema, 4, _config(batch_size=BATCH // 4))
    for ds in four:
        ds.load_state_dict(state)
    parts = [list(ds) for ds in four]
    for t, want in enumerate(whole[3:]):
        assert _same_rows([parts[r][t] for r in range(4)], [want])
    # one process's position resumes at 2 ranks too
    back = _ranks(ten_groups, tiny_schema, 2, _config(batch_size=BATCH // 2))
    for ds in back:
        ds.load_state_dict(state)
        assert ds.state_dict() == state


def test_another_global_batch_size_goes_on_from_the_same_row(ten_groups, tiny_schema):
    """3 steps of 2 x 8 rows (48 rows), then steps of 3 x 8: rows 48.. of the stream, which
    one process at 24 reads from its third batch on."""
    two = _ranks(ten_groups, tiny_schema, 2, _config(batch_size=8))
    for ds in two:
        assert len([b for _, b in zip(range(3), ds, strict=False)]) == 3
    state = two[0].state_dict()
    assert state["sample_in_epoch"] == 48
    three = _ranks(ten_groups, tiny_schema, 3, _config(batch_size=8))
    for ds in three:
        ds.load_state_dict(state)
    at_24 = list(
        RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config(batch_size=24))
    )
    parts = [list(ds) for ds in three]
    assert len(parts[0]) == len(at_24) - 2
    for t, want in enumerate(at_24[2:]):
        assert _same_rows([parts[r][t] for r in range(3)], [want])


def test_a_position_at_the_end_of_an_epoch_starts_the_next(ten_groups, tiny_schema):
    ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config())
    steps = len(ds)
    for _ in ds:
        state = ds.state_dict()  # after the epoch's last batch
    assert (state["epoch"], state["sample_in_epoch"]) == (0, steps * BATCH)
    again = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config())
    again.load_state_dict(state)
    assert again.epoch == 1 and again.origin == 0
    ds.set_epoch(1)
    assert _same(list(again), list(ds))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_workers_keep_the_order_and_resume_exactly(ten_groups, tiny_schema, num_workers):
    """The same batches in the same order for 0, 1 and 2 workers; a loader stopped after 2
    batches and resumed with workers goes on with the uninterrupted run's batches."""
    config = _config(read_ahead=0)
    want = list(_ranks(ten_groups, tiny_schema, 2, config)[1])

    def loader() -> RankLoader:
        ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=config, rank=1,
                              world_size=2)  # fmt: skip
        return RankLoader(ds, num_workers=num_workers)

    assert _same(list(loader()), want)
    first = loader()
    got = []
    for batch in first:
        got.append(batch)
        if len(got) == 2:
            break
    state = first.state_dict()
    assert state["sample_in_epoch"] == 2 * 2 * BATCH
    second = loader()
    second.load_state_dict(state)
    got += list(second)
    assert _same(got, want)
    assert second.epoch == 1


def test_refusals(ten_groups, tiny_schema, make_dataset):
    with pytest.raises(DataError, match="`on_error` must be 'raise'"):
        RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config(on_error="skip"))
    with pytest.raises(DataError, match=r"`rank` must be in \[0, world_size=2\), got 2"):
        RankBatchDataset(str(ten_groups), schema=tiny_schema, rank=2, world_size=2)
    ds = RankBatchDataset(str(ten_groups), schema=tiny_schema, config=_config())
    state = ds.state_dict()
    for change, match in (
        ({"seed": 4}, r"saved with `seed` = 4, this reader has 3"),
        ({"shuffle": False}, r"saved with `shuffle` = False, this reader has True"),
        ({"shuffle_buffer": 7}, r"`shuffle_buffer` = 7"),
        ({"rows": 5}, r"saved with rows in the epoch \(another dataset or part\) = 5"),
        ({"sample_in_epoch": 10**6}, r"at row 1,000,000 of epoch 0, which has \d+ rows"),
        ({"sample_in_epoch": -1}, "invalid `sample_in_epoch`"),
        ({"extra": 1}, "a stream position has"),
    ):
        with pytest.raises(DataError, match=match) as info:
            ds.load_state_dict({**state, **change})
        assert "\n" not in str(info.value)  # one line
    unshuffled = RankBatchDataset(str(ten_groups), schema=tiny_schema,
                                  config=_config(shuffle=False, seed=9))  # fmt: skip
    unshuffled.load_state_dict({**state, "shuffle": False})  # the seed does not matter
    with pytest.raises(DataError, match=r"version 1 .* start the run afresh"):
        ds.load_state_dict({"version": 1, "kind": "ranks", "epoch": 0, "delivered": 1,
                            "batch_size": 16, "layout": None})  # fmt: skip
    with pytest.raises(DataError, match="not a stream position"):
        ds.load_state_dict({"version": 1, "epoch": 0})
    other = make_dataset(num_sessions=40, files=1, row_group_rows=25, name="other")
    with pytest.raises(DataError, match="another stream"):
        RankBatchDataset(str(other), schema=tiny_schema, config=_config()).load_state_dict(state)
