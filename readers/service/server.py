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

**Failed authentications** back the peer's host off, and repeated refusals of one host are
summarised in the log (:mod:`readers.service.guard`).

**Shutdown.** SIGTERM or Ctrl-C (:func:`serve`) closes the listener, tells every client
(``ERROR``), stops and joins the reader processes (kept ones too), closes the sockets and prints
a summary. Every wait on the way has a deadline (:meth:`ReaderServer.close`), and the signal
handler only sets a flag (it takes no lock: a handler that took one the interrupted main thread
held would wait forever). A progress line goes to stderr every ``report_every_s`` seconds.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TextIO

from readers.service.config import TOKEN_ENV, ServerStats, ServiceConfig, SessionStats, fmt_bytes
from readers.service.guard import PeerGuard
from readers.service.producers import BatchProducer
from readers.service.reader_process import ReaderPool
from readers.service.session import (
    JOIN_TIMEOUT_S,
    AuthenticationError,
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
_STREAM_GRACE_S = 5.0  # at most this (or heartbeat_s) for streams to notice a shutdown


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
        self._guard = PeerGuard(
            free=self.config.auth_failures_free,
            backoff_s=self.config.auth_backoff_s,
            backoff_max_s=self.config.auth_backoff_max_s,
            log_every_s=self.config.refusal_log_every_s,
        )
        self._stop_requested = False  # set by request_stop(), e.g. from a signal handler
        self._started = 0.0
        self._clients_total = self._rejected = 0
        self._auth_failures = self._auth_backed_off = 0
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
        """Block until ``stop`` is set, :meth:`request_stop` is called or the server is closed."""
        while not (self._stop_requested or self._closing.is_set() or (stop and stop.is_set())):
            self._closing.wait(0.2)

    def request_stop(self) -> None:
        """Make :meth:`serve_forever` return; safe in a signal handler (it takes no lock)."""
        self._stop_requested = True

    def close(self, *, timeout: float = JOIN_TIMEOUT_S) -> ServerStats:
        """Stop accepting, tell and disconnect every client, join the readers; idempotent.

        Every wait has a deadline, so it returns within about ``3 * timeout + 25`` s whatever
        the threads and reader processes do: ``min(heartbeat_s, 5) + 1`` s for the streams to
        notice, then their sockets are shut down and the connections have what is left of
        ``timeout`` (at least :data:`JOIN_TIMEOUT_S`); then the reader processes are asked,
        terminated and killed (:meth:`ReaderPool.close`). Threads still running then are left
        behind (daemons; the log says how many); a lock a stuck thread holds is waited for at most
        ``timeout``.

        Returns:
            The final statistics.
        """
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(_left(deadline))
        with _held(self._lock, timeout=_left(deadline)):
            handshaking = list(self._handshaking.values())
            connections = dict(self._connections)
        for conn in handshaking:  # nothing to tell them yet
            _shutdown(conn)
        grace = time.monotonic() + min(self.config.heartbeat_s, _STREAM_GRACE_S) + 1.0
        for thread in connections:  # streams notice closing within a heartbeat
            thread.join(_left(min(grace, deadline)))
        for thread, conn in connections.items():
            if thread.is_alive():
                _shutdown(conn)  # stuck sending to a stalled client
        deadline = max(deadline, time.monotonic() + JOIN_TIMEOUT_S)
        for thread in connections:
            thread.join(_left(deadline))
        stuck = sum(thread.is_alive() for thread in connections)
        if stuck:
            self._log(f"{stuck} connections did not finish in time; closing without them")
        self._pool.close()
        for line in self._guard.summaries(everything=True):
            self._log(line)
        return self.stats(timeout=timeout)

    def __enter__(self) -> ReaderServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection ------------------------------------------------------------------------
    def stats(self, *, timeout: float = JOIN_TIMEOUT_S) -> ServerStats:
        """A snapshot of the server's counters, of the clients being served and of the most
        recent finished ones (in the order they were admitted); taken without the server's
        lock if that cannot be had within ``timeout``."""
        with _held(self._lock, timeout=timeout):
            active = list(self._active.items())
            sessions = [*self._finished, *((n, s.stats()) for n, s in active)]
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
                auth_failures=self._auth_failures,
                auth_backed_off=self._auth_backed_off,
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
            finally:
                for line in self._guard.summaries():
                    self._log(line)
            self._open(conn, _Peer(str(peer[0]), int(peer[1])))

    def _open(self, conn: socket.socket, peer: _Peer) -> None:
        """Give a new connection its thread, or refuse it at once (too many handshakes, or
        its host is backed off after failed authentications)."""
        cfg = self.config
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cfg.send_buffer_bytes:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.send_buffer_bytes)
        left, failures = self._guard.backoff(peer.host)
        busy, why = True, "busy"
        with self._lock:
            if self._closing.is_set():
                reason = "the reader service is shutting down"
            elif left > 0:
                busy, why = False, "backed off"
                reason = (
                    f"{failures} failed authentications from {peer.host}: its connections are "
                    f"refused for {left:.0f} s more; check the token (--token-file or "
                    f"${TOKEN_ENV})"
                )
                self._auth_backed_off += 1
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
        self._log_refusal(peer, why, reason)
        _refuse_at_once(conn, reason, busy=busy)

    def _serve(self, conn: socket.socket, peer: _Peer) -> None:
        """A connection's thread: handshake, admission, then the client's session."""
        me = threading.current_thread()
        try:
            try:
                request = check_request(read_hello(conn, config=self.config), self.producer)
            except AuthenticationError as exc:
                self._guard.failed(peer.host)  # before the ERROR: the next try finds it
                with self._lock:
                    self._auth_failures += 1
                self._refuse(conn, peer, exc, why="failed authentication")
                return
            except ServiceError as exc:
                self._refuse(conn, peer, exc, why="bad handshake")
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
        self, conn: socket.socket, peer: _Peer, request: Request
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
                    ClientSession(conn, str(peer), request, self._context),
                )
                self._active[number] = session
                self._clients_total += 1
                return number, session
        self._refuse(conn, peer, ServiceBusyError(reason), why="busy")
        return None

    def _finish(self, number: int, session: ClientSession) -> None:
        stats = session.stats()
        with self._lock:
            del self._active[number]
            self._finished.append((number, stats))
            self._states[stats.state] += 1

    def _refuse(self, conn: socket.socket, peer: _Peer, exc: ServiceError, *, why: str) -> None:
        with self._lock:
            self._rejected += 1
        self._log_refusal(peer, why, str(exc))
        refuse(conn, str(exc), busy=isinstance(exc, ServiceBusyError))

    def _log_refusal(self, peer: _Peer, why: str, message: str) -> None:
        """Log a refusal in full if it is the host's first in a while; else the host's summary
        line counts it (see :class:`~readers.service.guard.PeerGuard`)."""
        if self._guard.refused(peer.host, why):
            self._log(f"refused {peer}: {message}")

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


class _Peer(NamedTuple):
    """A client's address: its ``host`` (what back-offs and log summaries go by) and port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


@contextlib.contextmanager
def _held(lock: threading.Lock, *, timeout: float) -> Iterator[bool]:
    """Hold ``lock`` if it can be had within ``timeout`` (yields whether it was); a shutdown
    goes on without it rather than wait for ever on a thread that is stuck holding it."""
    acquired = lock.acquire(timeout=timeout)
    try:
        yield acquired
    finally:
        if acquired:
            lock.release()


def _shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _refuse_at_once(conn: socket.socket, message: str, *, busy: bool = True) -> None:
    """Refuse a connection without a thread: one non-blocking ERROR (``code: "busy"`` if
    ``busy``), then close (after reading what already arrived, so that closing does not
    reset the connection before the peer reads the ERROR)."""
    meta = {"message": message, **({"code": "busy"} if busy else {})}
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(encode_frame(FrameKind.ERROR, meta))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1 << 16)
    conn.close()


def serve(producer: BatchProducer, *, config: ServiceConfig) -> int:
    """Run a server until SIGTERM or Ctrl-C, then shut down cleanly and print a summary.

    Returns:
        0 (the exit code).
    """
    server = ReaderServer(producer, config=config)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    # only a flag: the handler runs in the main thread between two of its bytecodes, maybe
    # while it holds a lock the handler would wait for (an Event's, when it set one)
    handler: Callable[[int, Any], None] = lambda signum, frame: server.request_stop()  # noqa: E731
    for sig in previous:
        signal.signal(sig, handler)
    try:
        server.start()
        server.serve_forever()
        server._log("shutting down")
    finally:
        stats = server.close()
        for sig, old in previous.items():
            signal.signal(sig, old)
    print(stats.summary(), file=sys.stderr, flush=True)
    return 0
