"""The configs of ``trainer``: a table, a model, a training run (``recpipe train``'s options).

Plain dataclasses checked in ``__post_init__``, importing nothing heavy: ``recpipe train``
generates its options from them (:mod:`recpipe.config_cli`) without importing torch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from recpipe.errors import RecpipeError

__all__ = [
    "DEFAULT_LR",
    "ModelConfig",
    "OptimizerKind",
    "PoolingMode",
    "TableConfig",
    "TrainConfig",
    "default_threads",
    "metrics_format",
]

PoolingMode = Literal["sum", "mean"]
_POOLING: tuple[str, ...] = get_args(PoolingMode)

OptimizerKind = Literal["adagrad", "sgd", "adam"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerKind)
DEFAULT_LR: dict[str, float] = {"adagrad": 0.05, "sgd": 0.1, "adam": 1e-3}


@dataclass(frozen=True)
class TableConfig:
    """One embedding table and the features that look it up.

    Attributes:
        name: table name (unique in a collection).
        num_embeddings: rows of the table.
        dim: embedding dimension D.
        features: sparse features that read this table; several features may share it.
        pooling: how a bag of ids is pooled by ``trainer.modules.PooledEmbeddings``.
        hash_ids: take ids modulo ``num_embeddings`` in the module (for raw ids; leave off when
            preprocessing already mapped them into range, e.g. ``readers.HashModulo``).
        sparse_grad: produce sparse gradients for the table (only the rows looked up); the
            optimizer must accept them (SGD, Adagrad, SparseAdam).

    Raises:
        RecpipeError: a bad value, quoted.
    """

    name: str
    num_embeddings: int
    dim: int
    features: tuple[str, ...]
    pooling: PoolingMode = "sum"
    hash_ids: bool = False
    sparse_grad: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if not isinstance(self.name, str) or not self.name:
            msg = f"`name` must be a non-empty string, got {self.name!r}"
            raise RecpipeError(msg)
        for attr in ("num_embeddings", "dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"table {self.name!r}: `{attr}` must be a positive integer, got {value!r}"
                raise RecpipeError(msg)
        if not self.features or len(set(self.features)) != len(self.features):
            msg = (
                f"table {self.name!r}: `features` must name at least one feature, each once, "
                f"got {list(self.features)!r}"
            )
            raise RecpipeError(msg)
        if self.pooling not in _POOLING:
            msg = f"table {self.name!r}: `pooling` must be one of {list(_POOLING)}, got {self.pooling!r}"
            raise RecpipeError(msg)


@dataclass
class ModelConfig:
    """What DLRM to build from a schema.

    Attributes:
        embedding_dim: embedding dimension D of every table, of the bottom MLP output and of
            attention pooling.
        num_embeddings: rows of each default table (with ``hash_ids`` raw ids are taken modulo
            this).
        tables: explicit tables; ``None``: one table per sparse feature (see
            ``trainer.models.default_tables``). Tables may be shared by several features.
        hash_ids: default tables take ids modulo ``num_embeddings``; turn it off only when
            preprocessing already mapped every id into range (e.g. ``HashModulo``).
        pooling: pooling of the default tables' bags.
        bottom_mlp: hidden widths of the bottom MLP (its output width is ``embedding_dim``).
        top_mlp: hidden widths of the top MLP (its output is one logit).
        attention: the sequence features pooled by attention: ``auto`` (the user dedup group
            with the longest lists, among the groups of the dataset's schema as written: the
            groups a run reads with never change the model), ``none``, or a comma-separated
            list of features. A run shows and records the features ``auto`` resolved to.
        attention_heads: heads of the attention layers.
        attention_layers: encoder layers of the attention pooling.
        sparse_grad: tables produce sparse gradients (only the rows looked up).
        seed: init seed; the same seed builds the same parameters.
    """

    embedding_dim: int = 16
    num_embeddings: int = 100_000
    tables: tuple[TableConfig, ...] | None = None
    hash_ids: bool = True
    pooling: PoolingMode = "sum"
    bottom_mlp: tuple[int, ...] = (64,)
    top_mlp: tuple[int, ...] = (128, 64)
    attention: Literal["auto", "none"] | tuple[str, ...] = "auto"
    attention_heads: int = 2
    attention_layers: int = 1
    sparse_grad: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("embedding_dim", "num_embeddings", "attention_heads", "attention_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise RecpipeError(msg)
        for name in ("bottom_mlp", "top_mlp"):
            widths = tuple(getattr(self, name))
            if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
                msg = f"`{name}` must hold positive integer widths, got {list(widths)!r}"
                raise RecpipeError(msg)
            setattr(self, name, widths)
        if isinstance(self.attention, str):
            if self.attention not in ("auto", "none"):
                msg = (
                    f"`attention` must be 'auto', 'none' or a list of features, "
                    f"got {self.attention!r}"
                )
                raise RecpipeError(msg)
        else:
            self.attention = tuple(self.attention)
        if self.embedding_dim % self.attention_heads:
            msg = (
                f"`attention_heads` ({self.attention_heads}) must divide `embedding_dim` "
                f"({self.embedding_dim})"
            )
            raise RecpipeError(msg)
        if self.tables is not None:
            self.tables = tuple(self.tables)
            dims = {t.dim for t in self.tables}
            if dims != {self.embedding_dim}:
                msg = (
                    f"every table must have dim `embedding_dim` = {self.embedding_dim} "
                    f"(dot interaction), got dims {sorted(dims)}"
                )
                raise RecpipeError(msg)


@dataclass
class TrainConfig:
    """A training run (what ``recpipe train`` parses its options into).

    Attributes:
        dataset: clustered dataset directory; with ``service``, the one the server serves (its
            schema, and its sessions divided into training and held-out ones as the server
            divides them; the server reads both parts).
        dedup: deduplicate: read one IKJT per dedup group and run the embedding lookups and the
            attention on its unique rows (RecD O5-O7); off reads one plain KJT, which the
            model deduplicates as the readers do: the same losses, bit for bit on the CPU.
        dedup_groups: the dedup groups to read with, whatever the dataset was built with:
            ``auto`` (the groups ``recpipe stats`` proposes at ``batch_size``) or a TOML file
            with a ``[dedup]`` table like the schema's (default: the schema's groups). They
            change how batches are read, never the model (``attention`` ``auto`` is resolved
            from the schema's own groups); a ``service`` must serve the same ones.
        steps: total optimizer steps, a resumed run's earlier steps included (default: one
            epoch).
        epochs: passes over the training data (instead of ``steps``).
        batch_size: rows per batch.
        lr: learning rate (default: adagrad 0.05, sgd 0.1, adam 0.001).
        optimizer: optimizer of the tables (sparse rows) and of the dense parameters.
        eval_fraction: share of rows held out for evaluation: whole sessions, chosen by a hash
            of the session id (within one session of the fraction at any dataset size).
        eval_every: also evaluate every N steps (0: only at the end).
        eval_batches: most held-out batches per evaluation (default: all of them).
        device: cpu, cuda or cuda:N.
        checkpoint: write checkpoints into this directory (default: none).
        checkpoint_every: also checkpoint every N steps (0: only at the end).
        resume: continue from the checkpoint in ``checkpoint`` (it must hold one, written with
            the same model, optimizer, store, seed, held-out split, batch size and dataset).
        overwrite: replace the checkpoint ``checkpoint`` already holds (without it, or
            ``resume``, a run refuses a directory holding one).
        service: HOST:PORT of ``recpipe serve`` to read the training part and the held-out
            part from (it must make batches of ``batch_size`` rows).
        store: embedding tables as parameters (module) or in the hybrid embedding store
            (hybrid, ``trainer.store``).
        seed: seed of the model init, the shuffles and the held-out draw.
        workers: DataLoader worker processes.
        preprocess: the readers' preprocessing config (a TOML file).
        fitted: the fitted state of the preprocessing config's ``fit`` entries that ``recpipe
            fit --out FILE`` wrote (default: the one ``recpipe fit`` wrote into the dataset).
        model: the model config (its seed is replaced by ``seed``).
        log_window: batches in the running training AUC.
        log_every: compute the running training AUC (progress bar, metrics) every N steps.
        metrics: write one record per step and per evaluation to this file, CSV (``.csv``) or
            JSON Lines (``.jsonl``): step, epoch, samples, loss, AUC (every ``log_every``
            steps), samples/s, step time, dedup factor, peak memory; a resumed run keeps the
            records up to its checkpoint's step.
        tensorboard: also write those metrics as TensorBoard scalars into this directory (needs
            the tensorboard package).
        threads: torch threads of each process (default: the cores free for it: those it may
            run on, divided among the ranks of a node under ``--nproc``, less the machine's
            load; at least 1; see :func:`default_threads`).
        shuffle: shuffle the training part's row groups and sessions (seeded; the epoch is
            mixed in); held-out rows are read in order. With ``service`` the server shuffles
            as ``recpipe serve`` was told (its default: on).
        read_ahead: splits each reader decodes ahead in a second thread (0: none); the
            batches are the same either way.
        verify: how much of the files' bytes the readers check: ``pages`` (each Parquet
            page's checksum), ``full`` (also every file's sha256 against the manifest) or
            ``off``.
        on_error: a corrupt file or row group: ``raise`` it, or ``skip`` it and count it.
    """

    dataset: str
    dedup: bool = True
    dedup_groups: str | None = None
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
    overwrite: bool = False
    service: str | None = None
    store: Literal["module", "hybrid"] = "module"
    seed: int = 0
    workers: int = 0
    preprocess: str | None = None
    fitted: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    log_window: int = 50
    log_every: int = 10
    metrics: str | None = None
    tensorboard: str | None = None
    threads: int | None = None
    shuffle: bool = True
    read_ahead: int = 1
    verify: Literal["off", "pages", "full"] = "pages"
    on_error: Literal["raise", "skip"] = "raise"

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            msg = f"give `steps` or `epochs`, not both (got {self.steps!r} and {self.epochs!r})"
            raise RecpipeError(msg)
        for name in ("steps", "epochs", "batch_size", "log_window", "log_every", "threads"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise RecpipeError(msg)
        for name in ("eval_every", "checkpoint_every", "workers", "read_ahead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"`{name}` must be a non-negative integer, got {value!r}"
                raise RecpipeError(msg)
        if self.optimizer not in OPTIMIZERS:
            msg = f"`optimizer` must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}"
            raise RecpipeError(msg)
        if not 0.0 <= self.eval_fraction < 1.0:
            msg = f"`eval_fraction` must be in [0, 1), got {self.eval_fraction!r}"
            raise RecpipeError(msg)
        if self.verify not in ("off", "pages", "full"):
            msg = f"`verify` must be 'off', 'pages' or 'full', got {self.verify!r}"
            raise RecpipeError(msg)
        if self.on_error not in ("raise", "skip"):
            msg = f"`on_error` must be 'raise' or 'skip', got {self.on_error!r}"
            raise RecpipeError(msg)
        if self.store not in ("module", "hybrid"):
            msg = f"`store` must be 'module' or 'hybrid', got {self.store!r}"
            raise RecpipeError(msg)
        if self.lr is not None and (
            isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or not self.lr > 0
            or not math.isfinite(self.lr)
        ):  # fmt: skip
            msg = f"`lr` must be a finite number > 0, got {self.lr!r}"
            raise RecpipeError(msg)
        if self.resume and self.checkpoint is None:
            msg = "`resume` needs a `checkpoint` directory"
            raise RecpipeError(msg)
        if self.overwrite and self.checkpoint is None:
            msg = (
                "`overwrite` needs a `checkpoint` directory (the one whose checkpoint it replaces)"
            )
            raise RecpipeError(msg)
        if self.overwrite and self.resume:
            msg = "give `resume` or `overwrite`, not both: continue the checkpoint or replace it"
            raise RecpipeError(msg)
        if self.fitted is not None and self.preprocess is None:
            msg = f"`fitted` {self.fitted!r} needs the `preprocess` config it was fitted for"
            raise RecpipeError(msg)
        if self.metrics is not None:
            metrics_format(self.metrics)
        _check_device(self.device)


def default_threads(environ: Mapping[str, str] | None = None, *, load: float | None = None) -> int:
    """``threads`` when not given: the cores free for this process, at least 1.

    The cores it may run on (its CPU affinity, which a container or ``taskset`` narrows),
    divided among the processes of this node (``LOCAL_WORLD_SIZE``, set by torchrun for
    ``--nproc``), less their share of the machine's load (the 1-minute load average, ``load``,
    over ``os.cpu_count()`` CPUs): on a shared box whose cores are busy, torch's own default
    (a thread per core) ran several times slower than one thread, as threads wait for cores
    other processes hold; on an idle machine every core is used.

    >>> default_threads({"LOCAL_WORLD_SIZE": "1000000"}, load=0.0)
    1
    """
    environ = os.environ if environ is None else environ
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    busy = min(1.0, max(0.0, load / (os.cpu_count() or cores)))
    return max(1, min(cores // local, math.floor(cores * (1.0 - busy))))


def metrics_format(path: str | os.PathLike[str]) -> str:
    """``"csv"`` or ``"jsonl"``: the format a metrics file's suffix names.

    Raises:
        RecpipeError: another suffix.

    >>> metrics_format("runs/metrics.jsonl")
    'jsonl'
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in (".csv", ".jsonl"):
        msg = f"`metrics` must name a .csv or .jsonl file, got {os.fspath(path)!r}"
        raise RecpipeError(msg)
    return suffix[1:]


def _check_device(device: object) -> None:
    """``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has."""
    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", device) if isinstance(device, str) else None
    if match is None:
        msg = f"`device` must be cpu, cuda or cuda:N, got {device!r}"
        raise RecpipeError(msg)
    if device == "cpu":
        return
    import torch  # only for a CUDA device: parsing options must not import torch

    if not torch.cuda.is_available():
        msg = f"`device` is {device!r} but CUDA is not available here"
        raise RecpipeError(msg)
    index = match.group(1)
    if index is not None and int(index) >= torch.cuda.device_count():
        msg = f"`device` is {device!r} but this machine has {torch.cuda.device_count()} GPU(s)"
        raise RecpipeError(msg)
