"""The tower partitioner (DMT's TP): feature affinity -> metric MDS -> balanced k-means.

::

    gram  M = mean over samples of R Rᵀ          R: [F, N] the sample's pooled embeddings
    affinity  I_ij = |M_ij| / sqrt(M_ii M_jj)     |cos| of the features' embeddings
    distance  D = I (diverse: interacting features apart) or 1 - I (coherent: together)
    metric MDS  x_1..x_F in R^dims minimising sum_{i<j} (|x_i - x_j| - D_ij)^2 by gradient descent
    constrained k-means (Bradley, Bennett & Demiriz 2000) on x: each assignment step is a
                min-cost flow that keeps every tower between lo and hi = floor(K lo) features;
                every feasible lo is tried, the lowest within-tower sum of squares kept

Everything here is NumPy and deterministic for a seed (no thread-dependent reductions). The
affinity itself comes from a trained model (:mod:`trainer.towers.affinity`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.towers.config import (
    STRATEGIES,
    Strategy,
    TowerError,
    TowerPlan,
    plan_from_assignment,
)

__all__ = [
    "Partition",
    "affinity_from_gram",
    "balanced_kmeans",
    "constrained_kmeans",
    "distances",
    "metric_mds",
    "partition_features",
    "plot_partition",
    "size_bounds",
]


def affinity_from_gram(gram: np.ndarray) -> np.ndarray:
    """``|cos|`` of the features' embeddings from the mean Gram matrix ``M`` [F, F]:
    ``I_ij = |M_ij| / sqrt(M_ii M_jj)``, 1 on the diagonal (0 off it for a feature whose
    embeddings are all zero).

    >>> affinity_from_gram(np.array([[4.0, -2.0], [-2.0, 1.0]])).tolist()
    [[1.0, 1.0], [1.0, 1.0]]
    """
    m = np.asarray(gram, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        msg = f"`gram` must be a square [F, F] matrix, got shape {m.shape}"
        raise TowerError(msg)
    if not np.isfinite(m).all():
        msg = "`gram` holds NaN or infinite values: the embeddings diverged"
        raise TowerError(msg)
    norm = np.sqrt(np.clip(np.diag(m), 0.0, None))
    scale = np.outer(norm, norm)
    out = np.divide(np.abs(m), scale, out=np.zeros_like(m), where=scale > 0)
    out = np.clip((out + out.T) / 2, 0.0, 1.0)
    np.fill_diagonal(out, 1.0)
    return out


def distances(affinity: np.ndarray, strategy: Strategy) -> np.ndarray:
    """``D = I`` (``diverse``) or ``1 - I`` (``coherent``), zero on the diagonal."""
    if strategy not in STRATEGIES:
        msg = f"`strategy` must be one of {list(STRATEGIES)}, got {strategy!r}"
        raise TowerError(msg)
    d = affinity.copy() if strategy == "diverse" else 1.0 - affinity
    np.fill_diagonal(d, 0.0)
    return d


def metric_mds(
    dist: np.ndarray, *, dims: int = 2, seed: int = 0, steps: int = 500, tol: float = 1e-9
) -> tuple[np.ndarray, float]:
    """Points whose distances approximate ``dist``: gradient descent on the raw stress
    ``S = sum_{i<j} (|x_i - x_j| - D_ij)^2``.

    The step is ``x <- x - grad S / (2F)``, the step size under which gradient descent on the
    stress is SMACOF's majorisation step, so ``S`` never increases. The start is a seeded
    Gaussian cloud scaled to the distances.

    Args:
        dist: symmetric [F, F] distances.
        dims: dimensions of the embedding.
        seed: seed of the start.
        steps: most gradient steps.
        tol: stop when the stress falls by less than ``tol`` (relative) in a step.

    Returns:
        ``[F, dims]`` coordinates and the final stress.
    """
    d = np.asarray(dist, dtype=np.float64)
    n = d.shape[0]
    rng = np.random.default_rng([int(seed), 0x3D5])
    x = rng.normal(0.0, 1.0, (n, dims)) * (d.mean() if n > 1 and d.mean() > 0 else 1.0)
    stress = _stress(x, d)
    for _ in range(steps):
        diff = x[:, None, :] - x[None, :, :]  # (F, F, dims)
        norm = np.sqrt((diff * diff).sum(-1))  # (F, F)
        ratio = np.divide(d, norm, out=np.zeros_like(d), where=norm > 0)
        grad = 2.0 * ((1.0 - ratio)[:, :, None] * diff).sum(1)  # dS/dx_i, (F, dims)
        x = x - grad / (2.0 * n)
        new = _stress(x, d)
        done = stress - new <= tol * max(stress, 1e-300)
        stress = new
        if done:
            break
    return x, stress


def _stress(x: np.ndarray, d: np.ndarray) -> float:
    diff = x[:, None, :] - x[None, :, :]
    norm = np.sqrt((diff * diff).sum(-1))
    return float(np.triu((norm - d) ** 2, k=1).sum())


# -------------------------------------------------------------------------------------------
# constrained k-means


def _bounded_assignment(cost: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The assignment of F points to k clusters with ``lo <= size <= hi`` of least total
    ``cost[i, cluster]``: min-cost flow (Bradley et al.'s assignment step) by successive
    shortest paths.

    Each unit of flow is a new point entering some cluster, possibly pushing a chain of
    assigned points into other clusters; a cluster's first ``lo`` points earn a large bonus
    (so the lower bounds hold whenever ``k·lo <= F``), its places up to ``hi`` cost nothing.
    With moves between clusters priced ``min_i (cost[i, b] - cost[i, a])`` the shortest path
    runs over the k clusters (Bellman-Ford, k³ per point).
    """
    points, k = cost.shape
    assign = np.full(points, -1, dtype=np.int64)
    size = np.zeros(k, dtype=np.int64)
    bonus = (float(np.abs(cost).max()) + 1.0) * (points + 1) * 4
    for _ in range(points):
        free = np.flatnonzero(assign < 0)
        entry_arg = free[np.argmin(cost[free], axis=0)]  # (k,) the cheapest free point per cluster
        dist = cost[entry_arg, np.arange(k)].copy()
        move = np.full((k, k), np.inf)
        move_arg = np.full((k, k), -1, dtype=np.int64)
        for a in range(k):
            members = np.flatnonzero(assign == a)
            if members.size:
                delta = cost[members] - cost[members, a][:, None]  # (m, k)
                best = np.argmin(delta, axis=0)
                move[a] = delta[best, np.arange(k)]
                move_arg[a] = members[best]
            move[a, a] = np.inf
        pred = np.full(k, -1, dtype=np.int64)
        eps = 1e-12 * bonus
        for _ in range(k):
            cand = dist[:, None] + move  # (from, to)
            src = np.argmin(cand, axis=0)
            best = cand[src, np.arange(k)]
            better = best < dist - eps
            if not better.any():
                break
            dist[better] = best[better]
            pred[better] = src[better]
        exit_cost = np.where(size < lo, -bonus, np.where(size < hi, 0.0, np.inf))
        target = int(np.argmin(dist + exit_cost))
        if not np.isfinite(dist[target] + exit_cost[target]):
            msg = f"no assignment of {points} points to {k} clusters of {lo}..{hi} points"
            raise TowerError(msg)
        at = target
        for _ in range(k):  # the chain of moves that ends in `target`
            came = pred[at]
            if came < 0:
                break
            assign[move_arg[came, at]] = at
            at = came
        assign[entry_arg[at]] = at
        size = np.bincount(assign[assign >= 0], minlength=k)
    return assign


def _kmeanspp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centers = [x[int(rng.integers(x.shape[0]))]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None, :] - np.array(centers)[None]) ** 2).sum(-1), axis=1)
        total = d2.sum()
        pick = (
            int(rng.choice(x.shape[0], p=d2 / total))
            if total > 0
            else int(rng.integers(x.shape[0]))
        )
        centers.append(x[pick])
    return np.array(centers)


def constrained_kmeans(
    x: np.ndarray,
    k: int,
    *,
    lo: int,
    hi: int,
    seed: int = 0,
    restarts: int = 8,
    iterations: int = 100,
) -> tuple[np.ndarray, float]:
    """k-means whose clusters hold between ``lo`` and ``hi`` points (Bradley et al. 2000):
    k-means++ starts, then alternate the bounded assignment (a min-cost flow) and the means
    until the assignment stops changing; the best of ``restarts`` starts is kept.

    Returns:
        ``[F]`` cluster of each point and the within-cluster sum of squares.
    """
    rng = np.random.default_rng([int(seed), 0xC1A5])
    best: tuple[np.ndarray, float] | None = None
    for _ in range(restarts):
        centers = _kmeanspp(x, k, rng)
        assign = np.full(x.shape[0], -1)
        for _ in range(iterations):
            cost = ((x[:, None, :] - centers[None]) ** 2).sum(-1)  # (F, k)
            new = _bounded_assignment(cost, lo, hi)
            if np.array_equal(new, assign):
                break
            assign = new
            centers = np.array([x[assign == c].mean(0) for c in range(k)])
        sse = float(((x - centers[assign]) ** 2).sum())
        if best is None or sse < best[1] - 1e-12:
            best = (assign.copy(), sse)
    assert best is not None
    return best


def size_bounds(features: int, towers: int, balance: float) -> list[tuple[int, int]]:
    """Every ``(lo, hi)`` with ``hi = floor(K·lo)`` that fits ``features`` into ``towers``
    towers; together they cover every partition whose largest tower is at most K times the
    smallest.

    >>> size_bounds(10, 3, 2.0)
    [(2, 4), (3, 6)]
    """
    if not (isinstance(balance, int | float) and math.isfinite(balance) and balance >= 1):
        msg = f"`balance` must be a number >= 1, got {balance!r}"
        raise TowerError(msg)
    if isinstance(towers, bool) or not isinstance(towers, int) or not 1 <= towers <= features:
        msg = f"`towers` must be in [1, {features}] (the number of features), got {towers!r}"
        raise TowerError(msg)
    out = []
    for lo in range(1, features // towers + 1):
        hi = math.floor(balance * lo + 1e-9)
        if towers * hi >= features:
            out.append((lo, hi))
    if not out:
        best = math.ceil(features / towers) / (features // towers)
        msg = (
            f"`balance` {balance:g} cannot split {features} features into {towers} towers: the "
            f"most even split needs a balance of at least {best:g}"
        )
        raise TowerError(msg)
    return out


def balanced_kmeans(
    x: np.ndarray, towers: int, *, balance: float, seed: int = 0, restarts: int = 8
) -> tuple[np.ndarray, float]:
    """Constrained k-means whose largest cluster holds at most ``balance`` times the points
    of the smallest: the best of :func:`constrained_kmeans` over every :func:`size_bounds`."""
    best: tuple[np.ndarray, float] | None = None
    for lo, hi in size_bounds(x.shape[0], towers, balance):
        got = constrained_kmeans(x, towers, lo=lo, hi=hi, seed=seed, restarts=restarts)
        if best is None or got[1] < best[1] - 1e-12:
            best = got
    assert best is not None
    return _canonical(best[0]), best[1]


def _canonical(assign: np.ndarray) -> np.ndarray:
    """Clusters renumbered by their first point, so equal partitions compare equal."""
    order: dict[int, int] = {}
    for c in assign.tolist():
        order.setdefault(c, len(order))
    return np.array([order[c] for c in assign.tolist()], dtype=np.int64)


# -------------------------------------------------------------------------------------------
# the whole partitioner


@dataclass(frozen=True)
class Partition:
    """What :func:`partition_features` found.

    Attributes:
        plan: the towers.
        features: the features, in the order of the matrices.
        affinity: [F, F] |cos| affinities.
        coords: [F, dims] the MDS embedding.
        assignment: [F] tower of each feature.
        stress: the MDS stress.
        sse: the within-tower sum of squares of the k-means.
    """

    plan: TowerPlan
    features: tuple[str, ...]
    affinity: np.ndarray
    coords: np.ndarray
    assignment: np.ndarray
    stress: float
    sse: float


def partition_features(
    features: Sequence[str],
    affinity: np.ndarray,
    *,
    towers: int,
    strategy: Strategy = "coherent",
    balance: float = 1.5,
    seed: int = 0,
    dims: int = 2,
    source: str = "",
) -> Partition:
    """Towers of ``features`` from their affinities (see the module docstring).

    Args:
        features: the feature names, in the order of ``affinity``'s rows.
        affinity: [F, F] |cos| affinities (:func:`affinity_from_gram`).
        towers: towers T.
        strategy: ``coherent`` (features that interact share a tower) or ``diverse``.
        balance: K: the largest tower holds at most K times the features of the smallest.
        seed: seed of the MDS start and the k-means starts.
        dims: dimensions of the MDS embedding.
        source: where the affinities came from (kept in the plan).
    """
    features = tuple(features)
    aff = np.asarray(affinity, dtype=np.float64)
    if aff.shape != (len(features), len(features)):
        msg = f"`affinity` must be [{len(features)}, {len(features)}], got {aff.shape}"
        raise TowerError(msg)
    size_bounds(len(features), towers, balance)  # refuse a bad balance before any work
    coords, stress = metric_mds(distances(aff, strategy), dims=dims, seed=seed)
    assignment, sse = balanced_kmeans(coords, towers, balance=balance, seed=seed)
    plan = plan_from_assignment(features, assignment, strategy=strategy, balance=float(balance),
                                seed=int(seed), source=source)  # fmt: skip
    return Partition(plan, features, aff, coords, assignment, stress, sse)


def plot_partition(part: Partition, path: str | Path, *, title: str | None = None) -> Path:
    """A PNG of the 2-D MDS embedding (the first two dimensions), features coloured by tower
    and labelled by name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 6.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xy = part.coords if part.coords.shape[1] >= 2 else np.pad(part.coords, ((0, 0), (0, 1)))
    colours = [f"C{t % 10}" for t in part.assignment.tolist()]
    ax.scatter(xy[:, 0], xy[:, 1], c=colours, s=42, edgecolors="black", linewidths=0.4)
    for name, (px, py) in zip(part.features, xy[:, :2].tolist(), strict=True):
        ax.annotate(name, (px, py), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for t in range(part.plan.num_towers):
        ax.scatter([], [], c=f"C{t % 10}", label=f"tower {t} ({part.plan.sizes[t]})")
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title or f"{part.plan.strategy} towers (MDS of the feature distances)")
    ax.set_xlabel("MDS 1")
    ax.set_ylabel("MDS 2")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
