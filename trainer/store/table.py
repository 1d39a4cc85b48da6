"""A model's embedding table kept in an embedding store (``recpipe train --store hybrid``).

:class:`StoreTable` is the table backend the trainer's models use when a table's rows live in
an :class:`~trainer.store.EmbeddingStore` instead of a parameter; :meth:`StoreTable.create` and
:meth:`StoreTable.resume` make or reopen its store.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from recpipe.errors import StoreError
from trainer.modules import table_ids
from trainer.store.config import StoreConfig, store_optimizer
from trainer.store.module import StoreEmbeddingBag
from trainer.store.store import EmbeddingStore, open_store

if TYPE_CHECKING:
    from trainer.modules import PoolingMode, TableConfig

__all__ = ["StoreTable"]


class StoreTable(nn.Module):
    """A table backend over :class:`~trainer.store.EmbeddingStore` (see
    :class:`trainer.modules.TableBackend`).

    Ids are read through :func:`trainer.modules.table_ids` (taken modulo ``num_embeddings``
    with ``hash_ids``, as in every backend; without it the store's id index grows); gradients are
    pushed to the store in backward and applied by :meth:`optimizer_step` (``store.update()``),
    which :class:`trainer.train.Trainer` calls after the torch optimizers.

    Args:
        config: the table (``num_embeddings`` only sets the init scale).
        store: the store holding its rows.
    """

    def __init__(self, config: TableConfig, store: EmbeddingStore) -> None:
        super().__init__()
        self.config = config
        self.store = store
        self.bags = nn.ModuleDict({m: StoreEmbeddingBag(store, mode=m) for m in ("sum", "mean")})

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str] | None,
        table: TableConfig,
        *,
        optimizer: Literal["sgd", "adagrad", "adam"],
        lr: float,
        seed: int,
        device: str,
    ) -> StoreTable:
        """A table whose rows live in a new store in directory ``path`` (None: a temporary one).

        Args:
            path: the store directory (it must not hold a store).
            table: the table; its features set how many prefetches stay pinned.
            optimizer: ``"sgd"``, ``"adagrad"`` (the store's row-wise Adagrad) or ``"adam"``.
            lr: learning rate.
            seed: seed of the rows' init (reduced to 31 bits).
            device: the training device.
        """
        config = StoreConfig(
            dim=table.dim,
            optimizer=store_optimizer(optimizer),
            lr=lr,
            seed=seed % (1 << 31),
            init_scale=math.sqrt(1.0 / table.num_embeddings),
            pin_window=len(table.features) + 2,
            device=device,
            sync="full",  # durable like the training state saved beside it (fsynced)
        )
        return cls(table, EmbeddingStore.create(path, config))

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike[str],
        table: TableConfig,
        *,
        step: int,
        lr: float,
        device: str,
        checkpoint: str | os.PathLike[str],
    ) -> StoreTable:
        """The table of a run resumed from ``checkpoint`` at ``step``: its store reopened at the
        checkpoint of that step (rolled back one checkpoint if it committed a later one).

        Raises:
            StoreError: naming the checkpoint, the table and its store, when the store is
                missing, has no commit record or cannot give the state of ``step``.
        """
        path = Path(path)
        where = f"cannot resume from {str(checkpoint)!r} at step {step}: table {table.name!r}"
        if not (path / "meta.json").exists():
            msg = f"{where} has no embedding store at {str(path)!r} (meta.json is missing)"
            raise StoreError(msg)
        try:
            store = open_store(path, lr=lr, device=device, step=step)
        except StoreError as exc:
            raise StoreError(f"{where}: {exc}") from exc
        return cls(table, store)

    def pool(self, ids: torch.Tensor, offsets: torch.Tensor, *, mode: PoolingMode) -> torch.Tensor:
        """Pooled ``[R, D]`` bags."""
        return self.bags[mode](table_ids(self.config, ids), offsets)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` rows (bags of one id each)."""
        offsets = torch.arange(ids.numel() + 1, device=ids.device)
        return self.bags["sum"](table_ids(self.config, ids), offsets)

    def optimizer_step(self) -> None:
        """Apply the pushed gradients."""
        self.store.update()
