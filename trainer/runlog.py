"""What a training run records and reports: :class:`RunLog` (per-step losses, held-out
evaluations, the running AUC, the metrics sinks), :class:`TrainResult` and :func:`format_summary`.

The single-process loop (:mod:`trainer.train`) and every rank of a multi-rank one
(:mod:`trainer.distributed.run`) keep one :class:`RunLog` each, so both write the same records and
end in the same :class:`TrainResult`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.config import DEFAULT_LR, TrainConfig
from trainer.metrics import MetricsFile, PredictionWindow, TensorBoardLog, peak_memory_bytes

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = [
    "EvalResult",
    "RunLog",
    "TrainResult",
    "batch_dedup_factor",
    "divergence_hint",
    "format_bytes",
    "format_summary",
    "run_targets",
]

_log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """Loss and AUC over an evaluation set.

    Attributes:
        loss: mean binary cross-entropy per sample.
        auc: ROC AUC (``nan`` with one class only).
        samples: samples evaluated.
        batches: batches evaluated.
    """

    loss: float
    auc: float
    samples: int
    batches: int


@dataclass
class TrainResult:
    """What a run did.

    Attributes:
        steps: optimizer steps done in total (resumed ones included).
        samples: training samples seen in total.
        losses: per-step training losses of the whole run (resumed ones included).
        train_auc: AUC over the last ``log_window`` training batches.
        evals: ``[(step, EvalResult)]`` evaluations on the held-out data.
        samples_per_s: training throughput of this process (loading included).
        peak_memory_bytes: peak device memory (CUDA) or peak RSS (CPU).
        dedup_factor: mean sparse dedup factor of the training batches of this process.
        wall_s: wall time of this process.
        checkpoint: the checkpoint file written last (``None`` without checkpoints).
        resumed_from: the step resumed from (``None`` for a fresh run).
        train_splits, eval_splits: row groups holding training rows and held-out rows.
    """

    steps: int
    samples: int
    losses: list[float]
    train_auc: float
    evals: list[tuple[int, EvalResult]]
    samples_per_s: float
    peak_memory_bytes: int
    dedup_factor: float
    wall_s: float
    checkpoint: str | None = None
    resumed_from: int | None = None
    train_splits: int = 0
    eval_splits: int = 0

    @property
    def final_eval(self) -> EvalResult | None:
        """The last evaluation."""
        return self.evals[-1][1] if self.evals else None


def divergence_hint(config: TrainConfig, saved_step: int | None) -> str:
    """The end of a "training stopped" message: what the checkpoint keeps, and what to try."""
    lr = DEFAULT_LR[config.optimizer] if config.lr is None else config.lr
    if config.checkpoint is None:
        kept = ""
    elif saved_step is None:
        kept = "; no checkpoint was written"
    else:
        kept = f"; the checkpoint of step {saved_step} is kept"
    return f"{kept}; try a lower `--lr` (it is {lr:g})"


def run_targets(config: TrainConfig) -> tuple[int | None, int | None]:
    """``(steps, epochs)`` a run trains for: ``steps``, else ``epochs``, else one epoch."""
    if config.steps is not None:
        return config.steps, None
    return None, 1 if config.epochs is None else config.epochs


class RunLog:
    """What a training run records besides its model: per-step losses, samples, held-out
    evaluations, the running training AUC, the metrics sinks (``metrics``, ``tensorboard``),
    and the :class:`TrainResult` at the end. The single-process loop and every rank of a
    multi-rank one keep one each (a rank that does not ``write`` opens no sink).

    Args:
        config: the run.
        device: where the model runs (for peak memory).
        write: open the metrics sinks (rank 0 of a multi-rank job).
    """

    def __init__(self, config: TrainConfig, *, device: torch.device, write: bool = True) -> None:
        self.config, self.device, self.write = config, device, write
        self.losses: list[float] = []
        self.samples = 0
        self.evals: list[tuple[int, EvalResult]] = []
        self.window = PredictionWindow(config.log_window)
        self.factors: list[float] = []  # dedup factor of each batch trained on here
        self.resumed_from: int | None = None
        self.sinks: list[Any] = []
        self.dataset_id: str | None = None  # read from the manifest at the first checkpoint

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The history a checkpoint keeps (losses, samples, evaluations), the run's config and
        its dataset's identity (:func:`trainer.checkpoint.dataset_identity`)."""
        from trainer.checkpoint import dataset_identity

        if self.dataset_id is None:
            self.dataset_id = dataset_identity(self.config.dataset) or ""
        return {
            "losses": self.losses,
            "samples": self.samples,
            "evals": [(s, asdict(e)) for s, e in self.evals],
            "config": {k: v for k, v in asdict(self.config).items() if k != "model"},
            "model_config": asdict(self.config.model),
            "dataset_id": self.dataset_id or None,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, step: int) -> None:
        """Continue the history of a checkpoint taken at ``step``."""
        self.losses = list(state["losses"])
        self.samples = int(state["samples"])
        self.evals = [(s, EvalResult(**e)) for s, e in state["evals"]]
        self.resumed_from = step

    # -- metrics --------------------------------------------------------------------------------
    def open_sinks(self) -> None:
        """Open where the per-step records go: the ``metrics`` file, TensorBoard."""
        cfg = self.config
        if not self.write:
            return
        if cfg.metrics is not None:
            self.sinks.append(MetricsFile(cfg.metrics, resume_step=self.resumed_from))
            _log.info("metrics to %s", cfg.metrics)
        if cfg.tensorboard is not None:
            self.sinks.append(TensorBoardLog(cfg.tensorboard))
            _log.info("TensorBoard logs to %s", cfg.tensorboard)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def record(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def add_batch(self, batch: Batch, logits: torch.Tensor, *, samples: int) -> None:
        """Count a trained batch: its dedup factor, ``samples`` (the step's global rows) and its
        predictions for the running AUC."""
        self.factors.append(batch_dedup_factor(batch))
        self.samples += samples
        self.window.add(logits, batch.labels)

    def train_record(
        self, *, step: int, epoch: int, auc: float | None, samples_per_s: float, step_s: float,
        memory: int, wall_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        """The metrics record of a training step just counted by :meth:`add_batch`."""
        return {
            "kind": "train", "step": step, "epoch": epoch, "samples": self.samples, "auc": auc,
            "samples_per_s": samples_per_s, "step_s": step_s, "dedup_factor": self.factors[-1],
            "peak_memory_bytes": memory, "wall_s": wall_s,
        }  # fmt: skip

    def add_eval(self, step: int, result: EvalResult, *, epoch: int) -> None:
        """Keep (and record, and log) an evaluation that saw samples."""
        if not result.samples:
            return
        self.evals.append((step, result))
        self.record({
            "kind": "eval", "step": step, "epoch": epoch, "samples": result.samples,
            "loss": result.loss, "auc": result.auc,
            "peak_memory_bytes": peak_memory_bytes(self.device),
        })  # fmt: skip
        _log.info(
            "step %d: held-out loss %.4f, AUC %.4f (%d samples)",
            step, result.loss, result.auc, result.samples,
        )  # fmt: skip

    def evaluated_at(self, step: int) -> bool:
        return bool(self.evals) and self.evals[-1][0] == step

    # -- the end --------------------------------------------------------------------------------
    def result(
        self,
        *,
        steps: int,
        samples0: int,
        wall: float,
        checkpoint: Path | None,
        train_splits: int,
        eval_splits: int,
    ) -> TrainResult:
        """The run's :class:`TrainResult` (``samples0``: samples before this process started)."""
        done = self.samples - samples0
        return TrainResult(
            steps=steps,
            samples=self.samples,
            losses=self.losses,
            train_auc=self.window.auc(),
            evals=self.evals,
            samples_per_s=done / wall if wall > 0 else float("nan"),
            peak_memory_bytes=peak_memory_bytes(self.device),
            dedup_factor=float(np.mean(self.factors)) if self.factors else 1.0,
            wall_s=wall,
            checkpoint=None if checkpoint is None else str(checkpoint),
            resumed_from=self.resumed_from,
            train_splits=train_splits,
            eval_splits=eval_splits,
        )


def batch_dedup_factor(batch: Batch) -> float:
    """Sparse values of the expanded batch / values stored (1.0 without IKJTs)."""
    stored = batch.kjt.num_values + sum(g.num_values for g in batch.ikjts.values())
    expanded = batch.kjt.num_values + sum(g.num_expanded_values for g in batch.ikjts.values())
    return expanded / stored if stored else 1.0


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_summary(config: TrainConfig, result: TrainResult) -> str:
    """A one-screen summary of a run."""
    ev = result.final_eval
    last = result.losses[-min(50, len(result.losses)) :] if result.losses else []
    rows = [
        ("dataset", config.dataset if config.service is None else f"{config.service} (service)"),
        ("dedup", "on" if config.dedup else "off"),
        ("device", config.device),
        ("optimizer", f"{config.optimizer} lr={config.lr or DEFAULT_LR[config.optimizer]}"),
        (
            "row groups",
            f"{result.train_splits} with training rows, {result.eval_splits} with held-out",
        ),
        (
            "steps",
            f"{result.steps:,}"
            + (f" (resumed at {result.resumed_from:,})" if result.resumed_from else ""),
        ),
        ("samples", f"{result.samples:,}"),
        ("train loss", f"{np.mean(last):.4f} (last {len(last)} steps)" if last else "-"),
        ("train AUC", f"{result.train_auc:.4f} (last {config.log_window} batches)"),
        (
            "held-out",
            f"loss {ev.loss:.4f}  AUC {ev.auc:.4f}  ({ev.samples:,} samples)" if ev else "-",
        ),
        ("samples/s", f"{result.samples_per_s:,.0f}"),
        ("dedup factor", f"{result.dedup_factor:.2f}x sparse values (mean per batch)"),
        ("peak memory", format_bytes(result.peak_memory_bytes)),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("checkpoint", result.checkpoint or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "recpipe train: done\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
