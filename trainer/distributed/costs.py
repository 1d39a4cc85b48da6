"""The hot-set cost model, fitted on the job's own process group at start-up.

A step costs (HypeReca)::

    f(R) = [R > 0]·A_ar + R·C_ar + N·(1 − ρ(R))·C_a2a

``R`` hot rows cost an all-reduce of their gradients and touched-rows mask every step (``C_ar``
per row, ``A_ar`` per call); every other access of the step's ``N`` unique-id accesses (all
ranks) moves an id, a row and a gradient by all-to-all (``C_a2a`` per access). ``ρ(R)`` is the
share of accesses the R most accessed rows serve, measured (:class:`HotCandidates`).

:func:`fit_costs` times the two collectives at several sizes on the job's group, with the
payload shapes the exchange uses, takes the slowest rank's median at each size (every rank fits
the same numbers, so every rank chooses the same R) and fits a line to each; its r² says how
well a line explains the times. :func:`choose_num_hot` evaluates ``f`` at every R up to the
candidates and takes the smallest minimum (exact: no convexity assumed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer.distributed.comm import Comm
from trainer.distributed.exchange import GRAD_DTYPE, HotCandidates
from trainer.store import CostCoefficients, HotPlan

__all__ = ["CostFit", "LineFit", "choose_num_hot", "fit_costs"]

AR_ROWS: tuple[int, ...] = (1024, 4096, 16384, 65536)
A2A_ROWS: tuple[int, ...] = (256, 1024, 4096, 16384)


@dataclass(frozen=True)
class LineFit:
    """``seconds = intercept + slope · size``, fitted by least squares.

    Attributes:
        slope: seconds per unit of size.
        intercept: seconds per call.
        r2: coefficient of determination of the fit.
        sizes: the sizes timed.
        seconds: the time at each size (slowest rank's median).
    """

    slope: float
    intercept: float
    r2: float
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def of(cls, sizes: Sequence[int], seconds: Sequence[float]) -> LineFit:
        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        slope, intercept = np.polyfit(x, y, 1)
        resid = y - (intercept + slope * x)
        total = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
        return cls(float(slope), float(intercept), r2, tuple(int(s) for s in sizes),
                   tuple(float(v) for v in seconds))  # fmt: skip


@dataclass(frozen=True)
class CostFit:
    """The fitted coefficients of the cost model.

    Attributes:
        all_reduce: time of the hot gradient all-reduce against hot rows R.
        all_to_all: time of one rank's cold exchange (ids, rows, gradients) against the ids it
            sends.
        world_size: ranks of the group measured.
        backend: its backend.
    """

    all_reduce: LineFit
    all_to_all: LineFit
    world_size: int
    backend: str = "gloo"
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def c_ar(self) -> float:
        """Seconds per hot row per step."""
        return max(self.all_reduce.slope, 1e-12)

    @property
    def a_ar(self) -> float:
        """Seconds per all-reduce call (paid when R > 0)."""
        return max(self.all_reduce.intercept, 0.0)

    @property
    def c_a2a(self) -> float:
        """Seconds per cold access of the job (each rank sends 1/W of them)."""
        return max(self.all_to_all.slope / self.world_size, 1e-12)

    @property
    def r2(self) -> float:
        """The worse of the two fits' r²."""
        return min(self.all_reduce.r2, self.all_to_all.r2)

    def coefficients(self) -> CostCoefficients:
        return CostCoefficients(
            c_ar=self.c_ar,
            c_a2a=self.c_a2a,
            source=f"fitted on the job's process group ({self.world_size} ranks, {self.backend})",
        )

    def cost(self, num_hot: np.ndarray | int, rho: np.ndarray | float, accesses: float):
        """``f(R)`` (see the module docstring)."""
        r = np.asarray(num_hot, dtype=np.float64)
        hot = np.where(r > 0, self.a_ar + r * self.c_ar, 0.0)
        return hot + accesses * (1.0 - np.asarray(rho)) * self.c_a2a


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def fit_costs(
    comm: Comm,
    *,
    dim: int,
    dtype: torch.dtype = torch.float32,
    ar_rows: Sequence[int] = AR_ROWS,
    a2a_rows: Sequence[int] = A2A_ROWS,
    repeats: int = 5,
) -> CostFit:
    """Time the exchange's collectives on ``comm`` at several sizes and fit the cost model
    (collective: every rank calls it with the same arguments).

    Args:
        comm: the job's exchange group.
        dim: embedding dimension D.
        dtype: the rows' dtype (gradients travel in float64).
        ar_rows: hot-set sizes R to time the ``[R, D + 1]`` all-reduce at.
        a2a_rows: ids per rank to time the cold exchange at (spread over all ranks).
        repeats: timed calls per size (the median is kept).
    """
    world = comm.world_size
    dev = comm.device

    def all_reduce(rows: int) -> Callable[[], None]:
        flat = torch.zeros(rows * (dim + 1), dtype=GRAD_DTYPE, device=dev)
        return lambda: comm.all_reduce(flat, what="the cost probe all-reduce")

    def exchange(rows: int) -> Callable[[], None]:
        """The cold path of a step where this rank asks for ``rows`` ids spread over all ranks:
        counts, ids (to the owners), rows (back), float64 gradients (to the owners)."""
        split = [rows // world + (1 if d < rows % world else 0) for d in range(world)]
        served = split[comm.rank] * world  # every rank asks this rank for as many
        ids = torch.arange(rows, dtype=torch.int64)
        vals = torch.zeros(served, dim, dtype=dtype, device=dev)
        grads = torch.zeros(rows, dim, dtype=GRAD_DTYPE, device=dev)
        counts = torch.tensor(split, dtype=torch.int64).view(world, 1)

        def run() -> None:
            got = comm.all_to_all_counts(counts, what="the cost probe").view(-1).tolist()
            comm.all_to_all(ids, split, got, what="the cost probe")
            comm.all_to_all(vals, got, split, what="the cost probe")
            comm.all_to_all(grads, split, got, what="the cost probe")
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        return run

    times = []
    for rows in ar_rows:
        times.append(_median_time(all_reduce(rows), repeats))
    for rows in a2a_rows:
        times.append(_median_time(exchange(rows), repeats))
    slowest = torch.tensor(times, dtype=torch.float64)
    comm.all_reduce(slowest, what="the cost probe", op="max")
    t = slowest.tolist()
    n_ar = len(ar_rows)
    backend = "local" if world == 1 else ("nccl" if dev.type == "cuda" else "gloo")
    return CostFit(
        all_reduce=LineFit.of(ar_rows, t[:n_ar]),
        all_to_all=LineFit.of(a2a_rows, t[n_ar:]),
        world_size=world,
        backend=backend,
    )


def choose_num_hot(candidates: HotCandidates, fit: CostFit) -> HotPlan:
    """The R in ``[0, len(candidates)]`` minimising ``f(R)`` (the smallest on ties)."""
    rho = candidates.rho()
    accesses = candidates.accesses_per_step
    cost = fit.cost(np.arange(rho.size), rho, accesses)
    best = int(np.argmin(cost))
    return HotPlan(
        num_hot=best,
        rho=float(rho[best]),
        cost=float(cost[best]),
        cost_no_hot=float(cost[0]),
        accesses_per_batch=float(accesses),
        coefficients=fit.coefficients(),
    )
