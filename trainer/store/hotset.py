"""Choosing the hot set (HypeReca): rho(R) from measured frequencies and a measured cost model.

Hot rows are replicated on every accelerator and their gradients all-reduced each step, a cost
that grows with R; every other row is fetched through the all-to-all/host path, a cost per id
access. With N id accesses per batch and rho(R) the share of accesses covered by the R most
frequent ids (HypeReca Algorithm 1), the per-step cost is::

    f(R) = R * C_ar + N * (1 - rho(R)) * C_a2a

rho is concave (sorted frequencies), so f is convex and a ternary search over integers finds its
minimum, bounded above by the device memory budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from recpipe.errors import StoreError

__all__ = ["CostCoefficients", "HotPlan", "choose_hot_rows", "measure_costs", "rho_curve"]


@dataclass(frozen=True)
class CostCoefficients:
    """Seconds per hot row per step (``c_ar``) and per cold id access (``c_a2a``)."""

    c_ar: float
    c_a2a: float
    source: str = "measured"

    def __post_init__(self) -> None:
        if not (self.c_ar > 0 and self.c_a2a > 0):
            msg = f"cost coefficients must be > 0, got c_ar={self.c_ar!r}, c_a2a={self.c_a2a!r}"
            raise StoreError(msg)


@dataclass(frozen=True)
class HotPlan:
    """The chosen hot-set size and what the cost model predicted."""

    num_hot: int
    rho: float
    cost: float
    cost_no_hot: float
    accesses_per_batch: float
    coefficients: CostCoefficients


def rho_curve(counts: np.ndarray) -> np.ndarray:
    """``curve[R]`` = share of accesses covered by the R most frequent ids (``curve[0] = 0``).

    Args:
        counts: access count per row (int [rows]).
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    curve = np.zeros(counts.size + 1, dtype=np.float64)
    if total:
        ordered = np.sort(counts)[::-1]
        curve[1:] = np.cumsum(ordered) / total
    return curve


def choose_hot_rows(
    counts: np.ndarray,
    *,
    accesses_per_batch: float,
    coefficients: CostCoefficients,
    max_rows: int,
) -> HotPlan:
    """Minimise ``f(R)`` over ``0 <= R <= min(max_rows, rows seen)`` by ternary search.

    Args:
        counts: access count per row over the counted batches.
        accesses_per_batch: N, the mean id accesses per batch.
        coefficients: measured ``C_ar`` and ``C_a2a``.
        max_rows: the memory budget in rows.
    """
    if max_rows < 0:
        msg = f"`max_rows` must be >= 0, got {max_rows!r}"
        raise StoreError(msg)
    curve = rho_curve(counts)
    hi = min(max_rows, int(np.count_nonzero(counts)))

    def cost(r: int) -> float:
        return r * coefficients.c_ar + accesses_per_batch * (1.0 - curve[r]) * coefficients.c_a2a

    lo = 0
    while hi - lo > 2:
        m1 = lo + (hi - lo) // 3
        m2 = hi - (hi - lo) // 3
        if cost(m1) <= cost(m2):
            hi = m2
        else:
            lo = m1
    best = min(range(lo, hi + 1), key=lambda r: (cost(r), r))
    return HotPlan(
        num_hot=best,
        rho=float(curve[best]),
        cost=cost(best),
        cost_no_hot=cost(0),
        accesses_per_batch=float(accesses_per_batch),
        coefficients=coefficients,
    )


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(
    dim: int, *, device: str = "cpu", probe_rows: int = 16384, repeats: int = 5
) -> CostCoefficients:
    """Measure ``C_ar`` and ``C_a2a`` on this machine with a micro-benchmark.

    With ``torch.distributed`` initialised (world > 1) they are a real all-reduce of hot-row
    gradients and a real all-to-all of cold rows. In one process, ``C_ar`` is the per-row cost of
    the dense hot-gradient reduction + update on ``device`` every step, and ``C_a2a`` the per-id
    cost of the cold path: gather from host memory, copy to ``device``, and scatter the gradient
    back.

    Args:
        dim: embedding dimension.
        device: the training device.
        probe_rows: rows moved per probe.
        repeats: probes per coefficient (the fastest is kept).
    """
    import torch

    dev = torch.device(device)
    grads = torch.randn(probe_rows, dim, device=dev)
    table = torch.randn(probe_rows, dim, device=dev)
    host = torch.randn(probe_rows * 4, dim)
    idx = torch.randint(0, host.shape[0], (probe_rows,))
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def all_reduce() -> None:
        g = grads.clone()
        if world > 1:
            dist.all_reduce(g)
        table.add_(g, alpha=-0.01)
        sync()

    def all_to_all() -> None:
        rows = host.index_select(0, idx).to(dev)
        if world > 1:
            out = torch.empty_like(rows)
            dist.all_to_all_single(out, rows)
            rows = out
        host.index_add_(0, idx, rows.cpu())
        sync()

    all_reduce()
    all_to_all()
    c_ar = _best_time(all_reduce, repeats) / probe_rows
    c_a2a = _best_time(all_to_all, repeats) / probe_rows
    source = f"measured ({'distributed x' + str(world) if world > 1 else 'one process'}, {dev})"
    return CostCoefficients(c_ar=max(c_ar, 1e-12), c_a2a=max(c_a2a, 1e-12), source=source)
