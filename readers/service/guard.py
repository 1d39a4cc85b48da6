"""What the reader service remembers about its peers: failed authentications, for a back-off,
and refusals, for a log that summarises them.

**Back-off.** A peer host (its address, whatever its port) may fail to authenticate
``free`` times; each failure after that refuses every connection from the host, at once and
without reading its HELLO, for a back-off that doubles with each failure, from
``backoff_s`` up to ``backoff_max_s``. A host that has not failed for ``backoff_max_s`` starts
afresh. So a loop guessing tokens gets ``free`` guesses, then about one per ``backoff_max_s``,
while other hosts are served as before (the refusal costs no thread and no handshake slot).
Clients on the locked-out host are refused too, whatever their token: checking it would tell
the guesser when it is right.

**Refusals in the log.** The first refusal of a host is logged in full; the ones after it are
counted, and one line per host and ``log_every_s`` says how many there were and why
(:meth:`PeerGuard.refused`, :meth:`PeerGuard.summaries`).

Both tables are bounded (``max_peers``): beyond it, the host seen least recently is forgotten.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MAX_PEERS", "PeerGuard"]

MAX_PEERS = 4096  # hosts remembered at once, in each table


@dataclass
class _Failures:
    count: int = 0  # failures since the host last went quiet
    last: float = 0.0  # when the last one was
    until: float = 0.0  # refused until then


@dataclass
class _Refusals:
    since: float  # when this interval began
    counts: collections.Counter[str] = field(default_factory=collections.Counter)


class PeerGuard:
    """Failed authentications and refusals per peer host (see the module docs); thread-safe.

    Args:
        free: failures a host may have before its back-off starts.
        backoff_s: the first back-off, doubled with each failure after it.
        backoff_max_s: the longest back-off; a host quiet this long starts afresh.
        log_every_s: at most one summary line per host this often.
        max_peers: hosts remembered at once.
        clock: ``time.monotonic`` (tests may pass another).
    """

    def __init__(
        self,
        *,
        free: int,
        backoff_s: float,
        backoff_max_s: float,
        log_every_s: float,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free, self.backoff_s, self.backoff_max_s = free, backoff_s, backoff_max_s
        self.log_every_s, self.max_peers, self.clock = log_every_s, max_peers, clock
        self._lock = threading.Lock()
        self._failures: collections.OrderedDict[str, _Failures] = collections.OrderedDict()
        self._refusals: collections.OrderedDict[str, _Refusals] = collections.OrderedDict()

    def backoff(self, host: str) -> tuple[float, int]:
        """``(seconds left, failures)`` of ``host``'s back-off; ``(0.0, failures)`` if none."""
        now = self.clock()
        with self._lock:
            entry = self._failures.get(host)
            if entry is None:
                return 0.0, 0
            return max(entry.until - now, 0.0), entry.count

    def failed(self, host: str) -> float:
        """Count a failed authentication of ``host``; the back-off it starts (0: none yet)."""
        now = self.clock()
        with self._lock:
            entry = self._failures.pop(host, None) or _Failures()
            if now - entry.last > self.backoff_max_s and now >= entry.until:
                entry.count = 0  # quiet long enough: start afresh
            entry.count += 1
            entry.last = now
            over = entry.count - self.free
            wait = (
                min(self.backoff_s * 2.0 ** min(over - 1, 64), self.backoff_max_s)
                if over > 0
                else 0
            )
            entry.until = max(entry.until, now + wait)
            self._failures[host] = entry  # the most recent last
            _trim(self._failures, self.max_peers)
            return wait

    def refused(self, host: str, why: str) -> bool:
        """Count a refusal of ``host`` (``why``: a short reason); True if it is to be logged
        in full (the host's first in its interval), False if the summary will count it."""
        now = self.clock()
        with self._lock:
            entry = self._refusals.get(host)
            if entry is None:
                self._refusals[host] = _Refusals(since=now)
                _trim(self._refusals, self.max_peers)
                return True
            entry.counts[why] += 1
            return False

    def summaries(self, *, everything: bool = False) -> list[str]:
        """One line per host whose interval is over (``everything``: every host) and that
        was refused again in it; those hosts start a new interval."""
        now = self.clock()
        lines = []
        with self._lock:
            for host, entry in list(self._refusals.items()):
                if not everything and now - entry.since < self.log_every_s:
                    continue
                if not entry.counts:
                    del self._refusals[host]  # nothing since the full line: the next is full too
                    continue
                total = sum(entry.counts.values())
                reasons = ", ".join(f"{n:,} {why}" for why, n in entry.counts.most_common())
                lines.append(
                    f"refused {host} {total:,} more time{'s' if total > 1 else ''} in "
                    f"{now - entry.since:.1f} s ({reasons})"
                )
                self._refusals[host] = _Refusals(since=now)
        return lines


def _trim(table: collections.OrderedDict[str, object], limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)
