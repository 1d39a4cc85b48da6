"""Held-out sessions by session-id hash: share, disjointness, determinism, reading a part."""

from __future__ import annotations

import collections

import pyarrow.parquet as pq
import pytest

from readers.dataset import ParquetBatchDataset, StatefulLoader, iter_batches
from readers.holdout import Holdout, holdout_splits
from readers.source import DatasetSource, ReaderConfig
from recpipe.errors import DataError
from tests.common.data import session_table, write_clustered


def _dataset(tmp_path, tiny_schema, *, sessions: int, row_group_rows: int):
    path = tmp_path / f"ds{sessions}_{row_group_rows}" / "part-0.parquet"
    table = session_table(tiny_schema, num_sessions=sessions, seed=sessions)
    write_clustered(table, path, row_group_rows=row_group_rows)
    return path.parent, table.num_rows


def _rows_by_session(splits) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for split in splits:
        table = pq.ParquetFile(split.path).read_row_group(split.row_group)
        ids = split.kept(table, session_key="session_id")["session_id"].to_pylist()
        assert len(ids) == split.num_rows
        out.update(ids)
    return out


@pytest.mark.parametrize(
    ("sessions", "row_group_rows", "fraction"),
    [(100, 64, 0.1), (1000, 512, 0.2), (4450, 1 << 16, 0.1), (4450, 1 << 16, 0.3)],
)
def test_the_held_out_share_is_the_fraction_at_any_size(
    tmp_path, tiny_schema, sessions, row_group_rows, fraction
):
    root, rows = _dataset(tmp_path, tiny_schema, sessions=sessions, row_group_rows=row_group_rows)
    splits = DatasetSource(root, schema=tiny_schema).splits
    if row_group_rows == 1 << 16:
        assert len(splits) == 1 and rows >= 20_000  # the small dataset: one row group
    train, held = holdout_splits(splits, session_key="session_id", fraction=fraction, seed=7)
    held_rows, train_rows = _rows_by_session(held), _rows_by_session(train)
    share = sum(held_rows.values()) / rows
    assert abs(share - fraction) <= 0.02, share
    assert set(held_rows).isdisjoint(train_rows)  # whole sessions on one side
    assert sum(held_rows.values()) + sum(train_rows.values()) == rows  # every row once
    again = holdout_splits(splits, session_key="session_id", fraction=fraction, seed=7)
    assert again == (train, held)  # deterministic
    other = holdout_splits(splits, session_key="session_id", fraction=fraction, seed=8)[1]
    assert set(_rows_by_session(other)) != set(held_rows)  # the seed decides


def test_a_part_reads_exactly_its_rows_and_len_counts_its_batches(tmp_path, tiny_schema):
    root, _ = _dataset(tmp_path, tiny_schema, sessions=400, row_group_rows=300)
    splits = DatasetSource(root, schema=tiny_schema).splits
    train, held = holdout_splits(splits, session_key="session_id", fraction=0.25, seed=1)
    for part, want in (("train", train), ("held_out", held)):
        batches = list(
            iter_batches(
                root, schema=tiny_schema, config=ReaderConfig(batch_size=32),
                holdout=Holdout(0.25, seed=1, part=part),
            )
        )  # fmt: skip
        got = collections.Counter(int(s) for b in batches for s in b.session_ids.tolist())
        assert got == _rows_by_session(want)
    dataset = ParquetBatchDataset(root, schema=tiny_schema, config=ReaderConfig(batch_size=32))
    dataset.source.splits = held
    loader = StatefulLoader(dataset)
    delivered = list(loader)
    assert len(delivered) == len(loader) > 0
    assert sum(b.batch_size for b in delivered) == sum(s.num_rows for s in held)


def test_holdout_errors(tmp_path, tiny_schema):
    root, _ = _dataset(tmp_path, tiny_schema, sessions=1, row_group_rows=64)
    splits = DatasetSource(root, schema=tiny_schema).splits
    with pytest.raises(DataError, match="needs at least two sessions, the dataset has 1"):
        holdout_splits(splits, session_key="session_id", fraction=0.1, seed=0)
    with pytest.raises(DataError, match="must be in \\[0, 1\\)"):
        holdout_splits(splits, session_key="session_id", fraction=1.0, seed=0)
    assert holdout_splits(splits, session_key="session_id", fraction=0.0, seed=0) == (splits, [])
