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
        probe_repeats: timed steps per size when fitting the cost model at start-up (the
            median is kept).
        probe_rows: the largest size probed: hot rows of the all-reduce, ids per rank of the
            all-to-all (each is probed at 1/64, 1/16, 1/4 and all of it).
    """

    hot_rows: Literal["auto"] | int = "auto"
    count_steps: int = 20
    hot_budget_rows: int = 65536
    timeout_s: float = 300.0
    probe_repeats: int = 7
    probe_rows: int = 65536

    def __post_init__(self) -> None:
        if self.hot_rows != "auto" and (
            isinstance(self.hot_rows, bool)
            or not isinstance(self.hot_rows, int)
            or self.hot_rows < 0
        ):
            msg = f"`hot_rows` must be 'auto' or a non-negative integer, got {self.hot_rows!r}"
            raise RecpipeError(msg)
        for name in ("count_steps", "hot_budget_rows", "probe_repeats", "probe_rows"):
            if not _positive_int(getattr(self, name)):
                msg = f"`{name}` must be a positive integer, got {getattr(self, name)!r}"
                raise RecpipeError(msg)
        if not self.timeout_s > 0:
            msg = f"`timeout_s` must be > 0, got {self.timeout_s!r}"
            raise RecpipeError(msg)
