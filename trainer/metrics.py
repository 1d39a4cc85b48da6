"""Training metrics: exact ROC AUC, a sliding window of recent predictions, peak memory."""

from __future__ import annotations

import collections
import resource
import sys

import numpy as np
import torch

__all__ = ["PredictionWindow", "auc", "peak_memory_bytes"]


def auc(scores: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> float:
    """ROC AUC of ``scores`` against binary ``labels`` (ties count one half).

    Computed exactly from average ranks (Mann-Whitney U), O(n log n).

    Returns:
        The AUC, or ``nan`` when the labels hold only one class.

    Example:
        >>> auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
        0.75
    """
    s = _numpy(scores).astype(np.float64).ravel()
    y = _numpy(labels).ravel() > 0.5
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # average rank (1-based) of every run of equal scores
    starts = np.r_[0, np.flatnonzero(sorted_s[1:] != sorted_s[:-1]) + 1]
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x)


class PredictionWindow:
    """The predictions and labels of the last ``batches`` batches, for a running AUC.

    Args:
        batches: how many recent batches to keep.
    """

    def __init__(self, batches: int = 50) -> None:
        self._items: collections.deque[tuple[np.ndarray, np.ndarray]] = collections.deque(
            maxlen=batches
        )

    def add(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """Record one batch's scores (logits or probabilities) and labels."""
        self._items.append((_numpy(scores), _numpy(labels)))

    def auc(self) -> float:
        """AUC over the window (``nan`` when empty or one class only)."""
        if not self._items:
            return float("nan")
        return auc(
            np.concatenate([s for s, _ in self._items]), np.concatenate([y for _, y in self._items])
        )


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Peak memory so far: allocated device memory on CUDA, the process's peak RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
