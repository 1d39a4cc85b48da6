"""The ranks of a multi-rank job through the reader service (one client per rank): each rank
gets exactly the batches of the in-process rank reader, in order, and resumes from the same
state (saved at any world size, by either reader)."""

from __future__ import annotations

import pytest

from readers.holdout import Holdout
from readers.ranks import RankBatchDataset
from readers.service import DatasetProducer, ServiceError, SyntheticProducer
from readers.service.client import ServiceRankDataset
from readers.source import DatasetSource, ReaderConfig
from recpipe.errors import DataError

BATCH, SEED = 16, 3
TIMEOUT = 60.0


@pytest.fixture
def dataset(make_dataset, tiny_schema, tmp_path):
    """About 14 row groups of uneven sizes, and the schema as a file for the server."""
    root = make_dataset(num_sessions=70, files=2, row_group_rows=25)
    schema = tmp_path / "tiny.toml"
    schema.write_text(tiny_schema.to_toml())
    return root, str(schema)


def _producer(dataset, **kw) -> DatasetProducer:
    root, schema = dataset
    options = {"batch_size": BATCH, "shuffle": True, "seed": SEED, "schema": schema,
               "warmup_batches": 0, "read_ahead": 0, **kw}  # fmt: skip
    return DatasetProducer(str(root), **options)


def _in_process(dataset, tiny_schema, world, *, holdout=None, state=None) -> list[list]:
    root, _ = dataset
    splits = DatasetSource(str(root), schema=tiny_schema).splits
    if holdout is not None:
        splits = holdout.select(splits, session_key=tiny_schema.session_key)
    config = ReaderConfig(batch_size=BATCH, shuffle=True, seed=SEED, read_ahead=0)
    out = []
    for rank in range(world):
        ds = RankBatchDataset(str(root), schema=tiny_schema, config=config, rank=rank,
                              world_size=world, splits=splits)  # fmt: skip
        if state is not None:
            ds.load_state_dict(state)
        out.append(list(ds))
    return out


def _client(server, rank, world, **kw) -> ServiceRankDataset:
    address = "{}:{}".format(*server.address)
    return ServiceRankDataset(address, rank=rank, world_size=world, batch_size=BATCH,
                              read_timeout_s=TIMEOUT, **kw)  # fmt: skip


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(a.equals(b) for a, b in zip(got, want, strict=True))


def test_each_rank_gets_its_in_process_batches_in_order(dataset, tiny_schema, start_server):
    """Two reader processes per client: the session relays their steps in order."""
    server = start_server(_producer(dataset), readers=2)
    for world in (2, 3):
        want = _in_process(dataset, tiny_schema, world)
        assert len({len(w) for w in want}) == 1 and len(want[0]) >= 3
        for rank in range(world):
            client = _client(server, rank, world)
            got = list(client)
            assert _same(got, want[rank]), (world, rank)
            assert client.epoch == 1 and client.delivered == 0  # the epoch is done
        in_process = RankBatchDataset(str(dataset[0]), schema=tiny_schema, world_size=world,
                                      config=ReaderConfig(batch_size=BATCH, shuffle=True,
                                                          seed=SEED))  # fmt: skip
        assert client.remainder_rows == in_process.layout.remainder_rows


def test_the_training_part_and_a_second_epoch(dataset, tiny_schema, start_server):
    server = start_server(_producer(dataset))
    part = Holdout(0.2, seed=1)
    root, _ = dataset
    train = part.select(DatasetSource(str(root), schema=tiny_schema).splits,
                        session_key=tiny_schema.session_key)  # fmt: skip
    config = ReaderConfig(batch_size=BATCH, shuffle=True, seed=SEED, read_ahead=0)
    for rank in range(2):
        client = _client(server, rank, 2, holdout=part, splits=len(train))
        ds = RankBatchDataset(str(root), schema=tiny_schema, config=config, rank=rank,
                              world_size=2, splits=train)  # fmt: skip
        first, second = list(client), list(client)  # epoch 0, then epoch 1
        assert _same(first, list(ds)) and _same(second, list(ds))
        assert not _same(first, second)  # epoch 1 is shuffled differently
    with pytest.raises(DataError, match=r"serves \d+ row groups"):
        list(_client(server, 0, 2, holdout=part, splits=len(train) + 1))


def test_resume_at_the_same_and_another_world_size(dataset, tiny_schema, start_server):
    """Two steps at 2 ranks through the service, then: the rest at 2 ranks, and the batches
    no rank delivered re-dealt to 3 ranks, through the service and in-process alike."""
    server = start_server(_producer(dataset))
    whole = _in_process(dataset, tiny_schema, 2)
    states = []
    for rank in range(2):
        client = _client(server, rank, 2)
        for k, batch in zip(range(2), client, strict=False):
            assert batch.equals(whole[rank][k])
        states.append(client.state_dict())
    assert states[0] == states[1]  # one state for every rank
    assert states[0]["delivered"] == 2 and states[0]["layout"]["world_size"] == 2
    for rank in range(2):
        client = _client(server, rank, 2)
        client.load_state_dict(states[0])
        assert _same(list(client), whole[rank][2:])
    redealt = _in_process(dataset, tiny_schema, 3, state=states[0])
    for rank in range(3):
        client = _client(server, rank, 3)
        client.load_state_dict(states[0])
        got = list(client)
        assert got and _same(got, redealt[rank])


def test_refusals(dataset, start_server):
    synthetic = start_server(SyntheticProducer(4, batch_size=BATCH))
    with pytest.raises(ServiceError, match="cannot serve the ranks of a job"):
        list(_client(synthetic, 0, 2))
    server = start_server(_producer(dataset))
    client = _client(server, 0, 2)
    with pytest.raises(DataError, match="saved with batch_size=8"):
        client.load_state_dict({**client.state_dict(), "batch_size": 8})
    with pytest.raises(DataError, match=r"`rank` must lie in \[0, `world_size`=2\)"):
        _client(server, 2, 2)
