"""The least-cost placement by brute force, for the dispatch tests."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np


@cache
def _compositions(total: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """Every way to write ``total`` as ``parts`` non-negative integers."""
    if parts == 1:
        return ((total,),)
    return tuple(
        (k, *rest) for k in range(total + 1) for rest in _compositions(total - k, parts - 1)
    )


def brute_force(costs: np.ndarray, sizes: np.ndarray, capacity: np.ndarray) -> float:
    """The least cost over every placement (pieces may split) that respects ``capacity``."""
    n, w = costs.shape
    unit = costs / sizes[:, None]
    best = np.inf
    for flows in itertools.product(*(_compositions(int(s), w) for s in sizes)):
        flow = np.array(flows, dtype=np.int64).reshape(n, w)
        if (flow.sum(0) <= capacity).all():
            best = min(best, float((unit * flow).sum()))
    return best
