"""One client of the reader service: its handshake, then its readers, queue and stream.

**The conversation.** ``client: HELLO{token, shard, num_shards, epoch[, holdout][, batch_size]
[, ranks]}`` -> ``server: WELCOME{readers, queue_depth, heartbeat_s, shard, num_shards, epoch
[, batch_size][, splits][, ranks]}`` (or ``ERROR{message[, code]}`` and close: wrong token, bad
request, a batch size the server does not make, server busy) -> ``BATCH``... with ``HEARTBEAT``
frames while no batch is ready -> ``END{batches, samples}``. A reader failure reaches the
client as ``ERROR{message}``; shutting the server down sends ``ERROR`` too. ``holdout`` asks
for one part of the dataset (``{"fraction", "seed", "part": "train" | "held_out"}``, see
:mod:`readers.holdout`); ``splits`` is how many row groups that part holds. A refusal because
of a limit carries ``code: "busy"`` (the client raises
:class:`~readers.service.wire.ServiceBusyError`).

**Ranks.** ``ranks: {rank, world_size, state[, drop_remainder]}`` makes the client rank
``rank`` of a job (``shard``/``num_shards`` are ignored), read at the server's batch size per
rank; a client of one rank with ``drop_remainder: false`` reads the whole stream (evaluation,
see :class:`readers.ranks.RankBatchDataset`) at the HELLO's ``batch_size``, whatever the
server's. ``state`` is its stream position
(:meth:`readers.ranks.RankBatchDataset.state_dict`, saved at any world size and batch size) or
``null`` for the start of ``epoch``. WELCOME answers ``ranks: {rank, world_size, state}`` with
the position resolved (a finished epoch moved to the next, the stream's rows and shuffle
settings filled in); the BATCH frames are the rank's micro-batches from there to the end of the
epoch, in step order (the session relays its readers round-robin, reader ``j`` making steps
``j``, ``j + readers``, ...).

**Before HELLO a connection holds nothing** but its socket and the thread reading it
(:func:`read_hello`): no queue, no semaphore, no shared memory. The whole HELLO must arrive
within ``handshake_timeout_s`` of the start (one deadline, not one per read), the token is
compared in constant time, and only then does a :class:`ClientSession` take its resources.
Every field is checked for its type and bounded (:data:`MAX_SHARDS`, :data:`MAX_WORLD_SIZE`,
:data:`MAX_EPOCH`, unknown fields refused; a ``ranks.state`` checked for its form, then
against the dataset's own stream) before anything is computed from it.
The token is a shared secret against accidental or casual use, not encryption: keep the
service on loopback or a private network.

**Backpressure.** Each session holds at most ``queue_depth`` encoded frames between its readers
and its socket (the one being sent included): a collector thread receives a frame from a
reader's socket only once one of ``queue_depth`` credits is free, and a frame returns its
credit once the session thread has sent it. A slow or stalled client fills its socket buffers,
then the queue, then the readers' socket pairs, then blocks its readers, each holding one more
encoded frame for its writer, however long it stalls.

One concept, over 600 lines: one client's session, from the handshake to the end of its stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import queue as queue_mod
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from readers.holdout import Holdout
from readers.service.config import TOKEN_ENV, ServiceConfig, SessionStats, fmt_bytes
from readers.service.producers import BatchProducer, RankRequest, ShardSpec
from readers.service.reader_process import (
    STOP_GRACE_S,
    PooledReader,
    ReaderPool,
    ThreadCounters,
    run_reader,
)
from readers.service.wire import (
    HELLO_MAX_BYTES,
    Frame,
    FrameKind,
    ProtocolError,
    ServiceError,
    ServiceTimeoutError,
    encode_frame,
    frame_meta,
    recv_frame,
    recv_raw_frame,
)
from recpipe.errors import DataError

__all__ = [
    "AuthenticationError",
    "ClientSession",
    "Request",
    "SessionContext",
    "check_request",
    "read_hello",
    "refuse",
]

JOIN_TIMEOUT_S = 10.0
_LINGER_S = 1.0  # a refused peer has this long to read the ERROR before the socket closes
_POLL_S = 0.2
_HOLDOUT_KEYS = frozenset({"fraction", "seed", "part"})
_RANKS_KEYS = frozenset({"rank", "world_size", "state", "drop_remainder"})
_HELLO_KEYS = frozenset({"token", "shard", "num_shards", "epoch", "holdout", "batch_size", "ranks"})

# What a HELLO may ask for, checked before anything is computed from it.
MAX_SHARDS = 1 << 20  # `num_shards`
MAX_WORLD_SIZE = 1 << 16  # `ranks.world_size`
MAX_EPOCH = (1 << 31) - 1  # `epoch`
MAX_BATCH_SIZE = (1 << 31) - 1  # `batch_size`
MAX_COUNT = 1 << 48  # rows and seeds in a `ranks.state`
_MAX_STATE_BYTES = HELLO_MAX_BYTES - 4096  # a WELCOME carries it back, a resuming HELLO too

SessionState = Literal["streaming", "done", "disconnected", "failed", "stopped"]


@dataclass(frozen=True)
class Request:
    """What an authenticated client asked for in its HELLO.

    Attributes:
        spec: its shard of the epoch (``reader`` 0 of ``num_readers``) and holdout part.
        batch_size: the rows per batch it expects (``None``: whatever the server makes).
        splits: row groups in its holdout part (after :func:`check_request`; ``None``
            without a part).
    """

    spec: ShardSpec
    batch_size: int | None = None
    splits: int | None = None


def read_hello(conn: socket.socket, *, config: ServiceConfig) -> Request:
    """Receive a client's HELLO (within ``handshake_timeout_s`` in all), check its token, parse it.

    Raises:
        AuthenticationError: the token is wrong or missing.
        ServiceError: the HELLO did not arrive in time, or a field is invalid
            (:class:`~readers.service.wire.ProtocolError`).
    """
    deadline = time.monotonic() + config.handshake_timeout_s
    try:
        hello = recv_frame(conn, max_frame_bytes=HELLO_MAX_BYTES, deadline=deadline)
    except ServiceTimeoutError:
        msg = f"no complete HELLO within `handshake_timeout_s`={config.handshake_timeout_s:g} s"
        raise ServiceError(msg) from None
    if hello.kind is not FrameKind.HELLO:
        msg = f"expected a HELLO frame first, got {hello.kind.name}"
        raise ProtocolError(msg)
    _check_token(hello, config.token)
    return _parse_request(hello.meta, num_readers=config.readers_per_client)


class AuthenticationError(ServiceError):
    """A client's HELLO carried no token or a wrong one (the server backs its host off)."""


def _check_token(hello: Frame, expected: str | None) -> None:
    if expected is None:
        return
    given = hello.meta.get("token")
    given_bytes = given.encode(errors="replace") if isinstance(given, str) else b""
    if not hmac.compare_digest(given_bytes, expected.encode()):
        what = "no token" if not given_bytes else "a wrong token"
        msg = f"authentication failed: the client sent {what} (set `token` or ${TOKEN_ENV})"
        raise AuthenticationError(msg)


def _parse_request(meta: dict[str, Any], *, num_readers: int) -> Request:
    unknown = sorted(set(meta) - _HELLO_KEYS)
    if unknown:
        msg = f"HELLO has unknown field(s) {', '.join(map(repr, unknown))[:200]}"
        raise ProtocolError(msg)
    values = {
        "shard": _hello_int(meta, "shard", 0, MAX_SHARDS - 1),
        "num_shards": _hello_int(meta, "num_shards", 1, MAX_SHARDS, default=1),
        "epoch": _hello_int(meta, "epoch", 0, MAX_EPOCH),
    }
    if not values["shard"] < values["num_shards"]:
        msg = f"HELLO asks for shard {values['shard']} of {values['num_shards']}"
        raise ProtocolError(msg)
    batch_size = meta.get("batch_size")
    if batch_size is not None:
        batch_size = _hello_int(meta, "batch_size", 1, MAX_BATCH_SIZE)
    ranks = _parse_ranks(meta.get("ranks"))
    if ranks is not None:
        values["shard"], values["num_shards"] = ranks.rank, ranks.world_size
        ranks = dataclasses.replace(ranks, batch_size=batch_size)
    spec = ShardSpec(
        values["shard"], values["num_shards"], 0, num_readers, values["epoch"],
        _parse_holdout(meta.get("holdout")), ranks,
    )  # fmt: skip
    return Request(spec, batch_size)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hello_int(meta: dict[str, Any], name: str, least: int, most: int, *, default: int = 0) -> int:
    """Integer field ``name`` of a HELLO (or of a dict in it), in ``[least, most]``."""
    value = meta.get(name, default)
    if not _is_int(value) or not least <= value <= most:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(least, "an integer")
        msg = f"HELLO field `{name}` must be {what} (at most {most:,}), got {value!r:.50}"
        raise ProtocolError(msg)
    return value


def _parse_ranks(value: Any) -> RankRequest | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= _RANKS_KEYS:
        msg = (
            "HELLO field `ranks` must be {rank, world_size, state[, drop_remainder]}, got "
            f"{value!r:.100}"
        )
        raise ProtocolError(msg)
    rank, world = value.get("rank"), value.get("world_size")
    if not _is_int(rank) or not _is_int(world) or not 0 <= rank < world:
        msg = f"HELLO field `ranks` needs 0 <= rank < world_size, got {value!r:.100}"
        raise ProtocolError(msg)
    if world > MAX_WORLD_SIZE:
        msg = (
            f"HELLO field `ranks.world_size` must be at most {MAX_WORLD_SIZE:,} ranks, "
            f"got {world!r}"
        )
        raise ProtocolError(msg)
    state = value.get("state")
    if state is not None:
        _check_state_shape(state)
    drop = value.get("drop_remainder", True)
    if not isinstance(drop, bool) or (not drop and world > 1):
        msg = f"HELLO field `ranks.drop_remainder` must be true, or false for one rank, got {drop!r:.20}"
        raise ProtocolError(msg)
    return RankRequest(rank, world, state, drop_remainder=drop)


def _check_state_shape(state: Any) -> None:
    """Check a stream position's form and bounds (not yet against the dataset, see
    :meth:`~readers.service.producers.DatasetProducer.rank_state`)."""
    from readers.ranks import state_problem

    problem = state_problem(state)
    if problem is None:
        big = [k for k, v in state.items() if _is_int(v) and not -MAX_COUNT <= v <= MAX_COUNT]
        problem = f"`state` has an invalid `{big[0]}` {state[big[0]]!r:.50}" if big else None
    if problem is not None:
        msg = f"HELLO field `ranks.state`: {problem}"
        raise ProtocolError(msg)


def _parse_holdout(value: Any) -> Holdout | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= _HOLDOUT_KEYS or "fraction" not in value:
        msg = f"HELLO field `holdout` must be {{fraction, seed, part}}, got {value!r:.100}"
        raise ProtocolError(msg)
    try:
        return Holdout(**value)
    except DataError as exc:
        msg = f"HELLO field `holdout` is invalid: {exc}"
        raise ProtocolError(msg) from None


def check_request(request: Request, producer: BatchProducer) -> Request:
    """Check what an authenticated client asks for against what ``producer`` makes.

    Returns:
        ``request``, with ``splits`` filled in for a holdout part.

    Raises:
        ServiceError: another batch size than the producer's, a holdout part from a producer
            without row groups, or a dataset that cannot be divided as asked.
    """
    made = getattr(producer, "batch_size", None)
    ranks = request.spec.ranks
    if (
        (ranks is None or ranks.drop_remainder)  # a whole-stream reader (evaluation) reads at
        and request.batch_size is not None  # the batch size it asks for
        and made is not None
        and request.batch_size != made
    ):
        msg = (
            f"the client expects batches of {request.batch_size} rows but this server makes "
            f"batches of {made} (`--batch-size`): start both with the same batch size"
        )
        raise ServiceError(msg)
    request = _check_ranks(request, producer)
    holdout = request.spec.holdout
    if holdout is None:
        return request
    count_splits: Callable[[Holdout], int] | None = getattr(producer, "count_splits", None)
    if count_splits is None:
        msg = (
            f"this server's producer ({type(producer).__name__}) has no row groups to hold "
            f"out; serve a dataset to ask for the `{holdout.part}` part"
        )
        raise ServiceError(msg)
    try:
        splits = count_splits(holdout)
    except Exception as exc:  # an unreadable dataset, too few row groups: say so, by name
        msg = f"cannot serve the `{holdout.part}` part: {type(exc).__name__}: {exc}"
        raise ServiceError(msg) from None
    return dataclasses.replace(request, splits=splits)


def _check_ranks(request: Request, producer: BatchProducer) -> Request:
    """Resolve a rank client's position (its layout for its world size), or refuse it."""
    spec = request.spec
    if spec.ranks is None:
        return request
    rank_state: Callable[..., dict[str, Any]] | None = getattr(producer, "rank_state", None)
    if rank_state is None:
        msg = (
            f"this server's producer ({type(producer).__name__}) cannot serve the ranks of a "
            "job: serve a dataset"
        )
        raise ServiceError(msg)
    try:
        state = rank_state(spec.ranks, epoch=spec.epoch, holdout=spec.holdout)
    except Exception as exc:  # a foreign state, an unreadable dataset: say so, by name
        msg = f"cannot serve rank {spec.ranks.rank}: {type(exc).__name__}: {exc}"
        raise ServiceError(msg) from None
    size = len(orjson.dumps(state))
    if size > _MAX_STATE_BYTES:
        msg = (
            f"the position of rank {spec.ranks.rank} of {spec.ranks.world_size} takes {size:,} "
            f"bytes, more than a handshake frame holds ({_MAX_STATE_BYTES:,}): use fewer ranks"
        )
        raise ServiceError(msg)
    ranks = dataclasses.replace(spec.ranks, state=state)
    spec = dataclasses.replace(spec, epoch=int(state["epoch"]), ranks=ranks)
    return dataclasses.replace(request, spec=spec)


def refuse(conn: socket.socket, message: str, *, busy: bool = False) -> None:
    """Send ``ERROR{message}`` (with ``code: "busy"`` if ``busy``) and half-close, reading what
    the peer still sends for a bounded time, so that closing does not reset the connection and
    destroy the ERROR frame before the peer reads it."""
    meta: dict[str, Any] = {"message": message}
    if busy:
        meta["code"] = "busy"
    deadline = time.monotonic() + _LINGER_S
    with contextlib.suppress(OSError):
        conn.settimeout(_LINGER_S)
        conn.sendall(encode_frame(FrameKind.ERROR, meta))
        conn.shutdown(socket.SHUT_WR)
        for _ in range(64):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            if not conn.recv(1 << 16):
                break


@dataclass(frozen=True)
class SessionContext:
    """What a :class:`ClientSession` needs from its server.

    Attributes:
        config: the server's settings.
        producer: what reader threads run (``readers=0``).
        pool: where reader processes are lent from and given back to.
        closing: set when the server shuts down.
        log: writes one progress line.
        count: adds ``(batches, samples, bytes)`` sent to the server's totals.
    """

    config: ServiceConfig
    producer: BatchProducer
    pool: ReaderPool
    closing: threading.Event
    log: Callable[[str], None]
    count: Callable[[int, int, int], None]


class _ShuttingDown(Exception):
    """The server is closing; tell the client and stop."""


class ClientSession:
    """One authenticated client: its readers, its queue and the stream to its socket.

    :meth:`run` (on the connection's thread) says WELCOME, starts the readers, relays their
    frames until every reader has ended, says END, and gives the readers back. The caller
    owns ``conn`` and closes it afterwards.

    Args:
        conn: the client's socket, after its HELLO.
        peer: ``host:port`` of the client, for messages.
        request: what it asked for (see :func:`check_request`).
        context: the server's side of things.
    """

    def __init__(
        self, conn: socket.socket, peer: str, request: Request, context: SessionContext
    ) -> None:
        self.conn, self.peer, self.request, self.ctx = conn, peer, request, context
        self.spec = request.spec
        self.state: SessionState = "streaming"
        self.batches = self.samples = self.bytes_sent = 0
        self.peak_frames = self.peak_bytes = 0
        self.held_frames = self.held_bytes = 0  # received from readers, not yet sent
        self.stop = threading.Event()
        self.backpressure = threading.Event()
        self.counters = ThreadCounters()  # frames, bytes written by reader threads
        self.pooled: list[PooledReader] = []  # reader processes lent by the server
        self.pooled_base: list[int] = []  # their frame counters when lent
        self.released = False  # the readers went back to the server (or were stopped)
        self.pooled_produced = 0  # frames they wrote for this session, counted at release
        self.ready: queue_mod.Queue[tuple[str, Any, Any]] = queue_mod.Queue()
        self.credits = threading.Semaphore(context.config.queue_depth)
        self.held_lock = threading.Lock()
        self.socks: list[socket.socket] = []  # the session's ends of the readers' sockets
        self.reader_socks: list[socket.socket] = []  # the readers' ends (reader threads only)
        self.collector: threading.Thread | None = None
        self.workers: list[Any] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve the client to the end (done, disconnected, failed or stopped)."""
        try:
            self._welcome()
            self._start_readers()
            self._stream()
        except _ShuttingDown:
            self.state = "stopped"
            self._send_quietly(FrameKind.ERROR, {"message": "the reader service is shutting down"})
        except OSError as exc:  # the client went away (reset, broken pipe, shut down)
            self.state = "disconnected" if not self.ctx.closing.is_set() else "stopped"
            self.ctx.log(
                f"client {self.peer} disconnected after {self.batches} batches ({exc.__class__.__name__})"
            )
        except Exception as exc:  # a bug or a reader that cannot start: tell the client
            self.state = "failed"
            self.ctx.log(f"client {self.peer}: internal error: {type(exc).__name__}: {exc}")
            self._send_quietly(FrameKind.ERROR, {"message": f"internal error: {exc}"})
        finally:
            self._stop_readers()

    def _welcome(self) -> None:
        cfg = self.ctx.config
        self.conn.settimeout(None)  # a stalled client blocks the sender (backpressure)
        welcome: dict[str, Any] = {
            "readers": self.spec.num_readers,
            "queue_depth": cfg.queue_depth,
            "heartbeat_s": cfg.heartbeat_s,
            "shard": self.spec.shard,
            "num_shards": self.spec.num_shards,
            "epoch": self.spec.epoch,
        }
        made = getattr(self.ctx.producer, "batch_size", None)
        if self.spec.ranks is not None and self.spec.ranks.batch_size is not None:
            made = self.spec.ranks.batch_size
        if made is not None:
            welcome["batch_size"] = made
        if self.request.splits is not None:
            welcome["splits"] = self.request.splits
        ranks = self.spec.ranks
        if ranks is not None:
            welcome["ranks"] = {"rank": ranks.rank, "world_size": ranks.world_size,
                                "state": ranks.state}  # fmt: skip
        self._send(encode_frame(FrameKind.WELCOME, welcome))

    def _start_readers(self) -> None:
        cfg = self.ctx.config
        in_process = cfg.readers == 0
        if not in_process:
            self.pooled = self.ctx.pool.take(self.spec.num_readers)
        for reader in range(self.spec.num_readers):
            mine, theirs = socket.socketpair()
            self.socks.append(mine)
            spec = dataclasses.replace(self.spec, reader=reader)
            if in_process:
                self.reader_socks.append(theirs)
                worker = threading.Thread(
                    target=run_reader,
                    args=(self.ctx.producer, spec, theirs, self.stop, self.counters),
                    kwargs={
                        "narrow": cfg.narrow,
                        "max_frame_bytes": cfg.max_frame_bytes,
                        "in_process": True,
                    },
                    name=f"recpipe-reader-{self.spec.shard}.{reader}",
                    daemon=True,
                )
                worker.start()
                self.workers.append(worker)
            else:
                pooled = self.pooled[reader]
                self.pooled_base.append(pooled.frames())
                pooled.assign(spec, theirs)
                self.workers.append(pooled.process)
                theirs.close()  # the reader has its own copy; EOF means it is gone
        collector = threading.Thread(
            target=self._collect, name=f"recpipe-collect-{self.peer}", daemon=True
        )
        collector.start()
        self.collector = collector

    # -- readers -> queue (the collector thread) ----------------------------------------------
    def _collect(self) -> None:
        """Move frames from the readers' sockets to :attr:`ready`, ``queue_depth`` at most.

        Items: ``("batch", frame, rows)``, ``("end", reader, batches)``, ``("error", reader,
        message)``. A frame is received only once a credit is free (returned when the frame
        has been sent), so the session never holds more than ``queue_depth`` frames; beyond
        that the readers block on their sockets. A rank client's frames are taken from its
        readers in turn (:meth:`_collect_in_order`).
        """
        if self.spec.ranks is not None:
            self._collect_in_order()
            return
        with selectors.DefaultSelector() as selector:
            for reader, sock in enumerate(self.socks):
                selector.register(sock, selectors.EVENT_READ, reader)
            while selector.get_map() and not self.stop.is_set():
                for key, _ in selector.select(timeout=_POLL_S):
                    if not self._take_credit():
                        return
                    item = self._receive(key.fileobj, key.data)
                    if item is None:
                        return
                    if item[0] != "batch":
                        self.credits.release()
                        selector.unregister(key.fileobj)
                    self.ready.put(item)
                    if item[0] == "error":
                        return

    def _collect_in_order(self) -> None:
        """Frames from reader 0, 1, ..., 0, 1, ...: reader ``j`` makes the rank's steps ``j``,
        ``j + readers``, ..., so taking them in turn gives the steps in order. A reader that
        ended is passed over (the ones after it in the turn end too: they have no later
        step)."""
        live = list(range(len(self.socks)))
        while live and not self.stop.is_set():
            for reader in list(live):
                if not self._take_credit():
                    return
                item = self._receive(self.socks[reader], reader)
                if item is None:
                    return
                if item[0] != "batch":
                    self.credits.release()
                    live.remove(reader)
                self.ready.put(item)
                if item[0] == "error":
                    return

    def _take_credit(self) -> bool:
        if self.credits.acquire(blocking=False):
            return True
        self.backpressure.set()
        while not self.stop.is_set():
            if self.credits.acquire(timeout=_POLL_S):
                return True
        return False

    def _receive(self, sock: Any, reader: int) -> tuple[str, Any, Any] | None:
        """One item from reader ``reader``'s socket; ``None`` when the session is stopping."""
        try:
            kind, frame = recv_raw_frame(sock, max_frame_bytes=self.ctx.config.max_frame_bytes)
            meta = frame_meta(frame)
        except (ServiceError, OSError) as exc:
            if self.stop.is_set():
                return None
            if isinstance(exc, ProtocolError):
                return ("error", reader, f"it sent a bad frame: {exc}")
            worker = self.workers[reader]
            worker.join(1.0)
            code = getattr(worker, "exitcode", None)
            return ("error", reader, f"it went away (exit code {code}): {exc}")
        if kind is FrameKind.BATCH:
            with self.held_lock:
                self.held_frames += 1
                self.held_bytes += len(frame)
                self.peak_frames = max(self.peak_frames, self.held_frames)
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            return ("batch", frame, int(meta.get("rows", 0)))
        if kind is FrameKind.END:
            return ("end", reader, meta.get("batches"))
        if kind is FrameKind.ERROR:
            return ("error", reader, meta.get("message"))
        return ("error", reader, f"it sent an unexpected {kind.name} frame")

    # -- queue -> client (the session thread) -------------------------------------------------
    def _stream(self) -> None:
        cfg = self.ctx.config
        ended = 0
        while ended < len(self.workers):
            if self.ctx.closing.is_set():
                raise _ShuttingDown
            try:
                kind, payload, extra = self.ready.get(timeout=cfg.heartbeat_s)
            except queue_mod.Empty:
                died = self._dead_worker()
                if died is not None:
                    self._fail(died)
                    return
                self._send(encode_frame(FrameKind.HEARTBEAT))
                continue
            if kind == "batch":
                rows = extra
                self._send_batch(payload)
                self.batches += 1
                self.samples += rows
                self.ctx.count(1, rows, len(payload))
            elif kind == "end":
                ended += 1
            else:  # "error"
                self._fail(f"reader {payload} of shard {self.spec.shard} failed: {extra}")
                return
        end = {"batches": self.batches, "samples": self.samples}
        self._send(encode_frame(FrameKind.END, end))
        self.state = "done"
        self.ctx.log(
            f"client {self.peer} (shard {self.spec.shard}/{self.spec.num_shards}, epoch "
            f"{self.spec.epoch}, {self.part}): done, {self.batches} batches, "
            f"{self.samples:,} samples, {fmt_bytes(self.bytes_sent)}"
        )

    def _send_batch(self, frame: bytearray) -> None:
        """Send one BATCH frame, then free its credit."""
        try:
            self._send(frame)
        finally:
            with self.held_lock:
                self.held_frames -= 1
                self.held_bytes -= len(frame)
            self.credits.release()

    def _dead_worker(self) -> str | None:
        """Why a reader process died without saying so (killed, out of memory), if one did."""
        for worker in self.workers:
            code = getattr(worker, "exitcode", None)
            if code:
                return f"reader process {worker.name} died with exit code {code}"
        return None

    def _fail(self, message: str) -> None:
        self.state = "failed"
        self.ctx.log(f"client {self.peer}: {message}")
        self._send(encode_frame(FrameKind.ERROR, {"message": message}))

    def _send(self, frame: bytes | bytearray) -> None:
        self.conn.sendall(frame)
        self.bytes_sent += len(frame)

    def _send_quietly(self, kind: FrameKind, meta: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.conn.settimeout(1.0)
            self._send(encode_frame(kind, meta))

    def _stop_readers(self) -> None:
        self.stop.set()
        for sock in self.socks:  # a reader blocked writing gets EPIPE; the collector wakes
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.collector is not None:
            self.collector.join(JOIN_TIMEOUT_S)
        deadline = time.monotonic() + STOP_GRACE_S
        if self.pooled:  # idle again within the grace: back to the server; else stopped
            self.pooled_produced = self._pooled_produced()
            for pooled in self.pooled:
                idle = pooled.wait_idle(max(deadline - time.monotonic(), 0.0))
                self.ctx.pool.give_back(pooled, idle=idle)
        else:  # reader threads: they stop at their next write (the socket is shut down)
            for worker in self.workers:
                worker.join(timeout=max(deadline - time.monotonic(), 0.0))
            for worker in self.workers:
                worker.join(timeout=JOIN_TIMEOUT_S)
        self.released = True
        for sock in self.socks + self.reader_socks:
            sock.close()

    def shutdown_socket(self) -> None:
        """Unblock a sender stuck on a stalled client (used when the server closes)."""
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)

    # -- introspection ------------------------------------------------------------------------
    @property
    def part(self) -> str:
        """The part of the dataset asked for: ``"all"``, ``"train"`` or ``"held_out"``."""
        return "all" if self.spec.holdout is None else self.spec.holdout.part

    def stats(self) -> SessionStats:
        """A snapshot of this client's counters."""
        with self.counters.get_lock():
            produced = self.counters[0]
        produced += self.pooled_produced if self.released else self._pooled_produced()
        if self.pooled and self.released:
            alive = 0  # lent back to the server: none runs for this session
        else:
            alive = sum(1 for w in self.workers if _worker_alive(w))
        return SessionStats(
            client=self.peer,
            shard=self.spec.shard,
            num_shards=self.spec.num_shards,
            epoch=self.spec.epoch,
            state=self.state,
            batches=self.batches,
            samples=self.samples,
            bytes_sent=self.bytes_sent,
            produced=produced,
            peak_queued_frames=self.peak_frames,
            peak_queued_bytes=self.peak_bytes,
            backpressured=self.backpressure.is_set(),
            readers_alive=alive,
            reader_pids=tuple(p.process.pid for p in self.pooled),
            part=self.part,
        )

    def _pooled_produced(self) -> int:
        return sum(p.frames() - b for p, b in zip(self.pooled, self.pooled_base))


def _worker_alive(worker: Any) -> bool:
    try:
        return worker.is_alive()
    except ValueError:  # a closed Process object
        return False
