"""The client side of the reader service: what a trainer imports.

* :class:`ServiceClient` - one connection: HELLO, then an iterator of batches until END.
* :class:`ServiceDataset` - an ``IterableDataset`` for a DataLoader: each worker of each rank
  opens its own connection for its own shard of the epoch.
* :class:`ServiceStream` - epoch after epoch in the training process, with a position
  (epoch, batches consumed) to checkpoint and resume from, and whole passes for evaluation.
* :class:`ServiceRankDataset` - one rank of a job (one process: rank 0 of 1): the same batches
  as the in-process :class:`readers.ranks.RankBatchDataset`, with the same position format.

Every client may ask for one :class:`~readers.holdout.Holdout` part of the served dataset (its
training or its held-out row groups, divided exactly as the in-process trainer divides them)
and say which batch size it expects (a server making another size refuses it). Every wait is
bounded: connecting and the handshake by ``connect_timeout_s`` in all, and the stream by
``read_timeout_s`` without a frame (the server heartbeats every ``heartbeat_s``).

One concept, over 600 lines: the client side of the wire (the connection and the datasets
built on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset, get_worker_info

from readers.holdout import Holdout
from readers.ranks import STREAM_KEYS, EpochLayout, check_stream_state, stream_state
from readers.service.config import TOKEN_ENV
from readers.service.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    HELLO_MAX_BYTES,
    Frame,
    FrameKind,
    ProtocolError,
    ServiceBusyError,
    ServiceError,
    ServiceTimeoutError,
    encode_frame,
    frame_to_batch,
    recv_frame,
)
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = [
    "ServiceClient",
    "ServiceDataset",
    "ServiceRankDataset",
    "ServiceStream",
    "parse_address",
]

_STATE_VERSION = 1

_log = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``.

    Raises:
        DataError: ``address`` is not ``HOST:PORT``.

    >>> parse_address("127.0.0.1:5717")
    ('127.0.0.1', 5717)
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        msg = f"`address` must be HOST:PORT, got {address!r}"
        raise DataError(msg)
    return host, int(port)


class ServiceClient:
    """One connection to a reader service: a handshake, then an iterator of batches.

    Args:
        host: the server's address.
        port: the server's port.
        token: the shared token (default: ``$RECPIPE_TOKEN`` if set).
        shard: which shard of the epoch to read, in ``[0, num_shards)``.
        num_shards: how many shards the epoch is split into.
        epoch: the epoch number (mixed into the readers' shuffle seed).
        holdout: read only this part of the served dataset (``None``: all of it).
        batch_size: the rows per batch expected; a server making another size refuses the
            connection (``None``: whatever it makes).
        ranks: ``{"rank", "world_size", "state"}``: read as one rank of a multi-rank job
            (``shard``/``num_shards`` are then ignored; see :class:`ServiceRankDataset`).
        connect_timeout_s: give up connecting and handshaking after this long, in all.
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
        holdout: Holdout | None = None,
        batch_size: int | None = None,
        ranks: Mapping[str, Any] | None = None,
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
        self.holdout, self.batch_size = holdout, batch_size
        self.ranks = None if ranks is None else dict(ranks)
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
            ServiceBusyError: the server is at its limit of clients or readers (retry later).
            ServiceError: the server cannot be reached or refused the connection.
        """
        deadline = time.monotonic() + self.connect_timeout_s
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.recv_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.recv_buffer_bytes)
            sock.settimeout(self.connect_timeout_s)
            sock.connect((self.host, self.port))
        except OSError as exc:
            sock.close()
            msg = f"cannot connect to the reader service at {self.where}: {exc} (is `recpipe serve` running?)"
            raise ServiceError(msg) from exc
        self._sock = sock
        try:
            sock.sendall(encode_frame(FrameKind.HELLO, self._hello()))
            reply = recv_frame(sock, max_frame_bytes=HELLO_MAX_BYTES, deadline=deadline)
        except (OSError, ServiceError) as exc:
            self.close()
            msg = f"handshake with the reader service at {self.where} failed: {exc}"
            raise ServiceError(msg) from exc
        if reply.kind is FrameKind.ERROR:
            self.close()
            msg = f"the reader service at {self.where} refused the connection: {reply.meta.get('message')}"
            raise (ServiceBusyError if reply.meta.get("code") == "busy" else ServiceError)(msg)
        if reply.kind is not FrameKind.WELCOME:
            self.close()
            msg = f"the reader service at {self.where} answered HELLO with {reply.kind.name}"
            raise ProtocolError(msg)
        self.welcome = reply.meta
        sock.settimeout(self.read_timeout_s)
        _log.debug(
            "connected to %s: shard %d of %d, epoch %d", self.where, self.shard, self.num_shards,
            self.epoch,
        )  # fmt: skip
        return self

    def _hello(self) -> dict[str, Any]:
        hello: dict[str, Any] = {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "epoch": self.epoch,
        }
        if self.token is not None:
            hello["token"] = self.token
        if self.holdout is not None:
            hello["holdout"] = dataclasses.asdict(self.holdout)
        if self.batch_size is not None:
            hello["batch_size"] = self.batch_size
        if self.ranks is not None:
            hello["ranks"] = self.ranks
        return hello

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
            if isinstance(exc, ServiceTimeoutError):
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

    Position: :meth:`state_dict` is the epoch and the batches of this process's shard consumed
    so far (in a DataLoader worker, that worker's: what ``torchdata``'s ``StatefulDataLoader``
    collects from each worker); :meth:`load_state_dict` makes the next pass resume after them.
    The server streams a shard from its start, so resuming reads and drops the batches already
    consumed (the stream is deterministic: the same batches). A shard that was read to its end
    stays finished until :meth:`set_epoch`. There is no ``len()``: the number of batches is the
    server's (its readers per client each end with a short batch).

    Args:
        host: the server's address.
        port: the server's port.
        token: the shared token (default: ``$RECPIPE_TOKEN`` if set).
        rank: this trainer's rank.
        world_size: trainers reading the epoch.
        holdout: read only this part of the served dataset (``None``: all of it).
        batch_size: the rows per batch expected (see :class:`ServiceClient`).
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
        holdout: Holdout | None = None,
        batch_size: int | None = None,
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
        self.holdout, self.batch_size = holdout, batch_size
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.epoch = 0
        self._batches = 0  # batches of the current pass consumed
        self._finished = False  # the current pass reached the end of the shard
        self._resume: dict[str, Any] | None = None  # a loaded state, used by the next pass

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next, from its start (the readers mix it into their shuffle seed)."""
        self.epoch = epoch
        self._batches, self._finished, self._resume = 0, False, None

    def _shard(self) -> tuple[int, int]:
        """``(shard, num_shards)`` of the calling process (a DataLoader worker, or this one)."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    def state_dict(self) -> dict[str, Any]:
        """The position of this process's shard: epoch, batches consumed, whether it ended."""
        shard, num_shards = self._shard()
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "shard": shard,
            "num_shards": num_shards,
            "batches": self._batches,
            "finished": self._finished,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a :meth:`state_dict` position with the next pass.

        Raises:
            DataError: ``state`` is not a state of this class.
        """
        keys = ("epoch", "shard", "num_shards", "batches", "finished")
        if (
            not isinstance(state, Mapping)
            or state.get("version") != _STATE_VERSION
            or any(k not in state for k in keys)
        ):
            msg = (
                f"`state` is not a ServiceDataset state_dict (version {_STATE_VERSION}): {state!r}"
            )
            raise DataError(msg)
        self.epoch = int(state["epoch"])
        self._batches, self._finished = int(state["batches"]), bool(state["finished"])
        self._resume = dict(state)

    def client(self) -> ServiceClient:
        """A (not yet connected) client for the calling DataLoader worker's shard."""
        shard, num_shards = self._shard()
        return ServiceClient(
            self.host,
            self.port,
            token=self.token,
            shard=shard,
            num_shards=num_shards,
            epoch=self.epoch,
            holdout=self.holdout,
            batch_size=self.batch_size,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            max_frame_bytes=self.max_frame_bytes,
        )

    def __iter__(self) -> Iterator[Batch]:
        skip, resume, self._resume = 0, self._resume, None
        if resume is not None:
            here = self._shard()
            saved = (int(resume["shard"]), int(resume["num_shards"]))
            if saved != here:
                msg = (
                    f"`state` was saved by shard {saved[0]} of {saved[1]}, this reader is shard "
                    f"{here[0]} of {here[1]}: resume with the same ranks and DataLoader workers"
                )
                raise DataError(msg)
            if resume["finished"]:
                return  # the shard was read to its end: nothing left in this epoch
            skip = int(resume["batches"])
            _log.debug("resuming shard %d of %d after %d batches", *saved, skip)
        self._batches, self._finished = skip, False
        with self.client() as client:
            for batch in client:
                if client.batches <= skip:  # consumed before the state was saved
                    continue
                self._batches = client.batches
                yield batch
        if client.batches < skip:
            msg = (
                f"the reader service at {client.where} sent {client.batches} batches of shard "
                f"{client.shard}, the state to resume had consumed {skip}: another dataset?"
            )
            raise DataError(msg)
        self._finished = True


class ServiceStream:
    """Batches from ``recpipe serve`` in the training process, epoch after epoch, resumable.

    Iterating yields the rest of the current epoch (from the position a checkpoint restored),
    then moves to the next epoch; :meth:`state_dict` is the position of the batches yielded so
    far. :meth:`read_epoch` reads one whole epoch without moving the position (evaluation)::

        train = ServiceStream("127.0.0.1:5717", holdout=Holdout(0.1), batch_size=4096)
        held_out = ServiceStream("127.0.0.1:5717", holdout=Holdout(0.1, part="held_out"))
        for batch in train: ...
        loss = evaluate(held_out.read_epoch(0))

    Args:
        address: ``HOST:PORT`` of the server.
        token: the shared token (default: ``$RECPIPE_TOKEN`` if set).
        holdout: read only this part of the served dataset (``None``: all of it).
        batch_size: the rows per batch expected; a server making another size refuses.
        splits: the row groups the part must hold (the trainer's own count for its dataset):
            a server that holds another number serves another dataset, and is refused.
        read_timeout_s: give up when the server is silent this long.

    Raises:
        DataError: ``address`` is not ``HOST:PORT``.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        holdout: Holdout | None = None,
        batch_size: int | None = None,
        splits: int | None = None,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.host, self.port = parse_address(address)
        self.token, self.holdout, self.batch_size = token, holdout, batch_size
        self.splits, self.read_timeout_s = splits, read_timeout_s
        self.epoch = 0
        self.batches = 0

    def __iter__(self) -> Iterator[Batch]:
        skip = self.batches
        for i, batch in enumerate(self.read_epoch(self.epoch)):
            if i < skip:
                continue
            self.batches = i + 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def read_epoch(self, epoch: int) -> Iterator[Batch]:
        """Every batch of epoch ``epoch``, from its start (the position does not move).

        Raises:
            DataError: the server's part holds another number of row groups than ``splits``.
            ServiceError: the server refused, failed or went away.
        """
        client = ServiceClient(
            self.host, self.port, token=self.token, epoch=epoch, holdout=self.holdout,
            batch_size=self.batch_size, read_timeout_s=self.read_timeout_s,
        )  # fmt: skip
        with client.connect():
            _check_served_splits(client, self.splits, self.holdout)
            yield from client

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch and the batches of it already yielded."""
        return {"service_epoch": self.epoch, "service_batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.epoch = int(state["service_epoch"])
        self.batches = int(state["service_batches"])

    @property
    def current_epoch(self) -> int:
        """The epoch being read (or read next)."""
        return self.epoch


class ServiceRankDataset:
    """One rank of a multi-rank job reading from ``recpipe serve`` (one client per rank; one
    process is rank 0 of 1).

    The server runs the in-process rank reader (:class:`readers.ranks.RankBatchDataset`) for
    this rank with its own reader config (``--batch-size`` per rank, ``--shuffle``, ``--seed``),
    so the rank gets the batches it would read in-process with that config: every rank the same number per epoch, its part of global batches of
    ``world_size * batch_size`` consecutive rows, the remainder counted. Iterating yields the
    rest of the current epoch from the position (one connection), then moves to the next epoch.
    :meth:`state_dict` is the in-process reader's format (a position in rows of the stream), so
    a job resumes through the service or in-process, at any world size::

        train = ServiceRankDataset("10.0.0.5:5717", rank=rank, world_size=world,
                                   holdout=Holdout(0.1), batch_size=1024)
        for batch in train:  # the same number of batches on every rank
            ...
        held = ServiceRankDataset("10.0.0.5:5717", rank=0, world_size=1, batch_size=world * 1024,
                                  holdout=Holdout(0.1, part="held_out"), drop_remainder=False)

    Args:
        address: ``HOST:PORT`` of the server.
        rank: this rank.
        world_size: ranks of the job.
        token: the shared token (default: ``$RECPIPE_TOKEN`` if set).
        holdout: read only this part of the served dataset (``None``: all of it).
        batch_size: rows per batch per rank: the server must make this size, except for a
            whole-stream reader (``drop_remainder=False``), which it serves at this size.
        splits: the row groups the part must hold (the trainer's own count): a server that
            holds another number serves another dataset, and is refused.
        drop_remainder: leave out the rows after the last whole global batch; ``False`` (one
            rank only) delivers them as a last, shorter batch.
        shuffle, seed: the shuffle the job expects (``None``: whatever the server's): a
            server reading with another is refused before a batch is read.
        connect_timeout_s: give up connecting after this long.
        read_timeout_s: give up when the server is silent this long.

    Raises:
        DataError: ``address`` is not ``HOST:PORT``, ``rank`` is not in ``[0, world_size)``,
            or ``drop_remainder=False`` with several ranks.
    """

    def __init__(
        self,
        address: str,
        *,
        rank: int,
        world_size: int,
        token: str | None = None,
        holdout: Holdout | None = None,
        batch_size: int,
        splits: int | None = None,
        drop_remainder: bool = True,
        shuffle: bool | None = None,
        seed: int | None = None,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            msg = f"`rank` must lie in [0, `world_size`={world_size!r}), got {rank!r}"
            raise DataError(msg)
        if not drop_remainder and world_size > 1:
            msg = (
                f"`drop_remainder=False` needs world_size=1, got {world_size}: the ranks step "
                "together on equal parts"
            )
            raise DataError(msg)
        self.host, self.port = parse_address(address)
        self.rank, self.world_size = rank, world_size
        self.token, self.holdout, self.batch_size = token, holdout, batch_size
        self.splits, self.drop_remainder = splits, drop_remainder
        self.expect = {"shuffle": shuffle, "seed": seed}
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.epoch = 0
        self.origin = 0  # the row of the epoch the next connection starts at
        self.delivered = 0  # steps delivered from there
        # which stream the position is in: unknown until loaded or told by the server
        self.stream: dict[str, Any] = dict.fromkeys(STREAM_KEYS)
        self._resolved = False  # the position was loaded or resolved by the server

    @property
    def global_batch_size(self) -> int:
        """Rows of a step over all ranks, ``world_size * batch_size``."""
        return self.world_size * self.batch_size

    @property
    def layout(self) -> EpochLayout | None:
        """The rest of the current epoch (its ``steps``: the batches it delivers); ``None``
        until the epoch's rows are known (a connection or a loaded state tells them)."""
        rows = self.stream["rows"]
        if rows is None:
            return None
        return EpochLayout.of(
            epoch=self.epoch, world_size=self.world_size, batch_size=self.batch_size,
            origin=self.origin, total_rows=rows, drop_remainder=self.drop_remainder,
        )  # fmt: skip

    @property
    def remainder_rows(self) -> int:
        """Rows of the current epoch no rank is given (0 until the server told the rows)."""
        layout = self.layout
        return 0 if layout is None else layout.remainder_rows

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next, from its beginning."""
        self.epoch, self.origin, self.delivered = int(epoch), 0, 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch yielded (the in-process reader's format)."""
        sample = self.origin + self.delivered * self.global_batch_size
        if self.stream["rows"] is not None:
            sample = min(sample, self.stream["rows"])
        return stream_state(epoch=self.epoch, sample_in_epoch=sample,
                            global_batch_size=self.global_batch_size,
                            stream=self.stream)  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a stream position (this class's or the in-process reader's, saved at
        any world size and batch size; the server checks it against its stream).

        Raises:
            DataError: not a stream position, or one of another stream than a position this
                client already holds.
        """
        state = check_stream_state(state, stream=self.stream)
        self.set_epoch(int(state["epoch"]))
        self.origin = int(state["sample_in_epoch"])
        self.stream = {key: state[key] for key in STREAM_KEYS}
        self._resolved = True

    def _request(self) -> dict[str, Any]:
        state = self.state_dict() if self._resolved else None
        return {"rank": self.rank, "world_size": self.world_size, "state": state,
                "drop_remainder": self.drop_remainder}  # fmt: skip

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch, then the position moves to the next epoch.

        Raises:
            DataError: the server serves another number of row groups than ``splits``, or
                ended the epoch early.
            ServiceError: the server refused, failed or went away.
        """
        client = ServiceClient(
            self.host, self.port, token=self.token, epoch=self.epoch, holdout=self.holdout,
            batch_size=self.batch_size, ranks=self._request(),
            connect_timeout_s=self.connect_timeout_s, read_timeout_s=self.read_timeout_s,
        )  # fmt: skip
        with client.connect():
            expected = self._adopt(client)
            for batch in client:
                self.delivered += 1
                yield batch
        if self.delivered < expected:
            msg = (
                f"the reader service at {client.where} ended epoch {self.epoch} of rank "
                f"{self.rank} after {self.delivered} of its {expected} batches"
            )
            raise DataError(msg)
        self.set_epoch(self.epoch + 1)

    def _adopt(self, client: ServiceClient) -> int:
        """Take the position the server resolved; the steps it will send."""
        _check_served_splits(client, self.splits, self.holdout)
        ranks = client.welcome.get("ranks")
        if not isinstance(ranks, Mapping) or not isinstance(ranks.get("state"), Mapping):
            msg = f"the reader service at {client.where} does not serve the ranks of a job"
            raise ProtocolError(msg)
        state = check_stream_state(ranks["state"], stream={})
        if state["global_batch_size"] != self.global_batch_size or state["rows"] is None:
            msg = (
                f"the reader service at {client.where} sent a position in global batches of "
                f"{state['global_batch_size']} rows (rows {state['rows']!r}), this job's are "
                f"{self.global_batch_size}"
            )
            raise ProtocolError(msg)
        for key, want in self.expect.items():
            if want is not None and state[key] != want and (key != "seed" or state["shuffle"]):
                flag = "--shuffle/--no-shuffle" if key == "shuffle" else "--seed"
                msg = (
                    f"the reader service at {client.where} reads with {key}={state[key]!r}, "
                    f"this job asks for {key}={want!r}: start `recpipe serve` with the job's "
                    f"`{flag}`"
                )
                raise DataError(msg)
        self.set_epoch(int(state["epoch"]))
        self.origin = int(state["sample_in_epoch"])
        self.stream = {key: state[key] for key in STREAM_KEYS}
        self._resolved = True
        layout = self.layout
        assert layout is not None  # the rows are known now
        return layout.steps

    @property
    def current_epoch(self) -> int:
        """The epoch being read (or read next)."""
        return self.epoch


def _check_served_splits(
    client: ServiceClient, splits: int | None, holdout: Holdout | None
) -> None:
    """Refuse a server whose part spans another number of row groups than the trainer's dataset
    (``splits``: the trainer's count, ``None``: unknown) — it serves another dataset."""
    served = client.welcome.get("splits")
    if splits is not None and served is not None and served != splits:
        part = "every" if holdout is None else f"the `{holdout.part}`"
        msg = (
            f"the reader service at {client.where} serves {served} row groups as {part} "
            f"part, the trainer's dataset has {splits}: give the trainer the dataset "
            f"the server serves"
        )
        raise DataError(msg)
