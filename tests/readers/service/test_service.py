"""The reader service over loopback: several clients, disconnects, backpressure, refusals.

Most servers here run their reader in a thread (``readers=0``) so the tests stay fast; the
reader-process path and SIGTERM are covered by the subprocess tests in test_service_process.py.
Every socket has a timeout and every wait a bound, so a broken server fails a test, not CI.
"""

from __future__ import annotations

import itertools
import re
import socket
import threading
from collections.abc import Iterator

import pytest

from readers.service import (
    TOKEN_ENV,
    ReaderServer,
    ServiceClient,
    ServiceConfig,
    ServiceDataset,
    ShardSpec,
    SyntheticProducer,
)
from readers.service.wire import (
    HEADER,
    MAGIC,
    WIRE_VERSION,
    FrameKind,
    ProtocolError,
    ServiceError,
    encode_frame,
    recv_frame,
)
from recpipe.batch import Batch
from recpipe.errors import DataError

TIMEOUT = 60.0


def _client(server: ReaderServer, **options: object) -> ServiceClient:
    host, port = server.address
    return ServiceClient(host, port, connect_timeout_s=TIMEOUT, read_timeout_s=TIMEOUT, **options)


def _rows(batches: list[Batch]) -> list[int]:
    return [int(r) for b in batches for r in b.dense[:, 0].tolist()]


@pytest.mark.parametrize("dedup", [True, False])
def test_batches_arrive_exactly(start_server, dedup: bool) -> None:
    producer = SyntheticProducer(num_batches=5, batch_size=32, dedup=dedup)
    server = start_server(producer)
    with _client(server) as client:
        got = list(client)
    assert len(got) == 5
    for index, batch in enumerate(got):
        assert batch.equals(producer.make_batch(index))
        assert bool(batch.ikjts) == dedup
    assert client.end == {"batches": 5, "samples": 160}
    assert client.bytes_received > 0


def test_two_clients_at_once_split_the_epoch(start_server) -> None:
    producer = SyntheticProducer(num_batches=9, batch_size=16)
    server = start_server(producer, queue_depth=2)
    clients = [_client(server, shard=s, num_shards=2).connect() for s in range(2)]
    streams = [iter(c) for c in clients]
    got: list[list[Batch]] = [[], []]
    # interleave the two streams while both are open
    for i in itertools.cycle(range(2)):
        if all(s is None for s in streams):
            break
        if streams[i] is not None:
            batch = next(streams[i], None)
            if batch is None:
                streams[i] = None
            else:
                got[i].append(batch)
    assert [len(g) for g in got] == [5, 4]
    assert sorted(_rows(got[0]) + _rows(got[1])) == list(range(9 * 16))
    assert set(_rows(got[0])).isdisjoint(_rows(got[1]))
    assert server.join_sessions(timeout=TIMEOUT)
    assert [s.state for s in server.stats().sessions] == ["done", "done"]


def test_client_disconnect_mid_stream_leaves_others_alone(start_server) -> None:
    # frames (~260 KB) much larger than the socket buffers, so the server notices the hang-up
    producer = SyntheticProducer(num_batches=5, batch_size=1024, list_len=64, dedup=False)
    server = start_server(producer, queue_depth=2, send_buffer_bytes=32 * 1024)
    leaver = _client(server, recv_buffer_bytes=32 * 1024).connect()
    stayer = _client(server).connect()
    stream = iter(leaver)
    next(stream)
    stream.close()  # closes the socket mid-stream
    assert leaver._sock is None
    rows = _rows(list(stayer))
    assert rows == list(range(5 * 1024))
    assert server.join_sessions(timeout=TIMEOUT)
    states = {s.client: s.state for s in server.stats().sessions}
    assert sorted(states.values()) == ["disconnected", "done"]
    # the server still serves new clients
    with _client(server) as again:
        assert _rows(list(again)) == list(range(5 * 1024))


def test_stalled_client_keeps_server_memory_bounded(start_server) -> None:
    depth, total = 2, 40
    producer = SyntheticProducer(num_batches=total, batch_size=1024, list_len=64, dedup=False)
    server = start_server(producer, queue_depth=depth, send_buffer_bytes=32 * 1024)
    client = _client(server, recv_buffer_bytes=32 * 1024).connect()
    stream = iter(client)
    first = next(stream)  # then stall: read nothing more
    frame_bytes = max(len(b"".join(_frames(producer, i))) for i in range(3))
    assert server.wait_backpressure(0, timeout=TIMEOUT)
    session = server.stats().sessions[0]
    assert session.backpressured
    # what waits server-side never exceeds the queue, however long the client stalls
    assert session.peak_queued_frames <= depth
    assert session.peak_queued_bytes <= depth * frame_bytes * 1.1
    # produced = sent (incl. kernel buffers, < 1 frame here) + queued + the one being sent
    assert session.produced <= session.batches + depth + 1
    assert session.produced < total // 2
    # resuming delivers everything, in order, nothing lost
    rows = _rows([first, *stream])
    assert rows == list(range(total * 1024))


def _frames(producer: SyntheticProducer, index: int) -> list:
    from readers.service.wire import batch_to_frame

    return batch_to_frame(producer.make_batch(index))


def test_wrong_or_missing_token_is_refused(start_server, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    server = start_server(SyntheticProducer(num_batches=2, batch_size=8), token="s3cret")
    with pytest.raises(
        ServiceError,
        match="refused the connection: authentication failed: the client sent a wrong token",
    ):
        _client(server, token="guess").connect()
    with pytest.raises(ServiceError, match="authentication failed: the client sent no token"):
        _client(server).connect()
    with _client(server, token="s3cret") as client:
        assert len(list(client)) == 2
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    with _client(server) as client:
        assert len(list(client)) == 2
    assert server.join_sessions(timeout=TIMEOUT)
    assert server.stats().rejected == 2


def _raw(server: ReaderServer) -> socket.socket:
    return socket.create_connection(server.address, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("hello", "match"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a recpipe frame"),
        (HEADER.pack(MAGIC, WIRE_VERSION, 1, 1 << 30, 0), r"exceeds `max_frame_bytes`=65536"),
        (HEADER.pack(MAGIC, WIRE_VERSION + 1, 1, 2, 0) + b"{}", "wire version"),
        (encode_frame(FrameKind.BATCH), "expected a HELLO frame first, got BATCH"),
        (encode_frame(FrameKind.HELLO, {"shard": 3, "num_shards": 2}), "shard 3 of 2"),
        (encode_frame(FrameKind.HELLO, {"epoch": "one"}), "`epoch` must be a non-negative integer"),
        (encode_frame(FrameKind.HELLO, {"batch_size": 0}), "`batch_size` must be a positive"),
        (encode_frame(FrameKind.HELLO, {"holdout": [0.1]}), "`holdout` must be {fraction, seed"),
        (
            encode_frame(FrameKind.HELLO, {"holdout": {"fraction": 1.5}}),
            r"`holdout` is invalid: `fraction` must be a number in \[0, 1\), got 1.5",
        ),
        (
            encode_frame(FrameKind.HELLO, {"holdout": {"fraction": 0.1, "part": "test"}}),
            "`part` must be one of 'train', 'held_out', got 'test'",
        ),
    ],
)
def test_malformed_handshakes_are_refused(start_server, hello: bytes, match: str) -> None:
    server = start_server(SyntheticProducer(num_batches=2, batch_size=8))
    with _raw(server) as sock:
        sock.sendall(hello)
        reply = recv_frame(sock, max_frame_bytes=1 << 16)
        assert reply.kind is FrameKind.ERROR
        assert re.search(match, reply.meta["message"])
        assert sock.recv(1) == b""  # and the server hung up
    with _client(server) as client:  # the server is unharmed
        assert len(list(client)) == 2
    assert server.join_sessions(timeout=TIMEOUT)
    assert server.stats().rejected == 1


def test_client_refuses_oversized_frames(start_server) -> None:
    server = start_server(SyntheticProducer(num_batches=2, batch_size=256))
    client = _client(server, max_frame_bytes=4096)
    with pytest.raises(ProtocolError, match=r"exceeds `max_frame_bytes`=4096 \(kind BATCH\)"):
        list(client)


class _Failing:
    """Yields one batch, then fails like a corrupt input would."""

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]:
        yield SyntheticProducer(batch_size=8).make_batch(0)
        msg = "part-00003.parquet: column `item_id` has type string, expected list<int64>"
        raise DataError(msg)


def test_reader_failure_reaches_the_client(start_server) -> None:
    server = start_server(_Failing())
    client = _client(server).connect()
    stream = iter(client)
    assert next(stream).batch_size == 8
    with pytest.raises(
        ServiceError,
        match=r"reader 0 of shard 0 failed: DataError: part-00003.parquet: column `item_id`",
    ):
        next(stream)
    assert server.join_sessions(timeout=TIMEOUT)
    assert server.stats().sessions[0].state == "failed"


def test_shutdown_tells_connected_clients(start_server) -> None:
    server = start_server(SyntheticProducer(num_batches=10_000, batch_size=8), queue_depth=2)
    client = _client(server).connect()
    stream = iter(client)
    next(stream)
    stats = server.close()
    assert stats.sessions[0].readers_alive == 0
    with pytest.raises(ServiceError, match="the reader service is shutting down"):
        for _ in range(10_000):  # bounded: frames already in flight, then the ERROR
            next(stream)
    with pytest.raises(ServiceError, match="cannot connect to the reader service"):
        _client(server).connect()


def test_silent_server_times_out() -> None:
    """A peer that says WELCOME and then nothing, not even heartbeats."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        host, port = listener.getsockname()[:2]
        accepted: list[socket.socket] = []

        def welcome_then_silence() -> None:
            conn, _ = listener.accept()
            accepted.append(conn)
            recv_frame(conn, max_frame_bytes=1 << 16)
            conn.sendall(encode_frame(FrameKind.WELCOME))

        thread = threading.Thread(target=welcome_then_silence)
        thread.start()
        client = ServiceClient(host, port, connect_timeout_s=TIMEOUT, read_timeout_s=0.2).connect()
        thread.join(TIMEOUT)
        with pytest.raises(ServiceError, match=r"not even a heartbeat, for `read_timeout_s`=0.2"):
            list(client)
        for conn in accepted:
            conn.close()


def test_service_dataset_shards_by_rank(start_server) -> None:
    from torch.utils.data import DataLoader

    producer = SyntheticProducer(num_batches=6, batch_size=8)
    server = start_server(producer)
    host, port = server.address
    rows = []
    for rank in range(2):
        ds = ServiceDataset(host, port, rank=rank, world_size=2, read_timeout_s=TIMEOUT)
        got = list(DataLoader(ds, batch_size=None, num_workers=0))
        assert all(isinstance(b, Batch) for b in got)
        rows.append(_rows(got))
    assert sorted(rows[0] + rows[1]) == list(range(48))
    assert set(rows[0]).isdisjoint(rows[1])
    with pytest.raises(DataError, match=r"`rank` must lie in \[0, `world_size`=2\), got 2"):
        ServiceDataset(host, port, rank=2, world_size=2)


def test_epochs_are_passed_to_readers(start_server) -> None:
    producer = SyntheticProducer(num_batches=1, batch_size=8)
    server = start_server(producer)
    host, port = server.address
    ds = ServiceDataset(host, port, read_timeout_s=TIMEOUT)
    ds.set_epoch(3)
    (batch,) = list(ds)
    assert batch.equals(producer.make_batch(0, epoch=3))
    assert not batch.equals(producer.make_batch(0, epoch=0))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"queue_depth": 0}, "`queue_depth` has an invalid value 0"),
        ({"readers": -1}, "`readers` has an invalid value -1"),
        ({"port": 70000}, "`port` has an invalid value 70000"),
        ({"token": ""}, "`token` must be a non-empty string"),
        ({"idle_readers": -1}, "`idle_readers` has an invalid value -1"),
    ],
)
def test_config_is_validated(options: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        ServiceConfig(**options)


def test_batches_over_the_frame_limit_fail_clearly(start_server) -> None:
    server = start_server(SyntheticProducer(num_batches=2, batch_size=256), max_frame_bytes=4096)
    with pytest.raises(
        ServiceError, match=r"encodes to \d+ bytes, more than `max_frame_bytes`=4096"
    ):
        list(_client(server))


def test_clients_beyond_max_clients_are_refused(start_server) -> None:
    server = start_server(SyntheticProducer(num_batches=10_000, batch_size=8), max_clients=1)
    first = _client(server).connect()
    with pytest.raises(ServiceError, match=r"the reader service is full \(`max_clients`=1\)"):
        _client(server).connect()
    first.close()
    assert server.join_sessions(timeout=TIMEOUT)
    with _client(server) as again:
        assert next(iter(again)).batch_size == 8
    summary = server.stats().summary()
    assert "2 served, 1 refused" in summary and "samples" in summary
