"""The service over a real (hand-made) clustered dataset: exactly what the in-process reader yields."""

from __future__ import annotations

import io

import pytest

from readers.dataset import iter_batches
from readers.service import DatasetProducer, ReaderServer, ServiceClient, ServiceConfig
from readers.source import ReaderConfig

PREPROCESS = """
[[preprocess]]
transform = "FillMissing"
features = ["user_age"]

[[preprocess]]
transform = "HashModulo"
features = ["user_items", "item_id"]
params = { modulus = 97 }

[[preprocess]]
transform = "Truncate"
features = ["user_items"]
params = { max_len = 3 }
"""


@pytest.mark.parametrize(("dedup", "read_ahead"), [(True, 0), (False, 0), (True, 2)])
def test_service_serves_the_reader_pipeline_exactly(
    make_dataset, tiny_schema, tmp_path, dedup: bool, read_ahead: int
) -> None:
    dataset = make_dataset(num_sessions=40, files=2, row_group_rows=30)
    schema_path = tmp_path / "tiny.toml"
    schema_path.write_text(tiny_schema.to_toml())
    preprocess = tmp_path / "preprocess.toml"
    preprocess.write_text(PREPROCESS)
    producer = DatasetProducer(
        str(dataset),
        batch_size=16,
        dedup=dedup,
        preprocess=str(preprocess),
        schema=str(schema_path),
        read_ahead=read_ahead,
    )
    config = ServiceConfig(readers=0, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        host, port = server.address
        for shard in range(2):
            with ServiceClient(
                host, port, shard=shard, num_shards=2, epoch=1, read_timeout_s=60
            ) as client:
                got = list(client)
            expected = list(
                iter_batches(
                    dataset,
                    schema=tiny_schema,
                    config=ReaderConfig(batch_size=16),
                    transforms=str(preprocess),
                    dedup=dedup,
                    rank=shard,
                    world_size=2,
                    epoch=1,
                )
            )
            assert len(got) == len(expected) > 0
            assert all(g.equals(e) for g, e in zip(got, expected))
            assert bool(got[0].ikjts) == dedup


@pytest.mark.slow
def test_a_kept_warm_reader_process_serves_shard_after_shard_exactly(
    make_dataset, tiny_schema, tmp_path
) -> None:
    dataset = make_dataset(num_sessions=40, files=2, row_group_rows=30)
    schema_path = tmp_path / "tiny.toml"
    schema_path.write_text(tiny_schema.to_toml())
    producer = DatasetProducer(str(dataset), batch_size=16, schema=str(schema_path))
    assert producer.warmup_batches > 0  # the reader runs batches before its first client
    config = ServiceConfig(readers=1, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        for shard in (0, 1, 0):
            with ServiceClient(*server.address, shard=shard, num_shards=2, read_timeout_s=60) as c:
                got = list(c)
            expected = list(
                iter_batches(
                    dataset, schema=tiny_schema, config=ReaderConfig(batch_size=16),
                    rank=shard, world_size=2,
                )
            )  # fmt: skip
            assert len(got) == len(expected) > 0
            assert all(g.equals(e) for g, e in zip(got, expected))
            assert server.join_sessions(timeout=60)
        assert server.stats().reader_processes_started == 1


def test_producer_options_are_validated(tmp_path) -> None:
    from recpipe.errors import DataError

    with pytest.raises(DataError, match="`warmup_batches` must be a non-negative integer"):
        DatasetProducer(str(tmp_path), warmup_batches=-1)
    with pytest.raises(DataError, match="`read_ahead` must be a non-negative integer"):
        DatasetProducer(str(tmp_path), read_ahead=-1)
