"""The reader server: accepts TCP clients and serves each from its own readers.

**Clients and shards.** Every connection is its own stream: it names a shard of the epoch
(``shard`` of ``num_shards``, from the trainer's rank/world size and its DataLoader worker) and
an epoch number, and the server gives ``readers`` reader processes to that connection alone,
each producing a disjoint part of the shard (row groups dealt round-robin: shards, then
readers). So several trainers can read at once, the shards of an epoch together deliver every
row exactly once, and a client that goes away stops only its own readers. Two clients asking
for the same shard each get all of it.

**Connections and limits.** The accept loop hands each connection to a thread of its own. A
connection that has not completed its HELLO counts against ``max_pending`` (beyond it, new
connections are refused at once) and holds only its socket and that thread; an authenticated
client is admitted if fewer than ``max_clients`` are being served and its readers fit under
``max_readers`` (else it is refused with a "busy" ERROR). A finished client leaves only a
:class:`~readers.service.config.SessionStats` snapshot in a bounded history.

**Shutdown.** SIGTERM or Ctrl-C (:func:`serve`) closes the listener, tells every client
(``ERROR``), stops and joins the reader processes (kept ones too), closes the sockets and prints
a summary. A progress line goes to stderr every ``report_every_s`` seconds.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from readers.service.config import ServerStats, ServiceConfig, SessionStats, fmt_bytes
from readers.service.producers import BatchProducer
from readers.service.reader_process import ReaderPool
from readers.service.session import (
    JOIN_TIMEOUT_S,
    ClientSession,
    Request,
    SessionContext,
    check_request,
    read_hello,
    refuse,
)
from readers.service.wire import FrameKind, ServiceBusyError, ServiceError, encode_frame

__all__ = ["SESSION_HISTORY", "ReaderServer", "serve"]

SESSION_HISTORY = 1024  # finished clients whose stats are kept


class ReaderServer:
    """Serve the batches of a :class:`BatchProducer` to TCP clients (see the module docs).

    Use it as a context manager, or call :meth:`start` and :meth:`close`::

        with ReaderServer(DatasetProducer("data/demo/dataset"), config=ServiceConfig()) as srv:
            host, port = srv.address
            srv.serve_forever()  # until SIGTERM / Ctrl-C (see `recpipe serve`)

    Args:
        producer: the batch source every reader runs (picklable for reader processes).
        config: the server's settings.
        log: where progress lines and the summary go (``None``: nowhere).
    """

    def __init__(
        self,
        producer: BatchProducer,
        *,
        config: ServiceConfig | None = None,
        log: TextIO | None = sys.stderr,
    ) -> None:
        self.producer = producer
        self.config = config or ServiceConfig()
        self._logfile = log
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._pool = ReaderPool(producer, config=self.config)
        self._context = SessionContext(
            self.config, producer, self._pool, self._closing, self._log, self._count
        )
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._connections: dict[threading.Thread, socket.socket] = {}  # every one open now
        self._handshaking: dict[threading.Thread, socket.socket] = {}  # no HELLO yet
        self._active: dict[int, ClientSession] = {}  # by admission number
        self._finished: collections.deque[tuple[int, SessionStats]] = collections.deque(
            maxlen=SESSION_HISTORY
        )
        self._states: collections.Counter[str] = collections.Counter()
        self._started = 0.0
        self._clients_total = self._rejected = 0
        self._batches = self._samples = self._bytes = 0
        self._address: tuple[str, int] = (self.config.host, self.config.port)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> ReaderServer:
        """Bind, listen and start accepting clients; returns ``self``.

        Raises:
            DataError: a non-loopback ``host`` without a token (see
                :meth:`ServiceConfig.check_exposure`).
            ServiceError: the address cannot be bound.
        """
        cfg = self.config
        cfg.check_exposure()
        try:
            listener = socket.create_server((cfg.host, cfg.port), backlog=cfg.max_pending)
        except OSError as exc:
            msg = f"cannot listen on `host`={cfg.host!r} `port`={cfg.port}: {exc}"
            raise ServiceError(msg) from exc
        listener.settimeout(0.2)  # so the accept loop notices close() promptly
        self._listener = listener
        self._address = listener.getsockname()[:2]
        self._started = time.monotonic()
        self._threads = [
            threading.Thread(target=self._accept_loop, name="recpipe-accept", daemon=True),
        ]
        if cfg.report_every_s:
            self._threads.append(
                threading.Thread(target=self._report_loop, name="recpipe-report", daemon=True)
            )
        for thread in self._threads:
            thread.start()
        self._pool.warm()  # kept readers start before the first client
        readers = f"{cfg.readers} reader processes" if cfg.readers else "in-process reader"
        token = "required" if cfg.token else "off" + (" (--insecure)" if cfg.insecure else "")
        self._log(
            f"listening on {self._address[0]}:{self._address[1]} ({readers} per client, queue "
            f"depth {cfg.queue_depth}, token {token}; at most {cfg.max_clients} clients and "
            f"{cfg.reader_limit} readers)"
        )
        return self

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on (the real port when ``port=0``)."""
        return self._address

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Block until ``stop`` is set (or the server is closed)."""
        stop = stop or self._closing
        while not stop.wait(0.5) and not self._closing.is_set():
            pass

    def close(self, *, timeout: float = JOIN_TIMEOUT_S) -> ServerStats:
        """Stop accepting, tell and disconnect every client, join the readers; idempotent.

        Returns:
            The final statistics.
        """
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            handshaking = list(self._handshaking.values())
            connections = dict(self._connections)
        for conn in handshaking:  # nothing to tell them yet
            _shutdown(conn)
        deadline = time.monotonic() + self.config.heartbeat_s + 1.0  # streams notice closing
        for thread in connections:
            thread.join(max(deadline - time.monotonic(), 0.0))
        for thread, conn in connections.items():
            if thread.is_alive():
                _shutdown(conn)  # stuck sending to a stalled client
        for thread in connections:
            thread.join(timeout + JOIN_TIMEOUT_S)
        self._pool.close()
        return self.stats()

    def __enter__(self) -> ReaderServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> ServerStats:
        """A snapshot of the server's counters, of the clients being served and of the most
        recent finished ones (in the order they were admitted)."""
        with self._lock:
            sessions = [*self._finished, *((n, s.stats()) for n, s in self._active.items())]
            sessions.sort(key=lambda item: item[0])
            return ServerStats(
                address=self._address,
                elapsed_s=time.monotonic() - self._started if self._started else 0.0,
                clients_total=self._clients_total,
                clients_active=len(self._active),
                rejected=self._rejected,
                batches=self._batches,
                samples=self._samples,
                bytes_sent=self._bytes,
                sessions=tuple(s for _, s in sessions),
                reader_processes_started=self._pool.started,
                reader_processes_idle=self._pool.idle,
                connections_pending=len(self._handshaking),
                session_states=dict(self._states),
            )

    def join_sessions(self, *, timeout: float) -> bool:
        """Wait until every connection open now has finished; False if some still run at
        ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._connections)
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0))
        return not any(thread.is_alive() for thread in threads)

    def wait_backpressure(self, session: int, *, timeout: float) -> bool:
        """Wait until client ``session`` (0-based, in admission order) has found its queue full."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                live = self._active.get(session)
                done = next((s for n, s in self._finished if n == session), None)
            if live is not None:
                return live.backpressure.wait(max(deadline - time.monotonic(), 0))
            if done is not None:
                return done.backpressured
            self._closing.wait(0.05)
        return False

    def reader_pids(self) -> list[int]:
        """Process ids of the reader processes alive now: kept idle ones, then lent ones."""
        return self._pool.pids()

    # -- connections --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None  # set by start()
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # the listener was closed
            self._open(conn, f"{peer[0]}:{peer[1]}")

    def _open(self, conn: socket.socket, peer: str) -> None:
        """Give a new connection its thread, or refuse it at once (too many handshakes)."""
        cfg = self.config
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cfg.send_buffer_bytes:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.send_buffer_bytes)
        with self._lock:
            if self._closing.is_set():
                reason = "the reader service is shutting down"
            elif len(self._handshaking) >= cfg.max_pending:
                reason = (
                    f"the reader service is busy: {cfg.max_pending} connections are waiting "
                    f"for their handshake (`max_pending`); try again later"
                )
            else:
                thread = threading.Thread(
                    target=self._serve, args=(conn, peer), name=f"recpipe-conn-{peer}", daemon=True
                )
                try:
                    thread.start()  # registered only once started: close() joins it
                except RuntimeError as exc:  # no thread to be had (out of memory, limits)
                    reason = f"the reader service is busy: cannot start a thread ({exc})"
                else:
                    self._connections[thread] = conn
                    self._handshaking[thread] = conn
                    return
            self._rejected += 1
        self._log(f"refused {peer}: {reason}")
        _refuse_at_once(conn, reason)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        """A connection's thread: handshake, admission, then the client's session."""
        me = threading.current_thread()
        try:
            try:
                request = check_request(read_hello(conn, config=self.config), self.producer)
            except ServiceError as exc:
                self._refuse(conn, peer, exc)
                return
            finally:
                with self._lock:
                    self._handshaking.pop(me, None)
            admitted = self._admit(conn, peer, request)
            if admitted is None:
                return
            number, session = admitted
            try:
                session.run()
            finally:
                self._pool.release(request.spec.num_readers)
                self._finish(number, session)
        except Exception as exc:  # a bug: keep the server alive, say what happened
            self._log(f"connection {peer}: internal error: {type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._connections.pop(me, None)

    def _admit(
        self, conn: socket.socket, peer: str, request: Request
    ) -> tuple[int, ClientSession] | None:
        """Register an authenticated client (its admission number and session), or refuse it as
        busy (at a limit, or closing)."""
        cfg = self.config
        with self._lock:
            if self._closing.is_set():
                reason = "the reader service is shutting down"
            elif len(self._active) >= cfg.max_clients:
                reason = f"the reader service is full (`max_clients`={cfg.max_clients})"
            elif not self._pool.reserve(request.spec.num_readers):
                reason = (
                    f"the reader service is busy: {self._pool.reserved} of its "
                    f"`max_readers`={cfg.reader_limit} readers serve other clients and this one "
                    f"needs {request.spec.num_readers}; try again later"
                )
            else:
                number, session = (
                    self._clients_total,
                    ClientSession(conn, peer, request, self._context),
                )
                self._active[number] = session
                self._clients_total += 1
                return number, session
        self._refuse(conn, peer, ServiceBusyError(reason))
        return None

    def _finish(self, number: int, session: ClientSession) -> None:
        stats = session.stats()
        with self._lock:
            del self._active[number]
            self._finished.append((number, stats))
            self._states[stats.state] += 1

    def _refuse(self, conn: socket.socket, peer: str, exc: ServiceError) -> None:
        with self._lock:
            self._rejected += 1
        self._log(f"refused {peer}: {exc}")
        refuse(conn, str(exc), busy=isinstance(exc, ServiceBusyError))

    # -- internals ----------------------------------------------------------------------------
    def _report_loop(self) -> None:
        last_samples, last_bytes, last_t = 0, 0, time.monotonic()
        while not self._closing.wait(self.config.report_every_s):
            stats, now = self.stats(), time.monotonic()
            dt = max(now - last_t, 1e-9)
            self._log(
                f"{stats.clients_active} clients, {stats.batches:,} batches, "
                f"{stats.samples:,} samples, {fmt_bytes(stats.bytes_sent)} sent | "
                f"{(stats.samples - last_samples) / dt:,.0f} samples/s, "
                f"{fmt_bytes((stats.bytes_sent - last_bytes) / dt)}/s"
            )
            last_samples, last_bytes, last_t = stats.samples, stats.bytes_sent, now

    def _count(self, batches: int, samples: int, nbytes: int) -> None:
        with self._lock:
            self._batches += batches
            self._samples += samples
            self._bytes += nbytes

    def _log(self, message: str) -> None:
        if self._logfile is not None:
            print(f"recpipe serve: {message}", file=self._logfile, flush=True)


def _shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _refuse_at_once(conn: socket.socket, message: str) -> None:
    """Refuse a connection without a thread: one non-blocking ERROR (``code: "busy"``), then
    close."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(encode_frame(FrameKind.ERROR, {"message": message, "code": "busy"}))
        conn.shutdown(socket.SHUT_WR)
    conn.close()


def serve(producer: BatchProducer, *, config: ServiceConfig) -> int:
    """Run a server until SIGTERM or Ctrl-C, then shut down cleanly and print a summary.

    Returns:
        0 (the exit code).
    """
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    handler: Callable[[int, Any], None] = lambda signum, frame: stop.set()  # noqa: E731
    for sig in previous:
        signal.signal(sig, handler)
    server = ReaderServer(producer, config=config)
    try:
        server.start()
        server.serve_forever(stop)
        server._log("shutting down")
    finally:
        stats = server.close()
        for sig, old in previous.items():
            signal.signal(sig, old)
    print(stats.summary(), file=sys.stderr, flush=True)
    return 0
