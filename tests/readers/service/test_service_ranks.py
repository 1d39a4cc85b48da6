"""The ranks of a multi-rank job through the reader service (one client per rank): each rank
gets exactly the batches of the in-process rank reader, in order, and resumes from the same
state (saved at any world size and batch size, by either reader)."""

from __future__ import annotations

import re

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


def _in_process(
    dataset, tiny_schema, world, *, holdout=None, state=None, batch=BATCH, **kw
) -> list[list]:
    root, _ = dataset
    splits = DatasetSource(str(root), schema=tiny_schema).splits
    if holdout is not None:
        splits = holdout.select(splits, session_key=tiny_schema.session_key)
    config = ReaderConfig(batch_size=batch, shuffle=True, seed=SEED, read_ahead=0)
    out = []
    for rank in range(world):
        ds = RankBatchDataset(str(root), schema=tiny_schema, config=config, rank=rank,
                              world_size=world, splits=splits, **kw)  # fmt: skip
        if state is not None:
            ds.load_state_dict(state)
        out.append(list(ds))
    return out


def _client(server, rank, world, *, batch=BATCH, **kw) -> ServiceRankDataset:
    address = "{}:{}".format(*server.address)
    return ServiceRankDataset(address, rank=rank, world_size=world, batch_size=batch,
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
    """Two steps at 2 ranks through the service, then: the rest at 2 ranks, and the rest of
    the epoch from the same row in global batches of 3 ranks, through the service and
    in-process alike."""
    server = start_server(_producer(dataset))
    whole = _in_process(dataset, tiny_schema, 2)
    states = []
    for rank in range(2):
        client = _client(server, rank, 2)
        for k, batch in zip(range(2), client, strict=False):
            assert batch.equals(whole[rank][k])
        states.append(client.state_dict())
    assert states[0] == states[1]  # one state for every rank
    assert states[0]["sample_in_epoch"] == 2 * 2 * BATCH
    assert states[0]["global_batch_size"] == 2 * BATCH and states[0]["rows"] > 0
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


def test_a_position_moves_between_the_service_and_in_process_at_any_world_size(
    dataset, tiny_schema, start_server
):
    """3 steps of 2 ranks x B in-process, resumed through the service by one rank of 2B; 2
    steps of that, resumed in-process by 2 ranks of B: every step is the uninterrupted one
    process run's global batch (2B consecutive rows), row for row."""
    server = start_server(_producer(dataset, batch_size=2 * BATCH))  # one rank of 2B
    whole = _in_process(dataset, tiny_schema, 1, batch=2 * BATCH)[0]
    root, _ = dataset
    config = ReaderConfig(batch_size=BATCH, shuffle=True, seed=SEED, read_ahead=0)
    ranks = [RankBatchDataset(str(root), schema=tiny_schema, config=config, rank=r,
                              world_size=2) for r in range(2)]  # fmt: skip
    for ds in ranks:
        assert len([b for _, b in zip(range(3), ds, strict=False)]) == 3
    in_process_state = ranks[0].state_dict()
    one = _client(server, 0, 1, batch=2 * BATCH)
    one.load_state_dict(in_process_state)
    got = [b for _, b in zip(range(2), one, strict=False)]
    assert _same(got, whole[3:5])
    service_state = one.state_dict()
    assert service_state == {**in_process_state, "sample_in_epoch": 5 * 2 * BATCH}
    for rank, ds in enumerate(ranks):
        ds.load_state_dict(service_state)
        rest = list(ds)
        assert len(rest) == len(whole) - 5
        for t, batch in enumerate(rest):  # rank r's part: rows [r*B, (r+1)*B) of step t
            assert batch.session_ids.equal(whole[5 + t].session_ids[rank * BATCH :][:BATCH])


def test_the_evaluation_stream_through_the_service(dataset, tiny_schema, start_server):
    """Rank 0 of 1 at the global batch size, the remainder delivered: every held-out row, the
    in-process batches (the server makes B per rank for training; this client asks 3B)."""
    server = start_server(_producer(dataset))
    part = Holdout(0.3, seed=1, part="held_out")
    want = _in_process(dataset, tiny_schema, 1, holdout=part, batch=3 * BATCH,
                       drop_remainder=False)[0]  # fmt: skip
    client = _client(server, 0, 1, batch=3 * BATCH, holdout=part, drop_remainder=False)
    got = list(client)
    assert _same(got, want) and got[-1].batch_size < 3 * BATCH
    with pytest.raises(DataError, match="`drop_remainder=False` needs world_size=1"):
        _client(server, 0, 2, drop_remainder=False)
    with pytest.raises(ServiceError, match="expects batches of 48 rows"):  # training: refused
        list(_client(server, 0, 1, batch=3 * BATCH, holdout=part))


def test_refusals(dataset, start_server):
    synthetic = start_server(SyntheticProducer(4, batch_size=BATCH))
    with pytest.raises(ServiceError, match="cannot serve the ranks of a job"):
        list(_client(synthetic, 0, 2))
    server = start_server(_producer(dataset))
    client = _client(server, 0, 2)
    next(iter(client))
    state = client.state_dict()
    other = _client(server, 0, 2)
    other.load_state_dict({**state, "seed": SEED + 1})  # the client does not know the stream
    with pytest.raises(ServiceError, match=r"another stream: saved with `seed` = 4, this reader"):
        list(other)
    with pytest.raises(DataError, match="another stream"):  # this one does
        client.load_state_dict({**state, "seed": SEED + 1})
    # a job that expects another shuffle than the server's is refused before any batch
    for expect, match in (
        (
            {"shuffle": False},
            "reads with shuffle=True, this job asks for "
            "shuffle=False: start `recpipe serve` with the job's "
            "`--shuffle/--no-shuffle`",
        ),
        ({"seed": SEED + 1}, "reads with seed=3, this job asks for seed=4"),
    ):
        with pytest.raises(DataError, match=re.escape(match)):
            next(iter(_client(server, 0, 2, **expect)))
    assert next(iter(_client(server, 0, 2, shuffle=True, seed=SEED))).batch_size == BATCH
    with pytest.raises(DataError, match=r"`rank` must lie in \[0, `world_size`=2\)"):
        _client(server, 2, 2)
