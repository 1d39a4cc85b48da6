"""Held-out data through the reader service: the training and held-out parts are disjoint, make
up the dataset together, and are divided exactly as the in-process trainer divides them."""

from __future__ import annotations

import collections
import io
import json
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest

from readers.dataset import iter_batches
from readers.holdout import Holdout, holdout_splits
from readers.service import (
    DatasetProducer,
    ReaderServer,
    ServiceClient,
    ServiceConfig,
    ServiceError,
    ServiceStream,
    SyntheticProducer,
)
from readers.source import DatasetSource, ReaderConfig
from recpipe.errors import DataError

TIMEOUT = 60.0
FRACTION, SEED = 0.25, 7


@pytest.fixture
def served(make_dataset, tiny_schema, tmp_path) -> Iterator[tuple[object, ReaderServer]]:
    """A tiny dataset (about 16 row groups) served in-process with batches of 16 rows."""
    dataset = make_dataset(num_sessions=80, files=2, row_group_rows=20)
    schema_path = tmp_path / "tiny.toml"
    schema_path.write_text(tiny_schema.to_toml())
    producer = DatasetProducer(str(dataset), batch_size=16, schema=str(schema_path))
    config = ServiceConfig(readers=0, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        yield dataset, server


def _read(server: ReaderServer, **options: object) -> tuple[list, dict]:
    client = ServiceClient(*server.address, read_timeout_s=TIMEOUT, **options)
    with client.connect():
        return list(client), client.welcome


def _sessions(batches: list) -> collections.Counter:
    return collections.Counter(int(s) for b in batches for s in b.session_ids.tolist())


def test_the_parts_are_disjoint_and_make_up_the_dataset(served, tiny_schema) -> None:
    dataset, server = served
    train, held = Holdout(FRACTION, SEED, "train"), Holdout(FRACTION, SEED, "held_out")
    everything, _ = _read(server)
    got = {}
    for part in (train, held):
        got[part.part] = []
        for shard in range(2):
            batches, _ = _read(server, holdout=part, shard=shard, num_shards=2)
            expected = list(
                iter_batches(
                    dataset, schema=tiny_schema, config=ReaderConfig(batch_size=16),
                    rank=shard, world_size=2, holdout=part,
                )
            )  # fmt: skip
            assert len(batches) == len(expected) > 0
            assert all(g.equals(e) for g, e in zip(batches, expected))
            got[part.part] += batches
    rows_train, rows_held = _sessions(got["train"]), _sessions(got["held_out"])
    assert set(rows_train).isdisjoint(rows_held)  # no session on both sides
    assert rows_train + rows_held == _sessions(everything)  # every row, exactly once

    # the same row groups as the in-process trainer's division of the dataset
    splits = DatasetSource(dataset, schema=tiny_schema).splits
    train_splits, held_splits = holdout_splits(
        splits, session_key="session_id", fraction=FRACTION, seed=SEED
    )
    held_sessions = {
        int(s)
        for split in held_splits
        for s in split.kept(
            pq.ParquetFile(split.path).read_row_group(split.row_group), session_key="session_id"
        )["session_id"].to_pylist()
    }
    assert set(rows_held) == held_sessions
    assert _read(server, holdout=held)[1]["splits"] == len(held_splits)
    assert _read(server, holdout=train)[1]["splits"] == len(train_splits)
    assert len(held_splits) >= 2 and len(train_splits) >= 2
    parts = [s.part for s in server.stats().sessions]
    assert parts.count("train") == 3 and parts.count("held_out") == 3


def test_a_batch_size_mismatch_is_refused(served) -> None:
    _, server = served
    with pytest.raises(
        ServiceError, match="expects batches of 8 rows but this server makes batches of 16"
    ):
        _read(server, batch_size=8)
    batches, welcome = _read(server, batch_size=16)
    assert welcome["batch_size"] == 16 and batches[0].batch_size == 16


def test_a_stream_checks_the_server_serves_the_trainers_dataset(served) -> None:
    _, server = served
    address = "{}:{}".format(*server.address)
    held = Holdout(FRACTION, SEED, "held_out")
    stream = ServiceStream(address, holdout=held, batch_size=16, splits=999)
    with pytest.raises(
        DataError, match=r"serves \d+ row groups as the `held_out` part, the trainer"
    ):
        list(stream.read_epoch(0))
    n_held = _read(server, holdout=held)[1]["splits"]
    stream = ServiceStream(address, holdout=held, batch_size=16, splits=n_held)
    assert _sessions(list(stream.read_epoch(0))) == _sessions(_read(server, holdout=held)[0])


def test_a_producer_without_row_groups_refuses_a_part() -> None:
    config = ServiceConfig(readers=0, report_every_s=0)
    producer = SyntheticProducer(num_batches=2, batch_size=8)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        with pytest.raises(
            ServiceError, match=r"SyntheticProducer\) has no row groups to hold out"
        ):
            _read(server, holdout=Holdout(0.1))
        assert len(_read(server, batch_size=8)[0]) == 2


def test_the_trainer_trains_and_evaluates_on_the_servers_two_parts(served, tiny_schema) -> None:
    from trainer.models import ModelConfig
    from trainer.train import TrainConfig, train

    dataset, server = served
    (dataset / "_manifest.json").write_text(json.dumps({"schema": tiny_schema.to_toml()}))
    model = ModelConfig(embedding_dim=4, num_embeddings=1000, bottom_mlp=(8,), top_mlp=(8,))
    config = TrainConfig(
        str(dataset), service="{}:{}".format(*server.address), batch_size=16, epochs=1,
        eval_fraction=FRACTION, seed=SEED, model=model, shuffle=False,  # as the server reads
    )  # fmt: skip
    result = train(config, progress=False)
    assert server.join_sessions(timeout=TIMEOUT)
    by_part = {s.part: s for s in server.stats().sessions}
    assert set(by_part) == {"train", "held_out"}
    assert result.final_eval.samples == by_part["held_out"].samples > 0
    assert result.samples == by_part["train"].samples > 0
    splits = DatasetSource(dataset, schema=tiny_schema).splits
    # sessions are held out, so a row group may hold rows of both parts; every row is in one
    assert 0 < result.eval_splits <= len(splits) and 0 < result.train_splits <= len(splits)
    # training reads whole global batches: the epoch's last rows short of one are the remainder
    left = sum(s.num_rows for s in splits) - result.samples - result.final_eval.samples
    assert 0 <= left < config.batch_size
    with pytest.raises(ServiceError, match="expects batches of 32 rows"):
        train(TrainConfig(**{**config.__dict__, "batch_size": 32}), progress=False)
