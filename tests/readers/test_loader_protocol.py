"""Loaders behave like loaders: len() equals the batches delivered, torchdata's StatefulDataLoader
resumes exactly (in-process and with workers), and the position is plain checkpointable data."""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from readers.dataset import ParquetBatchDataset, iter_batches, make_dataloader
from readers.source import ReaderConfig
from recpipe.errors import DataError
from tests.common.data import session_table

CFG = ReaderConfig(batch_size=16, shuffle=True, seed=11, shuffle_buffer=6)


def _row_keys(batch) -> list[tuple[int, float]]:
    """(session id, item price) per row: unique per row in the hand-made data."""
    return list(zip(batch.session_ids.tolist(), batch.dense[:, 1].tolist()))


def _reference(root) -> Counter:
    table = pa.concat_tables([pq.read_table(f) for f in sorted(root.glob("*.parquet"))])
    return Counter(
        zip(table.column("session_id").to_pylist(), table.column("item_price").to_pylist())
    )


@pytest.fixture
def uneven(make_dataset):
    """Three files of row groups of uneven sizes (cut at session boundaries, ~13-25 rows)."""
    return make_dataset(num_sessions=75, files=3, row_group_rows=13)


LAYOUTS = [(1, 1), (1, 3), (2, 2), (3, 1), (2, 4)]  # (world_size, readers per rank)


@pytest.mark.parametrize("batch_size", [7, 64])
@pytest.mark.parametrize("last_batch", ["partial", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_len_is_the_number_of_batches_every_layout_delivers(
    uneven, tiny_schema, batch_size, last_batch, shuffle
):
    """Each reader of each rank is run as a DataLoader worker runs it (``iter_batches`` with
    its ``worker_id``); the counts must equal ``len()`` of that rank for that layout."""
    config = ReaderConfig(
        batch_size=batch_size, shuffle=shuffle, seed=3, shuffle_buffer=5, last_batch=last_batch
    )
    for (world_size, readers), epoch in itertools.product(LAYOUTS, (0, 1)):
        rows = 0
        for rank in range(world_size):
            ds = ParquetBatchDataset(
                uneven, schema=tiny_schema, config=config, rank=rank, world_size=world_size,
                num_workers=readers,
            )  # fmt: skip
            ds.set_epoch(epoch)
            delivered = 0
            for worker in range(readers):
                for batch in iter_batches(
                    uneven, schema=tiny_schema, config=config, rank=rank, world_size=world_size,
                    worker_id=worker, num_workers=readers, epoch=epoch,
                ):  # fmt: skip
                    delivered += 1
                    rows += batch.batch_size
            layout = (world_size, rank, readers, epoch)
            assert len(ds) == ds.num_batches() == delivered, layout
        total = sum(pq.read_metadata(f).num_rows for f in uneven.glob("*.parquet"))
        assert rows == total or last_batch == "drop"


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("last_batch", ["partial", "drop"])
def test_len_of_make_dataloader_matches_its_epochs(uneven, tiny_schema, num_workers, last_batch):
    config = dataclasses.replace(CFG, batch_size=9, last_batch=last_batch)
    loader = make_dataloader(
        uneven, schema=tiny_schema, config=config, num_workers=num_workers, rank=1, world_size=2
    )
    for _ in range(2):  # two epochs: the split deal (hence the count) may change
        expected = len(loader)
        assert sum(1 for _ in loader) == expected > 0


def test_len_of_a_plain_dataloader_with_workers(uneven, tiny_schema):
    ds = ParquetBatchDataset(uneven, schema=tiny_schema, config=CFG, num_workers=2)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    assert len(loader) == len(ds) == sum(1 for _ in loader)  # torch warns (an error here) on more
    # len() counts two readers; read in the consumer's process the dataset refuses, since the
    # count would be wrong (a worker refuses the same way, see the message)
    in_process = DataLoader(ds, batch_size=None, num_workers=0)
    assert len(in_process) == ds.num_batches(num_workers=2)
    with pytest.raises(
        DataError, match=r"counted the batches of 2 reader\(s\), but it is read by 1"
    ):
        list(in_process)
    with pytest.raises(DataError, match="`num_workers` must be a non-negative integer, got -1"):
        ParquetBatchDataset(uneven, schema=tiny_schema, num_workers=-1)


def test_len_with_on_error_skip_is_an_upper_bound(make_dataset, tiny_schema, corrupt_column):
    root = make_dataset(num_sessions=30, files=2, row_group_rows=1000)
    corrupt_column(root / "part-00001.parquet", "user_sellers")
    loader = make_dataloader(
        root, schema=tiny_schema, config=ReaderConfig(batch_size=8, on_error="skip")
    )
    expected = len(loader)
    delivered = sum(1 for _ in loader)
    assert loader.skipped_splits == 1 and delivered < expected


# -- torchdata's StatefulDataLoader ------------------------------------------------------------
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a warning
_torchdata_warning = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def _resume_through_torchdata(root, schema, *, num_workers, stop):
    """Read ``stop`` batches, save the loader's state (through torch.save), resume a new loader."""

    def loader():
        ds = ParquetBatchDataset(root, schema=schema, config=CFG, num_workers=num_workers)
        return stateful_dataloader.StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)

    first = loader()
    head: Counter = Counter()
    it = iter(first)
    for _ in range(stop):
        head.update(_row_keys(next(it)))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    del it, first
    buffer.seek(0)
    resumed = loader()
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    tail: Counter = Counter()
    batches = 0
    for batch in resumed:
        tail.update(_row_keys(batch))
        batches += 1
    return head, tail, batches, len(resumed)


@_torchdata_warning
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_without_loss_or_repeat(uneven, tiny_schema, num_workers):
    total = len(
        ParquetBatchDataset(uneven, schema=tiny_schema, config=CFG, num_workers=num_workers)
    )
    for stop in (1, total // 2, total - 1):
        head, tail, batches, length = _resume_through_torchdata(
            uneven, tiny_schema, num_workers=num_workers, stop=stop
        )
        assert not set(head) & set(tail), stop
        assert head + tail == _reference(uneven), stop
        assert stop + batches == length == total, stop


@_torchdata_warning
def test_stateful_dataloader_worker_that_finished_stays_finished(tmp_path, tiny_schema):
    """Two workers; worker 1's only row group is small, so it ends while worker 0 has many
    batches to go. A state taken then holds worker 1's final state: resuming must not make it
    read its stream again."""
    path = tmp_path / "ds" / "part-00000.parquet"
    path.parent.mkdir()
    parts = [
        session_table(tiny_schema, num_sessions=n, seed=i, first_session=100 * i)
        for i, n in enumerate((12, 1, 12))
    ]
    with pq.ParquetWriter(path, parts[0].schema) as writer:
        for part in parts:  # one row group each: worker 0 reads 0 and 2, worker 1 reads 1
            writer.write_table(part, row_group_size=1 << 20)
    config = ReaderConfig(batch_size=2)

    def loader():
        ds = ParquetBatchDataset(path.parent, schema=tiny_schema, config=config, num_workers=2)
        return stateful_dataloader.StatefulDataLoader(ds, batch_size=None, num_workers=2)

    total = len(loader())
    worker_1 = -(-parts[1].num_rows // 2)
    assert total - 2 * worker_1 > 4  # worker 0 still has batches after worker 1 ended
    first = loader()
    seen: Counter = Counter()
    it = iter(first)
    for _ in range(total - 2):
        seen.update(_row_keys(next(it)))
    state = first.state_dict()
    ended = state["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    assert ended["epoch"] == 0 and ended["positions"] == {"1": [1, 0]}  # past its one split
    again = loader()
    again.load_state_dict(state)
    for batch in again:
        seen.update(_row_keys(batch))
    assert seen == _reference(path.parent)


@_torchdata_warning
def test_worker_state_is_its_own_position(uneven, tiny_schema):
    """What a worker reports: its layout and its position only, also before its first batch."""
    ds = ParquetBatchDataset(uneven, schema=tiny_schema, config=CFG, num_workers=2)
    loader = stateful_dataloader.StatefulDataLoader(ds, batch_size=None, num_workers=2)
    state = loader.state_dict()  # before any batch: the workers' initial states
    workers = state["_snapshot"]["_worker_snapshots"]
    for key, worker in workers.items():
        dataset_state = worker["dataset_state"]
        assert dataset_state["num_workers"] == 2 and dataset_state["positions"] == {}, key
