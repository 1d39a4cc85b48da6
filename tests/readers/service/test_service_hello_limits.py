"""Every field of a HELLO is bounded before the server computes anything from it: a client
asking for a world of 10**12 ranks, a layout of 10**12 batches or a field the server does not
know is refused in one ERROR frame, and the next client is served as if nothing happened.

Every socket has a timeout, so a server that builds what it was asked for fails the test
instead of wedging it.
"""

from __future__ import annotations

import re
import socket

import pytest

from readers.service import DatasetProducer
from readers.service.client import ServiceRankDataset
from readers.service.session import MAX_SHARDS, MAX_WORLD_SIZE
from readers.service.wire import HELLO_MAX_BYTES, FrameKind, encode_frame, recv_frame

BATCH = 16
TIMEOUT = 60.0


@pytest.fixture
def server(make_dataset, tiny_schema, tmp_path, start_server):
    root = make_dataset(num_sessions=70, files=2, row_group_rows=25)
    schema = tmp_path / "tiny.toml"
    schema.write_text(tiny_schema.to_toml())
    producer = DatasetProducer(str(root), batch_size=BATCH, schema=str(schema),
                               warmup_batches=0, read_ahead=0)  # fmt: skip
    return start_server(producer)


def _refusal(server, hello: dict) -> str:
    """Say ``hello``; the ERROR's message (the test fails on anything else)."""
    with socket.create_connection(server.address, timeout=TIMEOUT) as sock:
        sock.sendall(encode_frame(FrameKind.HELLO, hello))
        reply = recv_frame(sock, max_frame_bytes=HELLO_MAX_BYTES)
        assert reply.kind is FrameKind.ERROR, reply.meta
        assert sock.recv(1) == b""  # and the server hung up
    return reply.meta["message"]


def _rank_client(server, rank: int, world: int) -> ServiceRankDataset:
    address = "{}:{}".format(*server.address)
    return ServiceRankDataset(address, rank=rank, world_size=world, batch_size=BATCH,
                              read_timeout_s=TIMEOUT)  # fmt: skip


def test_a_huge_world_size_is_refused_at_once_and_the_server_serves_on(server) -> None:
    """The attack: one HELLO with world_size 10**12 grew the server's memory until it was
    killed, with every client. The first HELLO here is just past the limit (the server used
    to accept it), so a server without the bound fails before the huge one is sent."""
    for world in (MAX_WORLD_SIZE + 1, 10**12):
        message = _refusal(
            server, {"batch_size": BATCH, "ranks": {"rank": 0, "world_size": world, "state": None}}
        )
        assert f"`ranks.world_size` must be at most {MAX_WORLD_SIZE:,} ranks" in message
        assert str(world) in message
    log = server._logfile.getvalue()
    assert "`ranks.world_size` must be at most" in log  # the refusal is in the server's log
    got = list(_rank_client(server, 0, 2))  # a normal rank client afterwards
    assert len(got) >= 2
    assert server.stats().rejected == 2


def _state(server) -> dict:
    client = _rank_client(server, 0, 2)
    next(iter(client))
    return client.state_dict()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.__setitem__("sample_in_epoch", 10**12), r"at row 1,000,000,000,000 of epoch"),
        (lambda s: s.__setitem__("sample_in_epoch", 2**60), "invalid `sample_in_epoch`"),
        (lambda s: s.__setitem__("sample_in_epoch", -1), "invalid `sample_in_epoch`"),
        (lambda s: s.__setitem__("global_batch_size", 0), "invalid `global_batch_size`"),
        (lambda s: s.__setitem__("rows", 3), "another stream"),
        (lambda s: s.__setitem__("extra", [[[[]]]]), "a stream position has"),
        (lambda s: s.__setitem__("seed", "x" * 100), "invalid `seed`"),
    ],
    ids=["past-the-end", "huge", "negative", "batch-0", "other-rows", "extra-key", "seed"],
)
def test_a_forged_rank_state_is_refused_before_it_is_expanded(server, change, match) -> None:
    state = _state(server)
    change(state)
    message = _refusal(server, {"batch_size": BATCH, "ranks": {"rank": 0, "world_size": 2,
                                                              "state": state}})  # fmt: skip
    assert re.search(match, message), message
    assert len(list(_rank_client(server, 1, 2))) >= 2  # the server is unharmed


@pytest.mark.parametrize(
    ("hello", "match"),
    [
        ({"num_shards": MAX_SHARDS + 1}, "`num_shards` must be a positive integer"),
        ({"shard": 10**15, "num_shards": 10**16}, "`shard` must be a non-negative integer"),
        ({"epoch": 2**40}, r"`epoch` must be a non-negative integer \(at most"),
        ({"batch_size": 2**40}, "`batch_size` must be a positive integer"),
        ({"ranks": {"rank": True, "world_size": 2}}, "needs 0 <= rank < world_size"),
        ({"ranks": {"rank": 0, "world_size": 2, "state": [0] * 100}}, "not a stream position"),
        ({"shards": 2}, "HELLO has unknown field"),
    ],
)
def test_every_hello_field_is_bounded(server, hello: dict, match: str) -> None:
    assert re.search(match, _refusal(server, {"batch_size": BATCH, **hello}))
    assert len(list(_rank_client(server, 0, 1))) >= 2
