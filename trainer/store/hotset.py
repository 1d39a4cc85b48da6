"""The hot set (HypeReca): rows replicated on the training device, chosen by a cost model.

:class:`HotSet` holds the hot rows (a device tensor, with their optimizer state) and the access
counts that choose them.

Hot rows are replicated on every accelerator and their gradients all-reduced each step, a cost
that grows with R; every other row is fetched through the all-to-all/host path, a cost per id
access. With N id accesses per batch and rho(R) the share of accesses covered by the R most
frequent ids (HypeReca Algorithm 1), the per-step cost is::

    f(R) = [R > 0] * A_ar + R * C_ar + N * (1 - rho(R)) * C_a2a

One curve and one choice serve every engine: :func:`rho_curve` (the store's counts of its rows,
or the ranks' top (table, id) pairs with the total of every access) and :func:`choose_on_curve`
(the smallest-cost R up to a budget, exhaustively: ``A_ar`` makes f non-convex at 0, and
evaluating f at every R is one vectorised pass). The coefficients come from
:func:`measure_costs` (one process's micro-benchmark, or collectives where torch.distributed is
set up) or from a fit on a job's own process group (:mod:`trainer.distributed.costs`, which adds
``A_ar`` and the coefficients' standard errors: a saving the fit cannot tell from noise is not
taken, ``confidence``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from recpipe.errors import StoreError
from trainer.store import _kernels as K
from trainer.store.cache import sparse_step

if TYPE_CHECKING:
    import torch

    from trainer.store.cache import RowCache
    from trainer.store.home import Home

__all__ = [
    "CostCoefficients",
    "HotPlan",
    "HotSet",
    "choose_hot_rows",
    "choose_on_curve",
    "measure_costs",
    "rho_curve",
]


@dataclass(frozen=True)
class CostCoefficients:
    """The cost model's coefficients (see the module docstring).

    Attributes:
        c_ar: seconds per hot row per step.
        c_a2a: seconds a cold id access costs more than a hot one.
        source: where they come from (measured, fitted).
        a_ar: seconds per all-reduce call, paid when R > 0.
        c_ar_se, c_a2a_se: standard errors of ``c_ar`` and ``c_a2a`` (0: taken as exact).
    """

    c_ar: float
    c_a2a: float
    source: str = "measured"
    a_ar: float = 0.0
    c_ar_se: float = 0.0
    c_a2a_se: float = 0.0

    def __post_init__(self) -> None:
        if not (self.c_ar > 0 and self.c_a2a > 0):
            msg = f"cost coefficients must be > 0, got c_ar={self.c_ar!r}, c_a2a={self.c_a2a!r}"
            raise StoreError(msg)
        if not (self.a_ar >= 0 and self.c_ar_se >= 0 and self.c_a2a_se >= 0):
            msg = (
                f"`a_ar` and the standard errors must be >= 0, got a_ar={self.a_ar!r}, "
                f"c_ar_se={self.c_ar_se!r}, c_a2a_se={self.c_a2a_se!r}"
            )
            raise StoreError(msg)

    def cost(self, num_hot: np.ndarray | int, rho: np.ndarray | float, accesses: float) -> Any:
        """``f(R)`` per step at ``num_hot`` R and its ``rho`` with ``accesses`` N per step."""
        r = np.asarray(num_hot, dtype=np.float64)
        hot = np.where(r > 0, self.a_ar + r * self.c_ar, 0.0)
        return hot + accesses * (1.0 - np.asarray(rho)) * self.c_a2a

    def saving_se(self, num_hot: np.ndarray | int, rho: np.ndarray | float, accesses: float) -> Any:
        """Standard error of the saving ``f(0) − f(R)`` (from ``c_ar_se`` and ``c_a2a_se``,
        taken as independent)."""
        r = np.asarray(num_hot, dtype=np.float64)
        a2a = accesses * np.asarray(rho) * self.c_a2a_se
        return np.sqrt(a2a * a2a + (r * self.c_ar_se) ** 2)


@dataclass(frozen=True)
class HotPlan:
    """The chosen hot-set size and what the cost model predicted."""

    num_hot: int
    rho: float
    cost: float
    cost_no_hot: float
    accesses_per_batch: float
    coefficients: CostCoefficients


def rho_curve(counts: np.ndarray, *, total: int | None = None) -> np.ndarray:
    """``curve[R]`` = share of accesses covered by the R most frequent ids (``curve[0] = 0``).

    Args:
        counts: access counts (int [n], any order): every row's, or only the most accessed
            ones' (the ranks' candidates) with ``total``.
        total: accesses of every id counted (``None``: the sum of ``counts``).
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum()) if total is None else int(total)
    curve = np.zeros(counts.size + 1, dtype=np.float64)
    if total:
        ordered = np.sort(counts)[::-1]
        curve[1:] = np.cumsum(ordered) / total
    return curve


def choose_on_curve(
    rho: np.ndarray,
    *,
    accesses_per_batch: float,
    coefficients: CostCoefficients,
    max_rows: int | None = None,
    confidence: float = 0.0,
) -> HotPlan:
    """The R in ``[0, min(max_rows, len(rho) - 1)]`` minimising ``f(R)`` (the smallest on
    ties), among R = 0 and the R whose saving ``f(0) − f(R)`` exceeds ``confidence`` standard
    errors of it (:meth:`CostCoefficients.saving_se`; ``0``: the plain minimum).

    Args:
        rho: :func:`rho_curve`.
        accesses_per_batch: N, the mean id accesses per batch (step).
        coefficients: the cost model's.
        max_rows: the memory budget in rows (``None``: every R of the curve).
        confidence: standard errors a hot set's saving must exceed.
    """
    if max_rows is not None and max_rows < 0:
        raise StoreError(f"`max_rows` must be >= 0, got {max_rows!r}")
    if not (isinstance(confidence, int | float) and 0 <= confidence < float("inf")):
        msg = f"`confidence` must be a finite number of standard errors >= 0, got {confidence!r}"
        raise StoreError(msg)
    rho = np.asarray(rho, dtype=np.float64)
    if max_rows is not None:
        rho = rho[: max_rows + 1]
    sizes = np.arange(rho.size)
    cost = coefficients.cost(sizes, rho, accesses_per_batch)
    sure = cost[0] - cost > 0
    if confidence:
        sure &= (
            cost[0] - cost - confidence * coefficients.saving_se(sizes, rho, accesses_per_batch) > 0
        )
    sure[0] = True
    best = int(np.flatnonzero(sure)[np.argmin(cost[sure])])
    return HotPlan(
        num_hot=best,
        rho=float(rho[best]),
        cost=float(cost[best]),
        cost_no_hot=float(cost[0]),
        accesses_per_batch=float(accesses_per_batch),
        coefficients=coefficients,
    )


def choose_hot_rows(
    counts: np.ndarray,
    *,
    accesses_per_batch: float,
    coefficients: CostCoefficients,
    max_rows: int,
) -> HotPlan:
    """:func:`choose_on_curve` on the rows' own counts: ``0 <= R <= min(max_rows, rows
    seen)``.

    Args:
        counts: access count per row over the counted batches.
        accesses_per_batch: N, the mean id accesses per batch.
        coefficients: measured ``C_ar`` and ``C_a2a``.
        max_rows: the memory budget in rows.
    """
    if max_rows < 0:
        raise StoreError(f"`max_rows` must be >= 0, got {max_rows!r}")
    seen = int(np.count_nonzero(counts))
    return choose_on_curve(
        rho_curve(counts)[: seen + 1],
        accesses_per_batch=accesses_per_batch,
        coefficients=coefficients,
        max_rows=max_rows,
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


class HotSet:
    """The hot rows on the training device, and the access counts that choose them.

    ::

        tensor      float32 [R, W] on the device   the hot rows (embedding then state)
        rows        int64 [R]                       their row numbers
        dirty       bool [R]                        changed since the last checkpoint
        hot_of_row  int64 [rows]                    index in ``tensor`` (-1: not hot)
        counts      int64 [rows]                    accesses over the counted batches

    Every method runs with the store lock held (the facade's). ``generation`` changes whenever
    the hot set does, so that locations made before are refused.

    Args:
        dim: embedding dimension D.
        width: floats per row (embedding + optimizer state).
        device: the training device.
        count_batches: prefetches counted from the start.
    """

    def __init__(self, *, dim: int, width: int, device: torch.device, count_batches: int) -> None:
        import torch

        self._dim = dim
        self._width = width
        self._coefficients: CostCoefficients | None = None
        self.device = device
        self.tensor = torch.zeros(0, width, device=device)
        self.rows = np.zeros(0, dtype=np.int64)
        self.dirty = np.zeros(0, dtype=np.bool_)
        self.generation = 0
        self.hot_of_row = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self._count_left = count_batches
        self.counted_batches = 0
        self.counted_accesses = 0

    @property
    def size(self) -> int:
        return int(self.rows.size)

    def grow_rows(self, cap: int) -> None:
        """Make room for rows [0, cap) (not hot, never counted)."""
        hot = np.full(cap, -1, dtype=np.int64)
        hot[: self.hot_of_row.size] = self.hot_of_row
        counts = np.zeros(cap, dtype=np.int64)
        counts[: self.counts.size] = self.counts
        self.hot_of_row, self.counts = hot, counts

    # ------------------------------------------------------------------ counting and choosing

    def count(self, uniq: np.ndarray) -> None:
        """Count one prefetch's unique rows, while counting."""
        if self._count_left > 0:
            K.count_rows(uniq, self.counts)
            self.counted_batches += 1
            self.counted_accesses += uniq.size
            self._count_left -= 1

    def restart_counting(self, batches: int) -> None:
        """Forget the counts and count the next ``batches`` prefetches."""
        self.counts[:] = 0
        self._count_left = batches
        self.counted_batches = self.counted_accesses = 0

    def rho(self, num_hot: int, num_rows: int) -> float:
        """Share of counted accesses of rows [0, num_rows) covered by the ``num_hot`` most
        frequent."""
        curve = rho_curve(self.counts[:num_rows])
        return float(curve[min(num_hot, curve.size - 1)])

    def plan(
        self, num_rows: int, *, coefficients: CostCoefficients | None, max_rows: int
    ) -> HotPlan:
        """Choose R among rows [0, num_rows) with the cost model (measuring its coefficients on
        this machine once, unless given)."""
        if coefficients is None:
            if self._coefficients is None:
                self._coefficients = measure_costs(self._dim, device=str(self.device))
            coefficients = self._coefficients
        per_batch = self.counted_accesses / max(self.counted_batches, 1)
        return choose_hot_rows(
            self.counts[:num_rows],
            accesses_per_batch=per_batch,
            coefficients=coefficients,
            max_rows=max_rows,
        )

    def most_frequent(self, num_hot: int, num_rows: int) -> np.ndarray:
        """The ``num_hot`` most counted of rows [0, num_rows), ties broken by row number."""
        counts = self.counts[:num_rows]
        order = np.lexsort((np.arange(num_rows), -counts))
        return order[: min(num_hot, num_rows)].astype(np.int64)

    # ------------------------------------------------------------------ moving rows

    def demote_all(self, cache: RowCache, seq: int) -> None:
        """Move every hot row to the cache (dirty flags and optimizer state kept)."""
        rows = self.rows
        if not rows.size:
            return
        cache.insert(rows, self.tensor.cpu().numpy(), self.dirty, seq)
        self.hot_of_row[rows] = -1
        self._set(
            np.zeros(0, np.int64), np.zeros((0, self._width), np.float32), np.zeros(0, np.bool_)
        )

    def install(self, rows: np.ndarray, cache: RowCache, home: Home) -> None:
        """Move ``rows`` (none of them hot) from the cache or the home file to the device."""
        image = np.empty((rows.size, self._width), dtype=np.float32)
        dirty = np.zeros(rows.size, dtype=np.bool_)
        cached, cached_image, cached_dirty = cache.remove(rows)
        image[cached] = cached_image
        dirty[cached] = cached_dirty
        if (~cached).any():
            pos = np.flatnonzero(~cached)
            home.read(rows[pos], image.view(np.uint32), pos)
        self.hot_of_row[rows] = np.arange(rows.size)
        self._set(rows, image, dirty)

    def _set(self, rows: np.ndarray, image: np.ndarray, dirty: np.ndarray) -> None:
        import torch

        self.tensor = torch.from_numpy(image).to(self.device)
        self.rows = rows
        self.dirty = dirty
        self.generation += 1

    def take_dirty(self) -> tuple[np.ndarray, np.ndarray]:
        """The dirty hot rows and a host copy of their values, now marked clean (a checkpoint
        takes them)."""
        import torch

        hot = np.flatnonzero(self.dirty)
        image = self.tensor[torch.from_numpy(hot)].cpu().numpy()
        self.dirty[:] = False
        return self.rows[hot], image

    # ------------------------------------------------------------------ the optimizer

    def step(
        self,
        idx: torch.Tensor,
        g: torch.Tensor,
        *,
        optimizer: str,
        lr: float,
        eps: float,
        step: int = 0,
    ) -> None:
        """Apply the optimizer to hot rows ``idx`` (distinct) with gradients ``g`` [Uh, D]
        (``step``: Adam's, counting this update)."""
        opt = {"optimizer": optimizer, "lr": lr, "eps": eps, "step": step}
        if self.device.type == "cpu":  # the cold path's update: bitwise the same arithmetic
            sparse_step(self.tensor.numpy(), idx.numpy(), g, **opt)
            return
        d = g.shape[1]
        if optimizer == "adam":
            from trainer.optim import sparse_adam_

            sparse_adam_(self.tensor[:, :d], self.tensor[:, d:], idx, g, lr=lr, eps=eps, step=step)
            return
        rows = self.tensor.index_select(0, idx)  # (Uh, W)
        if optimizer == "sgd":
            rows[:, :d] -= lr * g
        else:
            state = rows[:, d] + (g * g).sum(1) / d
            rows[:, d] = state
            rows[:, :d] -= (lr / (state.sqrt() + eps)).unsqueeze(1) * g
        self.tensor.index_copy_(0, idx, rows)
