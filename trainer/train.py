"""``recpipe train`` in one process: the model, its optimizers and the step (:class:`Trainer`,
driven by the one loop of :mod:`trainer.loop` as :class:`LocalEngine`), dedup on or off.

::

    clustered dataset --(session hash)--> train rows | held-out rows (whole sessions)
    train rows -> the run's stream (trainer.streams: global batches, IKJTs when dedup)
               -> DLRM -> BCE loss -> optimizers (sparse rows + dense)   [--steps | --epochs]
    every --checkpoint-every steps and at the end: model, optimizers, reader position, RNG
    at the end (and every --eval-every steps): loss and AUC on the held-out rows

``--dedup off`` reads the same batches as one plain KJT and runs the same model: the losses
agree with ``--dedup on``. A checkpoint is taken at a step boundary and resuming from it
continues exactly as if training had not stopped; a multi-rank job's checkpoint resumes here
too (its engine on a world of one, :func:`train`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from readers.holdout import holdout_splits
from recpipe.errors import RecpipeError
from trainer.checkpoint import (
    check_resume,
    checkpoint_file,
    claim_checkpoint,
    global_batch_change,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import (
    DEFAULT_LR,
    OPTIMIZERS,
    ModelConfig,
    OptimizerKind,
    TableConfig,
    TrainConfig,
)
from trainer.exact import ExactDense, global_batch_norms
from trainer.idplan import plan_batch
from trainer.metrics import (
    auc,
)
from trainer.models import DLRM
from trainer.modules import ParameterTable, PlannedTable, dedup_batch, table_seed
from trainer.optim import RowwiseAdagrad
from trainer.runlog import (
    EvalResult,
    TrainResult,
    divergence_hint,
)

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = [
    "LocalEngine",
    "OptimizerKind",
    "TrainConfig",
    "Trainer",
    "evaluate_batches",
    "holdout_splits",
    "make_optimizers",
    "model_config",
    "read_schema",
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
    """Optimizers for a model: one for its parameter tables, one for everything else.

    ``adagrad``: row-wise Adagrad for the tables (:class:`trainer.optim.RowwiseAdagrad`, what
    the store and sharded tables run) and torch's Adagrad for the dense part; ``sgd``: SGD for
    both; ``adam``: ``SparseAdam`` for the sparse-gradient tables, ``Adam`` for the rest.

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
    tables = [m for m in model.modules() if isinstance(m, ParameterTable)]
    if kind == "adam":  # SparseAdam takes sparse gradients only
        tables = [m for m in tables if m.config.sparse_grad]
    sparse = [m.weight for m in tables]
    seen = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in seen and p.requires_grad]
    out: list[torch.optim.Optimizer] = []
    if kind == "adagrad":
        if sparse:
            out.append(RowwiseAdagrad(sparse, lr=lr))
        if dense:
            out.append(torch.optim.Adagrad(dense, lr=lr))
        return out
    if kind == "sgd":
        make_sparse = make_dense = torch.optim.SGD
    else:
        make_sparse, make_dense = torch.optim.SparseAdam, torch.optim.Adam
    if sparse:
        out.append(make_sparse(sparse, lr=lr))
    if dense:
        out.append(make_dense(dense, lr=lr))
    return out


@torch.no_grad()
def evaluate_batches(
    logits_of: Callable[[Batch], torch.Tensor],
    batches: Iterable[Batch],
    *,
    device: torch.device,
    max_batches: int | None = None,
) -> EvalResult:
    """Loss and AUC over ``batches`` (at most ``max_batches``), each scored by ``logits_of``
    (the caller puts its model in eval mode). Ranks that all score the same batches (collective
    lookups) each get the whole result, with no gather."""
    scores, labels, total, n = [], [], 0.0, 0
    count = 0
    for batch in batches:
        if max_batches is not None and count >= max_batches:
            break
        batch = batch.to(device, non_blocking=True)
        logits = logits_of(batch)
        y = batch.labels.to(logits.dtype)
        total += float(F.binary_cross_entropy_with_logits(logits, y, reduction="sum"))
        n += y.numel()
        scores.append(logits.cpu())
        labels.append(y.cpu())
        count += 1
    if n == 0:
        return EvalResult(float("nan"), float("nan"), 0, 0)
    return EvalResult(total / n, auc(torch.cat(scores), torch.cat(labels)), n, count)


class Trainer:
    """A model, its optimizers and the training step; device-agnostic.

    Args:
        model: a model mapping a :class:`~recpipe.batch.Batch` to ``[B]`` logits.
        optimizer: ``"adagrad"``, ``"sgd"`` or ``"adam"``.
        lr: learning rate (default per optimizer).
        device: where the model runs; batches are moved there.
        exact_dense: every dense gradient a float64 sum over the rows, rounded once, and batch
            norm's statistics summed in float64 (:mod:`trainer.exact`), the step's loss a
            float64 sum over the rows: what ``recpipe train`` does in one process and on W
            ranks unless ``--fast-dense``, so the two train the same model (``False``: torch's
            float32 autograd, faster).

    Table modules with an ``optimizer_step()`` method (store-backed tables, which are not
    ``nn.Parameter`` s) are stepped after the torch optimizers. When the tables read id plans
    (:class:`~trainer.modules.PlannedTable`: the store's tables), each batch is planned once
    (:func:`trainer.idplan.plan_batch`, as the model deduplicates it) when it reaches the
    device, and the model runs on the batch with its plan.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerKind = "adagrad",
        lr: float | None = None,
        device: torch.device | str = "cpu",
        exact_dense: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.exact: ExactDense | None = None
        if exact_dense:
            global_batch_norms(self.model, None)
            self.exact = ExactDense(self.model)
        self.optimizers = make_optimizers(self.model, optimizer, lr=lr)
        self._extra_steps = [m for m in self.model.modules() if hasattr(m, "optimizer_step")]
        self._planned = [m.config for m in self.model.modules() if isinstance(m, PlannedTable)]
        self.step = 0

    def _plan(self, batch: Batch) -> Batch:
        """``batch`` with its id plan when the tables read plans."""
        if not self._planned:
            return batch
        groups = getattr(self.model, "dedup_groups", ())
        partial = getattr(self.model, "dedup_partial", ())
        if groups or partial:  # the lookups the model's collections make
            batch = dedup_batch(batch, groups, partial)
        return plan_batch(batch, self._planned)  # the store locates rows on the CPU

    def train_step(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on ``batch``; returns the (detached) loss and logits."""
        self.model.train()
        batch = self._plan(batch.to(self.device, non_blocking=True))
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        logits = self.model(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.dtype))
        loss.backward()
        if self.exact is not None:
            self.exact.reduce()
            loss = F.binary_cross_entropy_with_logits(  # the loss as the gradients: float64
                logits.detach().to(torch.float64), batch.labels.to(torch.float64)
            )
        # the sparse gradients come from torch's own embedding ops: skip re-checking them
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            for opt in self.optimizers:
                opt.step()
        for module in self._extra_steps:
            module.optimizer_step()
        self.step += 1
        return loss.detach(), logits.detach()

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None = None) -> EvalResult:
        """Loss and AUC over ``batches`` (at most ``max_batches``)."""
        self.model.eval()
        return evaluate_batches(
            lambda batch: self.model(self._plan(batch)),
            batches, device=self.device, max_batches=max_batches,
        )  # fmt: skip

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


class LocalEngine:
    """One process's step engine (:class:`trainer.loop.StepEngine`): a :class:`Trainer` over
    parameter tables, or over hybrid-store tables (``store="hybrid"``).

    Args:
        config: the run (its model resolved).
        schema: the schema it reads and builds the model with.
        resume_state: the checkpoint the run resumes (the stores reopen at its step).
        exact_dense: exact dense gradients (see :class:`Trainer`).
    """

    world_size = 1
    writer = True

    def __init__(
        self, config: TrainConfig, schema: DatasetSchema, *,
        resume_state: dict[str, Any] | None, exact_dense: bool = True,
    ) -> None:  # fmt: skip
        self.config, self.schema = config, schema
        self.device = torch.device(config.device)
        self.resume_state = resume_state
        self.stores: list[Any] = []
        table_factory = self._store_factory() if config.store == "hybrid" else None
        model = DLRM.from_schema(schema, model_config(config), table_factory=table_factory)
        self.trainer = Trainer(model, optimizer=config.optimizer, lr=config.lr,
                               device=self.device, exact_dense=exact_dense)  # fmt: skip
        self._losses: list[float] = []

    @property
    def step(self) -> int:
        return self.trainer.step

    # -- the step -----------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> torch.Tensor:
        loss, logits = self.trainer.train_step(batch)
        self._losses.append(float(loss))
        return logits

    def pending_losses(self) -> list[float]:
        losses, self._losses = self._losses, []
        return losses

    def after_step(self) -> float:
        return 0.0

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None) -> EvalResult:
        return self.trainer.evaluate(batches, max_batches=max_batches)

    # -- hybrid store --------------------------------------------------------------------------
    def _store_factory(self) -> Any:
        cfg = self.config
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
                checkpoint = checkpoint_file(cfg.checkpoint)
                st = StoreTable.resume(
                    path, table, step=at, lr=lr, device=device, checkpoint=checkpoint
                )
            else:  # claim_checkpoint removed an old store (--overwrite) or refused the run
                st = StoreTable.create(
                    path,
                    table,
                    optimizer=cfg.optimizer,
                    lr=lr,
                    seed=table_seed(seed, table.name),
                    device=device,
                )
            self.stores.append(st.store)
            return st

        return factory

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, state: dict[str, Any]) -> Path:
        cfg = self.config
        assert cfg.checkpoint is not None
        path = checkpoint_file(cfg.checkpoint)
        self._check_finite()
        step = self.trainer.step
        # every store commits this step (all at once), then the rest is saved: after a crash in
        # between the stores are ahead of the state file, and resuming rolls them back
        if self.stores:
            from trainer.store.checkpoints import checkpoint_stores

            checkpoint_stores(self.stores, step)
        layout = {"kind": "local", "world_size": 1, "store": cfg.store}
        save_checkpoint({"trainer": self.trainer.state_dict(), "layout": layout, **state}, path)
        return path

    def _check_finite(self) -> None:
        """Refuse to save a model with a non-finite parameter (the rows in stores aside)."""
        for name, param in self.trainer.model.named_parameters():
            if not bool(torch.isfinite(param).all()):
                msg = (
                    f"step {self.trainer.step}: the model's {name} is not finite; it is not "
                    f"saved{divergence_hint(self.config, None)}"
                )
                raise RecpipeError(msg)

    def restore(self, state: dict[str, Any]) -> None:
        path = checkpoint_file(self.config.checkpoint or ".")
        for store in self.stores:
            at = store.stats().last_checkpoint_step
            if at != state["trainer"]["step"]:
                msg = (
                    f"{path}: the checkpoint is at step {state['trainer']['step']} but the "
                    f"embedding store under {store.root} at step {at}"
                )
                raise RecpipeError(msg)
        self.trainer.load_state_dict(state["trainer"])

    def close(self, *, failing: bool) -> None:
        del failing
        for store in self.stores:
            store.close()


def layout_refusal(
    state: Mapping[str, Any], *, path: Path, world_size: int, towers: bool = False
) -> str | None:
    """Why a checkpoint written in another layout cannot resume in this one (``None``: it
    can, as far as the layout goes; a towers engine then checks the plan and ranks itself).
    ``towers``: this run trains towers. A multi-rank job's checkpoint resumes in one process
    through its own engine (``recpipe train`` does that), not through :func:`train`."""
    kind = state.get("kind") or (state.get("layout") or {}).get("kind", "local")
    if towers != (kind == "towers"):
        was = "a towers run" if kind == "towers" else "a run without towers"
        fix = "with `--towers` and its plan" if kind == "towers" else "without `--towers`"
        return f"{path}: written by {was}; resume it {fix}, or start afresh with --overwrite"
    if kind == "distributed" and world_size == 1 and not towers:
        return (
            f"{path}: written by a {state.get('world_size')}-rank job; `recpipe train --resume` "
            "continues it in one process (the job's engine on a world of one: "
            "trainer.distributed.run.train_rank with Comm.single), or at any `--nproc`"
        )
    if kind == "local" and world_size > 1:
        return (
            f"{path}: written by one process (its tables are whole parameter tables, not "
            f"sharded rows); resume it without `--nproc`, or start afresh with --overwrite"
        )
    return None


def train(
    config: TrainConfig, *, progress: bool = True, log: TextIO | None = None,
    exact_dense: bool = True,
) -> TrainResult:  # fmt: skip
    """Train a DLRM on a clustered dataset (see :class:`TrainConfig`).

    Args:
        config: the run.
        progress: show a tqdm progress bar on stderr (with a total and an ETA when the number
            of steps is known: ``steps``, or ``epochs`` read in-process).
        log: unused, kept for callers that pass it; messages go to the ``logging`` module
            (logger ``trainer.train``), which the ``recpipe`` command configures.
        exact_dense: exact dense gradients, as a multi-rank run's (the default; ``False`` is
            ``--fast-dense``: torch's float32 autograd, see :class:`Trainer`).

    Returns:
        The run's :class:`TrainResult`; :func:`trainer.runlog.format_summary` renders it.
    """
    from trainer.loop import run_loop
    from trainer.streams import open_stream

    config = resolve_model(config)
    set_threads(config)
    with claim_checkpoint(config.checkpoint, resume=config.resume, overwrite=config.overwrite):
        schema = read_schema(config)
        state = None
        if config.resume and config.checkpoint is not None:
            path = checkpoint_file(config.checkpoint)
            state = load_checkpoint(path, map_location=config.device)
        if state is not None:
            why = layout_refusal(state, path=path, world_size=1)
            if why is not None:
                raise RecpipeError(why)
            _saved_attention_resolved(state, schema)
            check_resume(state, config, path=path)
            if (note := global_batch_change(state, config, path=path)) is not None:
                _log.warning("%s", note)
        engine = LocalEngine(config, schema, resume_state=state, exact_dense=exact_dense)
        stream = open_stream(config, schema, device=engine.device)
        _log.info(
            "training on %s: %d row groups with training rows, %d with held-out rows; dedup %s",
            config.dataset if config.service is None else config.service, *stream.splits,
            "on" if config.dedup else "off",
        )  # fmt: skip
        return run_loop(config, engine, stream, resume_state=state, progress=progress)
