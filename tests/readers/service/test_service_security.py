"""The reader service under hostile or careless use: connection churn, slow handshakes, exposed
binds, tokens from files, and limits on clients, readers and pending handshakes.

Every socket has a timeout and every wait a deadline, so a wedged server fails a test, not CI.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from readers.service import (
    ReaderServer,
    ServiceBusyError,
    ServiceClient,
    ServiceConfig,
    SyntheticProducer,
    register_cli,
)
from readers.service.cli import read_token
from readers.service.config import is_loopback
from readers.service.wire import FrameKind, ServiceError, decode_frame, encode_frame, recv_frame
from recpipe.errors import DataError

TIMEOUT = 60.0


def _client(server: ReaderServer, **options: object) -> ServiceClient:
    host, port = server.address
    return ServiceClient(host, port, connect_timeout_s=TIMEOUT, read_timeout_s=TIMEOUT, **options)


CHURN = 2_000
_SERVE = (
    "import sys, argparse; from readers import service; p = argparse.ArgumentParser(); "
    "service.register_cli(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); "
    "sys.exit(a.func(a))"
)


def _poll(condition: Callable[[], bool], *, timeout: float = TIMEOUT) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (bounded, no sleep)."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while time.monotonic() < deadline:
        if condition():
            return True
        tick.wait(0.05)
    return condition()


# -- (1) churn of unauthenticated connections ------------------------------------------------
class _ServerProcess:
    """`recpipe serve` in a child process, stderr to a file (a pipe would fill up and block)."""

    def __init__(self, log: Path, *args: str, env: dict[str, str]) -> None:
        self.log = log
        cmd = [sys.executable, "-c", _SERVE, "serve", "--report-every", "0", *args]
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen(cmd, stderr=stderr, env={**os.environ, **env})
        found: list[re.Match] = []
        if not _poll(lambda: self._listening(found) or self.proc.poll() is not None, timeout=120):
            pytest.fail(f"server never listened; stderr:\n{log.read_text()}")
        if not found:
            pytest.fail(f"server exited {self.proc.returncode}; stderr:\n{log.read_text()}")
        self.port = int(found[0].group(1))

    def _listening(self, found: list[re.Match]) -> bool:
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.log.read_text())
        if match:
            found.append(match)
        return match is not None

    def resources(self) -> dict[str, int]:
        """Open file descriptors, memory mappings, and mappings of /dev/shm files (POSIX
        semaphores and multiprocessing's shared-memory arenas) of the server process."""
        pid = self.proc.pid
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        return {
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "maps": len(maps),
            "shm_maps": sum("/dev/shm/" in line for line in maps),
        }

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)


def _garbage_connection(port: int) -> FrameKind:
    """Connect, send 20 bytes that are not a frame, read the reply, close."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"\x00garbage-not-a-frame"[:20])
        reply = recv_frame(sock, max_frame_bytes=1 << 16)
        assert sock.recv(1) == b""  # the server hung up after answering
    return reply.kind


@pytest.mark.slow
def test_unauthenticated_churn_leaves_nothing_behind(make_dataset, tiny_schema, tmp_path) -> None:
    """Thousands of refused connections: the server's fds, /dev/shm mappings and memory
    mappings return to where they were, and a real client then gets an exact epoch.

    Slack: fds and /dev/shm mappings must return exactly. Memory mappings may differ by a few
    lines for reasons unrelated to sessions (glibc caches freed thread stacks, malloc grows
    per-thread arenas, CPython's allocator maps arenas), so up to 64 lines are allowed; a
    session that kept its queues, semaphores and shared memory held about 6 mappings, so 2,000
    of them would add ~12,000 lines and even 11 leaked sessions would exceed the slack.
    """
    from readers.dataset import iter_batches
    from readers.source import ReaderConfig

    dataset = make_dataset(num_sessions=40, files=2, row_group_rows=30)
    schema_path = tmp_path / "tiny.toml"
    schema_path.write_text(tiny_schema.to_toml())
    # --no-shuffle: the batches are compared with an unshuffled read below (serve shuffles by default)
    args = [str(dataset), "--schema", str(schema_path), "--readers", "1", "--batch-size", "16",
            "--no-shuffle"]  # fmt: skip
    server = _ServerProcess(tmp_path / "serve.log", *args, env={"RECPIPE_TOKEN": "s3cret"})
    try:
        for _ in range(100):  # warm up: thread stacks, allocator arenas
            assert _garbage_connection(server.port) is FrameKind.ERROR
        before = server.resources()
        for _ in range(CHURN):
            assert _garbage_connection(server.port) is FrameKind.ERROR
        settled = _poll(
            lambda: (
                (after := server.resources())["fds"] <= before["fds"]
                and after["shm_maps"] <= before["shm_maps"]
                and after["maps"] <= before["maps"] + 64
            )
        )
        assert settled, f"before {before}, after {server.resources()}"

        with ServiceClient("127.0.0.1", server.port, token="s3cret", read_timeout_s=TIMEOUT) as c:
            got = list(c)
        expected = list(
            iter_batches(dataset, schema=tiny_schema, config=ReaderConfig(batch_size=16))
        )
        assert len(got) == len(expected) > 0
        assert all(g.equals(e) for g, e in zip(got, expected))

        # SIGTERM while connections keep arriving: a clean exit, no traceback
        churning = threading.Event()

        def churn() -> None:
            for _ in range(500):
                try:
                    _garbage_connection(server.port)
                except (OSError, ServiceError):
                    return  # the server is gone
                churning.set()

        thread = threading.Thread(target=churn, daemon=True)
        thread.start()
        assert churning.wait(TIMEOUT)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(TIMEOUT) == 0
        thread.join(TIMEOUT)
        log = server.log.read_text()
        assert "Traceback" not in log and "recpipe serve: summary" in log
        served, refused = map(int, re.search(r"(\d+) served, (\d+) refused", log).groups())
        assert served == 1 and refused >= CHURN + 100
    finally:
        server.close()


def test_a_connection_thread_that_cannot_start_is_refused_and_close_still_works(
    start_server, monkeypatch
) -> None:
    """Out of threads (the state a connection flood used to end in): that connection is
    refused, the server goes on serving, and closing it joins only threads that started."""
    server = start_server(SyntheticProducer(num_batches=2, batch_size=8))
    real_start, failed = threading.Thread.start, []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(("recpipe-conn", "recpipe-session")) and not failed:
            failed.append(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with socket.create_connection(server.address, timeout=10) as sock:
        reply = recv_frame(sock, max_frame_bytes=1 << 16)
    monkeypatch.undo()
    assert failed and reply.kind is FrameKind.ERROR and reply.meta["code"] == "busy"
    assert "cannot start a thread" in reply.meta["message"]
    with _client(server) as client:
        assert len(list(client)) == 2
    stats = server.close()  # used to end in "cannot join thread before it is started"
    assert (stats.clients_total, stats.rejected) == (1, 1)


# -- (2) one deadline for the whole HELLO ----------------------------------------------------
def test_a_slow_hello_is_cut_at_the_handshake_deadline(start_server) -> None:
    server = start_server(SyntheticProducer(num_batches=2, batch_size=8), handshake_timeout_s=1.0)
    hello = encode_frame(
        FrameKind.HELLO, {"shard": 0, "num_shards": 1, "epoch": 0, "pad": "x" * 64}
    )
    sent, reply = 0, b""
    with socket.create_connection(server.address, timeout=TIMEOUT) as sock:
        sock.settimeout(0.05)  # one byte every 50 ms: each read is quick, the whole is not
        while sent < len(hello):
            sock.sendall(hello[sent : sent + 1])
            sent += 1
            try:
                reply = sock.recv(1 << 16)
                break  # the server answered before the HELLO was complete
            except TimeoutError:
                continue
        sock.settimeout(TIMEOUT)
        while more := sock.recv(1 << 16):  # the rest, until the server hangs up
            reply += more
    assert sent < len(hello), "the server waited for the whole trickled HELLO"
    frame = decode_frame(bytearray(reply), max_frame_bytes=1 << 16)
    assert frame.kind is FrameKind.ERROR
    assert "no complete HELLO within `handshake_timeout_s`=1 s" in frame.meta["message"]
    with _client(server) as client:  # and the server is unharmed
        assert len(list(client)) == 2


# -- (3) exposure: bind, token sources -------------------------------------------------------
def test_a_non_loopback_bind_without_a_token_is_refused() -> None:
    config = ServiceConfig(host="0.0.0.0", readers=0, report_every_s=0)
    server = ReaderServer(SyntheticProducer(num_batches=1), config=config, log=io.StringIO())
    try:
        with pytest.raises(
            DataError, match=r"refusing to listen on `host`='0.0.0.0' without a token"
        ):
            server.start()
    finally:
        server.close()
    ServiceConfig(host="0.0.0.0", token="s3cret").check_exposure()  # with a token: fine
    ServiceConfig(host="0.0.0.0", insecure=True).check_exposure()  # or said on purpose
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        ServiceConfig(host=host).check_exposure()
    assert not is_loopback("") and not is_loopback("::")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_refuses_exposure_and_reads_tokens_from_a_file_or_the_environment(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.delenv("RECPIPE_TOKEN", raising=False)
    assert _parse("--synthetic", "2", "--host", "0.0.0.0", "--insecure").insecure
    args = _parse("--synthetic", "2", "--host", "0.0.0.0")
    with pytest.raises(DataError, match="--insecure"):
        args.func(args)  # refused before anything is bound

    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    assert read_token(token=None, token_file=token_file) == "s3cret"
    monkeypatch.setenv("RECPIPE_TOKEN", "from-env")
    assert read_token(token=None, token_file=None) == "from-env"
    assert read_token(token="given", token_file=None) == "given"
    with pytest.raises(DataError, match="not both"):
        read_token(token="given", token_file=token_file)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        read_token(token=None, token_file=tmp_path / "empty")
    with pytest.raises(DataError, match="cannot read the token"):
        read_token(token=None, token_file=tmp_path / "missing")

    with pytest.raises(SystemExit):
        _parse("--help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "visible to every user in `ps`" in help_text and "--token-file" in help_text


# -- (4) limits: clients, readers, pending handshakes ----------------------------------------
def test_a_client_beyond_max_readers_gets_a_clear_busy_error(start_server) -> None:
    producer = SyntheticProducer(num_batches=10_000, batch_size=8)
    server = start_server(producer, max_readers=1, queue_depth=2)  # one reader thread in all
    first = _client(server).connect()
    stream = iter(first)  # held: a dropped iterator closes its client, freeing the reader
    assert next(stream).batch_size == 8
    with pytest.raises(ServiceBusyError, match=r"busy: 1 of its `max_readers`=1 readers"):
        _client(server).connect()
    stream.close()
    first.close()
    assert server.join_sessions(timeout=TIMEOUT)
    with _client(server) as again:  # the readers are free again
        assert next(iter(again)).batch_size == 8
    with pytest.raises(DataError, match=r"`max_readers`=1 is below `readers`=2"):
        ServiceConfig(readers=2, max_readers=1)
    assert _parse("x", "--max-clients", "3", "--max-readers", "5").max_readers == 5


@pytest.mark.slow
def test_reader_processes_never_exceed_max_readers(start_server) -> None:
    producer = SyntheticProducer(num_batches=10_000, batch_size=8)
    server = start_server(producer, readers=1, idle_readers=1, max_readers=2, queue_depth=2)
    clients = [_client(server).connect() for _ in range(2)]
    streams = [iter(c) for c in clients]
    assert all(next(s).batch_size == 8 for s in streams)
    with pytest.raises(ServiceBusyError, match="`max_readers`=2"):
        _client(server).connect()
    assert len(server.reader_pids()) == 2 and server.stats().reader_processes_started == 2
    for client in clients:
        client.close()
    assert server.join_sessions(timeout=TIMEOUT)
    assert server.stats().reader_processes_idle == 1  # one kept, the other stopped


def test_connections_waiting_for_hello_are_capped(start_server) -> None:
    server = start_server(SyntheticProducer(num_batches=2, batch_size=8), max_pending=2)
    silent = [socket.create_connection(server.address, timeout=TIMEOUT) for _ in range(2)]
    try:
        assert _poll(lambda: server.stats().connections_pending == 2)
        with socket.create_connection(server.address, timeout=TIMEOUT) as third:
            reply = recv_frame(third, max_frame_bytes=1 << 16)
        assert reply.kind is FrameKind.ERROR and reply.meta["code"] == "busy"
        assert "`max_pending`" in reply.meta["message"]
    finally:
        for sock in silent:
            sock.close()
    assert _poll(lambda: server.stats().connections_pending == 0)
    with _client(server) as client:
        assert len(list(client)) == 2
    assert server.stats().rejected == 3  # the capped one and the two that never said HELLO
