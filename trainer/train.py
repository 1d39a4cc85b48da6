"""The training loop behind ``recpipe train``: dedup on/off, held-out evaluation, exact resume.

::

    clustered dataset --(session hash)--> train rows | held-out rows (whole sessions)
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
import math
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
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
    check_resume,
    checkpoint_file,
    claim_checkpoint,
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
    auc,
    peak_memory_bytes,
)
from trainer.models import DLRM
from trainer.modules import ParameterTable, table_seed
from trainer.runlog import (
    EvalResult,
    RunLog,
    TrainResult,
    divergence_hint,
    format_bytes,
    run_targets,
)

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = [
    "OptimizerKind",
    "TrainConfig",
    "Trainer",
    "make_optimizers",
    "model_config",
    "read_schema",
    "reader_options",
    "resolve_model",
    "set_threads",
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


# -------------------------------------------------------------------------------------------
# the whole run


def model_config(config: TrainConfig) -> ModelConfig:
    """The model a run builds: its ``model`` resolved (:func:`resolve_model`), with its seed."""
    from dataclasses import replace

    return replace(resolve_model(config).model, seed=config.seed)


def resolve_model(config: TrainConfig) -> TrainConfig:
    """``config`` with ``--attention auto`` resolved to its features, and ``threads`` to its
    count (:func:`trainer.config.default_threads`).

    ``auto`` is resolved against the dataset's schema as written (its own dedup groups), never
    against the groups the run reads with (``dedup_groups``): how a run reads its batches does
    not change the model. The resolved features are what the summary prints and the
    checkpoint records.
    """
    from dataclasses import replace

    from readers.dataset import dataset_schema
    from trainer.config import default_threads
    from trainer.models import attention_features

    if config.threads is None:
        config = replace(config, threads=default_threads())
    if config.model.attention == "auto":
        features = attention_features(dataset_schema(config.dataset), config.model)
        config = replace(config, model=replace(config.model, attention=features))
    return config


def set_threads(config: TrainConfig) -> None:
    """Use ``config.threads`` torch threads in this process (its default when ``None``)."""
    from trainer.config import default_threads

    torch.set_num_threads(config.threads or default_threads())


def read_schema(config: TrainConfig) -> DatasetSchema:
    """The schema a run reads and builds its model with: the dataset's, with the dedup groups
    ``config.dedup_groups`` chooses (:func:`readers.groups.resolve_dedup_groups`)."""
    from readers.dataset import dataset_schema
    from readers.groups import resolve_dedup_groups

    return resolve_dedup_groups(
        config.dedup_groups, schema=dataset_schema(config.dataset), dataset=config.dataset,
        batch_size=config.batch_size,
    )  # fmt: skip


def _saved_attention_resolved(state: dict[str, Any], schema: DatasetSchema) -> None:
    """A checkpoint written before ``auto`` was resolved records ``"attention": "auto"``:
    resolved here as that run resolved it (against the groups it read with), so that it
    resumes when its features are this run's and is refused, naming ``--attention``, when not."""
    from trainer.models import attention_features

    saved = state.get("model_config")
    if isinstance(saved, dict) and saved.get("attention") == "auto":
        features = attention_features(schema, ModelConfig())  # its attention: auto
        state["model_config"] = {**saved, "attention": features}


def reader_options(config: TrainConfig) -> dict[str, Any]:
    """The :class:`readers.source.ReaderConfig` fields a run's options set (shuffle and seed
    aside, which differ between the training part and the held-out part)."""
    return {"batch_size": config.batch_size, "read_ahead": config.read_ahead,
            "verify": config.verify, "on_error": config.on_error}  # fmt: skip


class _Run:
    """The state of one ``train`` call (kept out of the public API)."""

    def __init__(self, config: TrainConfig, *, progress: bool, log: TextIO) -> None:

        self.config, self.progress, self.log = config, progress, log
        self.schema: DatasetSchema = read_schema(config)
        self.device = torch.device(config.device)
        # read (and checked to be this run's) before the stores open: they reopen at the step
        # of the dense checkpoint
        self.resume_state = self._read_checkpoint() if config.resume else None
        if self.resume_state is not None:
            _saved_attention_resolved(self.resume_state, self.schema)
            check_resume(self.resume_state, config, path=self.checkpoint_path)
        table_factory = None
        self.stores: list[Any] = []
        if config.store == "hybrid":
            table_factory = self._store_factory()
        model = DLRM.from_schema(self.schema, model_config(config), table_factory=table_factory)
        self.trainer = Trainer(model, optimizer=config.optimizer, lr=config.lr, device=self.device)
        self._make_loaders()
        self.log_ = RunLog(config, device=self.device)
        self.saved_step: int | None = None  # the step of the last checkpoint this run wrote

    # -- data ---------------------------------------------------------------------------------
    def _make_loaders(self) -> None:
        from readers.dataset import ParquetBatchDataset, StatefulLoader
        from readers.source import ReaderConfig

        cfg = self.config
        reader = ReaderConfig(**reader_options(cfg), shuffle=cfg.shuffle, seed=cfg.seed)
        eval_reader = ReaderConfig(**reader_options(cfg), shuffle=False)
        common = {"schema": self.schema, "transforms": cfg.preprocess, "fitted": cfg.fitted,
                  "dedup": cfg.dedup}  # fmt: skip
        self.eval_ds = ParquetBatchDataset(cfg.dataset, config=eval_reader, **common)
        self.eval_stream: ServiceStream | None = None
        if cfg.preprocess is not None:
            from readers.fitted import fitted_holdout_mismatch

            why = fitted_holdout_mismatch(
                cfg.dataset, eval_fraction=cfg.eval_fraction, seed=cfg.seed, fitted=cfg.fitted
            )
            if why is not None:
                _log.warning("%s", why)
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
        # the readers read `source.splits`; restrict each dataset to its part's rows
        train_ds.source.splits = train
        self.eval_ds.source.splits = held
        self.train_splits, self.eval_splits = len(train), len(held)
        self.loader = StatefulLoader(
            train_ds, num_workers=cfg.workers, pin_memory=self.device.type == "cuda"
        )

    def _make_service_streams(self) -> None:
        """Train on the server's training part and evaluate on its held-out part, divided as
        :func:`holdout_splits` divides this dataset in-process (the streams check that the
        server's parts span as many row groups; the server checks the batch size)."""
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
            else:  # claim_checkpoint removed an old store (--overwrite) or refused the run
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
        self._check_finite()
        # every store commits this step, then the rest is saved: after a crash in between the
        # stores are ahead of the state file, and resuming rolls them back (open_store(step=))
        for store in self.stores:
            try:
                store.checkpoint(self.trainer.step)
            except OSError as exc:
                msg = (
                    f"{store.root}: cannot write the embedding store's checkpoint of step "
                    f"{self.trainer.step}: {exc.strerror or exc}; the previous checkpoint is kept"
                )
                raise RecpipeError(msg) from None
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

    def _check_finite(self) -> None:
        """Refuse to save a model with a non-finite parameter (the rows in stores aside)."""
        for name, param in self.trainer.model.named_parameters():
            if not bool(torch.isfinite(param).all()):
                msg = (
                    f"step {self.trainer.step}: the model's {name} is not finite; it is not "
                    f"saved{self._lr_hint()}"
                )
                raise RecpipeError(msg)

    def _lr_hint(self) -> str:
        return divergence_hint(self.config, self.saved_step)

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
        from recpipe.progress import progress_bar

        cfg, log = self.config, self.log_
        if cfg.resume and self.restore():
            _log.info("resumed from step %d (%s)", self.trainer.step, self.checkpoint_path)
        target_steps, target_epochs = run_targets(cfg)
        start_step = self.trainer.step
        _log.info(
            "training on %s: %d row groups with training rows, %d with held-out rows; dedup %s",
            cfg.dataset if cfg.service is None else cfg.service,
            self.train_splits,
            self.eval_splits,
            "on" if cfg.dedup else "off",
        )
        self.bar = bar = progress_bar(
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
                    loss, logits = self.trainer.train_step(batch)
                    if not math.isfinite(value := float(loss)):
                        msg = (
                            f"step {self.trainer.step}: the training loss is {value}; training "
                            f"stopped{self._lr_hint()}"
                        )
                        raise RecpipeError(msg)
                    log.losses.append(value)
                    log.add_batch(batch, logits, samples=batch.batch_size)
                    step = self.trainer.step
                    bar.update(1)
                    now = time.perf_counter()
                    train_s = now - t0 - log.eval_s  # evaluations are not training time
                    rate = (log.samples - samples0) / max(train_s, 1e-9)
                    memory = peak_memory_bytes(self.device)
                    window_auc = None
                    if step % cfg.log_every == 0 or step == target_steps:
                        window_auc = log.window.auc()
                        bar.set_postfix(
                            loss=f"{np.mean(log.losses[-20:]):.4f}",
                            auc=f"{window_auc:.3f}",
                            sps=f"{rate:,.0f}",
                            mem=format_bytes(memory),
                            refresh=False,
                        )
                    record = log.train_record(
                        step=step, epoch=self._loader_epoch(), auc=window_auc,
                        samples_per_s=rate, step_s=now - last, memory=memory, wall_s=train_s,
                    )  # fmt: skip
                    log.record({**record, "loss": log.losses[-1]})
                    last = now
                    if cfg.eval_every and step % cfg.eval_every == 0:
                        last += self._evaluate(step)  # the next step_s leaves it out
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        self.save()
                    if target_steps is not None and step >= target_steps:
                        break
                done = self._finished(target_steps, target_epochs)
                if empty_passes >= 2 and not done:
                    msg = f"{cfg.dataset}: the training split yields no batches"
                    raise DataError(msg)
            wall = time.perf_counter() - t0 - log.eval_s  # train_wall_s
            if not log.evaluated_at(self.trainer.step):
                self._evaluate(self.trainer.step)
            path = self.save()
        except BaseException:
            self._close(failing=True)
            raise
        self._close(failing=False)
        return log.result(
            steps=self.trainer.step, samples0=samples0, wall=wall, checkpoint=path,
            train_splits=self.train_splits, eval_splits=self.eval_splits,
        )  # fmt: skip

    def _close(self, *, failing: bool) -> None:
        """Close the progress bar, the metrics and the stores; when the run is already failing,
        an error closing them is logged, not raised over the first one."""
        closers = [self.bar.close, self.log_.close, *(s.close for s in self.stores)]
        for close in closers:
            try:
                close()
            except Exception:
                if not failing:
                    raise
                _log.debug("closing after the error above failed too", exc_info=True)

    def _finished(self, target_steps: int | None, target_epochs: int | None) -> bool:
        if target_steps is not None:
            return self.trainer.step >= target_steps
        return self._loader_epoch() >= target_epochs

    def _evaluate(self, step: int) -> float:
        """Evaluate on the held-out data; the seconds it took."""
        t0 = time.perf_counter()
        result = self.trainer.evaluate(self._eval_batches(), max_batches=self.config.eval_batches)
        seconds = time.perf_counter() - t0
        self.log_.add_eval(step, result, epoch=self._loader_epoch(), seconds=seconds)
        return seconds


def train(config: TrainConfig, *, progress: bool = True, log: TextIO | None = None) -> TrainResult:
    """Train a DLRM on a clustered dataset (see :class:`TrainConfig`).

    Args:
        config: the run.
        progress: show a tqdm progress bar on stderr (with a total and an ETA when the number
            of steps is known: ``steps``, or ``epochs`` read in-process).
        log: unused, kept for callers that pass it; messages go to the ``logging`` module
            (logger ``trainer.train``), which the ``recpipe`` command configures.

    Returns:
        The run's :class:`TrainResult`; :func:`trainer.runlog.format_summary` renders it.
    """
    config = resolve_model(config)
    set_threads(config)
    with claim_checkpoint(config.checkpoint, resume=config.resume, overwrite=config.overwrite):
        return _Run(config, progress=progress, log=log or sys.stderr).run()
