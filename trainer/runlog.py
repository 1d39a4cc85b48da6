"""What a training run records and reports: :class:`RunLog` (per-step losses, held-out
evaluations, the running AUC, the metrics sinks), :class:`TrainResult` and :func:`format_summary`.

The single-process loop (:mod:`trainer.train`) and every rank of a multi-rank one
(:mod:`trainer.distributed.run`) keep one :class:`RunLog` each, so both write the same records and
end in the same :class:`TrainResult`.
"""

from __future__ import annotations

import logging
import math
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
    "summary_dict",
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
        samples_per_s: training samples of this process / ``train_wall_s`` (loading included).
        peak_memory_bytes: peak device memory (CUDA) or peak RSS (CPU).
        dedup_factor: mean sparse dedup factor of the training batches of this process.
        train_wall_s: seconds this process spent in the training loop: reading, steps and the
            checkpoints taken inside it; the held-out evaluations are not counted.
        checkpoint: the checkpoint file written last (``None`` without checkpoints).
        resumed_from: the step resumed from (``None`` for a fresh run).
        train_splits, eval_splits: row groups holding training rows and held-out rows.
        eval_wall_s: seconds this process spent in held-out evaluations (all of them).
        eval_runs: evaluations this process ran (those of a resumed run's first part aside).

    Start-up (opening the dataset, building the model) and the final checkpoint are in neither
    ``train_wall_s`` nor ``eval_wall_s``; :attr:`wall_s` is their sum.
    """

    steps: int
    samples: int
    losses: list[float]
    train_auc: float
    evals: list[tuple[int, EvalResult]]
    samples_per_s: float
    peak_memory_bytes: int
    dedup_factor: float
    train_wall_s: float
    checkpoint: str | None = None
    resumed_from: int | None = None
    train_splits: int = 0
    eval_splits: int = 0
    eval_wall_s: float = 0.0
    eval_runs: int = 0

    @property
    def final_eval(self) -> EvalResult | None:
        """The last evaluation."""
        return self.evals[-1][1] if self.evals else None

    @property
    def wall_s(self) -> float:
        """``train_wall_s + eval_wall_s``: training and evaluating, start-up and the final
        checkpoint not counted."""
        return self.train_wall_s + self.eval_wall_s


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
        self.eval_s = 0.0  # seconds this process spent evaluating (the loops subtract it)
        self.eval_runs = 0

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

    def add_eval(self, step: int, result: EvalResult, *, epoch: int, seconds: float) -> None:
        """Count ``seconds`` of evaluation (:attr:`eval_s`: the loops leave it out of their
        training time), and keep (and record, and log) an evaluation that saw samples."""
        self.eval_s += seconds
        self.eval_runs += 1
        if not result.samples:
            return
        self.evals.append((step, result))
        self.record({
            "kind": "eval", "step": step, "epoch": epoch, "samples": result.samples,
            "loss": result.loss, "auc": result.auc,
            "peak_memory_bytes": peak_memory_bytes(self.device), "wall_s": seconds,
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
        """The run's :class:`TrainResult` (``samples0``: samples before this process started;
        ``wall``: seconds of its training loop less :attr:`eval_s`)."""
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
            train_wall_s=wall,
            checkpoint=None if checkpoint is None else str(checkpoint),
            resumed_from=self.resumed_from,
            train_splits=train_splits,
            eval_splits=eval_splits,
            eval_wall_s=self.eval_s,
            eval_runs=self.eval_runs,
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


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def summary_dict(config: TrainConfig, result: TrainResult) -> dict[str, Any]:
    """The run's summary as JSON-ready values (``nan`` as ``None``): what ``--json`` writes,
    under the names :func:`format_summary` prints.

    ``train_loss`` is the mean loss of the last ``log_window`` steps and ``train_auc`` the AUC
    of the last ``log_window`` batches; ``final_step_loss`` is the loss of the last step (the
    ``loss`` of the last ``train`` record of ``--metrics``). ``eval_loss``, ``eval_auc`` and
    ``eval_samples`` are those of the last evaluation (its ``eval`` record's ``loss``, ``auc``
    and ``samples``); ``eval_wall_s`` sums the ``wall_s`` of the ``eval`` records, and
    ``train_wall_s`` is the ``wall_s`` of the last ``train`` record (to the loop's end).
    """
    ev = result.final_eval
    window = result.losses[-min(config.log_window, len(result.losses)) :]
    return {
        "dataset": str(config.dataset) if config.service is None else f"{config.service} (service)",
        "dedup": config.dedup,
        "device": config.device,
        "threads": config.threads,
        "attention": _attention(config.model.attention),
        "optimizer": config.optimizer,
        "lr": DEFAULT_LR[config.optimizer] if config.lr is None else config.lr,
        "train_splits": result.train_splits,
        "eval_splits": result.eval_splits,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "samples": result.samples,
        "log_window": config.log_window,
        "train_loss": _num(float(np.mean(window))) if window else None,
        "final_step_loss": _num(result.losses[-1]) if result.losses else None,
        "train_auc": _num(result.train_auc),
        "eval_step": result.evals[-1][0] if result.evals else None,
        "eval_loss": _num(ev.loss) if ev else None,
        "eval_auc": _num(ev.auc) if ev else None,
        "eval_samples": ev.samples if ev else None,
        "samples_per_s": _num(result.samples_per_s),
        "dedup_factor": result.dedup_factor,
        "peak_memory_bytes": result.peak_memory_bytes,
        "train_wall_s": result.train_wall_s,
        "eval_wall_s": result.eval_wall_s,
        "eval_runs": result.eval_runs,
        "wall_s": result.wall_s,
        "checkpoint": result.checkpoint,
    }


def _attention(value: str | tuple[str, ...]) -> str | list[str]:
    """The summary's ``attention``: the features (a list; empty: none), or the setting as
    given when it was not resolved (``auto``)."""
    return value if isinstance(value, str) else list(value)


def format_summary(config: TrainConfig, result: TrainResult) -> str:
    """A one-screen summary of a run: one line per key of :func:`summary_dict` (the names
    ``--json`` writes), its value and what it is."""
    d = summary_dict(config, result)
    n = min(config.log_window, len(result.losses))

    def num(key: str, fmt: str, note: str = "") -> tuple[str, str]:
        value = d[key]
        text = "-" if value is None else format(value, fmt)
        return text, note if value is not None else ""

    resumed = d["resumed_from"]
    rows: dict[str, tuple[str, str]] = {
        "dataset": (str(d["dataset"]), ""),
        "dedup": ("on" if d["dedup"] else "off", ""),
        "device": (str(d["device"]), ""),
        "threads": (
            "-" if d["threads"] is None else f"{d['threads']}",
            "torch threads per process",
        ),
        "attention": (
            ",".join(d["attention"]) or "none"
            if isinstance(d["attention"], list)
            else str(d["attention"]),
            "features pooled by attention (a model setting)",
        ),
        "optimizer": (str(d["optimizer"]), ""),
        "lr": (f"{d['lr']:g}", ""),
        "train_splits": (f"{d['train_splits']}", "row groups with training rows"),
        "eval_splits": (f"{d['eval_splits']}", "row groups with held-out rows"),
        "steps": (f"{d['steps']:,}" + (f" (resumed at {resumed:,})" if resumed else ""), ""),
        "resumed_from": ("-" if resumed is None else f"{resumed:,}", ""),
        "samples": (f"{d['samples']:,}", "training samples"),
        "log_window": (f"{d['log_window']}", "steps in train_loss and train_auc"),
        "train_loss": num("train_loss", ".4f", f"mean of the last {n} steps"),
        "final_step_loss": num("final_step_loss", ".4f", "the last step's loss"),
        "train_auc": num("train_auc", ".4f", f"last {n} batches"),
        "eval_step": num("eval_step", ",", "step of the last evaluation"),
        "eval_loss": num("eval_loss", ".4f", "held-out, last evaluation"),
        "eval_auc": num("eval_auc", ".4f", "held-out, last evaluation"),
        "eval_samples": num("eval_samples", ",", "held-out samples evaluated"),
        "samples_per_s": num("samples_per_s", ",.0f", "training samples / train_wall_s"),
        "dedup_factor": (
            f"{d['dedup_factor']:.2f}x",
            "sparse values per value stored, mean per batch",
        ),
        "peak_memory_bytes": (format_bytes(d["peak_memory_bytes"]), ""),
        "train_wall_s": (
            f"{d['train_wall_s']:.1f} s",
            "reading, steps and the checkpoints in the loop; evaluations not counted",
        ),
        "eval_wall_s": (f"{d['eval_wall_s']:.1f} s", "held-out evaluations"),
        "eval_runs": (f"{d['eval_runs']}", "evaluations run by this process"),
        "wall_s": (
            f"{d['wall_s']:.1f} s",
            "train_wall_s + eval_wall_s; start-up and the final checkpoint not counted",
        ),
        "checkpoint": (d["checkpoint"] or "-", ""),
    }
    width = max(len(k) for k in rows)
    vwidth = max((len(v) for v, note in rows.values() if note), default=0)
    lines = [
        f"  {k:<{width}}  {v:<{vwidth}}  {note}".rstrip() if note else f"  {k:<{width}}  {v}"
        for k, (v, note) in rows.items()
    ]
    return "recpipe train: done\n" + "\n".join(lines)
