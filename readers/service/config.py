"""Settings and statistics of the reader service: :class:`ServiceConfig` and what the server
reports about itself (:class:`ServerStats`, one :class:`SessionStats` per client).

The limits that keep a server alive under load or abuse are all here: ``max_pending``
connections may wait for their HELLO, each at most ``handshake_timeout_s`` in all;
``max_clients`` authenticated clients are served at once, using at most ``max_readers`` reader
processes (or threads) in all; frames are bounded by ``max_frame_bytes`` (and a HELLO by
:data:`readers.service.wire.HELLO_MAX_BYTES`). A server that listens on anything but loopback
needs a ``token`` unless ``insecure`` says otherwise.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from readers.service.wire import DEFAULT_MAX_FRAME_BYTES
from recpipe.errors import DataError

__all__ = [
    "DEFAULT_MAX_READERS",
    "TOKEN_ENV",
    "ServerStats",
    "ServiceConfig",
    "SessionStats",
    "is_loopback",
]

TOKEN_ENV = "RECPIPE_TOKEN"
DEFAULT_MAX_READERS = 8  # reader processes in all, unless `readers` alone needs more
MAX_READERS_PER_CLIENT = 256  # `readers` and `idle_readers`
MAX_PENDING = 65_535  # `max_pending` (also the listen backlog)
MAX_SECONDS = 86_400.0  # every duration setting


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches only this machine (every address it resolves to
    is a loopback address). ``""``, ``0.0.0.0`` and ``::`` (every interface) are not.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False  # binding will fail with a clear error anyway
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


@dataclass
class ServiceConfig:
    """Settings of a :class:`~readers.service.server.ReaderServer`.

    Attributes:
        host: address to listen on (loopback by default; anything else needs a ``token``
            or ``insecure``).
        port: TCP port; 0 picks a free one (printed by ``recpipe serve``; see
            ``ReaderServer.address``).
        readers: reader processes per client; 0 produces in one thread of the server process
            (no extra processes: for tests and debugging).
        idle_readers: reader processes kept running between clients, warm: started with the
            server (``readers`` of them), handed to the next client when one disconnects or
            finishes. ``None``: ``readers`` (one client's worth); 0: a client's readers start
            with it and stop after it.
        queue_depth: encoded frames buffered per client between its readers and its socket.
        token: shared secret a client must present; ``None`` accepts every client.
        max_frame_bytes: largest frame produced or accepted.
        max_clients: authenticated clients served at once; more are refused as busy.
        max_readers: reader processes (threads with ``readers=0``) in all, lent to clients or
            kept idle; a client that would need more is refused as busy; each reader process
            holds its pipeline's memory. ``None``: :data:`DEFAULT_MAX_READERS` (8), or
            ``readers`` and ``idle_readers`` if larger.
        max_pending: connections waiting for their HELLO at once; more are refused at once.
        heartbeat_s: a client hears from the server at least this often (HEARTBEAT frames).
        handshake_timeout_s: seconds a connection has, in all, to complete its HELLO: one
            whose HELLO is not complete this long after it was accepted is dropped (one
            deadline for the whole HELLO, not per read).
        report_every_s: seconds between progress lines on stderr; 0 turns them off.
        send_buffer_bytes: the sockets' ``SO_SNDBUF``, or ``None`` for the system default.
        narrow: send int64 tensors that fit as int32 (exact; see
            :func:`readers.service.wire.batch_to_frame`).
        insecure: allow a non-loopback ``host`` without a ``token`` (anyone who reaches the
            port can read the data).
        auth_failures_free: failed authentications a peer host may have before its back-off
            starts (see :mod:`readers.service.guard`).
        auth_backoff_s: the first back-off: every connection from the host is refused this
            long after its next failed authentication, twice as long after the one after it...
        auth_backoff_max_s: the longest back-off; a host without failures this long starts
            afresh.
        refusal_log_every_s: a refused peer host's first refusal is logged in full, the ones
            after it in one summary line per host this often.
    """

    host: str = "127.0.0.1"
    port: int = 0
    readers: int = 2
    idle_readers: int | None = None
    queue_depth: int = 8
    token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_clients: int = 64
    max_readers: int | None = None
    max_pending: int = 32
    heartbeat_s: float = 1.0
    handshake_timeout_s: float = 10.0
    report_every_s: float = 10.0
    send_buffer_bytes: int | None = None
    narrow: bool = True
    insecure: bool = False
    auth_failures_free: int = 3
    auth_backoff_s: float = 1.0
    auth_backoff_max_s: float = 60.0
    refusal_log_every_s: float = 10.0

    def __post_init__(self) -> None:
        def count(value: object, least: int, most: int) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most

        def seconds(value: object, *, zero: bool = False) -> bool:  # finite, at most a day
            number = isinstance(value, int | float) and not isinstance(value, bool)
            return number and (value >= 0 if zero else value > 0) and value <= MAX_SECONDS

        readers, pending = MAX_READERS_PER_CLIENT, MAX_PENDING
        checks: list[tuple[str, bool, str]] = [
            ("port", count(self.port, 0, 65535), "an integer in [0, 65535]"),
            ("readers", count(self.readers, 0, readers), f"an integer in [0, {readers}]"),
            ("idle_readers", self.idle_readers is None or count(self.idle_readers, 0, readers),
             f"an integer in [0, {readers}]"),
            ("queue_depth", count(self.queue_depth, 1, 1 << 16), "an integer in [1, 65536]"),
            ("max_frame_bytes", count(self.max_frame_bytes, 1025, 1 << 40),
             "an integer in [1025, 2**40]"),
            ("max_clients", count(self.max_clients, 1, 1 << 20), "an integer in [1, 2**20]"),
            ("max_readers", self.max_readers is None or count(self.max_readers, 1, 1 << 16),
             "an integer in [1, 65536]"),
            ("max_pending", count(self.max_pending, 1, pending), f"an integer in [1, {pending}]"),
            ("heartbeat_s", seconds(self.heartbeat_s), f"a number of seconds in (0, {MAX_SECONDS:,}]"),
            ("handshake_timeout_s", seconds(self.handshake_timeout_s),
             f"a number of seconds in (0, {MAX_SECONDS:,}]"),
            ("report_every_s", seconds(self.report_every_s, zero=True),
             f"a number of seconds in [0, {MAX_SECONDS:,}]"),
            ("send_buffer_bytes",
             self.send_buffer_bytes is None or count(self.send_buffer_bytes, 1, (1 << 31) - 1),
             "an integer in [1, 2**31 - 1]"),
            ("auth_failures_free", count(self.auth_failures_free, 0, 1 << 20),
             "an integer in [0, 2**20]"),
            ("auth_backoff_s", seconds(self.auth_backoff_s),
             f"a number of seconds in (0, {MAX_SECONDS:,}]"),
            ("auth_backoff_max_s", seconds(self.auth_backoff_max_s)
             and self.auth_backoff_max_s >= self.auth_backoff_s,
             f"a number of seconds in [`auth_backoff_s`, {MAX_SECONDS:,}]"),
            ("refusal_log_every_s", seconds(self.refusal_log_every_s, zero=True),
             f"a number of seconds in [0, {MAX_SECONDS:,}]"),
        ]  # fmt: skip
        for name, ok, want in checks:
            if not ok:
                msg = f"`{name}` has an invalid value {getattr(self, name)!r}: it must be {want}"
                raise DataError(msg)
        if self.token is not None and not self.token:
            msg = "`token` must be a non-empty string or None, got ''"
            raise DataError(msg)
        if self.max_readers is not None and self.max_readers < max(
            self.readers_per_client, self.kept_readers
        ):
            msg = (
                f"`max_readers`={self.max_readers} is below `readers`={self.readers} or "
                f"`idle_readers`={self.idle_readers}: raise it or lower those"
            )
            raise DataError(msg)

    @property
    def readers_per_client(self) -> int:
        """Readers one client gets: ``readers`` processes, or one thread with ``readers=0``."""
        return max(self.readers, 1)

    @property
    def kept_readers(self) -> int:
        """How many idle reader processes the server keeps (0 without reader processes)."""
        if not self.readers:
            return 0
        return self.readers if self.idle_readers is None else self.idle_readers

    @property
    def reader_limit(self) -> int:
        """Readers in all, lent or idle (``max_readers`` or its default)."""
        if self.max_readers is not None:
            return self.max_readers
        return max(DEFAULT_MAX_READERS, self.readers_per_client, self.kept_readers)

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback without a token (unless ``insecure``).

        Raises:
            DataError: ``host`` is not a loopback address, ``token`` is ``None`` and
                ``insecure`` is not set.
        """
        if self.token is None and not self.insecure and not is_loopback(self.host):
            msg = (
                f"refusing to listen on `host`={self.host!r} without a token: anyone who can "
                f"reach the port could read the data. Set a token (--token-file FILE or "
                f"${TOKEN_ENV}), listen on 127.0.0.1, or pass --insecure (`insecure=True`)"
            )
            raise DataError(msg)


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
        readers_alive: reader processes/threads still running for this client.
        reader_pids: process ids of the reader processes lent to this client (empty with
            reader threads).
        part: the part of the dataset asked for (``"all"``, ``"train"`` or ``"held_out"``).
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
    reader_pids: tuple[int, ...] = ()
    part: str = "all"


@dataclass(frozen=True)
class ServerStats:
    """A snapshot of the whole server (see :meth:`ReaderServer.stats`).

    ``sessions`` holds the clients being served and the most recent finished ones (a bounded
    history); ``session_states`` counts every client over the server's life by final state.
    """

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
    connections_pending: int = 0  # waiting for their HELLO right now
    session_states: Mapping[str, int] = field(default_factory=dict)
    auth_failures: int = 0  # HELLOs with no token or a wrong one
    auth_backed_off: int = 0  # connections refused because their host was backed off

    def summary(self) -> str:
        """A short multi-line summary for the end of a run."""
        rate = self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0
        per_sample = self.bytes_sent / self.samples if self.samples else 0.0
        lines = [
            f"recpipe serve: summary ({self.elapsed_s:.1f} s on {self.address[0]}:{self.address[1]})",
            f"  clients         {self.clients_total} served, {self.rejected} refused"
            + (
                f" ({self.auth_failures:,} failed authentication, {self.auth_backed_off:,} "
                "while their host was backed off)"
                if self.auth_failures or self.auth_backed_off
                else ""
            ),
            f"  batches         {self.batches:,}",
            f"  samples         {self.samples:,} ({rate:,.0f} samples/s)",
            f"  bytes sent      {fmt_bytes(self.bytes_sent)} ({per_sample:,.1f} B/sample)",
            f"  reader procs    {self.reader_processes_started} started",
        ]
        states = dict(self.session_states)
        for session in self.sessions:
            if session.state == "streaming":
                states["streaming"] = states.get("streaming", 0) + 1
        if states:
            lines.append(
                "  sessions        " + ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
            )
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B/KB/MB/GB (powers of 1000), for log lines."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:,.1f} TB"  # pragma: no cover
