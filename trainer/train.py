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

import os
import random
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recpipe.errors import DataError, RecpipeError
from trainer.metrics import PredictionWindow, auc, peak_memory_bytes
from trainer.models import DLRM, ModelConfig
from trainer.modules import ParameterTable, TableConfig, table_seed

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = [
    "EvalResult",
    "OptimizerKind",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "batch_dedup_factor",
    "format_summary",
    "holdout_splits",
    "make_optimizers",
    "train",
]

OptimizerKind = Literal["adagrad", "sgd", "adam"]
_OPTIMIZERS: tuple[str, ...] = ("adagrad", "sgd", "adam")
DEFAULT_LR: dict[str, float] = {"adagrad": 0.05, "sgd": 0.1, "adam": 1e-3}
CHECKPOINT_FILE = "checkpoint.pt"
_CHECKPOINT_VERSION = 1


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
    if kind not in _OPTIMIZERS:
        msg = f"`optimizer` must be one of {list(_OPTIMIZERS)}, got {kind!r}"
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
# data: held-out row groups, loaders


def holdout_splits(
    splits: Sequence[Any], *, session_key: str, fraction: float, seed: int
) -> tuple[list[Any], list[Any]]:
    """Divide row groups into training and held-out ones, never splitting a session.

    ``round(fraction * n)`` row groups are drawn with ``seed``; a drawn row group whose first or
    last session also begins or ends a training row group (a session longer than a row group)
    goes back to training, so no held-out row belongs to a training session.

    Args:
        splits: the dataset's splits (``readers.source.Split``: ``path``, ``row_group``).
        session_key: the session column.
        fraction: share of row groups to hold out, in [0, 1).
        seed: the draw's seed.

    Returns:
        ``(train, held_out)``, each in dataset order.

    Raises:
        DataError: a non-zero fraction with fewer than two row groups.
    """
    import pyarrow.parquet as pq

    if not 0.0 <= fraction < 1.0:
        msg = f"`eval_fraction` must be in [0, 1), got {fraction!r}"
        raise DataError(msg)
    splits = list(splits)
    if fraction == 0:
        return splits, []
    if len(splits) < 2:
        msg = (
            f"`eval_fraction` {fraction} needs at least two row groups, the dataset has "
            f"{len(splits)}; use --eval-fraction 0 or rebuild with a smaller --row-group-size"
        )
        raise DataError(msg)
    n_eval = min(max(round(fraction * len(splits)), 1), len(splits) - 1)
    chosen = set(np.random.default_rng([seed, 0xE7A1]).permutation(len(splits))[:n_eval].tolist())
    ends: list[tuple[Any, Any]] = []
    files: dict[str, Any] = {}
    for s in splits:
        pf = files.get(s.path) or files.setdefault(s.path, pq.ParquetFile(s.path))
        col = pf.read_row_group(s.row_group, columns=[session_key]).column(0)
        ends.append((col[0].as_py(), col[-1].as_py()) if len(col) else (None, None))
    train_ends = {e for i, pair in enumerate(ends) if i not in chosen for e in pair}
    held = [i for i in sorted(chosen) if not ({*ends[i]} - {None}) & train_ends]
    held_set = set(held)
    return [s for i, s in enumerate(splits) if i not in held_set], [splits[i] for i in held]


class _ServiceStream:
    """Batches from ``recpipe serve`` with a resumable position (epoch, batches consumed)."""

    def __init__(self, address: str, *, token: str | None) -> None:
        from readers.service import ServiceDataset

        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            msg = f"`service` must be HOST:PORT, got {address!r}"
            raise DataError(msg)
        self.dataset = ServiceDataset(host, int(port), token=token)
        self.epoch = 0
        self.batches = 0

    def __iter__(self) -> Iterator[Batch]:
        self.dataset.set_epoch(self.epoch)
        skip = self.batches
        for i, batch in enumerate(self.dataset):
            if i < skip:
                continue
            self.batches = i + 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"service_epoch": self.epoch, "service_batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["service_epoch"])
        self.batches = int(state["service_batches"])

    @property
    def current_epoch(self) -> int:
        return self.epoch


# -------------------------------------------------------------------------------------------
# the whole run


@dataclass
class TrainConfig:
    """A training run (what ``recpipe train`` parses its options into).

    Args:
        dataset: the clustered dataset; with ``service`` it is the evaluation data (and the
            schema), the server reading the training data.
        dedup: read IKJTs per dedup group (``False``: one plain KJT, same model).
        steps: optimizer steps in total (a resumed run counts the steps already done);
            ``None`` with ``epochs`` None means one epoch.
        epochs: passes over the training splits (instead of ``steps``).
        batch_size: rows per batch.
        lr: learning rate (default per optimizer).
        optimizer: ``"adagrad"``, ``"sgd"`` or ``"adam"``.
        eval_fraction: share of row groups held out for evaluation.
        eval_every: evaluate every this many steps too (0: only at the end).
        eval_batches: most held-out batches per evaluation (``None``: all).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        checkpoint: checkpoint directory (``None``: no checkpoints).
        checkpoint_every: also checkpoint every this many steps (0: only at the end).
        resume: continue from the checkpoint in ``checkpoint`` when there is one.
        service: ``HOST:PORT`` of ``recpipe serve`` to read training batches from.
        store: ``"module"`` (tables are parameters) or ``"hybrid"`` (the embedding store of
            :mod:`trainer.store`).
        seed: seeds the model init, the shuffles and the held-out draw.
        workers: DataLoader worker processes.
        preprocess: a preprocessing config for the readers (``readers.transforms``).
        model: the model config (its seed is replaced by ``seed``).
        log_window: batches in the running training AUC.
    """

    dataset: str
    dedup: bool = True
    steps: int | None = None
    epochs: int | None = None
    batch_size: int = 4096
    lr: float | None = None
    optimizer: OptimizerKind = "adagrad"
    eval_fraction: float = 0.1
    eval_every: int = 0
    eval_batches: int | None = None
    device: str = "cpu"
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    service: str | None = None
    store: Literal["module", "hybrid"] = "module"
    seed: int = 0
    workers: int = 0
    preprocess: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    log_window: int = 50

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            msg = f"give `steps` or `epochs`, not both (got {self.steps!r} and {self.epochs!r})"
            raise RecpipeError(msg)
        for name in ("steps", "epochs", "batch_size"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise RecpipeError(msg)
        for name in ("eval_every", "checkpoint_every", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"`{name}` must be a non-negative integer, got {value!r}"
                raise RecpipeError(msg)
        if self.optimizer not in _OPTIMIZERS:
            msg = f"`optimizer` must be one of {list(_OPTIMIZERS)}, got {self.optimizer!r}"
            raise RecpipeError(msg)
        if not 0.0 <= self.eval_fraction < 1.0:
            msg = f"`eval_fraction` must be in [0, 1), got {self.eval_fraction!r}"
            raise RecpipeError(msg)
        if self.store not in ("module", "hybrid"):
            msg = f"`store` must be 'module' or 'hybrid', got {self.store!r}"
            raise RecpipeError(msg)
        if self.resume and self.checkpoint is None:
            msg = "`resume` needs a `checkpoint` directory"
            raise RecpipeError(msg)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            msg = f"`device` is {self.device!r} but CUDA is not available here"
            raise RecpipeError(msg)


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


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _model_config(config: TrainConfig) -> ModelConfig:
    from dataclasses import replace

    return replace(config.model, seed=config.seed)


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
        self.losses: list[float] = []
        self.samples = 0
        self.evals: list[tuple[int, EvalResult]] = []
        self.window = PredictionWindow(config.log_window)
        self.resumed_from: int | None = None
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
        if cfg.service is not None:
            self.loader: Any = _ServiceStream(cfg.service, token=os.environ.get("RECPIPE_TOKEN"))
            self.train_splits, self.eval_splits = 0, len(self.eval_ds.source.splits)
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

    def _loader_epoch(self) -> int:
        if isinstance(self.loader, _ServiceStream):
            return self.loader.current_epoch
        return self.loader.dataset.epoch

    def _eval_batches(self) -> Iterator[Batch]:
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
        return None if c is None else Path(c) / CHECKPOINT_FILE

    def save(self) -> Path | None:
        path = self.checkpoint_path
        if path is None:
            return None
        if self.saved_step == self.trainer.step:  # the last in-loop checkpoint, at the end
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        # every store commits this step, then the rest is saved: after a crash in between the
        # stores are ahead of the state file, and resuming rolls them back (open_store(step=))
        for store in self.stores:
            store.checkpoint(self.trainer.step)
        state = {
            "version": _CHECKPOINT_VERSION,
            "trainer": self.trainer.state_dict(),
            "reader": self.loader.state_dict(),
            "rng": _rng_state(),
            "losses": self.losses,
            "samples": self.samples,
            "evals": [(s, asdict(e)) for s, e in self.evals],
            "config": {k: v for k, v in asdict(self.config).items() if k != "model"},
            "model_config": asdict(self.config.model),
        }
        _save_atomic(state, path)
        self.saved_step = self.trainer.step
        return path

    def _read_checkpoint(self) -> dict[str, Any] | None:
        """The saved training state, or ``None`` when there is no checkpoint file yet."""
        path = self.checkpoint_path
        if path is None or not path.is_file():
            return None
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
        except Exception as exc:  # a truncated or foreign file
            msg = f"{path}: cannot read the checkpoint: {exc}"
            raise RecpipeError(msg) from exc
        if not isinstance(state, dict) or state.get("version") != _CHECKPOINT_VERSION:
            msg = f"{path}: not a recpipe training checkpoint (version {_CHECKPOINT_VERSION})"
            raise RecpipeError(msg)
        return state

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
        _set_rng_state(state["rng"])
        self.losses = list(state["losses"])
        self.samples = int(state["samples"])
        self.evals = [(s, EvalResult(**e)) for s, e in state["evals"]]
        self.resumed_from = self.saved_step = self.trainer.step
        return True

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg = self.config
        if cfg.resume:
            self.restore()
        target_steps = cfg.steps
        target_epochs = cfg.epochs if cfg.steps is None else None
        if target_steps is None and target_epochs is None:
            target_epochs = 1
        start_step = self.trainer.step
        bar = tqdm(
            total=target_steps,
            initial=start_step,
            unit="step",
            desc="train",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        t0 = time.perf_counter()
        samples0 = self.samples
        factors: list[float] = []
        done = self._finished(target_steps, target_epochs)
        empty_passes = 0
        try:
            while not done:
                empty_passes += 1
                for batch in self.loader:
                    empty_passes = 0
                    factors.append(batch_dedup_factor(batch))
                    loss, logits = self.trainer.train_step(batch)
                    self.losses.append(float(loss))
                    self.samples += batch.batch_size
                    self.window.add(logits, batch.labels)
                    step = self.trainer.step
                    bar.update(1)
                    if step % 10 == 0 or step == target_steps:
                        rate = (self.samples - samples0) / max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix(
                            loss=f"{np.mean(self.losses[-20:]):.4f}",
                            auc=f"{self.window.auc():.3f}",
                            sps=f"{rate:,.0f}",
                            mem=_fmt_bytes(peak_memory_bytes(self.device)),
                            refresh=False,
                        )
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
            if not self.evals or self.evals[-1][0] != self.trainer.step:
                self._evaluate(self.trainer.step)
            path = self.save()
        finally:
            bar.close()
            for store in self.stores:
                store.close()
        done_samples = self.samples - samples0
        return TrainResult(
            steps=self.trainer.step,
            samples=self.samples,
            losses=self.losses,
            train_auc=self.window.auc(),
            evals=self.evals,
            samples_per_s=done_samples / wall if wall > 0 else float("nan"),
            peak_memory_bytes=peak_memory_bytes(self.device),
            dedup_factor=float(np.mean(factors)) if factors else 1.0,
            wall_s=wall,
            checkpoint=None if path is None else str(path),
            resumed_from=self.resumed_from,
            train_splits=self.train_splits,
            eval_splits=self.eval_splits,
        )

    def _finished(self, target_steps: int | None, target_epochs: int | None) -> bool:
        if target_steps is not None:
            return self.trainer.step >= target_steps
        return self._loader_epoch() >= target_epochs

    def _evaluate(self, step: int) -> None:
        result = self.trainer.evaluate(self._eval_batches(), max_batches=self.config.eval_batches)
        if result.samples:
            self.evals.append((step, result))


def train(config: TrainConfig, *, progress: bool = True, log: TextIO | None = None) -> TrainResult:
    """Train a DLRM on a clustered dataset (see :class:`TrainConfig`).

    Args:
        config: the run.
        progress: show a tqdm progress bar on stderr.
        log: where messages go (default stderr).

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
