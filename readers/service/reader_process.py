"""Reader processes: what runs a :class:`~readers.service.producers.BatchProducer` for a client,
and the server's pool of them.

**The reader -> server hop.** Each reader writes its frames to its own socket pair with the
client's session, straight from the tensors' memory (scatter-gather, no join, no pickle), from
a writer thread so that producing the next batch overlaps sending this one. The stream is
``BATCH``... then ``END{reader, batches}``, or ``ERROR{reader, message}``. A full socket
blocks the reader (backpressure); the session shutting its end down stops it.

**Warm readers.** Reader processes (``multiprocessing``, spawn) outlive their clients: the
server starts ``readers`` of them with itself, each first warms its pipeline up
(``producer.warm_up()``), and a client's readers go back to the :class:`ReaderPool` when it is
done or disconnects, to serve the next client (a trainer connects once per epoch and DataLoader
worker). Up to ``idle_readers`` are kept; a reader that died or does not stop within a grace is
replaced. A job reaches a kept reader as a pickled :class:`ShardSpec` and the socket to its
session, passed as a file descriptor over a pipe between the server and its own reader
processes (the TCP wire to clients carries no pickle).

**Limits.** The pool lends readers only against a reservation (:meth:`ReaderPool.reserve`):
processes lent or kept idle never exceed ``ServiceConfig.reader_limit``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue as queue_mod
import signal
import socket
import threading
import time
from collections.abc import Sequence
from multiprocessing import reduction
from typing import Any

from readers.service.config import ServiceConfig
from readers.service.producers import BatchProducer, ShardSpec
from readers.service.wire import FrameKind, batch_to_frame, encode_frame, send_buffers
from recpipe.errors import DataError

__all__ = ["STOP_GRACE_S", "PooledReader", "ReaderPool", "ThreadCounters", "run_reader"]

STOP_GRACE_S = 2.0  # readers hold nothing worth saving: after this they are terminated
_PUT_POLL_S = 0.2


class _SessionGone(Exception):
    """The session closed its end of the reader's socket: stop quietly."""


class ThreadCounters:
    """Frames and bytes written by reader threads: the ``get_lock()`` / ``[0]`` / ``[1]``
    interface of a ``multiprocessing.Array("q", 2)``, without its shared memory or semaphore."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = [0, 0]

    def get_lock(self) -> threading.Lock:
        return self._lock

    def __getitem__(self, index: int) -> int:
        return self._values[index]

    def __setitem__(self, index: int, value: int) -> None:
        self._values[index] = value


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
                self.outbox.put(item, timeout=_PUT_POLL_S)
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
            self.join(_PUT_POLL_S)
        if self.gone.is_set():
            raise _SessionGone


def run_reader(
    producer: BatchProducer,
    spec: ShardSpec,
    sock: socket.socket,
    stop: Any,
    counters: Any,
    *,
    narrow: bool,
    max_frame_bytes: int,
    in_process: bool,
) -> None:
    """Run one reader: produce ``spec``'s batches and write each as a wire frame to ``sock``.

    Args:
        producer: what makes the batches.
        spec: the reader's part of the epoch.
        sock: the reader's end of a socket pair to its session.
        stop: an event-like object; once set, the reader stops at its next batch.
        counters: frames and bytes written (``multiprocessing.Array("q", 2)`` or
            :class:`ThreadCounters`).
        narrow: send int64 tensors that fit as int32.
        max_frame_bytes: a batch encoding to more fails the reader with a clear error.
        in_process: a reader thread of the server (keeps SIGINT, leaves ``sock`` open).
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
    """A reader process kept by the server between clients (see :class:`PooledReader`).

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
        run_reader(
            producer, spec, sock, _NeverSet(), counters,
            narrow=narrow, max_frame_bytes=max_frame_bytes, in_process=False,
        )  # fmt: skip
        try:
            conn.send(("idle",))
        except OSError:
            return


class PooledReader:
    """A reader process and the pipe the server hands it jobs over.

    Args:
        ctx: the ``multiprocessing`` context (spawn).
        producer: what the process runs (pickled to it once).
        config: the server's settings (``narrow``, ``max_frame_bytes``).
    """

    def __init__(self, ctx: Any, producer: BatchProducer, config: ServiceConfig) -> None:
        self.conn, child = ctx.Pipe()
        self.counters = ctx.Array("q", 2)  # frames, bytes written, over the process's life
        self.process = ctx.Process(
            target=_pooled_reader_main,
            args=(producer, child, self.counters, config.narrow, config.max_frame_bytes),
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

    def frames(self) -> int:
        """Frames this process has written over its life.

        Read without the counters' lock: the process is their only writer, and one it was
        killed holding (terminated in :meth:`retire`, out of memory) would be held for ever.
        """
        return int(self.counters.get_obj()[0])

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the job is over; False if the process died or is still busy."""
        try:
            return bool(self.conn.poll(timeout)) and self.conn.recv() == ("idle",)
        except (EOFError, OSError):
            return False

    def retire(self, timeout: float) -> None:
        """Stop the process (terminated if it does not stop within ``timeout``, killed if it
        does not die within ``timeout`` more)."""
        self.ask_to_stop()
        self.process.join(timeout)
        self.stop_now(timeout)

    def ask_to_stop(self) -> None:
        """Tell the process to stop once its job is over (it reads no more jobs)."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)

    def stop_now(self, timeout: float) -> None:
        """Terminate the process if it still runs, kill it if that takes over ``timeout``."""
        for end in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            end()
            self.process.join(timeout)
        self.conn.close()


class ReaderPool:
    """The server's reader processes: idle ones kept warm, and the ones lent to clients.

    A client first :meth:`reserve` s its readers (refused beyond ``config.reader_limit``), then
    :meth:`take` s them (idle ones first, new ones for the rest), :meth:`give_back` s each when
    it is done and :meth:`release` s the reservation. Reservations count reader threads too
    (``readers=0``), so the limit bounds every client's readers alike.

    Args:
        producer: what every reader process runs.
        config: the server's settings.
    """

    def __init__(self, producer: BatchProducer, *, config: ServiceConfig) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._producer, self._config = producer, config
        self._lock = threading.Lock()
        self._idle: list[PooledReader] = []
        self._lent: list[PooledReader] = []
        self._reserved = 0
        self._closed = False
        self.started = 0  # processes started over the pool's life

    def warm(self) -> None:
        """Start the kept readers before the first client (``readers`` of them at most)."""
        cfg = self._config
        for _ in range(min(cfg.readers, cfg.kept_readers)):
            reader = self._new()
            with self._lock:
                self._idle.append(reader)

    def reserve(self, n: int) -> bool:
        """Reserve ``n`` readers for a client; False if that would pass the limit."""
        with self._lock:
            if self._closed or self._reserved + n > self._config.reader_limit:
                return False
            self._reserved += n
            return True

    def release(self, n: int) -> None:
        """End a reservation made with :meth:`reserve`."""
        with self._lock:
            self._reserved -= n

    @property
    def reserved(self) -> int:
        """Readers reserved by clients now."""
        with self._lock:
            return self._reserved

    def take(self, n: int) -> list[PooledReader]:
        """``n`` reader processes for a client: idle ones first, new ones for the rest."""
        with self._lock:
            taken, dead = [], []
            while self._idle and len(taken) < n:
                reader = self._idle.pop()
                (taken if reader.process.is_alive() else dead).append(reader)
        for reader in dead:
            reader.retire(0.0)
        try:
            while len(taken) < n:
                taken.append(self._new())
        except BaseException:
            for reader in taken:
                reader.retire(STOP_GRACE_S)
            raise
        with self._lock:
            self._lent += taken
        return taken

    def give_back(self, reader: PooledReader, *, idle: bool) -> None:
        """Keep a reader whose job is over for the next client, or stop it (busy past the
        grace, dead, beyond ``idle_readers``, or the pool is closed)."""
        with self._lock:
            with contextlib.suppress(ValueError):
                self._lent.remove(reader)
            keep = (
                idle
                and reader.process.is_alive()
                and not self._closed
                and len(self._idle) < self._config.kept_readers
            )
            if keep:
                self._idle.append(reader)
                return
        reader.retire(STOP_GRACE_S)

    def pids(self) -> list[int]:
        """Process ids of the reader processes alive now: idle ones, then lent ones."""
        with self._lock:
            readers = self._idle + self._lent
        return [r.process.pid for r in readers if r.process.is_alive()]

    @property
    def idle(self) -> int:
        """Reader processes kept idle now."""
        with self._lock:
            return len(self._idle)

    def close(self, *, timeout: float = STOP_GRACE_S) -> None:
        """Stop the idle readers, and the lent ones that did not come back: all together,
        within about ``3 * timeout`` (asked, then terminated, then killed)."""
        if not self._lock.acquire(timeout=timeout):  # a stuck holder: close without the lock
            self._closed = True
            readers = list(self._idle) + list(self._lent)
        else:
            try:
                self._closed = True
                readers, self._idle = self._idle + self._lent, []
            finally:
                self._lock.release()
        for reader in readers:
            reader.ask_to_stop()
        for end in (None, "terminate", "kill"):  # each step waits for all of them at once
            alive = [r for r in readers if r.process.is_alive()]
            for reader in alive if end else ():
                getattr(reader.process, end)()
            deadline = time.monotonic() + timeout
            for reader in alive:
                reader.process.join(max(deadline - time.monotonic(), 0.0))
        for reader in readers:
            reader.conn.close()

    def _new(self) -> PooledReader:
        with self._lock:
            self.started += 1
        return PooledReader(self._ctx, self._producer, self._config)
