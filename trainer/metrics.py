"""Training metrics: exact ROC AUC, a window of recent predictions, peak memory, and where the
per-step records go (a CSV or JSON Lines file, TensorBoard when it is installed).

A record is a flat dict of :data:`METRIC_FIELDS`: one per training step (``kind`` ``"train"``)
and one per evaluation (``"eval"``); fields that do not apply are ``None``. The run's summary
(:func:`trainer.runlog.summary_dict`, ``recpipe train --json``) names a record's field by its
kind: ``eval_loss``/``eval_auc``/``eval_samples`` are the last ``eval`` record's ``loss``/
``auc``/``samples``, ``final_step_loss`` and ``train_wall_s`` the last ``train`` record's
``loss`` and ``wall_s``, ``eval_wall_s`` the sum of the ``eval`` records' ``wall_s``.
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import math
import os
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recpipe._deps import optional_import
from recpipe.errors import RecpipeError
from trainer.config import metrics_format

__all__ = [
    "METRIC_FIELDS",
    "MetricsFile",
    "PredictionWindow",
    "TensorBoardLog",
    "auc",
    "peak_memory_bytes",
]

_log = logging.getLogger(__name__)

METRIC_FIELDS: tuple[str, ...] = (
    "kind",  # "train" (one optimizer step) or "eval" (one evaluation on the held-out data)
    "step",  # optimizer steps done
    "epoch",  # the epoch being read
    "samples",  # training samples seen (train) or evaluated (eval)
    "loss",  # the step's loss, or the mean held-out loss
    "auc",  # AUC of the last `log_window` batches, every `log_every` steps; or held-out AUC
    "samples_per_s",  # training samples per second of training (wall_s) since the run started
    "step_s",  # wall seconds of this step, reading the batch included, evaluations not
    "dedup_factor",  # sparse values of the expanded batch / values stored
    "peak_memory_bytes",  # peak device memory (CUDA) or peak RSS (CPU) so far
    # train: seconds of training since the run (or resume) started, evaluations not counted;
    # eval: seconds this evaluation took
    "wall_s",
)
"""The fields of a metrics record, in file order."""


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


def _clean(value: Any) -> Any:
    """``None`` for NaN (JSON has no NaN); plain Python numbers otherwise."""
    if isinstance(value, float | np.floating) and not math.isfinite(float(value)):
        return None
    if isinstance(value, np.generic):
        return value.item()
    return value


class MetricsFile:
    """Per-step metrics records written to a ``.csv`` or ``.jsonl`` file as training goes.

    A fresh run replaces the file. A resumed run (``resume_step``) keeps the records up to the
    step it resumes from and drops later ones (steps the crashed run did after its checkpoint,
    which the resumed run does again), so the file always describes one run.

    Args:
        path: the file; its suffix chooses the format (``.csv``: a header line, then one row per
            record; ``.jsonl``: one JSON object per line).
        resume_step: the step a resumed run continues from (``None``: a fresh run).

    Raises:
        RecpipeError: another suffix, or a file to resume that cannot be read.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.format = metrics_format(self.path)
        kept = [] if resume_step is None else self._records_up_to(resume_step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "w", newline="", buffering=1)  # noqa: SIM115 - closed in close()
        self._csv = None
        if self.format == "csv":
            self._csv = csv.DictWriter(self._fh, fieldnames=METRIC_FIELDS, extrasaction="ignore")
            self._csv.writeheader()
        for record in kept:
            self.write(record)
        if resume_step is not None:
            _log.info("%s: kept %d records up to step %d", self.path, len(kept), resume_step)

    def _records_up_to(self, step: int) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            text = self.path.read_text()
            if self.format == "csv":
                rows = list(csv.DictReader(text.splitlines()))
                records = [{k: (v if v != "" else None) for k, v in r.items()} for r in rows]
            else:
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
            return [r for r in records if r.get("step") is not None and int(r["step"]) <= step]
        except (OSError, ValueError, TypeError) as exc:
            msg = f"{self.path}: cannot read the metrics of the run to resume: {exc}"
            raise RecpipeError(msg) from exc

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (fields of :data:`METRIC_FIELDS`; missing ones are ``None``)."""
        row = {k: _clean(record.get(k)) for k in METRIC_FIELDS}
        if self._csv is not None:
            self._csv.writerow(row)
        else:
            self._fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Flush and close the file; idempotent."""
        if not self._fh.closed:
            self._fh.close()


class TensorBoardLog:
    """The same records as TensorBoard scalars (``train/loss``, ``eval/auc``, ...).

    Needs the ``tensorboard`` package (``pip install tensorboard``): without it this raises
    :class:`~recpipe.errors.DependencyError` with that hint.

    Args:
        logdir: the TensorBoard log directory.
    """

    _SCALARS = ("loss", "auc", "samples_per_s", "step_s", "dedup_factor", "peak_memory_bytes")

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        optional_import("tensorboard", purpose="`--tensorboard`")
        board = optional_import("torch.utils.tensorboard", purpose="`--tensorboard`")
        self.writer = board.SummaryWriter(log_dir=os.fspath(logdir))

    def write(self, record: Mapping[str, Any]) -> None:
        """Add the record's numbers as scalars at its step."""
        kind, step = record.get("kind", "train"), int(record["step"])
        for name in self._SCALARS:
            value = _clean(record.get(name))
            if value is not None:
                self.writer.add_scalar(f"{kind}/{name}", float(value), step)

    def close(self) -> None:
        """Flush and close the writer."""
        self.writer.close()
