"""A model's embedding table kept in an embedding store (``recpipe train --store hybrid``).

:class:`StoreTable` is the table backend the trainer's models use when a table's rows live in
an :class:`~trainer.store.EmbeddingStore` instead of a parameter; :meth:`StoreTable.create` and
:meth:`StoreTable.resume` make or reopen its store.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from recpipe.errors import StoreError
from trainer.modules import table_ids
from trainer.store.config import Locations, StoreConfig, store_optimizer
from trainer.store.module import StoreEmbeddingBag
from trainer.store.store import EmbeddingStore, open_store

if TYPE_CHECKING:
    from trainer.modules import IdPlan, PoolingMode, TableConfig

__all__ = ["StoreTable"]


class StoreTable(nn.Module):
    """A table backend over :class:`~trainer.store.EmbeddingStore` (see
    :class:`trainer.modules.TableBackend`).

    Ids are read through :func:`trainer.modules.table_ids` (taken modulo ``num_embeddings``
    with ``hash_ids``, as in every backend; without it the store's id index grows); gradients are
    pushed to the store in backward and applied by :meth:`optimizer_step` (``store.update()``),
    which :class:`trainer.train.Trainer` calls after the torch optimizers.

    It reads id plans (:class:`~trainer.modules.PlannedTable`): the first lookup of a plan
    prefetches the table's distinct ids (``plan.ids``) once, and every feature pools its ids
    at their positions among them::

        plan    ids [7 3 9]     item_id positions [0 1 0]   liked positions [1 2]
        store   prefetch([7 3 9]) -> rows r7 r3 r9 (loc.inverse [0 1 2])
        item_id loc.inverse[[0 1 0]] -> r7 r3 r7      liked loc.inverse[[1 2]] -> r3 r9

    Each feature's backward pushes a ``[U, D]`` gradient over the table's U rows, zero where
    the feature reads none (the store sums a step's pushes per row), so the rows train as
    with a prefetch per feature; the store's hot-set counts see each row once per table and
    step (as a rank's exchange counts them).

    Args:
        config: the table (``num_embeddings`` only sets the init scale).
        store: the store holding its rows.
    """

    def __init__(self, config: TableConfig, store: EmbeddingStore) -> None:
        super().__init__()
        self.config = config
        self.store = store
        self.bags = nn.ModuleDict({m: StoreEmbeddingBag(store, mode=m) for m in ("sum", "mean")})
        self._plan: tuple[int, int, Locations] | None = None  # last plan: serial, table, rows

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

    def pool_planned(
        self, plan: IdPlan, feature: str, offsets: torch.Tensor, *, mode: PoolingMode
    ) -> torch.Tensor:
        """Pooled ``[R, D]`` bags of ``feature``'s ids, at their positions in ``plan``."""
        return self.bags[mode].pool(self._locations(plan, feature), offsets)

    def rows_planned(self, plan: IdPlan, feature: str) -> torch.Tensor:
        """``[n, D]`` rows of ``feature``'s ids, at their positions in ``plan``."""
        loc = self._locations(plan, feature)
        offsets = torch.arange(loc.inverse.numel() + 1)
        return self.bags["sum"].pool(loc, offsets)

    def _locations(self, plan: IdPlan, feature: str) -> Locations:
        """Where ``feature``'s ids live: the plan's prefetch (made at its first lookup), with
        the feature's positions among the table's distinct ids."""
        t = plan.table_of[feature]
        if plan.tables[t] != self.config.name:
            msg = (
                f"table {self.config.name!r}: the batch's id plan reads feature {feature!r} "
                f"from table {plan.tables[t]!r}"
            )
            raise StoreError(msg)
        if self._plan is None or self._plan[:2] != (plan.serial, t):
            self._plan = (plan.serial, t, self.store.prefetch(plan.ids[t]))
        loc = self._plan[2]
        positions = plan.positions[feature].to(loc.inverse.device)
        return dataclasses.replace(loc, inverse=loc.inverse.index_select(0, positions))

    def optimizer_step(self) -> None:
        """Apply the pushed gradients."""
        self.store.update()
