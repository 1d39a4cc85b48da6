"""The training loop behind ``recpipe train``: dedup on/off, held-out evaluation, exact resume.

::

    clustered dataset --(row groups)--> train splits | held-out splits (whole sessions)
    train splits -> ParquetBatchDataset (shuffled, IKJTs when dedup) -> StatefulLoader
                 -> DLRM -> BCE loss -> optimizers (sparse rows + dense)   [--steps | --epochs]
    every --checkpoint-every steps and at the end: model, optimizers, reader position, RNG
    at the end (and every --eval-every steps): loss and AUC on the held-out splits

``--dedup off`` reads the same batches as one plain KJT and runs the same model: the losses
agree with ``--dedup on`` to float rounding. A checkpoint is taken at a step boundary and
resuming from it continues exactly as if training had not stopped.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from readers.holdout import Holdout, holdout_splits
from readers.service.client import ServiceStream
from recpipe.errors import DataError, RecpipeError
from trainer.checkpoint import (
    checkpoint_file,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import (
    DEFAULT_LR,
    OPTIMIZERS,
    ModelConfig,
    OptimizerKind,
    TableConfig,
    TrainConfig,
)
from trainer.metrics import (
    MetricsFile,
    PredictionWindow,
    TensorBoardLog,
    auc,
    peak_memory_bytes,
)
from trainer.models import DLRM
from trainer.modules import ParameterTable, table_seed

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = [
    "EvalResult",
    "OptimizerKind",
    "RunLog",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "batch_dedup_factor",
    "format_summary",
    "make_optimizers",
    "run_targets",
    "train",
]

_log = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------
# optimizers and the step


def make_optimizers(
    model: nn.Module, kind: OptimizerKind = "adagrad", *, lr: float | None = None
) -> list[torch.optim.Optimizer]:
    """Optimizers for a model: one for the sparse-gradient tables, one for everything else.

    ``adagrad`` and ``sgd`` take sparse gradients as they are; ``adam`` uses ``SparseAdam``
    for the tables.

    Args:
        model: the model.
        kind: ``"adagrad"``, ``"sgd"`` or ``"adam"``.
        lr: learning rate (default :data:`DEFAULT_LR` of ``kind``).
    """
    if kind not in OPTIMIZERS:
        msg = f"`optimizer` must be one of {list(OPTIMIZERS)}, got {kind!r}"
        raise RecpipeError(msg)
    lr = DEFAULT_LR[kind] if lr is None else float(lr)
    if not lr > 0:
        msg = f"`lr` must be > 0, got {lr!r}"
        raise RecpipeError(msg)
    sparse = [
        m.weight for m in model.modules() if isinstance(m, ParameterTable) and m.config.sparse_grad
    ]
    seen = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in seen and p.requires_grad]
    out: list[torch.optim.Optimizer] = []
    if kind == "adagrad":
        make_sparse = make_dense = torch.optim.Adagrad
    elif kind == "sgd":
        make_sparse = make_dense = torch.optim.SGD
    else:
        make_sparse, make_dense = torch.optim.SparseAdam, torch.optim.Adam
    if sparse:
        out.append(make_sparse(sparse, lr=lr))
    if dense:
        out.append(make_dense(dense, lr=lr))
    return out


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


class Trainer:
    """A model, its optimizers and the training step; device-agnostic.

    Args:
        model: a model mapping a :class:`~recpipe.batch.Batch` to ``[B]`` logits.
        optimizer: ``"adagrad"``, ``"sgd"`` or ``"adam"``.
        lr: learning rate (default per optimizer).
        device: where the model runs; batches are moved there.

    Table modules with an ``optimizer_step()`` method (store-backed tables, which are not
    ``nn.Parameter`` s) are stepped after the torch optimizers.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerKind = "adagrad",
        lr: float | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizers = make_optimizers(self.model, optimizer, lr=lr)
        self._extra_steps = [m for m in self.model.modules() if hasattr(m, "optimizer_step")]
        self.step = 0

    def train_step(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on ``batch``; returns the (detached) loss and logits."""
        self.model.train()
        batch = batch.to(self.device, non_blocking=True)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        logits = self.model(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.dtype))
        loss.backward()
        # the sparse gradients come from torch's own embedding ops: skip re-checking them
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            for opt in self.optimizers:
                opt.step()
        for module in self._extra_steps:
            module.optimizer_step()
        self.step += 1
        return loss.detach(), logits.detach()

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None = None) -> EvalResult:
        """Loss and AUC over ``batches`` (at most ``max_batches``)."""
        self.model.eval()
        scores, labels, total, n = [], [], 0.0, 0
        count = 0
        for batch in batches:
            if max_batches is not None and count >= max_batches:
                break
            batch = batch.to(self.device, non_blocking=True)
            logits = self.model(batch)
            y = batch.labels.to(logits.dtype)
            total += float(F.binary_cross_entropy_with_logits(logits, y, reduction="sum"))
            n += y.numel()
            scores.append(logits.cpu())
            labels.append(y.cpu())
            count += 1
        if n == 0:
            return EvalResult(float("nan"), float("nan"), 0, 0)
        return EvalResult(total / n, auc(torch.cat(scores), torch.cat(labels)), n, count)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizers and step."""
        return {
            "model": self.model.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "step": self.step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.model.load_state_dict(state["model"])
        if len(state["optimizers"]) != len(self.optimizers):
            msg = (
                f"the checkpoint holds {len(state['optimizers'])} optimizers, this model needs "
                f"{len(self.optimizers)}: was it written with another model or optimizer?"
            )
            raise RecpipeError(msg)
        for opt, opt_state in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        self.step = int(state["step"])


def batch_dedup_factor(batch: Batch) -> float:
    """Sparse values of the expanded batch / values stored (1.0 without IKJTs)."""
    stored = batch.kjt.num_values + sum(g.num_values for g in batch.ikjts.values())
    expanded = batch.kjt.num_values + sum(g.num_expanded_values for g in batch.ikjts.values())
    return expanded / stored if stored else 1.0


# -------------------------------------------------------------------------------------------
# the whole run


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
        train_splits, eval_splits: row groups trained on and held out.
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


def _model_config(config: TrainConfig) -> ModelConfig:
    from dataclasses import replace

    return replace(config.model, seed=config.seed)


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

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The history a checkpoint keeps (losses, samples, evaluations) and the run's config."""
        return {
            "losses": self.losses,
            "samples": self.samples,
            "evals": [(s, asdict(e)) for s, e in self.evals],
            "config": {k: v for k, v in asdict(self.config).items() if k != "model"},
            "model_config": asdict(self.config.model),
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


class _Run:
    """The state of one ``train`` call (kept out of the public API)."""

    def __init__(self, config: TrainConfig, *, progress: bool, log: TextIO) -> None:
        from readers.dataset import dataset_schema

        self.config, self.progress, self.log = config, progress, log
        self.schema: DatasetSchema = dataset_schema(config.dataset)
        self.device = torch.device(config.device)
        # read before the stores open: they reopen at the step of the dense checkpoint
        self.resume_state = self._read_checkpoint() if config.resume else None
        table_factory = None
        self.stores: list[Any] = []
        if config.store == "hybrid":
            table_factory = self._store_factory()
        model = DLRM.from_schema(self.schema, _model_config(config), table_factory=table_factory)
        self.trainer = Trainer(model, optimizer=config.optimizer, lr=config.lr, device=self.device)
        self._make_loaders()
        self.log_ = RunLog(config, device=self.device)
        self.saved_step: int | None = None  # the step of the last checkpoint this run wrote

    # -- data ---------------------------------------------------------------------------------
    def _make_loaders(self) -> None:
        from readers.dataset import ParquetBatchDataset, StatefulLoader
        from readers.source import ReaderConfig

        cfg = self.config
        reader = ReaderConfig(batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed)
        eval_reader = ReaderConfig(batch_size=cfg.batch_size, shuffle=False)
        common = {"schema": self.schema, "transforms": cfg.preprocess, "dedup": cfg.dedup}
        self.eval_ds = ParquetBatchDataset(cfg.dataset, config=eval_reader, **common)
        self.eval_stream: ServiceStream | None = None
        if cfg.service is not None:
            self._make_service_streams()
            return
        train_ds = ParquetBatchDataset(cfg.dataset, config=reader, **common)
        train, held = holdout_splits(
            train_ds.source.splits,
            session_key=self.schema.session_key,
            fraction=cfg.eval_fraction,
            seed=cfg.seed,
        )
        # the readers read `source.splits`; restrict each dataset to its share of row groups
        train_ds.source.splits = train
        self.eval_ds.source.splits = held
        self.train_splits, self.eval_splits = len(train), len(held)
        self.loader = StatefulLoader(
            train_ds, num_workers=cfg.workers, pin_memory=self.device.type == "cuda"
        )

    def _make_service_streams(self) -> None:
        """Train on the server's training part and evaluate on its held-out part, divided as
        :func:`holdout_splits` divides this dataset in-process (the streams check that the
        server's parts hold as many row groups; the server checks the batch size)."""
        cfg = self.config
        train, held = holdout_splits(
            self.eval_ds.source.splits,
            session_key=self.schema.session_key,
            fraction=cfg.eval_fraction,
            seed=cfg.seed,
        )
        self.train_splits, self.eval_splits = len(train), len(held)
        holdout = Holdout(cfg.eval_fraction, seed=cfg.seed) if held else None
        common = {"batch_size": cfg.batch_size}
        self.loader = ServiceStream(cfg.service, holdout=holdout, splits=len(train), **common)
        if holdout is not None:
            part = holdout.other()
            self.eval_stream = ServiceStream(cfg.service, holdout=part, splits=len(held), **common)

    def _loader_epoch(self) -> int:
        if self.config.service is not None:
            return self.loader.current_epoch
        return self.loader.dataset.epoch

    def _eval_batches(self) -> Iterator[Batch]:
        if self.config.service is not None:
            return iter(()) if self.eval_stream is None else self.eval_stream.read_epoch(0)
        if not self.eval_ds.source.splits:
            return iter(())
        self.eval_ds.set_epoch(0)
        return iter(self.eval_ds)

    # -- hybrid store --------------------------------------------------------------------------
    def _store_factory(self) -> Any:
        cfg = self.config
        if cfg.optimizer == "adam":
            msg = "`store` 'hybrid' trains its rows with sgd or adagrad (row-wise), not adam"
            raise RecpipeError(msg)
        root = None if cfg.checkpoint is None else Path(cfg.checkpoint) / "store"

        def factory(table: TableConfig, seed: int) -> nn.Module:
            from trainer.store.table import StoreTable

            lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
            path = None if root is None else root / table.name
            device = str(self.device)
            if self.resume_state is not None and path is not None:
                # the store may have committed a later step than the dense checkpoint (a crash
                # between the two): it rolls back to the checkpoint's step
                at = self.resume_state["trainer"]["step"]
                checkpoint = self.checkpoint_path
                st = StoreTable.resume(
                    path, table, step=at, lr=lr, device=device, checkpoint=checkpoint
                )
            else:
                if path is not None and path.exists():
                    shutil.rmtree(path)  # a fresh run replaces an old store
                st = StoreTable.create(
                    path,
                    table,
                    optimizer=cfg.optimizer,  # sgd or adagrad (adam is refused above)
                    lr=lr,
                    seed=table_seed(seed, table.name),
                    device=device,
                )
            self.stores.append(st.store)
            return st

        return factory

    # -- checkpoints --------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path | None:
        c = self.config.checkpoint
        return None if c is None else checkpoint_file(c)

    def save(self) -> Path | None:
        path = self.checkpoint_path
        if path is None:
            return None
        if self.saved_step == self.trainer.step:  # the last in-loop checkpoint, at the end
            return path
        # every store commits this step, then the rest is saved: after a crash in between the
        # stores are ahead of the state file, and resuming rolls them back (open_store(step=))
        for store in self.stores:
            store.checkpoint(self.trainer.step)
        state = {
            "trainer": self.trainer.state_dict(),
            "reader": self.loader.state_dict(),
            "rng": rng_state(),
            **self.log_.state_dict(),
        }
        save_checkpoint(state, path)
        self.saved_step = self.trainer.step
        _log.debug("checkpoint at step %d: %s", self.trainer.step, path)
        return path

    def _read_checkpoint(self) -> dict[str, Any] | None:
        """The saved training state, or ``None`` when there is no checkpoint file yet."""
        path = self.checkpoint_path
        return None if path is None else load_checkpoint(path, map_location=self.device)

    def restore(self) -> bool:
        state, path = self.resume_state, self.checkpoint_path
        if state is None:
            return False
        for store in self.stores:
            at = store.stats().last_checkpoint_step
            if at != state["trainer"]["step"]:
                msg = (
                    f"{path}: the checkpoint is at step {state['trainer']['step']} but the "
                    f"embedding store under {store.root} at step {at}"
                )
                raise RecpipeError(msg)
        self.trainer.load_state_dict(state["trainer"])
        self.loader.load_state_dict(state["reader"])
        set_rng_state(state["rng"])
        self.log_.load_state_dict(state, step=self.trainer.step)
        self.saved_step = self.trainer.step
        return True

    def _planned_steps(self, target_steps: int | None, target_epochs: int | None) -> int | None:
        """The run's last step, for the progress bar: ``steps``, or the batches of
        ``epochs`` epochs (known in-process: ``len()`` of each epoch's loader)."""
        if target_steps is not None:
            return target_steps
        if self.config.service is not None or target_epochs is None:
            return None
        dataset = self.loader.dataset
        workers = self.loader.num_workers
        return sum(dataset.num_batches(num_workers=workers, epoch=e) for e in range(target_epochs))

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg, log = self.config, self.log_
        if cfg.resume and self.restore():
            _log.info("resumed from step %d (%s)", self.trainer.step, self.checkpoint_path)
        target_steps, target_epochs = run_targets(cfg)
        start_step = self.trainer.step
        _log.info(
            "training on %s: %d row groups, %d held out; dedup %s",
            cfg.dataset if cfg.service is None else cfg.service,
            self.train_splits,
            self.eval_splits,
            "on" if cfg.dedup else "off",
        )
        bar = tqdm(
            total=self._planned_steps(target_steps, target_epochs),
            initial=start_step,
            unit="step",
            desc="train",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        t0 = time.perf_counter()
        samples0 = log.samples
        done = self._finished(target_steps, target_epochs)
        empty_passes = 0
        last = t0
        try:
            log.open_sinks()
            while not done:
                empty_passes += 1
                for batch in self.loader:
                    empty_passes = 0
                    log.factors.append(batch_dedup_factor(batch))
                    loss, logits = self.trainer.train_step(batch)
                    log.losses.append(float(loss))
                    log.samples += batch.batch_size
                    log.window.add(logits, batch.labels)
                    step = self.trainer.step
                    bar.update(1)
                    now = time.perf_counter()
                    rate = (log.samples - samples0) / max(now - t0, 1e-9)
                    memory = peak_memory_bytes(self.device)
                    window_auc = None
                    if step % cfg.log_every == 0 or step == target_steps:
                        window_auc = log.window.auc()
                        bar.set_postfix(
                            loss=f"{np.mean(log.losses[-20:]):.4f}",
                            auc=f"{window_auc:.3f}",
                            sps=f"{rate:,.0f}",
                            mem=_fmt_bytes(memory),
                            refresh=False,
                        )
                    log.record({
                        "kind": "train", "step": step, "epoch": self._loader_epoch(),
                        "samples": log.samples, "loss": log.losses[-1], "auc": window_auc,
                        "samples_per_s": rate, "step_s": now - last,
                        "dedup_factor": log.factors[-1], "peak_memory_bytes": memory,
                        "wall_s": now - t0,
                    })  # fmt: skip
                    last = now
                    if cfg.eval_every and step % cfg.eval_every == 0:
                        self._evaluate(step)
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        self.save()
                    if target_steps is not None and step >= target_steps:
                        break
                done = self._finished(target_steps, target_epochs)
                if empty_passes >= 2 and not done:
                    msg = f"{cfg.dataset}: the training split yields no batches"
                    raise DataError(msg)
            wall = time.perf_counter() - t0
            if not log.evaluated_at(self.trainer.step):
                self._evaluate(self.trainer.step)
            path = self.save()
        finally:
            bar.close()
            log.close()
            for store in self.stores:
                store.close()
        return log.result(
            steps=self.trainer.step, samples0=samples0, wall=wall, checkpoint=path,
            train_splits=self.train_splits, eval_splits=self.eval_splits,
        )  # fmt: skip

    def _finished(self, target_steps: int | None, target_epochs: int | None) -> bool:
        if target_steps is not None:
            return self.trainer.step >= target_steps
        return self._loader_epoch() >= target_epochs

    def _evaluate(self, step: int) -> None:
        result = self.trainer.evaluate(self._eval_batches(), max_batches=self.config.eval_batches)
        self.log_.add_eval(step, result, epoch=self._loader_epoch())


def train(config: TrainConfig, *, progress: bool = True, log: TextIO | None = None) -> TrainResult:
    """Train a DLRM on a clustered dataset (see :class:`TrainConfig`).

    Args:
        config: the run.
        progress: show a tqdm progress bar on stderr (with a total and an ETA when the number
            of steps is known: ``steps``, or ``epochs`` read in-process).
        log: unused, kept for callers that pass it; messages go to the ``logging`` module
            (logger ``trainer.train``), which the ``recpipe`` command configures.

    Returns:
        The run's :class:`TrainResult`; :func:`format_summary` renders it.
    """
    return _Run(config, progress=progress, log=log or sys.stderr).run()


def _fmt_bytes(n: float) -> str:
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
        ("row groups", f"{result.train_splits} train, {result.eval_splits} held out"),
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
        ("peak memory", _fmt_bytes(result.peak_memory_bytes)),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("checkpoint", result.checkpoint or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "recpipe train: done\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
