"""``recpipe serve --dispatch``: rank clients of the reader service get exactly the micro-batches
the in-process rank readers cut with the same policy (reader threads and reader processes)."""

from __future__ import annotations

import argparse
import io

import pytest

from readers.dispatch.cut import rank_cut
from readers.ranks import RankBatchDataset
from readers.service import DatasetProducer, ReaderServer, ServiceConfig
from readers.service.client import ServiceRankDataset
from readers.source import ReaderConfig
from recpipe.errors import DataError

BATCH, SEED, WORLD = 8, 3, 2


@pytest.fixture
def dataset(make_dataset, tiny_schema, tmp_path):
    root = make_dataset(num_sessions=60, files=2, row_group_rows=25)
    schema = tmp_path / "tiny.toml"
    schema.write_text(tiny_schema.to_toml())
    return root, str(schema)


def _cut(schema):
    return rank_cut("esd", schema=schema, alpha=0.5, max_piece_rows=3, cache_rows=(16,),
                    bandwidths=(1.0, 10.0))  # fmt: skip


@pytest.mark.parametrize("readers", [0, 1])
def test_rank_clients_get_the_in_process_dispatch(dataset, tiny_schema, readers):
    root, schema_file = dataset
    config = ReaderConfig(batch_size=BATCH, shuffle=True, seed=SEED, read_ahead=0)
    want = [
        list(RankBatchDataset(str(root), schema=tiny_schema, config=config, rank=r,
                              world_size=WORLD, cut=_cut(tiny_schema)))
        for r in range(WORLD)
    ]  # fmt: skip
    contiguous = [
        list(RankBatchDataset(str(root), schema=tiny_schema, config=config, rank=r,
                              world_size=WORLD))
        for r in range(WORLD)
    ]  # fmt: skip
    assert any(not a.equals(b) for a, b in zip(want[0], contiguous[0], strict=True))
    producer = DatasetProducer(str(root), batch_size=BATCH, shuffle=True, seed=SEED,
                               schema=schema_file, warmup_batches=0, read_ahead=0,
                               cut=_cut(tiny_schema))  # fmt: skip
    options = ServiceConfig(readers=readers, report_every_s=0, heartbeat_s=0.5)
    server = ReaderServer(producer, config=options, log=io.StringIO()).start()
    try:
        address = "{}:{}".format(*server.address)
        for _ in range(2):  # a second job: the cut starts afresh with each client
            for rank in range(WORLD):
                client = ServiceRankDataset(address, rank=rank, world_size=WORLD,
                                            batch_size=BATCH, read_timeout_s=60.0)  # fmt: skip
                got = list(client)
                assert len(got) == len(want[rank]) >= 3
                assert all(a.equals(b) for a, b in zip(got, want[rank], strict=True))
    finally:
        server.close()


def test_serve_options_make_the_cut(dataset):
    from readers.dispatch import DispatchCut
    from readers.service.cli import _dispatch_cut, register_cli

    root, schema_file = dataset
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["serve", str(root), "--schema", schema_file, "--dispatch", "laia",
                              "--alpha", "0.25", "--cache-rows", "64"])  # fmt: skip
    cut = _dispatch_cut(args)
    assert isinstance(cut, DispatchCut)
    assert (cut.config.policy, cut.config.alpha) == ("laia", 0.25)
    assert _dispatch_cut(parser.parse_args(["serve", str(root)])) is None  # contiguous
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", str(root), "--dispatch", "nearest"])


def test_serve_prices_the_trainers_caches(dataset, capsys):
    from readers.service.cli import _dispatch_cut, register_cli

    root, schema_file = dataset
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    base = ["serve", str(root), "--schema", schema_file, "--dispatch", "esd"]
    cut = _dispatch_cut(
        parser.parse_args([*base, "--cache-rows", "512", "--bandwidths", "1e9,1e10"])
    )
    assert (cut.config.cache_rows, cut.config.bandwidths) == ((512,), (1e9, 1e10))
    with pytest.raises(DataError, match="without `--cache-rows`"):  # no cache priced by default
        _dispatch_cut(parser.parse_args(base))
    random = ["serve", str(root), "--schema", schema_file, "--dispatch", "random"]
    assert _dispatch_cut(parser.parse_args(random)).config.bandwidths == (1e9,)
    for bad in (["--cache-rows", "-1"], ["--cache-rows", "x"], ["--bandwidths", "1e9,-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, *bad])
        assert bad[0] in capsys.readouterr().err
