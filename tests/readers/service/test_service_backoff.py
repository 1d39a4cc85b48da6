"""Failed authentications back their host off, and the log summarises repeated refusals.

The attack: 2,000 wrong tokens from one loop, answered at once, each a line in the log. Now a
host gets ``auth_failures_free`` guesses, then its connections are refused at once for a
back-off that doubles with each failure; other hosts are served meanwhile; the log holds the
first refusal and one summary line per host and interval. The back-offs and the interval are
an hour here, so nothing depends on how fast the test runs.
"""

from __future__ import annotations

import socket

import pytest

from readers.service import ServiceClient, SyntheticProducer
from readers.service.guard import PeerGuard
from readers.service.wire import (
    HELLO_MAX_BYTES,
    FrameKind,
    ServiceError,
    encode_frame,
    recv_frame,
)

TIMEOUT = 60.0
ATTACKER = "127.0.0.2"  # loopback too, but another host than the clients on 127.0.0.1
HOUR = 3600.0


def _hello_from(source: str, address: tuple[str, int], token: str) -> str:
    """One connection from ``source`` saying HELLO with ``token``: the server's ERROR message,
    ``"WELCOME"``, or ``"closed: ..."`` when the connection was closed before the answer
    could be read."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.bind((source, 0))
        sock.connect(address)
        try:
            sock.sendall(encode_frame(FrameKind.HELLO, {"token": token}))
            reply = recv_frame(sock, max_frame_bytes=HELLO_MAX_BYTES)
        except (OSError, ServiceError) as exc:
            return f"closed: {exc}"
    return "WELCOME" if reply.kind is FrameKind.WELCOME else reply.meta["message"]


@pytest.fixture
def attacker_host() -> str:
    try:
        with socket.socket() as sock:
            sock.bind((ATTACKER, 0))
    except OSError as exc:
        pytest.skip(f"cannot bind {ATTACKER} here: {exc}")
    return ATTACKER


def test_a_token_guessing_loop_is_backed_off_and_summarised(start_server, attacker_host) -> None:
    server = start_server(
        SyntheticProducer(num_batches=2, batch_size=8),
        token="s3cret",
        auth_failures_free=2,
        auth_backoff_s=HOUR,
        auth_backoff_max_s=HOUR,
        refusal_log_every_s=HOUR,
    )
    answers = [_hello_from(attacker_host, server.address, f"guess{i}") for i in range(30)]
    assert all("authentication failed: the client sent a wrong token" in a for a in answers[:3])
    for answer in answers[3:]:  # refused without a look at the token
        assert answer.startswith("closed") or (
            f"3 failed authentications from {attacker_host}" in answer and "refused for" in answer
        ), answer
    # the right token from that host is refused too: a guesser must not learn it was right
    assert _hello_from(attacker_host, server.address, "s3cret") != "WELCOME"
    # every other host is served as before
    host, port = server.address
    with ServiceClient(host, port, token="s3cret", read_timeout_s=TIMEOUT) as client:
        assert len(list(client)) == 2

    stats = server.close()
    assert (stats.auth_failures, stats.auth_backed_off, stats.rejected) == (3, 28, 31)
    assert "3 failed authentication, 28 while their host was backed off" in stats.summary()
    lines = [line for line in server._logfile.getvalue().splitlines() if attacker_host in line]
    assert len(lines) == 2, lines  # the first refusal in full, then one summary line
    assert "authentication failed" in lines[0]
    assert f"refused {attacker_host} 30 more times in" in lines[1]
    assert "28 backed off, 2 failed authentication" in lines[1]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_back_off_doubles_and_a_quiet_host_starts_afresh() -> None:
    clock = _Clock()
    guard = PeerGuard(free=2, backoff_s=1.0, backoff_max_s=8.0, log_every_s=10.0, clock=clock)
    waits = []
    for _ in range(7):
        waits.append(guard.failed("h"))
        clock.now += 0.5
    assert waits == [0, 0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert guard.backoff("h") == (7.5, 7) and guard.backoff("other") == (0.0, 0)
    clock.now += 9.0  # past the back-off and quiet for longer than backoff_max_s
    assert guard.backoff("h")[0] == 0.0
    assert guard.failed("h") == 0  # counted afresh: free again


def test_refusals_are_logged_once_then_summarised_per_interval() -> None:
    clock = _Clock()
    guard = PeerGuard(free=2, backoff_s=1.0, backoff_max_s=8.0, log_every_s=10.0, clock=clock)
    assert guard.refused("h", "busy") is True  # the first: in full
    assert [guard.refused("h", why) for why in ("busy", "bad handshake", "busy")] == [False] * 3
    assert guard.refused("g", "busy") is True  # another host has its own line
    assert guard.summaries() == []  # the interval is not over
    clock.now += 10.0
    assert guard.summaries() == ["refused h 3 more times in 10.0 s (2 busy, 1 bad handshake)"]
    assert guard.refused("h", "busy") is False  # a new interval: counted
    clock.now += 10.0
    assert guard.summaries() == ["refused h 1 more time in 10.0 s (1 busy)"]
    clock.now += 10.0
    assert guard.summaries() == []  # a quiet interval ends the host's summaries
    assert guard.refused("h", "busy") is True  # so its next refusal is in full again
