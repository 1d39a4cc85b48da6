"""Splits, session-packed batches, shuffling, resume positions and bad input of readers.source."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from readers.source import (
    DatasetSource,
    ReaderConfig,
    SourcePosition,
    discover_files,
    plan_splits,
)
from recpipe.errors import CorruptInputError, DataError
from tests.common.tables import tables_equal


def _stream(source, splits, **kw):
    return list(source.iter_tables(splits, **kw))


def _sessions_contiguous(sid: np.ndarray) -> bool:
    """Each session id occupies one run of rows."""
    starts = np.concatenate(([True], sid[1:] != sid[:-1]))
    return len(np.unique(sid)) == int(starts.sum())


def test_discover_files_dirs_globs_partitions(make_dataset, tiny_schema):
    root = make_dataset(files=3, partitions=True)
    files = discover_files(root)
    assert [f.name for f in files] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    assert discover_files(str(root / "dt=*" / "*.parquet")) == files
    assert discover_files([files[1], files[0], files[1]]) == files[:2]
    source = DatasetSource(root, schema=tiny_schema, config=ReaderConfig(batch_size=8))
    assert source.splits[0].partition == (("dt", "2024-01-01-00"),)
    with pytest.raises(DataError, match="does not exist"):
        discover_files(root / "nope")
    with pytest.raises(DataError, match="matches no Parquet file"):
        discover_files(str(root / "zz*"))


def test_splits_are_row_groups(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=50, files=2, row_group_rows=30)
    source = DatasetSource(root, schema=tiny_schema)
    groups = sum(pq.ParquetFile(f).num_row_groups for f in source.files)
    assert len(source.splits) == groups > 2
    assert [s.index for s in source.splits] == list(range(groups))
    assert source.num_rows == sum(pq.ParquetFile(f).metadata.num_rows for f in source.files)
    assert all(s.compressed_bytes > 0 for s in source.splits)


@pytest.mark.parametrize("last_batch", ["partial", "drop"])
def test_unshuffled_stream_keeps_dataset_order(make_dataset, tiny_schema, last_batch):
    root = make_dataset(num_sessions=40)
    cfg = ReaderConfig(batch_size=16, last_batch=last_batch)
    source = DatasetSource(root, schema=tiny_schema, config=cfg)
    out = _stream(source, source.splits)
    got = pa.concat_tables([t for t, _ in out]).column("session_id").to_numpy()
    want = np.concatenate([pq.read_table(f).column("session_id").to_numpy() for f in source.files])
    sizes = [t.num_rows for t, _ in out]
    assert all(s == 16 for s in sizes[:-1])
    if last_batch == "drop":
        assert sizes[-1] == 16
        np.testing.assert_array_equal(got, want[: len(got)])
        assert len(want) - len(got) < 16
    else:
        np.testing.assert_array_equal(got, want)
        assert out[-1][1] == SourcePosition(len(source.splits), 0)
    assert _stream(source, source.splits, start=out[-1][1]) == []


def test_shuffle_moves_whole_sessions_only(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=80, row_group_rows=30)
    cfg = ReaderConfig(batch_size=32, shuffle=True, seed=3, shuffle_buffer=10)
    source = DatasetSource(root, schema=tiny_schema, config=cfg)
    splits = plan_splits(source.splits, config=cfg, epoch=0)
    table = pa.concat_tables([t for t, _ in _stream(source, splits)])
    reference = pa.concat_tables([pq.read_table(f) for f in source.files])
    sid = table.column("session_id").to_numpy()
    assert sorted(sid.tolist()) == sorted(reference.column("session_id").to_numpy().tolist())
    assert _sessions_contiguous(sid)
    assert not np.array_equal(sid, reference.column("session_id").to_numpy())

    # rows of a session keep their order
    def by_session(t):
        out = {}
        for s, item in zip(t.column("session_id").to_pylist(), t.column("item_id").to_pylist()):
            out.setdefault(s, []).append(item)
        return out

    assert by_session(table) == by_session(reference)
    # deterministic for (seed, epoch); another epoch gives another order
    again = pa.concat_tables([t for t, _ in _stream(source, splits)])
    assert tables_equal(again, table)
    splits1 = plan_splits(source.splits, config=cfg, epoch=1)
    other = pa.concat_tables([t for t, _ in _stream(source, splits1, epoch=1)])
    assert not np.array_equal(other.column("session_id").to_numpy(), sid)


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_plan_splits_partitions_exactly(make_dataset, tiny_schema, world_size, num_workers):
    root = make_dataset(num_sessions=80, row_group_rows=20)
    cfg = ReaderConfig(shuffle=True, seed=1)
    source = DatasetSource(root, schema=tiny_schema, config=cfg)
    seen = []
    for rank in range(world_size):
        for worker in range(num_workers):
            seen += plan_splits(
                source.splits, config=cfg, epoch=2, rank=rank, world_size=world_size,
                worker_id=worker, num_workers=num_workers,
            )  # fmt: skip
    assert sorted(s.index for s in seen) == list(range(len(source.splits)))
    with pytest.raises(DataError, match="`rank`"):
        plan_splits(source.splits, config=cfg, rank=2, world_size=2)


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_from_every_position(make_dataset, tiny_schema, shuffle):
    root = make_dataset(num_sessions=50, row_group_rows=25)
    cfg = ReaderConfig(batch_size=24, shuffle=shuffle, seed=5, shuffle_buffer=7)
    source = DatasetSource(root, schema=tiny_schema, config=cfg)
    splits = plan_splits(source.splits, config=cfg, epoch=0)
    full = _stream(source, splits)
    for k, (_, pos) in enumerate(full):
        rest = _stream(source, splits, start=pos)
        assert len(rest) == len(full) - k - 1
        for (a, _), (b, _) in zip(rest, full[k + 1 :]):
            assert tables_equal(a, b)


def test_config_validation():
    with pytest.raises(DataError, match="`batch_size`"):
        ReaderConfig(batch_size=0)
    with pytest.raises(DataError, match="`last_batch`"):
        ReaderConfig(last_batch="keep")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="`on_error`"):
        ReaderConfig(on_error="ignore")  # type: ignore[arg-type]


def test_missing_column_and_wrong_type_name_file_and_column(tmp_path, tiny_schema, make_table):
    table = make_table(num_sessions=5, seed=0)
    missing = tmp_path / "missing" / "part-00000.parquet"
    missing.parent.mkdir()
    pq.write_table(table.drop_columns(["item_tags"]), missing)
    with pytest.raises(DataError, match=r"part-00000\.parquet: column `item_tags` is missing"):
        DatasetSource(missing.parent, schema=tiny_schema)

    wrong = tmp_path / "wrong" / "part-00000.parquet"
    wrong.parent.mkdir()
    bad = table.set_column(
        table.schema.get_field_index("user_age"), "user_age",
        table.column("user_age").cast(pa.float64()),
    )  # fmt: skip
    pq.write_table(bad, wrong)
    with pytest.raises(DataError, match=r"column `user_age` has type double, expected float"):
        DatasetSource(wrong.parent, schema=tiny_schema)


def test_not_parquet_is_corrupt_or_skipped(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=20)
    (root / "part-00009.parquet").write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(CorruptInputError, match=r"part-00009\.parquet: not a readable Parquet"):
        DatasetSource(root, schema=tiny_schema)
    source = DatasetSource(root, schema=tiny_schema, config=ReaderConfig(on_error="skip"))
    assert [s.path.endswith("part-00009.parquet") for s in source.skipped] == [True]
    rows = sum(t.num_rows for t, _ in source.iter_tables(source.splits))
    assert (
        rows
        == source.num_rows
        == sum(pq.ParquetFile(f).metadata.num_rows for f in source.files[:-1])
    )


def test_corrupt_row_group_names_file_and_column(make_dataset, tiny_schema, corrupt_column):
    root = make_dataset(num_sessions=30, files=1, row_group_rows=1000)
    path = root / "part-00000.parquet"
    corrupt_column(path, "item_tags")
    source = DatasetSource(root, schema=tiny_schema)
    with pytest.raises(
        CorruptInputError, match=r"part-00000\.parquet: row group 0 column `item_tags`"
    ):
        list(source.iter_tables(source.splits))
    skipping = DatasetSource(root, schema=tiny_schema, config=ReaderConfig(on_error="skip"))
    assert list(skipping.iter_tables(skipping.splits)) == []
    assert [(s.row_group, s.rows) for s in skipping.skipped] == [(0, skipping.splits[0].num_rows)]


def test_null_session_or_label_names_file_row_and_column_or_is_skipped(
    tmp_path, tiny_schema, make_table
):
    table = make_table(num_sessions=5, seed=0)
    for column in ("session_id", "label"):
        values = table.column(column).to_pylist()
        values[3] = None
        bad = table.set_column(
            table.schema.get_field_index(column), table.schema.field(column),
            pa.array(values, type=table.schema.field(column).type),
        )  # fmt: skip
        path = tmp_path / column / "part-00000.parquet"
        path.parent.mkdir()
        pq.write_table(bad, path)
        source = DatasetSource(path.parent, schema=tiny_schema)
        with pytest.raises(
            DataError, match=rf"part-00000\.parquet: row group 0 row 3: `{column}` is null"
        ):
            list(source.iter_tables(source.splits))
        config = ReaderConfig(on_error="skip")
        skipping = DatasetSource(path.parent, schema=tiny_schema, config=config)
        assert list(skipping.iter_tables(skipping.splits)) == []
        assert [(s.row_group, s.rows) for s in skipping.skipped] == [(0, table.num_rows)]
