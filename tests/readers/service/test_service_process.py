"""`recpipe serve` as a real process: reader processes, DataLoader workers, SIGTERM, server death."""

from __future__ import annotations

import argparse
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from torch.utils.data import DataLoader

from readers.service import ServiceClient, ServiceDataset, SyntheticProducer, register_cli
from readers.service.wire import ServiceError
from recpipe.errors import DataError

TIMEOUT = 120.0
_SERVE = (
    "import sys, argparse; from readers import service; p = argparse.ArgumentParser(); "
    "service.register_cli(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); "
    "sys.exit(a.func(a))"
)


class ServerProcess:
    """`serve` in a child process; the port is read from its 'listening on' line."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-c", _SERVE, "serve", "--report-every", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.port = int(self.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))

    def wait_for(self, pattern: str) -> re.Match:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + TIMEOUT
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stderr, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=deadline - time.monotonic()):
                    break
                line = self.proc.stderr.readline()
                if not line:
                    break
                self.lines.append(line)
                found = re.search(pattern, line)
                if found:
                    return found
        pytest.fail(f"server never printed {pattern!r}; stderr so far:\n{''.join(self.lines)}")

    def rest_of_stderr(self) -> str:
        assert self.proc.stderr is not None
        return "".join(self.lines) + self.proc.stderr.read()

    def client(self, **options: object) -> ServiceClient:
        return ServiceClient("127.0.0.1", self.port, read_timeout_s=TIMEOUT, **options)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def server_process() -> Iterator[type[ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(*args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def _rows(batches: list) -> list[int]:
    return [int(r) for b in batches for r in b.dense[:, 0].tolist()]


@pytest.mark.slow
def test_reader_processes_and_sigterm(server_process) -> None:
    server = server_process("--synthetic", "100000", "--batch-size", "16", "--readers", "2")
    producer = SyntheticProducer(num_batches=100000, batch_size=16)
    client = server.client().connect()
    stream = iter(client)
    got = [next(stream) for _ in range(8)]  # both reader processes are up
    indices = [int(b.dense[0, 0]) // 16 for b in got]
    assert len(set(indices)) == 8
    assert all(b.equals(producer.make_batch(i)) for b, i in zip(got, indices))
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert len(children) >= 2  # the readers (and multiprocessing's resource tracker)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(TIMEOUT) == 0
    with pytest.raises(ServiceError, match="the reader service is shutting down"):
        for _ in range(100_000):  # bounded: what was in flight, then the ERROR frame
            next(stream)
    _, alive = psutil.wait_procs(children, timeout=TIMEOUT)
    assert alive == []
    stderr = server.rest_of_stderr()
    assert "2 reader processes per client" in stderr and "shutting down" in stderr
    assert "recpipe serve: summary" in stderr and "1 stopped" in stderr


@pytest.mark.slow
def test_dataloader_workers_then_server_death(server_process) -> None:
    server = server_process("--synthetic", "2000", "--batch-size", "8", "--readers", "0")
    # 2 DataLoader workers x world size 50 = 100 shards; rank 0 reads shards 0 and 1
    ds = ServiceDataset("127.0.0.1", server.port, rank=0, world_size=50, read_timeout_s=TIMEOUT)
    loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT)
    expected = [r for i in range(2000) if i % 100 in (0, 1) for r in range(i * 8, i * 8 + 8)]
    assert sorted(_rows(list(loader))) == expected

    stream = iter(server.client().connect())
    next(stream)
    server.proc.kill()
    server.proc.wait(TIMEOUT)
    with pytest.raises(
        ServiceError,
        match=r"lost the reader service at 127\.0\.0\.1:\d+ after \d+ batches \(the server died",
    ):
        for _ in range(2000):  # bounded: frames already in the socket, then EOF
            next(stream)
    with pytest.raises(ServiceError, match="cannot connect to the reader service"):
        server.client(connect_timeout_s=5).connect()


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_refuses_a_missing_dataset(tmp_path) -> None:
    with pytest.raises(DataError, match="`dataset` is required"):
        args = _parse()
        args.func(args)
    args = _parse(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="is not a directory"):
        args.func(args)
    assert _parse("x", "--dedup", "off", "--readers", "3").readers == 3


@pytest.mark.slow
def test_killed_reader_process_is_a_clear_client_error() -> None:
    import io
    import os

    from readers.service import ReaderServer, ServiceConfig

    producer = SyntheticProducer(num_batches=100_000, batch_size=64)
    config = ServiceConfig(readers=1, queue_depth=2, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        client = ServiceClient(*server.address, read_timeout_s=TIMEOUT).connect()
        stream = iter(client)
        first = next(stream)
        assert first.equals(producer.make_batch(0))
        (reader,) = server.stats().sessions[0].reader_pids
        os.kill(reader, signal.SIGKILL)
        with pytest.raises(ServiceError, match=r"reader .*exit code -9"):
            for _ in range(100_000):  # bounded: frames already in flight, then the ERROR
                next(stream)
        assert server.join_sessions(timeout=TIMEOUT)
        session = server.stats().sessions[0]
        assert (session.state, session.readers_alive) == ("failed", 0)
        # the dead reader is not handed to the next client: a new one serves it
        client = ServiceClient(*server.address, read_timeout_s=TIMEOUT).connect()
        assert next(iter(client)).equals(producer.make_batch(0))
        client.close()
        assert server.join_sessions(timeout=TIMEOUT)
        assert server.stats().reader_processes_started == 2


def _epoch(server, **options) -> list:
    client = ServiceClient(*server.address, read_timeout_s=TIMEOUT, **options)
    return list(client)


@pytest.mark.slow
def test_reader_processes_are_kept_warm_between_clients() -> None:
    """A client's reader goes back to the server when the client is done, or disconnects, and
    the next client gets it (no new process), with exactly the same batches."""
    import io

    from readers.service import ReaderServer, ServiceConfig

    producer = SyntheticProducer(num_batches=6, batch_size=16)
    want = [producer.make_batch(i) for i in range(6)]
    config = ServiceConfig(readers=1, queue_depth=2, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        assert server.stats().reader_processes_idle == 1  # started with the server
        first = _epoch(server)
        assert server.join_sessions(timeout=TIMEOUT)
        client = ServiceClient(*server.address, read_timeout_s=TIMEOUT).connect()
        assert next(iter(client)).equals(want[0])
        client.close()  # mid-stream: the reader stops producing and goes back
        assert server.join_sessions(timeout=TIMEOUT)
        third = _epoch(server)
        assert server.join_sessions(timeout=TIMEOUT)
        stats = server.stats()
        pids = {pid for s in stats.sessions for pid in s.reader_pids}
        assert len(pids) == 1 and stats.reader_processes_started == 1
        assert stats.reader_processes_idle == 1
        assert [s.readers_alive for s in stats.sessions] == [0, 0, 0]
        assert stats.sessions[0].produced == 6  # this session's frames only
        (reader,) = pids
    for got in (first, third):
        assert len(got) == 6 and all(a.equals(b) for a, b in zip(got, want))
    assert not psutil.pid_exists(reader)  # closing the server stops (and reaps) the kept readers


@pytest.mark.slow
def test_without_kept_readers_each_client_starts_its_own() -> None:
    import io

    from readers.service import ReaderServer, ServiceConfig

    producer = SyntheticProducer(num_batches=3, batch_size=16)
    config = ServiceConfig(readers=1, idle_readers=0, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        assert server.stats().reader_processes_idle == 0
        for _ in range(2):
            assert len(_epoch(server)) == 3
            assert server.join_sessions(timeout=TIMEOUT)
        stats = server.stats()
        assert (stats.reader_processes_started, stats.reader_processes_idle) == (2, 0)
        pids = [pid for s in stats.sessions for pid in s.reader_pids]
        assert len(pids) == 2 and not any(psutil.pid_exists(pid) for pid in pids)
