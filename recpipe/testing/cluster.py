"""A cluster in a box: H "hosts" on one Linux machine, each a network namespace, joined through a
bridge namespace by veth pairs, each host's link shaped with ``tc qdisc ... tbf``.

Topology (2 hosts; ``<p>`` is the run's prefix, ``rpcl<pid>x<4 hex>``)::

    ns <p>-h0                      ns <p>-br                        ns <p>-h1
    lo, eth0 10.A.B.1/24 ==veth== v0 --+                  +-- v1 ==veth== eth0 10.A.B.2/24, lo
    tbf R0 on eth0 (upload)  tbf R0 on v0 (download)  tbf R1 on v1   tbf R1 on eth0
                                       +------ br0 -------+

A host's link is shaped both ways at its own rate (its ``eth0`` egress and the bridge port's
egress toward it), so traffic from host i to host j is held to min(R_i, R_j) and the links are
full duplex. Processes of one host reach each other over the host's loopback, unshaped.

Names and addresses exist only inside the namespaces a run creates: interface names are the
same in every run (``eth0``, ``v<i>``, ``br0``: they live in the run's own namespaces), the
namespace names carry the creating process's id and a random tag, and the /24 is drawn at random
from 10.200.0.0/13. Nothing is added to the machine's own namespace, and no route leads out of the
run's namespaces, so a run can send nothing to any address outside them.

Clean-up on every exit path: :meth:`Cluster.close` (called by the context manager and, for
clusters still open when the interpreter exits, by an ``atexit`` hook) kills every process the
cluster started and every process still inside its namespaces, then deletes the namespaces;
where the creating process died by SIGKILL, the next :meth:`Cluster.start` (or
:func:`sweep_stale`) deletes namespaces of the ``rpcl`` family whose creating process is gone.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2) and the ``tbf``
qdisc; :func:`unavailable` says why a cluster cannot be made here (tests skip with that reason).

>>> Cluster([100.0, None]).rates_mbit
(100.0, None)
>>> bool(_NAME.match("rpcl123x0a1f-h0")), bool(_NAME.match("rpcl123x0a1f-br")), bool(_NAME.match("other"))
(True, True, False)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recpipe._process import pid_alive
from recpipe.errors import RecpipeError

__all__ = [
    "FAMILY",
    "INTERFACE",
    "MASTER_PORT",
    "Cluster",
    "ClusterError",
    "ClusterUnavailable",
    "Host",
    "sweep_stale",
    "unavailable",
    "wait_all",
]

FAMILY = "rpcl"  # every namespace of every run starts with this
_NAME = re.compile(r"^rpcl(\d+)x([0-9a-f]{4})-(br|h\d+)$")
INTERFACE = "eth0"  # a host's link, in every host namespace
MASTER_PORT = 29500  # free in a fresh namespace: nothing else listens there
_CMD_TIMEOUT_S = 20.0  # every ip/tc command
_KILL_WAIT_S = 10.0

_LIVE: list[Cluster] = []


class ClusterError(RecpipeError):
    """A cluster in a box cannot be built, driven or removed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot make network namespaces or shape their links (not root, no
    CAP_NET_ADMIN, no iproute2, no ``tbf``)."""


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its link's address and rate (Mbit/s each way; ``None``:
    unshaped)."""

    index: int
    namespace: str
    address: str
    rate_mbit: float | None
    interface: str = INTERFACE


def _run(argv: Sequence[str], *, timeout_s: float = _CMD_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        msg = f"`{' '.join(argv)}` failed: {exc}"
        raise ClusterError(msg) from exc
    if done.returncode != 0:
        msg = f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()!r}"
        raise ClusterError(msg)
    return done.stdout


def list_namespaces() -> list[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _namespace_pids(name: str) -> list[int]:
    try:
        out = _run(["ip", "netns", "pids", name])
    except ClusterError:
        return []
    return [int(p) for p in out.split()]


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside ``name`` (processes a cluster of this family started), then
    delete it."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while pids := _namespace_pids(name):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            msg = f"namespace {name!r}: processes {pids} survive SIGKILL"
            raise ClusterError(msg)
        time.sleep(0.05)
    _run(["ip", "netns", "delete", name])


def stale_namespaces() -> list[str]:
    """The namespaces of this family whose creating process is gone: left behind by a run
    (namespaces of runs still going, this process's or another's, are not)."""
    return [n for n in list_namespaces() if (m := _NAME.match(n)) and not pid_alive(int(m[1]))]


def sweep_stale() -> list[str]:
    """Delete the namespaces of this family whose creating process is gone (a run killed by
    SIGKILL); the names deleted."""
    removed = stale_namespaces()
    for name in removed:
        _delete_namespace(name)
    return removed


def unavailable() -> str | None:
    """Why no cluster can be made here (``None``: one can). Makes and removes one namespace
    holding a shaped veth pair."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform!r}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{FAMILY}{os.getpid()}x{random.getrandbits(16):04x}-br"
    try:
        _run(["ip", "netns", "add", name])
    except ClusterError as exc:
        return f"cannot make a network namespace (needs root or CAP_NET_ADMIN): {exc}"
    try:
        _run(["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "10mbit",
              "burst", "16kb", "latency", "50ms"])  # fmt: skip
    except ClusterError as exc:
        return f"cannot make a veth pair shaped with tbf: {exc}"
    finally:
        _delete_namespace(name)
    return None


def wait_all(procs: Sequence[subprocess.Popen[Any]], *, timeout_s: float) -> list[int | None]:
    """Exit codes of ``procs`` after waiting at most ``timeout_s`` for all of them; a process
    still running then is killed (its whole process group) and reported as ``None``."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(max(deadline - time.monotonic(), 0.0)))
        except subprocess.TimeoutExpired:
            _kill_group(p)
            codes.append(None)
    return codes


def _kill_group(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # started with start_new_session: pgid == pid
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(_KILL_WAIT_S)


def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


_RECEIVE = r"""
import socket, sys, time
want, timeout = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket(); s.bind((sys.argv[3], 0)); s.listen(1); s.settimeout(timeout)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(timeout)
got = 0
while got < want:
    b = c.recv(1 << 20)
    if not b:
        break
    got += len(b)
print(got, time.monotonic(), flush=True)
"""

_SEND = r"""
import socket, sys, time
addr, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
chunk = bytes(1 << 20)
print(time.monotonic(), flush=True)
with socket.create_connection((addr, port), timeout=timeout) as c:
    while n > 0:
        c.sendall(chunk[: min(n, len(chunk))])
        n -= len(chunk)
"""


class Cluster:
    """H hosts, one network namespace each, on one bridge; host i's link shaped to
    ``rates_mbit[i]`` Mbit/s each way (``None``: unshaped). Use it as a context manager.

    Args:
        rates_mbit: one rate per host.
        burst_bytes: the token bucket's depth (default: 4 ms of the rate, at least 16 KiB; the
            most a link sends at once above its rate).
        latency_ms: the longest a packet waits in the shaper's queue before it is dropped.
    """

    def __init__(
        self,
        rates_mbit: Sequence[float | None],
        *,
        burst_bytes: int | None = None,
        latency_ms: float = 100.0,
    ) -> None:
        rates = tuple(None if r is None else float(r) for r in rates_mbit)
        if not 1 <= len(rates) <= 250:
            msg = f"`rates_mbit` must give 1 to 250 hosts, got {len(rates)}"
            raise ClusterError(msg)
        if any(r is not None and not 0 < r < float("inf") for r in rates):
            msg = f"`rates_mbit` must be positive (Mbit/s) or None, got {list(rates_mbit)!r}"
            raise ClusterError(msg)
        self.rates_mbit = rates
        self.burst_bytes = burst_bytes
        self.latency_ms = float(latency_ms)
        self.prefix = ""
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    # -- building ---------------------------------------------------------------------------
    def burst_for(self, rate_mbit: float) -> int:
        """The token bucket of a link of ``rate_mbit`` (bytes)."""
        if self.burst_bytes is not None:
            return int(self.burst_bytes)
        return max(16384, int(rate_mbit * 1e6 / 8 * 0.004))

    def start(self) -> Cluster:
        """Make the namespaces, links and shapers (deleting stale ones of this family first)."""
        if self._namespaces:
            return self
        reason = unavailable()
        if reason is not None:
            raise ClusterUnavailable(f"no cluster in a box here: {reason}")
        sweep_stale()
        self.prefix = f"{FAMILY}{os.getpid()}x{random.getrandbits(16):04x}"
        subnet = f"10.{random.randint(200, 207)}.{random.randint(0, 255)}"
        if not _LIVE:
            atexit.register(_close_all)
        _LIVE.append(self)
        try:
            self._build(subnet)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, namespace: str, device: str, rate_mbit: float) -> None:
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
              "rate", f"{rate_mbit:g}mbit", "burst", str(self.burst_for(rate_mbit)),
              "latency", f"{self.latency_ms:g}ms"])  # fmt: skip

    def _build(self, subnet: str) -> None:
        bridge = f"{self.prefix}-br"
        self._add_namespace(bridge)
        _run(["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", bridge, "link", "set", "br0", "up"])
        for i, rate in enumerate(self.rates_mbit):
            ns, port = f"{self.prefix}-h{i}", f"v{i}"
            self._add_namespace(ns)
            _run(["ip", "-n", bridge, "link", "add", port, "type", "veth",
                  "peer", "name", INTERFACE, "netns", ns])  # fmt: skip
            _run(["ip", "-n", bridge, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", bridge, "link", "set", port, "up"])
            address = f"{subnet}.{i + 1}"
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
            if rate is not None:
                self._shape(ns, INTERFACE, rate)
                self._shape(bridge, port, rate)
            self.hosts.append(Host(index=i, namespace=ns, address=address, rate_mbit=rate))

    def set_rate(self, host: int, rate_mbit: float | None) -> None:
        """Reshape host ``host``'s link (both ends) to ``rate_mbit`` (``None``: unshaped)."""
        if rate_mbit is not None and not 0 < float(rate_mbit) < float("inf"):
            msg = f"`rate_mbit` must be positive (Mbit/s) or None, got {rate_mbit!r}"
            raise ClusterError(msg)
        bridge = f"{self.prefix}-br"
        ends = ((self.hosts[host].namespace, INTERFACE), (bridge, f"v{host}"))
        for ns, device in ends:
            if self.hosts[host].rate_mbit is not None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", device, "root"])
            if rate_mbit is not None:
                self._shape(ns, device, float(rate_mbit))
        rate = None if rate_mbit is None else float(rate_mbit)
        self.hosts[host] = replace(self.hosts[host], rate_mbit=rate)
        self.rates_mbit = tuple(h.rate_mbit for h in self.hosts)

    # -- running ----------------------------------------------------------------------------
    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``host`` (its own process group; killed by :meth:`close`
        if still running)."""
        if not self.hosts:
            msg = "the cluster is not started: use `with Cluster(...) as c` or `.start()`"
            raise ClusterError(msg)
        ns = self.hosts[host].namespace
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            env=None if env is None else dict(env),
            start_new_session=True,
            **kwargs,
        )
        self._procs.append(p)
        return p

    def rank_env(
        self,
        rank: int,
        placement: Sequence[int],
        *,
        port: int = MASTER_PORT,
        base: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """The environment of rank ``rank`` of a job whose rank k runs on host
        ``placement[k]``: torchrun's variables, the master on rank 0's host, and
        ``GLOO_SOCKET_IFNAME`` (gloo's sockets on the host's link)."""
        host = placement[rank]
        local = [k for k, h in enumerate(placement) if h == host]
        env = dict(os.environ if base is None else base)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(len(placement)),
            LOCAL_RANK=str(local.index(rank)),
            LOCAL_WORLD_SIZE=str(len(local)),
            GROUP_RANK=str(host),
            MASTER_ADDR=self.hosts[placement[0]].address,
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=INTERFACE,
        )
        return env

    def launch(
        self,
        argv: Sequence[str],
        placement: Sequence[int],
        *,
        env: Mapping[str, str] | None = None,
        logs: str | os.PathLike[str] | None = None,
        port: int = MASTER_PORT,
    ) -> list[subprocess.Popen[Any]]:
        """Start a job of ``len(placement)`` ranks, rank k running ``argv`` on host
        ``placement[k]``; each rank's output goes to ``logs/rank-<k>.log`` (or is inherited)."""
        if not placement or any(not 0 <= h < len(self.hosts) for h in placement):
            msg = f"`placement` must name hosts in [0, {len(self.hosts)}), got {list(placement)!r}"
            raise ClusterError(msg)
        procs = []
        for rank in range(len(placement)):
            out: Any = None
            if logs is not None:
                out = (Path(logs) / f"rank-{rank}.log").open("wb")
            try:
                procs.append(
                    self.popen(placement[rank], argv, stdout=out, stderr=subprocess.STDOUT,
                               env=self.rank_env(rank, placement, port=port, base=env))
                )  # fmt: skip
            finally:
                if out is not None:
                    out.close()
        return procs

    def transfer(self, src: int, dst: int, nbytes: int, *, timeout_s: float = 60.0) -> float:
        """Seconds from just before host ``src`` connects to host ``dst`` over TCP until
        ``dst`` has read ``nbytes`` sent through that connection (a plain socket pair)."""
        deadline = time.monotonic() + timeout_s
        recv = self.popen(
            dst, [sys.executable, "-c", _RECEIVE, str(nbytes), str(timeout_s),
                  self.hosts[dst].address],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        send = None
        try:
            if recv.stdout is None:  # popen was given stdout=PIPE above
                msg = f"the receiver on host {dst} has no output pipe"
                raise ClusterError(msg)
            port = recv.stdout.readline().strip()
            if not port:
                msg = f"the receiver on host {dst} did not start (exit {recv.wait(5)})"
                raise ClusterError(msg)
            send = self.popen(
                src, [sys.executable, "-c", _SEND, self.hosts[dst].address, port, str(nbytes),
                      str(timeout_s)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            sent_out, _ = send.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            got_out, _ = recv.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired as exc:
            msg = f"moving {nbytes} bytes from host {src} to host {dst} took over {timeout_s} s"
            raise ClusterError(msg) from exc
        finally:
            for p in (recv, send):
                if p is not None:
                    _kill_group(p)
        got, t1 = got_out.split()
        if int(got) != nbytes or send.returncode != 0:
            msg = (f"host {dst} received {got} of {nbytes} bytes from host {src} "
                   f"(sender exit {send.returncode})")  # fmt: skip
            raise ClusterError(msg)
        return float(t1) - float(sent_out.split()[0])

    # -- removing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process started here or still inside the namespaces and delete the
        namespaces (idempotent)."""
        for p in self._procs:
            _kill_group(p)
        self._procs.clear()
        failures = []
        for name in reversed(self._namespaces):  # hosts first, the bridge last
            try:
                _delete_namespace(name)
            except ClusterError as exc:
                failures.append(str(exc))
        self._namespaces.clear()
        if self in _LIVE:
            _LIVE.remove(self)
        if failures:
            msg = "could not remove the cluster's namespaces: " + "; ".join(failures)
            raise ClusterError(msg)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """The topology, for results files: hosts, rates, shaper settings."""
        return {
            "hosts": len(self.hosts),
            "rates_mbit": list(self.rates_mbit),
            "burst_bytes": [None if r is None else self.burst_for(r) for r in self.rates_mbit],
            "latency_ms": self.latency_ms,
            "shaper": "tbf on both ends of each host's veth (egress), a Linux bridge between",
        }
