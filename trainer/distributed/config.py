"""The configs of a multi-rank ``recpipe train``: how it is launched, how its exchange runs.

Plain dataclasses checked in ``__post_init__``, importing nothing heavy: ``recpipe train``
generates its ``--nproc``, ``--hot-rows``, ... options from them (:mod:`recpipe.config_cli`)
without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recpipe.errors import RecpipeError

__all__ = ["DistributedConfig", "LaunchConfig"]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class LaunchConfig:
    """Where the ranks of a multi-rank ``recpipe train`` run (torchrun's options).

    Attributes:
        nproc: train with N processes on this machine (gloo on CPU, NCCL on CUDA).
        nnodes: machines in the job (each runs the same command).
        node_rank: this machine's rank among ``nnodes``.
        master_addr: address of node 0 (needed with ``nnodes`` > 1).
        master_port: port on node 0.
    """

    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500

    def __post_init__(self) -> None:
        for name in ("nnodes", "master_port"):
            if not _positive_int(getattr(self, name)):
                msg = f"`{name}` must be a positive integer, got {getattr(self, name)!r}"
                raise RecpipeError(msg)
        if self.master_port > 65535:
            msg = f"`master_port` must be a TCP port, 1..65535, got {self.master_port!r}"
            raise RecpipeError(msg)
        if self.nproc is not None and not _positive_int(self.nproc):
            msg = f"`nproc` must be a positive integer, got {self.nproc!r}"
            raise RecpipeError(msg)
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int):
            msg = f"`node_rank` must be an integer, got {self.node_rank!r}"
            raise RecpipeError(msg)


@dataclass
class DistributedConfig:
    """How a multi-rank job runs its embedding exchange.

    Attributes:
        hot_rows: R, hot rows of all tables together: ``"auto"`` (the cost model's choice) or
            a number (``0``: no hot set).
        count_steps: steps whose id accesses are counted before R is chosen.
        hot_budget_rows: most hot rows the cost model may choose.
        timeout_s: collective timeout: a rank that hangs makes the others fail after it.
        probe_repeats: timed steps per size when fitting the cost model (after the counted
            steps), spread over up to 3 rotated visits of every size (each size keeps the
            slowest rank's fastest step of its fastest visit). Unset: chosen with the sizes so
            that the probe moves at most 5% of the run's planned exchange (at most 7 repeats
            and 65,536 rows; no probe where even the smallest exceeds it). Set, or
            ``probe_rows`` set: the probe runs as asked, over that bound too (the summary
            says so), and also with a fixed ``hot_rows``.
        probe_rows: the largest size probed: hot rows of the all-reduce, ids per rank of the
            all-to-all (each is probed at 1/64, 1/16, 1/4 and all of it). Unset: chosen
            within the bound, as ``probe_repeats``.
        dispatch: which rows of each global batch each rank trains on: ``contiguous`` (rank r
            its own part of the stream), or a dispatch policy of ``readers.dispatch``: ``esd``
            (embedding-aware: the least transfer cost), ``laia`` (cache locality), ``random``,
            ``round-robin`` (see docs/dispatch.md). With ``--service`` the server's
            ``--dispatch`` decides.
        alpha: ``esd``'s share of each global batch placed exactly (1: the cost model's
            optimum; 0: greedy by regret).
        cache_rows: give every rank an embedding cache of this many rows (all tables) in place
            of the hot set: rows are pulled into the cache of the rank that reads them, updated
            there while no other rank reads them, and written home when another rank reads them
            or the cache drops them (ESD's transfer model, see docs/dispatch.md). The dispatcher
            prices the same caches. 0: no caches (the 2FP exchange).
        bandwidths: bytes/s of each rank's link, comma-separated (one value: every rank): what
            the dispatcher weighs each rank's transfers by.
        exact_dense: sum every dense parameter's gradient in float64 over rows and ranks and
            round once (the default): W ranks then train exactly like one process on the same
            global batches (bit for bit when measured, attention pooling included). Off
            (``--fast-dense``): DDP's float32 all-reduce, faster, within about 1e-6 to 1e-3 of
            one process over training.
    """

    hot_rows: Literal["auto"] | int = "auto"
    count_steps: int = 20
    hot_budget_rows: int = 65536
    timeout_s: float = 300.0
    probe_repeats: int | None = None
    probe_rows: int | None = None
    dispatch: Literal["contiguous", "esd", "laia", "random", "round-robin"] = "contiguous"
    alpha: float = 1.0
    cache_rows: int = 0
    bandwidths: tuple[float, ...] = (1e9,)
    exact_dense: bool = True

    def __post_init__(self) -> None:
        choices = ("contiguous", "esd", "laia", "random", "round-robin")
        if self.dispatch not in choices:
            msg = f"`dispatch` must be one of {list(choices)}, got {self.dispatch!r}"
            raise RecpipeError(msg)
        if isinstance(self.alpha, bool) or not (
            isinstance(self.alpha, int | float) and 0.0 <= self.alpha <= 1.0
        ):
            msg = f"`alpha` must be in [0, 1], got {self.alpha!r}"
            raise RecpipeError(msg)
        if self.hot_rows != "auto" and (
            isinstance(self.hot_rows, bool)
            or not isinstance(self.hot_rows, int)
            or self.hot_rows < 0
        ):
            msg = f"`hot_rows` must be 'auto' or a non-negative integer, got {self.hot_rows!r}"
            raise RecpipeError(msg)
        for name in ("count_steps", "hot_budget_rows", "probe_repeats", "probe_rows"):
            if name.startswith("probe") and getattr(self, name) is None:
                continue
            if not _positive_int(getattr(self, name)):
                msg = f"`{name}` must be a positive integer, got {getattr(self, name)!r}"
                raise RecpipeError(msg)
        if (
            isinstance(self.cache_rows, bool)
            or not isinstance(self.cache_rows, int)
            or (self.cache_rows < 0)
        ):
            msg = f"`cache_rows` must be a non-negative integer, got {self.cache_rows!r}"
            raise RecpipeError(msg)
        if self.cache_rows and self.hot_rows not in ("auto", 0):
            msg = (
                f"`hot_rows` {self.hot_rows!r} with `cache_rows`: a job with caches has no hot set"
            )
            raise RecpipeError(msg)
        if self.dispatch in ("esd", "laia") and not self.cache_rows:
            msg = (
                f"`--dispatch {self.dispatch}` without `--cache-rows`: {self.dispatch} places "
                "samples by the rows each rank's embedding cache holds, and the ranks have no "
                "caches; hint: give every rank one (`--cache-rows ROWS`), or dispatch without "
                "caches (`--dispatch random`, `round-robin` or `contiguous`)"
            )
            raise RecpipeError(msg)
        self.bandwidths = tuple(float(b) for b in self.bandwidths)
        if not self.bandwidths or not all(b > 0 for b in self.bandwidths):
            msg = f"`bandwidths` must be positive bytes/s, got {list(self.bandwidths)!r}"
            raise RecpipeError(msg)
        if not self.timeout_s > 0:
            msg = f"`timeout_s` must be > 0, got {self.timeout_s!r}"
            raise RecpipeError(msg)
