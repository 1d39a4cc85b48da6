"""The reader service: ``recpipe serve`` streams preprocessed batches to trainers over TCP.

Reader processes (``multiprocessing``, spawn) run the reader pipeline and encode each
:class:`~recpipe.batch.Batch` into a frame (:mod:`readers.wire`: raw tensor buffers behind a
small header, no pickle on the wire). The server relays the frames to its clients; a trainer
reads them through :class:`ServiceDataset`, an ``IterableDataset`` for its DataLoader::

    $ recpipe serve data/demo/dataset --readers 2 --token s3cret        # on the reader host
    recpipe serve: listening on 127.0.0.1:5717 ...

    loader = DataLoader(ServiceDataset("127.0.0.1", 5717, token="s3cret"), batch_size=None)

**Clients and shards.** Every connection is its own stream: it names a shard of the epoch
(``shard`` of ``num_shards``, from the trainer's rank/world size and its DataLoader worker) and
an epoch number, and the server gives ``readers`` reader processes to that connection alone,
each producing a disjoint part of the shard (row groups dealt round-robin: shards, then
readers). So several trainers can read at once, the shards of an epoch together deliver every
row exactly once, and a client that goes away stops only its own readers. Two clients asking
for the same shard each get all of it.

**Warm readers.** Reader processes outlive their clients: the server starts ``readers`` of
them with itself, each first runs a few batches through the pipeline and drops them
(:meth:`DatasetProducer.warm_up`), and a client's readers go back to the server when it is done
or disconnects, to serve the next client (a trainer connects once per epoch and DataLoader
worker). Up to ``idle_readers`` are kept; a reader that died or does not stop within a grace is
replaced. Measured (benchmarks/service.py, ``kept_reader``): a client that gets a kept reader
has its first batch in 0.09-0.21 s instead of ~2.3 s. Warm-up targets a fresh process's first
epoch costing more CPU per batch (kernel loading, memory pools growing): 1.24x in one run, but
0.90-1.20x with or without warm-up in later ones, i.e. within noise. A job reaches a kept reader as a pickled :class:`ShardSpec` and
the socket to its session, passed as a file descriptor over a pipe between the server and its
own reader processes (the TCP wire to clients carries no pickle).

**The conversation.** ``client: HELLO{token, shard, num_shards, epoch}`` ->
``server: WELCOME`` (or ``ERROR`` and close: wrong token, bad shard, server full) ->
``BATCH``... with ``HEARTBEAT`` frames while no batch is ready -> ``END{batches, samples}``.
A reader failure reaches the client as ``ERROR{message}``; shutting the server down sends
``ERROR`` too. The token is compared in constant time; it is a shared secret against
accidental or casual use, not encryption: keep the service on loopback or a private network.

**The reader -> server hop.** Each reader writes its frames to its own socket pair with the
session, straight from the tensors' memory (scatter-gather, no join, no pickle), from a writer
thread so that producing the next batch overlaps sending this one; a collector
thread per session receives each frame whole into one buffer and the session thread relays
those bytes to the client unchanged. (Through a ``multiprocessing.Queue`` a frame was joined,
pickled, piped, unpickled: several more copies of ~0.75 MB per B=4096 batch.)

**Backpressure.** Each connection holds at most ``queue_depth`` encoded frames between its
readers and its socket (the one being sent included): the collector receives a frame only
once one of ``queue_depth`` credits is free, and a frame returns its credit once sent. A slow
or stalled client fills its socket buffers, then the queue, then the readers' socket pairs
(less than a frame each for B=4096 batches), then blocks its readers, each holding one more
encoded frame for its writer, however long it stalls.

**Shutdown.** SIGTERM or Ctrl-C closes the listener, tells every client (``ERROR``), stops and
joins the reader processes (kept ones too), closes the sockets and prints a summary. A progress line goes to
stderr every ``report_every_s`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hmac
import itertools
import multiprocessing
import os
import queue as queue_mod
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO

import torch
from torch.utils.data import IterableDataset, get_worker_info

from readers.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Frame,
    FrameKind,
    ProtocolError,
    ServiceError,
    batch_to_frame,
    encode_frame,
    frame_meta,
    frame_to_batch,
    recv_frame,
    recv_raw_frame,
    send_buffers,
)
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = [
    "TOKEN_ENV",
    "BatchProducer",
    "DatasetProducer",
    "ReaderServer",
    "ServerStats",
    "ServiceClient",
    "ServiceConfig",
    "ServiceDataset",
    "SessionStats",
    "ShardSpec",
    "SyntheticProducer",
    "register_cli",
]

TOKEN_ENV = "RECPIPE_TOKEN"
_HELLO_MAX_BYTES = 64 * 1024  # a HELLO is a few hundred bytes; refuse anything bigger
_JOIN_TIMEOUT_S = 10.0
_STOP_GRACE_S = 2.0  # readers hold nothing worth saving: after this they are terminated


# -- what readers produce -----------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSpec:
    """The part of an epoch one reader produces.

    A client reads shard ``shard`` of ``num_shards``; its ``num_readers`` readers split that
    shard further, reader ``reader`` taking its own part. Flattened, reader ``reader`` of
    shard ``shard`` is part ``shard * num_readers + reader`` of ``num_shards * num_readers``.
    """

    shard: int = 0
    num_shards: int = 1
    reader: int = 0
    num_readers: int = 1
    epoch: int = 0

    @property
    def part(self) -> int:
        """This reader's part of the epoch, in ``[0, num_parts)``."""
        return self.shard * self.num_readers + self.reader

    @property
    def num_parts(self) -> int:
        """Parts the epoch is split into, over all shards and readers."""
        return self.num_shards * self.num_readers


class BatchProducer(Protocol):
    """What a reader process runs: a picklable callable yielding the batches of one part."""

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]: ...


@dataclass(frozen=True)
class DatasetProducer:
    """The reader pipeline over a clustered dataset (:func:`readers.dataset.iter_batches`).

    Attributes:
        dataset: the clustered dataset directory (DESIGN §2.3).
        batch_size: rows per batch.
        dedup: ``True``: one IKJT per dedup group of the schema; ``False``: one plain KJT.
        preprocess: the preprocessing pipeline: a config file, a list of ``[[preprocess]]``
            entries (see ``readers.transforms.Pipeline.from_config``), or ``None``.
        schema: a schema TOML file, or ``None`` for the schema in the dataset's manifest.
        shuffle: shuffle row groups and sessions (seeded; the epoch is mixed in).
        seed: the shuffle seed.
        warmup_batches: batches a new reader process runs through the pipeline and drops
            before its first client (see :meth:`warm_up`); 0 turns it off.
        read_ahead: row groups a reader process decodes ahead in a second thread
            (:class:`readers.source.ReaderConfig`; 0: one thread per reader process).
    """

    dataset: str
    batch_size: int = 4096
    dedup: bool = True
    preprocess: str | Sequence[Mapping[str, Any]] | None = None
    schema: str | None = None
    shuffle: bool = False
    seed: int = 0
    warmup_batches: int = 20
    read_ahead: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.warmup_batches, bool) or not (
            isinstance(self.warmup_batches, int) and self.warmup_batches >= 0
        ):
            msg = f"`warmup_batches` must be a non-negative integer, got {self.warmup_batches!r}"
            raise DataError(msg)
        from readers.source import ReaderConfig

        ReaderConfig(read_ahead=self.read_ahead)  # checks it here, not in a reader process

    def warm_up(self) -> None:
        """Run the first ``warmup_batches`` batches of the epoch through the pipeline and drop
        them. A fresh process loads its compiled kernels and grows its memory pools on first
        use (measured once at 1.24x the CPU per batch of the next; within noise since). The
        default, 20, crosses one 65,536-row group at B=4096. Errors are left to the first
        client's run."""
        with contextlib.suppress(Exception):
            for _ in itertools.islice(self(ShardSpec()), self.warmup_batches):
                pass

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]:
        """Yield the batches of ``spec``'s part of the epoch."""
        from readers.dataset import iter_batches
        from readers.source import ReaderConfig
        from schemas import load_schema

        config = ReaderConfig(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            read_ahead=self.read_ahead,
        )
        return iter_batches(
            self.dataset,
            schema=None if self.schema is None else load_schema(self.schema),
            config=config,
            transforms=self.preprocess,
            dedup=self.dedup,
            rank=spec.shard,
            world_size=spec.num_shards,
            worker_id=spec.reader,
            num_workers=spec.num_readers,
            epoch=spec.epoch,
        )


@dataclass(frozen=True)
class SyntheticProducer:
    """Deterministic synthetic batches, to exercise the service without a dataset.

    Batch ``i`` of the epoch goes to part ``i % num_parts``. Rows are numbered through the
    epoch and the row number is stored in ``dense[:, 0]`` (exact up to 2**24 rows), so a test
    can count rows. Sessions hold ``rows_per_session`` consecutive rows and share their
    ``user_*`` lists, which form one dedup group (``"user"``) when ``dedup`` is on.

    Attributes:
        num_batches: batches per epoch.
        batch_size: rows per batch.
        num_dense: dense features (at least 1).
        rows_per_session: rows per session.
        list_len: maximum length of the user lists.
        dedup: put the user lists in an IKJT group instead of the plain KJT.
        seed: the seed; the epoch and batch index are mixed in.
    """

    num_batches: int = 16
    batch_size: int = 256
    num_dense: int = 4
    rows_per_session: int = 8
    list_len: int = 32
    dedup: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_dense", "rows_per_session", "list_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise DataError(msg)
        if not isinstance(self.num_batches, int) or self.num_batches < 0:
            msg = f"`num_batches` must be a non-negative integer, got {self.num_batches!r}"
            raise DataError(msg)

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]:
        """Yield the batches of ``spec``'s part of the epoch."""
        for index in range(spec.part, self.num_batches, spec.num_parts):
            yield self.make_batch(index, epoch=spec.epoch)

    def make_batch(self, index: int, *, epoch: int = 0) -> Batch:
        """Batch ``index`` of epoch ``epoch`` (the same on every call)."""
        from recpipe.batch import Batch
        from recpipe.ikjt import InverseKeyedJaggedTensor
        from recpipe.jagged import KeyedJaggedTensor

        gen = torch.Generator().manual_seed(hash((self.seed, epoch, index)) & 0x7FFFFFFF)
        b = self.batch_size
        rows = torch.arange(index * b, (index + 1) * b, dtype=torch.int64)
        sessions = rows // self.rows_per_session
        first = int(sessions[0])
        num_sessions = int(sessions[-1]) - first + 1
        dense = torch.rand((b, self.num_dense), generator=gen)
        dense[:, 0] = rows.to(torch.float32)
        labels = (torch.rand(b, generator=gen) < 0.3).to(torch.float32)
        plain_lengths = torch.cat(
            [torch.ones(b, dtype=torch.int64), torch.randint(0, 5, (b,), generator=gen)]
        )
        plain = KeyedJaggedTensor(
            ["item_id", "item_tags"],
            torch.randint(0, 1 << 40, (int(plain_lengths.sum()),), generator=gen),
            plain_lengths,
        )
        # (S sessions) lists, then one copy per row of the session
        user_lengths = torch.randint(0, self.list_len + 1, (2 * num_sessions,), generator=gen)
        per_session = KeyedJaggedTensor(
            ["user_items", "user_sellers"],
            torch.randint(0, 1 << 20, (int(user_lengths.sum()),), generator=gen),
            user_lengths,
        )
        user = per_session.index_select(sessions - first)
        if self.dedup:
            kjt, ikjts = plain, {"user": InverseKeyedJaggedTensor.from_kjt(user)}
        else:
            kjt, ikjts = KeyedJaggedTensor.concat([plain, user]), {}
        return Batch(dense=dense, labels=labels, kjt=kjt, ikjts=ikjts, session_ids=sessions)


# -- configuration ------------------------------------------------------------------------------
@dataclass
class ServiceConfig:
    """Settings of a :class:`ReaderServer`.

    Attributes:
        host: address to listen on (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`ReaderServer.address`).
        readers: reader processes per client; 0 produces in one thread of the server process
            (no extra processes: for tests and debugging).
        idle_readers: reader processes kept running between clients, warm: started with the
            server (``readers`` of them), handed to the next client when one disconnects or
            finishes. ``None``: ``readers`` (one client's worth); 0: a client's readers start
            with it and stop after it.
        queue_depth: encoded frames buffered per client between its readers and its socket.
        token: shared secret a client must present; ``None`` accepts every client.
        max_frame_bytes: largest frame produced or accepted.
        max_clients: connections served at once; more are refused with a clear error.
        heartbeat_s: a client hears from the server at least this often (HEARTBEAT frames).
        handshake_timeout_s: a connection that does not say HELLO in time is dropped.
        report_every_s: seconds between progress lines on stderr; 0 turns them off.
        send_buffer_bytes: the sockets' ``SO_SNDBUF``, or ``None`` for the system default.
        narrow: send int64 tensors that fit as int32 (exact; see :func:`readers.wire.batch_to_frame`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    readers: int = 2
    idle_readers: int | None = None
    queue_depth: int = 8
    token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_clients: int = 64
    heartbeat_s: float = 1.0
    handshake_timeout_s: float = 10.0
    report_every_s: float = 10.0
    send_buffer_bytes: int | None = None
    narrow: bool = True

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool]] = [
            ("port", isinstance(self.port, int) and 0 <= self.port <= 65535),
            ("readers", isinstance(self.readers, int) and self.readers >= 0),
            (
                "idle_readers",
                self.idle_readers is None
                or (isinstance(self.idle_readers, int) and self.idle_readers >= 0),
            ),
            ("queue_depth", isinstance(self.queue_depth, int) and self.queue_depth >= 1),
            (
                "max_frame_bytes",
                isinstance(self.max_frame_bytes, int) and self.max_frame_bytes > 1024,
            ),
            ("max_clients", isinstance(self.max_clients, int) and self.max_clients >= 1),
            ("heartbeat_s", self.heartbeat_s > 0),
            ("handshake_timeout_s", self.handshake_timeout_s > 0),
            ("report_every_s", self.report_every_s >= 0),
            ("send_buffer_bytes", self.send_buffer_bytes is None or self.send_buffer_bytes > 0),
        ]
        for name, ok in checks:
            if not ok:
                msg = f"`{name}` has an invalid value {getattr(self, name)!r}"
                raise DataError(msg)
        if self.token is not None and not self.token:
            msg = "`token` must be a non-empty string or None, got ''"
            raise DataError(msg)

    @property
    def kept_readers(self) -> int:
        """How many idle reader processes the server keeps (0 without reader processes)."""
        if not self.readers:
            return 0
        return self.readers if self.idle_readers is None else self.idle_readers


# -- statistics ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionStats:
    """One client connection, as the server sees it.

    Attributes:
        client: the peer's ``host:port``.
        shard, num_shards, epoch: what the client asked for.
        state: ``"streaming"``, ``"done"`` (END sent), ``"disconnected"`` (the client went
            away), ``"failed"`` (a reader failed; the client was told) or ``"stopped"``.
        batches, samples, bytes_sent: what was sent (bytes include framing).
        produced: frames the readers wrote to their sockets.
        peak_queued_frames, peak_queued_bytes: most frames / bytes held by the session at once
            (received from the readers, not yet sent; the one being sent included).
        backpressured: the queue was found full at least once (the readers had to wait).
        readers_alive: reader processes/threads still running.
    """

    client: str
    shard: int
    num_shards: int
    epoch: int
    state: str
    batches: int
    samples: int
    bytes_sent: int
    produced: int
    peak_queued_frames: int
    peak_queued_bytes: int
    backpressured: bool
    readers_alive: int


@dataclass(frozen=True)
class ServerStats:
    """A snapshot of the whole server (see :meth:`ReaderServer.stats`)."""

    address: tuple[str, int]
    elapsed_s: float
    clients_total: int
    clients_active: int
    rejected: int
    batches: int
    samples: int
    bytes_sent: int
    sessions: tuple[SessionStats, ...]
    reader_processes_started: int = 0  # over the server's life (kept ones serve many clients)
    reader_processes_idle: int = 0  # kept warm for the next client right now

    def summary(self) -> str:
        """A short multi-line summary for the end of a run."""
        rate = self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0
        per_sample = self.bytes_sent / self.samples if self.samples else 0.0
        lines = [
            f"recpipe serve: summary ({self.elapsed_s:.1f} s on {self.address[0]}:{self.address[1]})",
            f"  clients         {self.clients_total} served, {self.rejected} refused",
            f"  batches         {self.batches:,}",
            f"  samples         {self.samples:,} ({rate:,.0f} samples/s)",
            f"  bytes sent      {_fmt_bytes(self.bytes_sent)} ({per_sample:,.1f} B/sample)",
            f"  reader procs    {self.reader_processes_started} started",
        ]
        states: dict[str, int] = {}
        for session in self.sessions:
            states[session.state] = states.get(session.state, 0) + 1
        if states:
            lines.append(
                "  sessions        " + ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
            )
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:,.1f} TB"  # pragma: no cover


# -- reader side --------------------------------------------------------------------------------
class _SessionGone(Exception):
    """The session closed its end of the reader's socket: stop quietly."""


class _Writer(threading.Thread):
    """Writes a reader's frames to its socket, so that producing the next batch overlaps
    sending this one. Holds one frame at most, besides the one it is writing."""

    def __init__(self, sock: socket.socket, counters: Any) -> None:
        super().__init__(name="recpipe-reader-writer", daemon=True)
        self.sock, self.counters = sock, counters
        self.outbox: queue_mod.Queue[tuple[Sequence[memoryview | bytes], int] | None] = (
            queue_mod.Queue(1)
        )
        self.gone = threading.Event()

    def run(self) -> None:
        while (item := self.outbox.get()) is not None:
            buffers, batch_bytes = item
            try:
                send_buffers(self.sock, buffers)
            except OSError:
                self.gone.set()
                return
            if batch_bytes:
                with self.counters.get_lock():
                    self.counters[0] += 1
                    self.counters[1] += batch_bytes

    def put(self, buffers: Sequence[memoryview | bytes] | None, *, batch_bytes: int = 0) -> None:
        """Queue ``buffers`` (one frame; ``batch_bytes`` > 0 for a BATCH frame), or ``None``
        to finish; blocks while the previous frame waits.

        Raises:
            _SessionGone: the session closed the socket.
        """
        item = None if buffers is None else (buffers, batch_bytes)
        while not self.gone.is_set():
            try:
                self.outbox.put(item, timeout=0.2)
                return
            except queue_mod.Full:
                continue
        raise _SessionGone

    def finish(self) -> None:
        """Write what is queued, then stop.

        Raises:
            _SessionGone: the session closed the socket.
        """
        self.put(None)
        while self.is_alive():
            self.join(0.2)
        if self.gone.is_set():
            raise _SessionGone


def _reader_main(
    producer: BatchProducer,
    spec: ShardSpec,
    sock: socket.socket,
    stop: Any,
    counters: Any,
    narrow: bool,
    max_frame_bytes: int,
    in_process: bool,
) -> None:
    """Run one reader: produce batches and write each as a wire frame to ``sock``.

    ``sock`` is the reader's end of a socket pair to its session. It carries ``BATCH`` frames,
    written straight from the tensors' memory by a writer thread (no join, no pickle), then
    ``END{reader, batches}``, or ``ERROR{reader, message}``. A full socket blocks the reader
    (backpressure); the session shutting its end down stops it.
    """
    if not in_process:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when readers stop
    writer = _Writer(sock, counters)
    writer.start()
    produced = 0
    try:
        try:
            for batch in producer(spec):
                if stop.is_set():
                    return
                buffers = batch_to_frame(batch, meta={"reader": spec.reader}, narrow=narrow)
                nbytes = sum(memoryview(b).nbytes for b in buffers)
                if nbytes > max_frame_bytes:
                    msg = (
                        f"a batch of {batch.batch_size} rows encodes to {nbytes} bytes, more "
                        f"than `max_frame_bytes`={max_frame_bytes}; lower the batch size"
                    )
                    raise DataError(msg)
                writer.put(buffers, batch_bytes=nbytes)
                produced += 1
            writer.put([encode_frame(FrameKind.END, {"reader": spec.reader, "batches": produced})])
        except _SessionGone:
            return
        except Exception as exc:
            error = {"reader": spec.reader, "message": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(_SessionGone):
                writer.put([encode_frame(FrameKind.ERROR, error)])
        with contextlib.suppress(_SessionGone):
            writer.finish()
    finally:
        if writer.is_alive():  # stopped early: the writer may be blocked on a full outbox
            with contextlib.suppress(queue_mod.Full):
                writer.outbox.put_nowait(None)
        if not in_process:
            sock.close()


class _NeverSet:
    """The stop flag of a pooled reader: its session stops it by shutting the socket down."""

    @staticmethod
    def is_set() -> bool:
        return False


def _pooled_reader_main(
    producer: BatchProducer, conn: Any, counters: Any, narrow: bool, max_frame_bytes: int
) -> None:
    """A reader process kept by the server between clients (see :class:`_PooledReader`).

    Warms the pipeline up once (``producer.warm_up()`` when it has one), then runs one job
    after another: a :class:`ShardSpec` and the socket to its session (passed as a file
    descriptor over ``conn``), answered by ``("idle",)`` once the part is done or the session
    went away. ``None`` or the server closing ``conn`` ends the process.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when readers stop
    warm_up = getattr(producer, "warm_up", None)
    if callable(warm_up):
        warm_up()
    while True:
        try:
            spec = conn.recv()
            if spec is None:
                return
            sock = socket.socket(fileno=reduction.recv_handle(conn))
        except (EOFError, OSError):
            return  # the server went away
        _reader_main(producer, spec, sock, _NeverSet(), counters, narrow, max_frame_bytes, False)
        try:
            conn.send(("idle",))
        except OSError:
            return


class _PooledReader:
    """A reader process and the pipe the server hands it jobs over."""

    def __init__(self, server: ReaderServer) -> None:
        ctx, cfg = server._ctx, server.config
        self.conn, child = ctx.Pipe()
        self.counters = ctx.Array("q", 2)  # frames, bytes written, over the process's life
        self.process = ctx.Process(
            target=_pooled_reader_main,
            args=(server.producer, child, self.counters, cfg.narrow, cfg.max_frame_bytes),
            name="recpipe-reader",
            daemon=True,
        )
        self.process.start()
        child.close()

    def assign(self, spec: ShardSpec, sock: socket.socket) -> None:
        """Start producing ``spec``'s part into ``sock`` (the caller may close its copy)."""
        self.process.name = f"recpipe-reader-{spec.shard}.{spec.reader}"
        self.conn.send(spec)
        reduction.send_handle(self.conn, sock.fileno(), self.process.pid)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the job is over; False if the process died or is still busy."""
        try:
            return bool(self.conn.poll(timeout)) and self.conn.recv() == ("idle",)
        except (EOFError, OSError):
            return False

    def retire(self, timeout: float) -> None:
        """Stop the process (terminated if it does not stop within ``timeout``)."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        self.conn.close()


# -- server side --------------------------------------------------------------------------------
class _ShuttingDown(Exception):
    """The server is closing; tell the client and stop."""


class _Session:
    """One client connection: its readers, its queue and the thread that feeds its socket."""

    def __init__(self, server: ReaderServer, conn: socket.socket, peer: str) -> None:
        self.server = server
        self.conn = conn
        self.peer = peer
        self.spec = ShardSpec()
        self.state: Literal[
            "handshake", "streaming", "done", "disconnected", "failed", "stopped", "refused"
        ] = "handshake"
        self.batches = self.samples = self.bytes_sent = 0
        self.peak_frames = self.peak_bytes = 0
        self.held_frames = self.held_bytes = 0  # received from readers, not yet sent
        ctx = server._ctx
        self.stop = ctx.Event()
        self.backpressure = threading.Event()
        self.counters = ctx.Array("q", 2)  # frames, bytes written by reader threads
        self.pooled: list[_PooledReader] = []  # reader processes lent by the server
        self.pooled_base: list[int] = []  # their frame counters when lent
        self.released = False  # the readers went back to the server (or were stopped)
        self.pooled_produced = 0  # frames they wrote for this session, counted at release
        self.ready: queue_mod.Queue[tuple[str, Any, Any]] = queue_mod.Queue()
        self.credits = threading.Semaphore(server.config.queue_depth)
        self.held_lock = threading.Lock()
        self.socks: list[socket.socket] = []  # the session's ends of the readers' sockets
        self.reader_socks: list[socket.socket] = []  # the readers' ends (reader threads only)
        self.collector: threading.Thread | None = None
        self.workers: list[Any] = []
        self.thread = threading.Thread(
            target=self._run, name=f"recpipe-session-{peer}", daemon=True
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if not self._handshake():
                return
            self._start_readers()
            self._stream()
        except _ShuttingDown:
            self.state = "stopped"
            self._send_quietly(FrameKind.ERROR, {"message": "the reader service is shutting down"})
        except OSError as exc:  # the client went away (reset, broken pipe, shut down)
            self.state = "disconnected" if not self.server._closing.is_set() else "stopped"
            self.server._log(
                f"client {self.peer} disconnected after {self.batches} batches ({exc.__class__.__name__})"
            )
        except Exception as exc:  # a bug or a reader that cannot start: tell the client
            self.state = "failed"
            self.server._log(f"client {self.peer}: internal error: {type(exc).__name__}: {exc}")
            self._send_quietly(FrameKind.ERROR, {"message": f"internal error: {exc}"})
        finally:
            self._stop_readers()
            with contextlib.suppress(OSError):
                self.conn.close()
            self.server._session_done(self)

    def _handshake(self) -> bool:
        cfg = self.server.config
        self.conn.settimeout(cfg.handshake_timeout_s)
        try:
            hello = recv_frame(self.conn, max_frame_bytes=_HELLO_MAX_BYTES)
            if hello.kind is not FrameKind.HELLO:
                msg = f"expected a HELLO frame first, got {hello.kind.name}"
                raise ProtocolError(msg)
            self._check_token(hello)
            self.spec = self._parse_spec(hello.meta)
            if self.server._active_count() > cfg.max_clients:
                msg = f"the reader service is full (`max_clients`={cfg.max_clients})"
                raise ServiceError(msg)
        except ServiceError as exc:
            self.state = "refused"
            self.server._log(f"refused {self.peer}: {exc}")
            self._send_quietly(FrameKind.ERROR, {"message": str(exc)})
            self._linger()
            return False
        self.conn.settimeout(None)  # a stalled client blocks the sender (backpressure)
        readers = max(cfg.readers, 1)
        welcome = {
            "readers": readers,
            "queue_depth": cfg.queue_depth,
            "heartbeat_s": cfg.heartbeat_s,
            "shard": self.spec.shard,
            "num_shards": self.spec.num_shards,
            "epoch": self.spec.epoch,
        }
        self._send(encode_frame(FrameKind.WELCOME, welcome))
        self.state = "streaming"
        self.server._session_accepted()
        return True

    def _check_token(self, hello: Frame) -> None:
        expected = self.server.config.token
        if expected is None:
            return
        given = hello.meta.get("token")
        given_bytes = given.encode() if isinstance(given, str) else b""
        if not hmac.compare_digest(given_bytes, expected.encode()):
            what = "no token" if not given_bytes else "a wrong token"
            msg = f"authentication failed: the client sent {what} (set `token` or ${TOKEN_ENV})"
            raise ServiceError(msg)

    def _parse_spec(self, meta: dict[str, Any]) -> ShardSpec:
        values = {}
        for name, default in (("shard", 0), ("num_shards", 1), ("epoch", 0)):
            value = meta.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                msg = f"HELLO field `{name}` must be a non-negative integer, got {value!r:.50}"
                raise ProtocolError(msg)
            values[name] = value
        if not values["shard"] < values["num_shards"]:
            msg = f"HELLO asks for shard {values['shard']} of {values['num_shards']}"
            raise ProtocolError(msg)
        readers = max(self.server.config.readers, 1)
        return ShardSpec(values["shard"], values["num_shards"], 0, readers, values["epoch"])

    def _start_readers(self) -> None:
        cfg = self.server.config
        in_process = cfg.readers == 0
        if not in_process:
            self.pooled = self.server._take_readers(self.spec.num_readers)
        for reader in range(self.spec.num_readers):
            mine, theirs = socket.socketpair()
            self.socks.append(mine)
            spec = dataclasses.replace(self.spec, reader=reader)
            if in_process:
                args = (
                    self.server.producer,
                    spec,
                    theirs,
                    self.stop,
                    self.counters,
                    cfg.narrow,
                    cfg.max_frame_bytes,
                    True,
                )
                name = f"recpipe-reader-{self.spec.shard}.{reader}"
                worker = threading.Thread(target=_reader_main, args=args, name=name, daemon=True)
                worker.start()
                self.workers.append(worker)
                self.reader_socks.append(theirs)
            else:
                pooled = self.pooled[reader]
                self.pooled_base.append(pooled.counters[0])
                pooled.assign(spec, theirs)
                self.workers.append(pooled.process)
                theirs.close()  # the reader has its own copy; EOF means it is gone
        self.collector = threading.Thread(
            target=self._collect, name=f"recpipe-collect-{self.peer}", daemon=True
        )
        self.collector.start()

    # -- readers -> queue (the collector thread) ----------------------------------------------
    def _collect(self) -> None:
        """Move frames from the readers' sockets to :attr:`ready`, ``queue_depth`` at most.

        Items: ``("batch", frame, rows)``, ``("end", reader, batches)``, ``("error", reader,
        message)``. A frame is received only once a credit is free (returned when the frame
        has been sent), so the session never holds more than ``queue_depth`` frames; beyond
        that the readers block on their sockets.
        """
        with selectors.DefaultSelector() as selector:
            for reader, sock in enumerate(self.socks):
                selector.register(sock, selectors.EVENT_READ, reader)
            while selector.get_map() and not self.stop.is_set():
                for key, _ in selector.select(timeout=0.2):
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

    def _take_credit(self) -> bool:
        if self.credits.acquire(blocking=False):
            return True
        self.backpressure.set()
        while not self.stop.is_set():
            if self.credits.acquire(timeout=0.2):
                return True
        return False

    def _receive(self, sock: Any, reader: int) -> tuple[str, Any, Any] | None:
        """One item from reader ``reader``'s socket; ``None`` when the session is stopping."""
        try:
            kind, frame = recv_raw_frame(sock, max_frame_bytes=self.server.config.max_frame_bytes)
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
        cfg = self.server.config
        ended = 0
        while ended < len(self.workers):
            if self.server._closing.is_set():
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
                self.server._count(1, rows, len(payload))
            elif kind == "end":
                ended += 1
            else:  # "error"
                self._fail(f"reader {payload} of shard {self.spec.shard} failed: {extra}")
                return
        end = {"batches": self.batches, "samples": self.samples}
        self._send(encode_frame(FrameKind.END, end))
        self.state = "done"
        self.server._log(
            f"client {self.peer} (shard {self.spec.shard}/{self.spec.num_shards}, epoch "
            f"{self.spec.epoch}): done, {self.batches} batches, {self.samples:,} samples, "
            f"{_fmt_bytes(self.bytes_sent)}"
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
        self.server._log(f"client {self.peer}: {message}")
        self._send(encode_frame(FrameKind.ERROR, {"message": message}))

    def _send(self, frame: bytes | bytearray) -> None:
        self.conn.sendall(frame)
        self.bytes_sent += len(frame)

    def _send_quietly(self, kind: FrameKind, meta: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.conn.settimeout(1.0)
            self._send(encode_frame(kind, meta))

    def _linger(self) -> None:
        """Half-close and read what the peer still sends (bounded), so that closing does not
        reset the connection and destroy the ERROR frame before the peer reads it."""
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_WR)
            self.conn.settimeout(1.0)
            for _ in range(64):
                if not self.conn.recv(1 << 16):
                    break

    def _stop_readers(self) -> None:
        self.stop.set()
        for sock in self.socks:  # a reader blocked writing gets EPIPE; the collector wakes
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.collector is not None:
            self.collector.join(_JOIN_TIMEOUT_S)
        deadline = time.monotonic() + _STOP_GRACE_S
        if self.pooled:  # idle again within the grace: back to the server; else stopped
            self.pooled_produced = self._pooled_produced()
            for pooled in self.pooled:
                idle = pooled.wait_idle(max(deadline - time.monotonic(), 0.0))
                self.server._return_reader(pooled, idle=idle)
        else:  # reader threads: they stop at their next write (the socket is shut down)
            for worker in self.workers:
                worker.join(timeout=max(deadline - time.monotonic(), 0.0))
            for worker in self.workers:
                worker.join(timeout=_JOIN_TIMEOUT_S)
        self.released = True
        for sock in self.socks + self.reader_socks:
            sock.close()

    def shutdown_socket(self) -> None:
        """Unblock a sender stuck on a stalled client (used by :meth:`ReaderServer.close`)."""
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)

    def stats(self) -> SessionStats:
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
        )

    def _pooled_produced(self) -> int:
        return sum(p.counters[0] - b for p, b in zip(self.pooled, self.pooled_base))


def _worker_alive(worker: Any) -> bool:
    try:
        return worker.is_alive()
    except ValueError:  # a closed Process object
        return False


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
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sessions: list[_Session] = []
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._started = 0.0
        self._clients_total = self._rejected = 0
        self._batches = self._samples = self._bytes = 0
        self._address: tuple[str, int] = (self.config.host, self.config.port)
        self._idle: list[_PooledReader] = []  # warm reader processes waiting for a client
        self._started_readers = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> ReaderServer:
        """Bind, listen and start accepting clients; returns ``self``."""
        cfg = self.config
        try:
            listener = socket.create_server((cfg.host, cfg.port), backlog=cfg.max_clients)
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
        for _ in range(min(cfg.readers, cfg.kept_readers)):  # warm before the first client
            self._idle.append(self._new_reader())
        readers = f"{cfg.readers} reader processes" if cfg.readers else "in-process reader"
        self._log(
            f"listening on {self._address[0]}:{self._address[1]} ({readers} per client, queue "
            f"depth {cfg.queue_depth}, token {'required' if cfg.token else 'off'})"
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

    def close(self, *, timeout: float = _JOIN_TIMEOUT_S) -> ServerStats:
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
            sessions = list(self._sessions)
        grace = self.config.heartbeat_s + 1.0
        for session in sessions:
            session.thread.join(grace)
        for session in sessions:
            if session.thread.is_alive():
                session.shutdown_socket()  # stuck sending to a stalled client
                session.thread.join(timeout + _JOIN_TIMEOUT_S)
        with self._lock:
            idle, self._idle = self._idle, []
        for pooled in idle:
            pooled.retire(_STOP_GRACE_S)
        return self.stats()

    def __enter__(self) -> ReaderServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> ServerStats:
        """A snapshot of the server's counters and of every session so far."""
        with self._lock:
            sessions = tuple(s.stats() for s in self._sessions)
            return ServerStats(
                address=self._address,
                elapsed_s=time.monotonic() - self._started if self._started else 0.0,
                clients_total=self._clients_total,
                clients_active=sum(1 for s in self._sessions if s.thread.is_alive()),
                rejected=self._rejected,
                batches=self._batches,
                samples=self._samples,
                bytes_sent=self._bytes,
                sessions=sessions,
                reader_processes_started=self._started_readers,
                reader_processes_idle=len(self._idle),
            )

    def join_sessions(self, *, timeout: float) -> bool:
        """Wait until every session so far has finished; False if some still run at ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.thread.join(max(deadline - time.monotonic(), 0))
        return not any(session.thread.is_alive() for session in sessions)

    def wait_backpressure(self, session: int, *, timeout: float) -> bool:
        """Wait until session ``session`` (in connection order) has found its queue full."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = self._sessions[session] if session < len(self._sessions) else None
            if found is not None:
                return found.backpressure.wait(max(deadline - time.monotonic(), 0))
            self._closing.wait(0.05)
        return False

    # -- reader processes ---------------------------------------------------------------------
    def reader_pids(self) -> list[int]:
        """Process ids of the reader processes alive now: kept idle ones, then lent ones."""
        with self._lock:
            pooled = list(self._idle)
            pooled += [p for s in self._sessions if not s.released for p in s.pooled]
        return [p.process.pid for p in pooled if p.process.is_alive()]

    def _new_reader(self) -> _PooledReader:
        with self._lock:
            self._started_readers += 1
        return _PooledReader(self)

    def _take_readers(self, n: int) -> list[_PooledReader]:
        """``n`` reader processes for a session: idle ones first, new ones for the rest."""
        with self._lock:
            taken, dead = [], []
            while self._idle and len(taken) < n:
                pooled = self._idle.pop()
                (taken if pooled.process.is_alive() else dead).append(pooled)
        for pooled in dead:
            pooled.retire(0.0)
        return taken + [self._new_reader() for _ in range(n - len(taken))]

    def _return_reader(self, pooled: _PooledReader, *, idle: bool) -> None:
        """Keep a reader whose job is over for the next client, or stop it (busy past the
        grace, dead, beyond ``idle_readers``, or the server is closing)."""
        if idle and pooled.process.is_alive():
            with self._lock:  # close() sets _closing, then empties _idle under this lock
                if not self._closing.is_set() and len(self._idle) < self.config.kept_readers:
                    self._idle.append(pooled)
                    return
        pooled.retire(_STOP_GRACE_S)

    # -- internals ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None  # set by start()
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # the listener was closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.config.send_buffer_bytes:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.send_buffer_bytes)
            session = _Session(self, conn, f"{peer[0]}:{peer[1]}")
            with self._lock:
                self._sessions.append(session)
            session.thread.start()

    def _report_loop(self) -> None:
        last_samples, last_bytes, last_t = 0, 0, time.monotonic()
        while not self._closing.wait(self.config.report_every_s):
            stats, now = self.stats(), time.monotonic()
            dt = max(now - last_t, 1e-9)
            self._log(
                f"{stats.clients_active} clients, {stats.batches:,} batches, "
                f"{stats.samples:,} samples, {_fmt_bytes(stats.bytes_sent)} sent | "
                f"{(stats.samples - last_samples) / dt:,.0f} samples/s, "
                f"{_fmt_bytes((stats.bytes_sent - last_bytes) / dt)}/s"
            )
            last_samples, last_bytes, last_t = stats.samples, stats.bytes_sent, now

    def _active_count(self) -> int:
        with self._lock:
            return sum(1 for s in self._sessions if s.state == "streaming") + 1

    def _count(self, batches: int, samples: int, nbytes: int) -> None:
        with self._lock:
            self._batches += batches
            self._samples += samples
            self._bytes += nbytes

    def _session_done(self, session: _Session) -> None:
        with self._lock:
            if session.state == "refused":
                self._rejected += 1

    def _session_accepted(self) -> None:
        with self._lock:
            self._clients_total += 1

    def _log(self, message: str) -> None:
        if self._logfile is not None:
            print(f"recpipe serve: {message}", file=self._logfile, flush=True)


# -- client side --------------------------------------------------------------------------------
class ServiceClient:
    """One connection to a reader service: a handshake, then an iterator of batches.

    Args:
        host: the server's address.
        port: the server's port.
        token: the shared token (default: ``$RECPIPE_TOKEN`` if set).
        shard: which shard of the epoch to read, in ``[0, num_shards)``.
        num_shards: how many shards the epoch is split into.
        epoch: the epoch number (mixed into the readers' shuffle seed).
        connect_timeout_s: give up connecting / handshaking after this long.
        read_timeout_s: give up when the server sends nothing (not even a heartbeat) this long.
        max_frame_bytes: refuse larger frames.
        recv_buffer_bytes: the socket's ``SO_RCVBUF``, or ``None`` for the system default.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        shard: int = 0,
        num_shards: int = 1,
        epoch: int = 0,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float = 120.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        recv_buffer_bytes: int | None = None,
    ) -> None:
        if not (isinstance(num_shards, int) and num_shards >= 1 and 0 <= shard < num_shards):
            msg = f"`shard` must lie in [0, `num_shards`={num_shards!r}), got {shard!r}"
            raise DataError(msg)
        self.host, self.port = host, port
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.shard, self.num_shards, self.epoch = shard, num_shards, epoch
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.recv_buffer_bytes = recv_buffer_bytes
        self.welcome: dict[str, Any] = {}
        self.end: dict[str, Any] | None = None
        self.batches = self.samples = self.bytes_received = 0
        self._sock: socket.socket | None = None

    @property
    def where(self) -> str:
        """``host:port`` of the server, for messages."""
        return f"{self.host}:{self.port}"

    def connect(self) -> ServiceClient:
        """Connect and say HELLO; returns ``self``.

        Raises:
            ServiceError: the server cannot be reached or refused the connection.
        """
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if self.recv_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.recv_buffer_bytes)
            sock.settimeout(self.connect_timeout_s)
            sock.connect((self.host, self.port))
        except OSError as exc:
            sock.close()
            msg = f"cannot connect to the reader service at {self.where}: {exc} (is `recpipe serve` running?)"
            raise ServiceError(msg) from exc
        self._sock = sock
        hello = {"shard": self.shard, "num_shards": self.num_shards, "epoch": self.epoch}
        if self.token is not None:
            hello["token"] = self.token
        try:
            sock.sendall(encode_frame(FrameKind.HELLO, hello))
            reply = recv_frame(sock, max_frame_bytes=_HELLO_MAX_BYTES)
        except (OSError, ServiceError) as exc:
            self.close()
            msg = f"handshake with the reader service at {self.where} failed: {exc}"
            raise ServiceError(msg) from exc
        if reply.kind is FrameKind.ERROR:
            self.close()
            msg = f"the reader service at {self.where} refused the connection: {reply.meta.get('message')}"
            raise ServiceError(msg)
        if reply.kind is not FrameKind.WELCOME:
            self.close()
            msg = f"the reader service at {self.where} answered HELLO with {reply.kind.name}"
            raise ProtocolError(msg)
        self.welcome = reply.meta
        sock.settimeout(self.read_timeout_s)
        return self

    def __iter__(self) -> Iterator[Batch]:
        """Yield the batches of this connection's shard until the server says END.

        Raises:
            ServiceError: the server failed, shut down, went away, or fell silent.
        """
        if self._sock is None:
            self.connect()
        try:
            while True:
                frame = self._next_frame()
                if frame.kind is FrameKind.BATCH:
                    batch = frame_to_batch(frame)
                    self.batches += 1
                    self.samples += batch.batch_size
                    yield batch
                elif frame.kind is FrameKind.END:
                    self.end = frame.meta
                    return
                elif frame.kind is FrameKind.ERROR:
                    msg = (
                        f"the reader service at {self.where} reported: {frame.meta.get('message')}"
                    )
                    raise ServiceError(msg)
                elif frame.kind is not FrameKind.HEARTBEAT:
                    msg = f"unexpected {frame.kind.name} frame from the reader service at {self.where}"
                    raise ProtocolError(msg)
        finally:
            self.close()

    def _next_frame(self) -> Frame:
        assert self._sock is not None  # connected in __iter__
        try:
            frame = recv_frame(self._sock, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError:
            raise
        except ServiceError as exc:
            hint = "the server died or closed the connection"
            if "timed out" in str(exc):
                hint = f"nothing, not even a heartbeat, for `read_timeout_s`={self.read_timeout_s}"
            msg = f"lost the reader service at {self.where} after {self.batches} batches ({hint}): {exc}"
            raise ServiceError(msg) from None
        except OSError as exc:
            msg = f"lost the reader service at {self.where} after {self.batches} batches: {exc}"
            raise ServiceError(msg) from exc
        self.bytes_received += frame.nbytes
        return frame

    def close(self) -> None:
        """Close the connection (the server stops this client's readers); idempotent."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def __enter__(self) -> ServiceClient:
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServiceDataset(IterableDataset):
    """An ``IterableDataset`` of :class:`~recpipe.batch.Batch` read from ``recpipe serve``.

    Each DataLoader worker opens its own connection for its shard: shard
    ``rank * num_workers + worker_id`` of ``world_size * num_workers``; the shards of all
    workers of all ranks deliver every row once. Use ``batch_size=None`` (batches arrive whole)::

        ds = ServiceDataset("127.0.0.1", 5717, rank=rank, world_size=world_size)
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            for batch in DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True):
                ...

    Args:
        host: the server's address.
        port: the server's port.
        token: the shared token (default: ``$RECPIPE_TOKEN`` if set).
        rank: this trainer's rank.
        world_size: trainers reading the epoch.
        connect_timeout_s: give up connecting after this long.
        read_timeout_s: give up when the server is silent this long (it heartbeats every
            ``heartbeat_s``, so silence means it is gone or wedged).
        max_frame_bytes: refuse larger frames.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float = 120.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        super().__init__()
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            msg = f"`rank` must lie in [0, `world_size`={world_size!r}), got {rank!r}"
            raise DataError(msg)
        self.host, self.port, self.token = host, port, token
        self.rank, self.world_size = rank, world_size
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (the readers mix it into their shuffle seed)."""
        self.epoch = epoch

    def client(self) -> ServiceClient:
        """A (not yet connected) client for the calling DataLoader worker's shard."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return ServiceClient(
            self.host,
            self.port,
            token=self.token,
            shard=self.rank * workers + worker,
            num_shards=self.world_size * workers,
            epoch=self.epoch,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            max_frame_bytes=self.max_frame_bytes,
        )

    def __iter__(self) -> Iterator[Batch]:
        with self.client() as client:
            yield from client


# -- CLI ----------------------------------------------------------------------------------------
def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe serve`` to the top-level parser."""
    parser = subparsers.add_parser(
        "serve",
        help="serve preprocessed batches to trainers over TCP",
        description=(
            "Start reader processes that read a clustered dataset, convert and preprocess its "
            "batches (IKJT per dedup group with --dedup on), and stream them to trainers over "
            "TCP. Each client connection gets its own shard of the epoch and its own readers; "
            "trainers read with readers.service.ServiceDataset(host, port, token=...). "
            "Stop with SIGTERM or Ctrl-C."
        ),
    )
    parser.add_argument("dataset", nargs="?", help="clustered dataset directory (etl build output)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback)"
    )
    parser.add_argument(
        "--port", type=int, default=0, help="TCP port; 0 picks a free one (printed)"
    )
    parser.add_argument(
        "--readers", type=int, default=2, help="reader processes per client (default 2)"
    )
    parser.add_argument(
        "--idle-readers",
        type=int,
        default=None,
        help="reader processes kept running, warm, between clients: started with the server, "
        "handed to the next client (default: --readers; 0: each client's start and stop with it)",
    )
    parser.add_argument(
        "--warmup-batches",
        type=int,
        default=20,
        help="batches a new reader process runs through the pipeline and drops before its first "
        "client, so that kernel loading is not paid while a trainer waits (default 20; 0: off)",
    )
    parser.add_argument(
        "--read-ahead",
        type=int,
        default=1,
        help="row groups each reader process decodes ahead in a second thread (default 1; "
        "0: one thread per reader process)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="rows per batch (default 4096)"
    )
    parser.add_argument(
        "--token", default=None, help=f"shared token clients must present (default: ${TOKEN_ENV})"
    )
    parser.add_argument(
        "--queue-depth", type=int, default=8, help="encoded batches buffered per client (default 8)"
    )
    parser.add_argument(
        "--dedup",
        choices=["on", "off"],
        default="on",
        help="IKJT per dedup group (on) or one plain KJT (off)",
    )
    parser.add_argument(
        "--preprocess",
        default=None,
        metavar="CONFIG",
        help="preprocessing config file (see readers.transforms)",
    )
    parser.add_argument(
        "--schema", default=None, help="schema TOML (default: the dataset's manifest)"
    )
    parser.add_argument(
        "--shuffle", action="store_true", help="shuffle row groups and sessions (seeded)"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (the epoch is mixed in)")
    parser.add_argument(
        "--report-every",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between progress lines (0: off)",
    )
    parser.add_argument(
        "--synthetic",
        type=int,
        default=None,
        metavar="N",
        help="serve N synthetic batches instead of a dataset (checks the network path)",
    )
    parser.set_defaults(func=_cli_serve)


def _cli_serve(args: argparse.Namespace) -> int:
    dedup = args.dedup == "on"
    if args.synthetic is not None:
        producer: BatchProducer = SyntheticProducer(
            args.synthetic, batch_size=args.batch_size, dedup=dedup
        )
    elif args.dataset is None:
        msg = "`dataset` is required (or --synthetic N)"
        raise DataError(msg)
    elif not os.path.isdir(args.dataset):
        msg = f"`dataset` {args.dataset!r} is not a directory"
        raise DataError(msg)
    else:
        producer = DatasetProducer(
            args.dataset,
            batch_size=args.batch_size,
            dedup=dedup,
            preprocess=args.preprocess,
            schema=args.schema,
            shuffle=args.shuffle,
            seed=args.seed,
            warmup_batches=args.warmup_batches,
            read_ahead=args.read_ahead,
        )
    config = ServiceConfig(
        host=args.host,
        port=args.port,
        readers=args.readers,
        idle_readers=args.idle_readers,
        queue_depth=args.queue_depth,
        token=args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None,
        report_every_s=args.report_every,
    )
    return serve(producer, config=config)


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
