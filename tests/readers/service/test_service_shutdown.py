"""`recpipe serve` refuses options no server could run with, in one line, before it listens; and
every wait on the way down has a deadline, so SIGTERM always ends the server.

The hang this guards against: once, `serve` ignored two SIGTERMs for 11 minutes, its main thread
blocked in a lock acquire without a timeout. A signal handler runs in the main thread between
two of its bytecodes; one that sets a ``threading.Event`` takes the Event's lock, which the main
thread itself holds while it is inside ``Event.wait`` (the handler then waits for ever, and so
does every later SIGTERM's handler).
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading

import pytest

import readers.service.server
from readers.service import SyntheticProducer
from readers.service.reader_process import PooledReader
from recpipe_cli import main

TIMEOUT = 60.0


@pytest.fixture
def dataset(make_dataset) -> str:
    return str(make_dataset(num_sessions=20, files=1, row_group_rows=20))


def test_serve_batch_size_0_exits_in_one_line_without_listening(dataset) -> None:
    """It used to start and listen (so this run would be cut at its timeout)."""
    cmd = [sys.executable, "-m", "recpipe_cli", "serve", dataset, "--batch-size", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    assert "`--batch-size`" in lines[0] and "got 0" in lines[0] and "Traceback" not in done.stderr
    assert "listening" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--batch-size", "-3"),
        ("--warmup-batches", "-1"),
        ("--read-ahead", "-1"),
        ("--seed", "-1"),
        ("--alpha", "nan"),
        ("--port", "70000"),
        ("--handshake-timeout", "0"),
        ("--report-every", "inf"),
        ("--max-pending", "1000000000000"),
        ("--readers", "100000"),
        ("--queue-depth", "0"),
    ],
)
def test_every_serve_option_is_checked_before_it_listens(
    dataset, flag: str, value: str, monkeypatch, capsys
) -> None:
    def started(*args: object, **kwargs: object) -> int:
        raise AssertionError(f"`recpipe serve {flag} {value}` started serving")

    monkeypatch.setattr(readers.service.server, "serve", started)
    monkeypatch.delenv("RECPIPE_TOKEN", raising=False)
    assert main(["serve", dataset, flag, value]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"`{flag}`" in lines[0] and value in lines[0], lines


def test_sigterm_while_the_main_thread_holds_a_lock_still_stops_the_server() -> None:
    """The handler is called the way a signal would call it: in the main thread, while that
    thread holds the locks it could hold when the signal comes (the server's, its Events')."""
    script = """
import signal, threading, sys
from readers.service import ServiceConfig, SyntheticProducer, server as srv

real = srv.ReaderServer.serve_forever

def serve_forever(self, *args, **kwargs):
    events = [a for a in (*args, *kwargs.values(), self._closing) if isinstance(a, threading.Event)]
    locks = [self._lock, *(e._cond for e in events)]
    for lock in locks:
        lock.acquire()
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # as SIGTERM would, right now
    for lock in reversed(locks):
        lock.release()
    real(self, *args, **kwargs)

srv.ReaderServer.serve_forever = serve_forever
config = ServiceConfig(readers=0, report_every_s=0)
sys.exit(srv.serve(SyntheticProducer(num_batches=1), config=config))
"""
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the SIGTERM handler waited for a lock the main thread held")
    assert done.returncode == 0, done.stderr
    assert "shutting down" in done.stderr and "summary" in done.stderr


def _in_thread(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    return thread


def test_close_does_not_wait_for_ever_on_a_thread_stuck_holding_the_server_lock(
    start_server,
) -> None:
    server = start_server(SyntheticProducer(num_batches=2, batch_size=8))
    holding, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with server._lock:
            holding.set()
            release.wait(2 * TIMEOUT)  # the test releases it

    holder = threading.Thread(target=stuck, daemon=True)
    holder.start()
    assert holding.wait(TIMEOUT)
    try:
        closer = _in_thread(lambda: server.close(timeout=0.5))
        assert not closer.is_alive(), "close() waited for the lock without a deadline"
    finally:
        release.set()
        holder.join(TIMEOUT)


def test_a_reader_killed_holding_its_counters_lock_does_not_block_the_stats() -> None:
    """A reader process terminated inside ``with counters.get_lock()`` leaves that lock held
    for ever; the server reads its frame counter without it."""
    reader = PooledReader.__new__(PooledReader)  # no process: only its counters matter here
    reader.counters = multiprocessing.get_context("spawn").Array("q", 2)
    reader.counters.get_obj()[0] = 7
    held, release = threading.Event(), threading.Event()

    def dead_holder() -> None:
        with reader.counters.get_lock():
            held.set()
            release.wait(2 * TIMEOUT)  # the test releases it

    holder = threading.Thread(target=dead_holder, daemon=True)
    holder.start()
    assert held.wait(TIMEOUT)
    got: list[int] = []
    try:
        assert not _in_thread(lambda: got.append(reader.frames())).is_alive()
        assert got == [7]
    finally:
        release.set()
        holder.join(TIMEOUT)
