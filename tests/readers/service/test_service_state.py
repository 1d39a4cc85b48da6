"""ServiceDataset's position (epoch, batches consumed): resume without loss or repeat, in-process
and through torchdata's StatefulDataLoader with workers."""

from __future__ import annotations

import io

import pytest

from readers.service import DatasetProducer, ReaderServer, ServiceConfig, ServiceDataset
from recpipe.errors import DataError


@pytest.fixture
def server(make_dataset, tiny_schema, tmp_path):
    dataset = make_dataset(num_sessions=40, files=2, row_group_rows=30)
    schema_path = tmp_path / "tiny.toml"
    schema_path.write_text(tiny_schema.to_toml())
    producer = DatasetProducer(str(dataset), batch_size=8, schema=str(schema_path))
    config = ServiceConfig(readers=0, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as srv:
        yield srv


def _dataset(server, **kw):
    host, port = server.address
    return ServiceDataset(host, port, read_timeout_s=60, **kw)


def _keys(batches):
    return [tuple(b.session_ids.tolist()) + tuple(b.labels.tolist()) for b in batches]


def test_in_process_resume_loses_and_repeats_nothing(server):
    ds = _dataset(server)
    ds.set_epoch(2)
    everything = list(ds)
    assert len(everything) > 4
    assert ds.state_dict() == {
        "version": 1, "epoch": 2, "shard": 0, "num_shards": 1, "batches": len(everything),
        "finished": True,
    }  # fmt: skip
    ds.set_epoch(2)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = ds.state_dict()
    assert (state["epoch"], state["batches"], state["finished"]) == (2, 3, False)
    it.close()
    resumed = _dataset(server)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # before its first batch: the loaded position
    tail = list(resumed)
    assert _keys(head + tail) == _keys(everything)
    done = _dataset(server)
    done.load_state_dict(resumed.state_dict())
    assert list(done) == []  # a finished shard stays finished
    done.set_epoch(3)
    assert len(list(done)) > 0  # until the next epoch


def test_a_state_of_another_layout_is_refused(server):
    ds = _dataset(server, rank=0, world_size=2)
    other = _dataset(server)
    other.load_state_dict(ds.state_dict())
    with pytest.raises(DataError, match="saved by shard 0 of 2, this reader is shard 0 of 1"):
        list(other)
    with pytest.raises(DataError, match="not a ServiceDataset state_dict"):
        other.load_state_dict({"epoch": 0})


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_with_workers_resumes(server):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        return stateful.StatefulDataLoader(_dataset(server), batch_size=None, num_workers=2)

    everything = sorted(_keys(loader()))
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(len(everything) // 2)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    tail = list(again)
    assert sorted(_keys(head + tail)) == everything
