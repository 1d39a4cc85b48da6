"""The value types of the embedding store: its settings, a prefetch's locations, its counters.

Imported by every part of the store (cache, hot set, checkpoint writer, facade), so it imports
none of them; torch only for type hints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from recpipe.errors import StoreError

if TYPE_CHECKING:
    import torch

__all__ = [
    "OPTIMIZERS",
    "Locations",
    "Optimizer",
    "StoreConfig",
    "StoreStats",
    "SyncMode",
    "state_dim",
    "store_optimizer",
]

Optimizer = Literal["sgd", "rowwise_adagrad", "adam"]
SyncMode = Literal["full", "process"]
OPTIMIZERS: tuple[str, ...] = ("sgd", "rowwise_adagrad", "adam")
_OF_FLAG = {"sgd": "sgd", "adagrad": "rowwise_adagrad", "adam": "adam"}


def state_dim(optimizer: str, dim: int) -> int:
    """Floats of optimizer state kept beside each row's ``dim`` values: none (SGD), row-wise
    Adagrad's accumulator (1), Adam's first and second moments (``2 * dim``: m then v)."""
    return {"sgd": 0, "rowwise_adagrad": 1, "adam": 2 * dim}[optimizer]


def store_optimizer(flag: str) -> Optimizer:
    """The store's optimizer for ``--optimizer`` ``flag``: ``sgd``, ``rowwise_adagrad`` for
    ``adagrad`` (row-wise in every backend), ``adam`` (``SparseAdam``'s lazy Adam)."""
    if flag not in _OF_FLAG:
        msg = f"`optimizer` must be one of {sorted(_OF_FLAG)}, got {flag!r}"
        raise StoreError(msg)
    return _OF_FLAG[flag]  # type: ignore[return-value]


@dataclass
class StoreConfig:
    """Settings of an :class:`~trainer.store.EmbeddingStore`.

    Attributes:
        dim: embedding dimension D.
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` (fbgemm's row-wise Adagrad) or ``"adam"``
            (torch's ``SparseAdam``, :func:`trainer.optim.sparse_adam_`; its moments are kept
            beside each row, its step count with the store's checkpoints).
        lr: learning rate.
        eps: Adagrad's or Adam's epsilon.
        seed: seed of the deterministic row init.
        init_scale: new rows are uniform(-init_scale, init_scale).
        chunk_rows: rows per chunk of the home file (it grows by whole chunks).
        cache_rows: host memory budget in rows (None: unbounded).
        num_shards: shards of the id index (a power of two).
        pin_window: a prefetch's rows stay pinned for this many prefetches.
        count_batches: batches over which access frequencies are counted for the hot set.
        hot_budget_rows: most rows the hot set may hold (device memory budget).
        device: the training device (hot set and pulled rows live there).
        sync: ``"full"`` fsyncs (durable against power loss), ``"process"`` only survives a
            killed process.
    """

    dim: int
    optimizer: Optimizer = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    seed: int = 0
    init_scale: float = 0.05
    chunk_rows: int = 16384
    cache_rows: int | None = None
    num_shards: int = 16
    pin_window: int = 2
    count_batches: int = 100
    hot_budget_rows: int = 65536
    device: str = "cpu"
    sync: SyncMode = "full"

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise StoreError(f"`dim` must be >= 1, got {self.dim!r}")
        if self.optimizer not in OPTIMIZERS:
            msg = f"`optimizer` must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}"
            raise StoreError(msg)
        if not self.lr > 0:
            raise StoreError(f"`lr` must be > 0, got {self.lr!r}")
        if not self.eps > 0:
            raise StoreError(f"`eps` must be > 0, got {self.eps!r}")
        if self.chunk_rows < 1:
            raise StoreError(f"`chunk_rows` must be >= 1, got {self.chunk_rows!r}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise StoreError(f"`cache_rows` must be >= 1 or None, got {self.cache_rows!r}")
        if self.pin_window < 1:
            raise StoreError(f"`pin_window` must be >= 1, got {self.pin_window!r}")
        if self.count_batches < 0 or self.hot_budget_rows < 0:
            msg = (
                f"`count_batches` and `hot_budget_rows` must be >= 0, got "
                f"{self.count_batches!r} and {self.hot_budget_rows!r}"
            )
            raise StoreError(msg)
        if self.sync not in ("full", "process"):
            raise StoreError(f"`sync` must be 'full' or 'process', got {self.sync!r}")


@dataclass(frozen=True)
class Locations:
    """Where the unique ids of one prefetch live. Made by :meth:`EmbeddingStore.prefetch`.

    Attributes:
        inverse: int64 [n] position of each id given to ``prefetch`` among the U unique rows.
        num_unique: U.
        cold_pos: int64 [Uc] positions (among U) of rows in host memory; None if all are.
        cold_slots: int64 [Uc] their cache slots (CPU).
        hot_pos: int64 [Uh] positions of hot rows (device); None when there are none.
        hot_idx: int64 [Uh] their index in the hot tensor (device).
        hot_idx_cpu: the same on the CPU (marks rows dirty).
        seq: the prefetch's sequence number.
        generation: the hot-set generation the locations belong to.
    """

    inverse: torch.Tensor
    num_unique: int
    cold_pos: torch.Tensor | None
    cold_slots: torch.Tensor
    hot_pos: torch.Tensor | None
    hot_idx: torch.Tensor | None
    hot_idx_cpu: np.ndarray | None
    seq: int
    generation: int

    @classmethod
    def build(
        cls,
        inverse: np.ndarray,
        slots: np.ndarray,
        hot: np.ndarray | None,
        cold: np.ndarray | None,
        *,
        seq: int,
        generation: int,
        device: torch.device,
    ) -> Locations:
        """The locations of U unique rows: ``slots`` [U] their cache slots (-1 for hot rows),
        ``hot`` [U] their hot index, ``cold`` [U] which are not hot (both None: none is hot)."""
        import torch

        inv = torch.from_numpy(inverse)
        n_unique = slots.size
        if cold is None or cold.all():
            cold_slots = slots if cold is None else slots[cold]
            return cls(
                inv, n_unique, None, torch.from_numpy(cold_slots), None, None, None, seq, generation
            )
        pos = np.arange(n_unique, dtype=np.int64)
        hot_idx = hot[~cold]
        return cls(
            inverse=inv,
            num_unique=n_unique,
            cold_pos=torch.from_numpy(pos[cold]),
            cold_slots=torch.from_numpy(slots[cold]),
            hot_pos=torch.from_numpy(pos[~cold]).to(device),
            hot_idx=torch.from_numpy(hot_idx).to(device),
            hot_idx_cpu=hot_idx,
            seq=seq,
            generation=generation,
        )


@dataclass
class StoreStats:
    """Counters and sizes of a store (see :meth:`EmbeddingStore.stats`)."""

    rows: int
    rows_committed: int
    chunks: int
    cache_capacity: int
    cached_rows: int
    hot_rows: int
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    new_rows: int = 0
    hot_lookups: int = 0
    evictions: int = 0
    written_back: int = 0
    checkpoints: int = 0
    last_checkpoint_step: int = -1
    index_bytes: int = 0
    cache_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def miss_rate(self) -> float:
        """Share of cold lookups of existing rows that had to read the home file."""
        existing = self.hits + self.misses
        return self.misses / existing if existing else 0.0
