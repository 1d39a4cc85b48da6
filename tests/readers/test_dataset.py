"""DataLoader integration: exactly-once delivery, sharding, resume, pin_memory, bad input."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from readers.convert import BatchConverter
from readers.dataset import ParquetBatchDataset, dataset_schema, iter_batches, make_dataloader
from readers.source import DatasetSource, ReaderConfig, plan_splits
from recpipe.errors import CorruptInputError, DataError

CFG = ReaderConfig(batch_size=16, shuffle=True, seed=11, shuffle_buffer=6)


def _row_keys(batch) -> list[tuple[int, float]]:
    """(session id, item price) per row: unique per row in the hand-made data."""
    return list(zip(batch.session_ids.tolist(), batch.dense[:, 1].tolist()))


def _reference(root) -> Counter:
    files = sorted(root.glob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    return Counter(
        zip(table.column("session_id").to_pylist(), table.column("item_price").to_pylist())
    )


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_row_exactly_once(make_dataset, tiny_schema, num_workers, world_size):
    root = make_dataset(num_sessions=70, row_group_rows=20)
    seen: Counter = Counter()
    batches = 0
    for rank in range(world_size):
        loader = make_dataloader(
            root, schema=tiny_schema, config=CFG, rank=rank, world_size=world_size,
            num_workers=num_workers,
        )  # fmt: skip
        for batch in loader:
            seen.update(_row_keys(batch))
            batches += 1
            assert batch.batch_size <= CFG.batch_size
        assert loader.rows_delivered == sum(seen.values()) or rank > 0
    assert seen == _reference(root)
    assert batches >= 70 * 4 // 16


def test_batches_are_exact_ikjt_vs_kjt(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=40)
    dedup = list(iter_batches(root, schema=tiny_schema, config=CFG))
    plain = list(iter_batches(root, schema=tiny_schema, config=CFG, dedup=False))
    assert len(dedup) == len(plain) > 1
    for a, b in zip(dedup, plain):
        assert set(a.ikjts) == {"user_items+user_sellers", "user_segment"}
        expanded = a.to_plain().kjt
        for key in tiny_schema.sparse_names:
            assert expanded[key].equals(b.kjt[key]), key
        assert torch.equal(a.session_ids, b.session_ids)
        assert torch.equal(a.labels, b.labels)
        assert torch.equal(a.dense.nan_to_num(-1), b.dense.nan_to_num(-1))
    factors = [g.dedup_factor for batch in dedup for g in batch.ikjts.values()]
    assert min(factors) >= 1.0 and max(factors) > 1.5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_loses_and_repeats_nothing(make_dataset, tiny_schema, num_workers):
    root = make_dataset(num_sessions=70, row_group_rows=20)
    loader = make_dataloader(root, schema=tiny_schema, config=CFG, num_workers=num_workers)
    first: Counter = Counter()
    for step, batch in enumerate(loader):
        first.update(_row_keys(batch))
        if step == 4:
            break
    state = json.loads(json.dumps(loader.state_dict()))  # plain JSON, checkpoint-friendly
    assert state["epoch"] == 0 and state["num_workers"] == max(num_workers, 1)

    resumed = make_dataloader(root, schema=tiny_schema, config=CFG, num_workers=num_workers)
    resumed.load_state_dict(state)
    rest: Counter = Counter()
    for batch in resumed:
        rest.update(_row_keys(batch))
    assert not set(first) & set(rest)
    assert first + rest == _reference(root)
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["positions"] == {}


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_loop_left_early_goes_on_where_it_stopped(make_dataset, tiny_schema, read_ahead):
    root = make_dataset(num_sessions=40)
    config = dataclasses.replace(CFG, read_ahead=read_ahead)  # read-ahead threads in workers
    loader = make_dataloader(root, schema=tiny_schema, config=config, num_workers=2)
    seen: Counter = Counter()
    for _ in range(3):
        for step, batch in enumerate(loader):
            seen.update(_row_keys(batch))
            if step == 1:
                break
    for batch in loader:
        seen.update(_row_keys(batch))
    assert seen == _reference(root)
    assert loader.state_dict()["epoch"] == 1


def test_in_process_dataset_state_and_epochs(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=50)
    ds = ParquetBatchDataset(root, schema=tiny_schema, config=CFG)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = ds.state_dict()
    tail = list(it)
    assert ds.epoch == 1  # a finished pass moves on to the next epoch

    again = ParquetBatchDataset(root, schema=tiny_schema, config=CFG)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(tail)
    assert all(a.equals(b) for a, b in zip(resumed, tail) if not torch.isnan(a.dense).any())
    assert [_row_keys(b) for b in resumed] == [_row_keys(b) for b in tail]
    epoch0 = [k for b in head + tail for k in _row_keys(b)]
    epoch1 = [k for b in ds for k in _row_keys(b)]
    assert Counter(epoch0) == Counter(epoch1) and epoch0 != epoch1  # reshuffled


def test_state_layout_mismatch_is_refused(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=20)
    loader = make_dataloader(root, schema=tiny_schema, config=CFG, num_workers=0)
    next(iter(loader))
    state = loader.state_dict()
    other = make_dataloader(root, schema=tiny_schema, config=CFG, num_workers=2)
    with pytest.raises(DataError, match=r"saved with num_workers=1 .* num_workers=2"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="not a reader state_dict"):
        other.load_state_dict({"epoch": 0})


def test_iter_batches_matches_dataset_and_resumes(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=40)
    ds = ParquetBatchDataset(root, schema=tiny_schema, config=CFG)
    want = list(ds)
    got = list(iter_batches(root, schema=tiny_schema, config=CFG))
    assert [_row_keys(b) for b in got] == [_row_keys(b) for b in want]
    pairs = list(iter_batches(root, schema=tiny_schema, config=CFG, with_positions=True))
    state = {
        "version": 1, "epoch": 0, "rank": 0, "world_size": 1, "num_workers": 1,
        "positions": {"0": [pairs[1][1].split_pos, pairs[1][1].row]},
    }  # fmt: skip
    rest = list(iter_batches(root, schema=tiny_schema, config=CFG, start_state=state))
    assert [_row_keys(b) for b in rest] == [_row_keys(b) for b, _ in pairs[2:]]


def test_pin_memory_dataloader(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=20)
    ds = ParquetBatchDataset(root, schema=tiny_schema, config=CFG)
    plain = list(ds)
    ds.set_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # CPU-only torch: no memory to pin
        pinned = list(DataLoader(ds, batch_size=None, pin_memory=True))
    assert len(pinned) == len(plain)
    assert [_row_keys(b) for b in pinned] == [_row_keys(b) for b in plain]
    loader = make_dataloader(root, schema=tiny_schema, config=CFG, pin_memory=True)
    assert sum(b.batch_size for b in loader) == sum(b.batch_size for b in plain)


def test_preprocessing_in_workers(make_dataset, tiny_schema, tmp_path):
    root = make_dataset(num_sessions=40)
    config = [
        {"transform": "HashModulo", "features": ["item_id"], "params": {"modulus": 7}},
        {"transform": "Truncate", "features": ["user_items"], "params": {"max_len": 2}},
    ]
    loader = make_dataloader(root, schema=tiny_schema, config=CFG, transforms=config, num_workers=2)
    for batch in loader:
        assert int(batch.kjt["item_id"].values().max()) < 7
        assert int(batch.ikjts["user_items+user_sellers"]["user_items"].lengths().max()) <= 2
    # the same pipeline given as Transform objects or as a TOML file
    from readers.pipeline import transform_from_config

    objects = [transform_from_config(e) for e in config]
    toml = tmp_path / "pre.toml"
    toml.write_text(
        '[[preprocess]]\ntransform = "HashModulo"\nfeatures = ["item_id"]\nparams = { modulus = 7 }\n'
        '[[preprocess]]\ntransform = "Truncate"\nfeatures = ["user_items"]\nparams = { max_len = 2 }\n'
    )
    want = list(iter_batches(root, schema=tiny_schema, config=CFG, transforms=config))
    for transforms in (objects, toml, str(toml)):
        got = list(iter_batches(root, schema=tiny_schema, config=CFG, transforms=transforms))
        assert all(a.to_plain().kjt.equals(b.to_plain().kjt) for a, b in zip(got, want))


def test_skip_bad_file_and_corrupt_split_counted(make_dataset, tiny_schema, corrupt_column):
    root = make_dataset(num_sessions=30, files=2, row_group_rows=1000)
    good = pq.read_metadata(root / "part-00000.parquet").num_rows
    (root / "part-00007.parquet").write_bytes(b"PAR1 garbage")
    corrupt_column(root / "part-00001.parquet", "user_sellers")
    with pytest.raises(CorruptInputError, match=r"part-00007\.parquet"):
        make_dataloader(root, schema=tiny_schema, config=CFG)
    cfg = ReaderConfig(batch_size=16, on_error="skip")
    loader = make_dataloader(root, schema=tiny_schema, config=cfg, num_workers=2)
    assert [s.path.endswith("part-00007.parquet") for s in loader.dataset.skipped] == [True]
    rows = sum(b.batch_size for b in loader)
    assert rows == loader.rows_delivered == good
    assert loader.skipped_splits == 1
    strict = make_dataloader(root / "part-00001.parquet", schema=tiny_schema, config=CFG)
    with pytest.raises(
        CorruptInputError, match=r"part-00001\.parquet: row group 0 column `user_sellers`"
    ):
        list(strict)


def test_dataset_schema_from_manifest(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=5)
    (root / "_manifest.json").write_text(json.dumps({"schema": tiny_schema.to_toml()}))
    assert dataset_schema(root) == tiny_schema
    (root / "_manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"_manifest\.json: cannot read the `schema`"):
        dataset_schema(root)


@pytest.mark.slow
def test_clustered_dataset_from_etl_is_exact(request):
    pytest.importorskip("etl.build", reason="etl.build (the ETL) is not built yet")
    clustered_dataset = request.getfixturevalue("clustered_dataset")
    schema = dataset_schema(clustered_dataset)
    cfg = ReaderConfig(batch_size=4096)
    source = DatasetSource(clustered_dataset, schema=schema, config=cfg)
    dedup, plain = BatchConverter(schema), BatchConverter(schema, dedup=False)
    total = 0
    for table, _ in source.iter_tables(plan_splits(source.splits, config=cfg)):
        a, b = dedup(table), plain(table)
        expanded = a.to_plain().kjt
        for key in schema.sparse_names:
            assert expanded[key].equals(b.kjt[key]), key
        total += table.num_rows
    assert total == source.num_rows > 0
