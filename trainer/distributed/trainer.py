"""One rank's trainer: a DLRM with sharded tables, DDP on the dense part, the 2FP exchange.

::

    batch (this rank's micro-batch of the global batch)
      -> sparse.prepare(batch)        the batch's id plan (computed once), and the rows of its
                                      unique ids (all-to-all): the batch with its plan
      -> model(planned batch)         DDP; lookups at the plan's positions; batch norm over the
                                      global batch
      -> sum of losses / global B     backward: dense gradients summed by DDP
      -> dense optimizers, sparse.step()   hot gradients all-reduced, cold ones to their owners
      -> the step's loss: all-reduced sum / global B (the global batch's mean loss)

With equal micro-batches on every rank this computes what one process computes on the
concatenated global batch; :class:`DistributedTrainer` with a world of one *is* that process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from recpipe.errors import RecpipeError
from trainer.config import DEFAULT_LR
from trainer.distributed.cache import CachedEmbeddings
from trainer.distributed.comm import Comm
from trainer.distributed.dense import ExactDense, global_batch_norms, wrap_ddp
from trainer.distributed.exchange import ShardedEmbeddings, ShardedTable
from trainer.distributed.shard import RowShard, sparse_optimizer
from trainer.metrics import auc
from trainer.modules import TableConfig, TableFactory, table_seed
from trainer.runlog import EvalResult
from trainer.train import make_optimizers

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = ["DistributedTrainer", "PendingLosses", "evaluate_on_ranks", "sharded_table_factory"]

SparseKind = Literal["sgd", "adagrad", "adam"]


@torch.no_grad()
def evaluate_on_ranks(
    logits_of: Callable[[Batch], torch.Tensor],
    batches: Iterable[Batch],
    *,
    comm: Comm,
    device: torch.device,
    max_batches: int | None = None,
) -> EvalResult:
    """Loss and AUC over every rank's ``batches``, each scored by ``logits_of`` and gathered
    to every rank (collective: every rank must bring the same number of batches of the same
    size). The caller puts its model in eval mode."""
    scores, labels, count = [], [], 0
    for batch in batches:
        if max_batches is not None and count >= max_batches:
            break
        batch = batch.to(device, non_blocking=True)
        logits = logits_of(batch)
        pair = torch.stack([logits.to(torch.float64), batch.labels.to(torch.float64)])
        every = comm.all_gather(pair, what="the evaluation gather")
        scores.extend(p[0] for p in every)
        labels.extend(p[1] for p in every)
        count += 1
    if not scores:
        return EvalResult(float("nan"), float("nan"), 0, 0)
    s, y = torch.cat(scores), torch.cat(labels)
    loss = float(F.binary_cross_entropy_with_logits(s, y, reduction="sum")) / y.numel()
    return EvalResult(loss, auc(s, y), y.numel(), count)


class PendingLosses:
    """Each step's local loss sum and global row count, kept until :meth:`reduce` turns them into
    global mean losses with one all-reduce for all of them (not one per step)."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, int]] = []

    def add(self, loss_sum: torch.Tensor, global_rows: int) -> None:
        """Keep a step's local ``loss_sum`` (summed over this rank's rows)."""
        self._items.append((loss_sum.detach().to(torch.float64), global_rows))

    def reduce(self, comm: Comm) -> list[float]:
        """The global mean losses of the steps kept since the last call, in order (collective)."""
        if not self._items:
            return []
        sums = torch.stack([s for s, _ in self._items])
        comm.all_reduce(sums, what="the loss all-reduce")
        out = [float(s) / rows for s, (_, rows) in zip(sums.tolist(), self._items, strict=True)]
        self._items = []
        return out


def sharded_table_factory(
    *,
    optimizer: SparseKind,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> TableFactory:
    """Build :class:`ShardedTable` s the way ``--store hybrid`` builds store tables: rows are
    initialised from a hash of (``table_seed(seed, name)``, id) in ``±sqrt(1/num_embeddings)``,
    so a sharded run starts from the same tables as a single-process store run. Each row keeps
    the state of ``optimizer``'s row update (row-wise Adagrad's accumulator, Adam's moments)."""
    rows = sparse_optimizer(optimizer, 1.0)  # for the shape of its state (the lr plays no part)

    def factory(table: TableConfig, seed: int) -> nn.Module:
        state_shape = rows.state_shape(table.dim)
        shard = RowShard(
            dim=table.dim,
            dtype=dtype,
            device=device,
            seed=table_seed(seed, table.name) % (1 << 31),
            init_scale=math.sqrt(1.0 / table.num_embeddings),
            with_state=state_shape is not None,
            state_shape=state_shape or (),
        )
        return ShardedTable(table, shard)

    return factory


class DistributedTrainer:
    """A model with :class:`ShardedTable` s, its optimizers and the step, on one rank.

    Args:
        model: built with :func:`sharded_table_factory` (its dense part in ``dtype``).
        comm: the exchange group (world size 1: a single process).
        optimizer: ``"sgd"`` (SGD everywhere), ``"adagrad"`` (row-wise Adagrad for the
            tables, Adagrad for the dense part) or ``"adam"`` (``SparseAdam``'s lazy Adam for
            the table rows, state with each row's owner; torch's Adam for the dense part).
        lr: learning rate (default per optimizer).
        device: where the model runs.
        hot_budget_rows: most hot rows the planner may choose (all tables).
        count_steps: steps whose accesses are counted for the hot set (``None``: every step).
        cache_rows: give every rank an embedding cache of this many rows
            (:class:`~trainer.distributed.cache.CachedEmbeddings`, no hot set) in place of the
            2FP exchange (``None``).
        table_order: with ``cache_rows``, the tables in the order that breaks recency ties at
            eviction (the dispatcher's).
        exact_dense: sum every dense gradient in float64 over rows and ranks and round once
            (:class:`~trainer.distributed.dense.ExactDense`, in place of DDP): every dense
            parameter, attention pooling's included, then gets the float32 gradient one process
            computes, bit for bit, and the step's loss is a float64 sum over the rows too (what
            ``recpipe train --nproc`` does unless ``--fast-dense``). Costs the float64 products
            of the weights' gradients.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        comm: Comm,
        optimizer: SparseKind = "adagrad",
        lr: float | None = None,
        device: torch.device | str = "cpu",
        hot_budget_rows: int = 65536,
        count_steps: int | None = None,
        cache_rows: int | None = None,
        table_order: Sequence[str] | None = None,
        exact_dense: bool = False,
    ) -> None:
        if optimizer not in ("sgd", "adagrad", "adam"):
            msg = f"`optimizer` must be 'sgd', 'adagrad' or 'adam' with sharded tables, got {optimizer!r}"
            raise RecpipeError(msg)
        self.comm = comm
        self.device = torch.device(device)
        self.lr = DEFAULT_LR[optimizer] if lr is None else float(lr)
        self.module = model.to(self.device)
        global_batch_norms(self.module, comm)
        rows = sparse_optimizer(optimizer, self.lr)
        self.sparse: ShardedEmbeddings | CachedEmbeddings
        if cache_rows is None:
            self.sparse = ShardedEmbeddings(self.module, comm=comm, optimizer=rows,
                                            hot_budget_rows=hot_budget_rows,
                                            count_steps=count_steps)  # fmt: skip
        else:
            self.sparse = CachedEmbeddings(self.module, comm=comm, optimizer=rows,
                                           capacity=cache_rows, table_order=table_order)  # fmt: skip
        self.optimizers = make_optimizers(self.module, optimizer, lr=self.lr)
        self.exact = ExactDense(self.module, comm) if exact_dense else None
        self.model = self.module if exact_dense else wrap_ddp(self.module, comm, device=self.device)
        self.step = 0
        self._pending = PendingLosses()

    @property
    def tables(self) -> list[ShardedTable]:
        return self.sparse.tables

    def train_step(
        self, batch: Batch, *, reduce_loss: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step on this rank's micro-batch (collective); returns the global batch's mean
        loss (the same on every rank) and this rank's logits.

        With ``reduce_loss=False`` the loss is kept for :meth:`pending_losses`, which reduces
        the losses of many steps in one all-reduce (one collective less per step), and
        ``None`` is returned in its place.
        """
        if not self.module.training:  # train() walks every module: not on every step
            self.module.train()
        batch = batch.to(self.device, non_blocking=True)
        global_rows = batch.batch_size * self.comm.world_size
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        batch = self.sparse.prepare(batch)  # with its id plan
        logits = self.model(batch)
        loss_sum = F.binary_cross_entropy_with_logits(
            logits, batch.labels.to(logits.dtype), reduction="sum"
        )
        (loss_sum / global_rows).backward()
        if self.exact is not None:
            self.exact.reduce()
        for opt in self.optimizers:
            opt.step()
        self.sparse.step()
        self.step += 1
        if self.exact is not None:  # the loss as the dense gradients: a float64 sum over rows
            loss_sum = F.binary_cross_entropy_with_logits(
                logits.detach().to(torch.float64), batch.labels.to(torch.float64), reduction="sum"
            )
        self._pending.add(loss_sum, global_rows)
        if not reduce_loss:
            return None, logits.detach()
        return torch.tensor(self.pending_losses()[-1]), logits.detach()

    def pending_losses(self) -> list[float]:
        """The global mean losses of the steps since the last call, in order (collective: one
        all-reduce of all of them)."""
        return self._pending.reduce(self.comm)

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None = None) -> EvalResult:
        """Loss and AUC over every rank's ``batches`` (collective: every rank must bring the
        same number of batches of the same size)."""
        self.module.eval()

        def logits_of(batch: Batch) -> torch.Tensor:
            return self.module(self.sparse.prepare(batch, train=False))

        return evaluate_on_ranks(
            logits_of, batches, comm=self.comm, device=self.device, max_batches=max_batches
        )

    def state_dict(self) -> dict[str, Any]:
        """The dense model, the dense optimizers and the step (the same on every rank)."""
        return {
            "model": self.module.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "step": self.step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.module.load_state_dict(state["model"])
        if len(state["optimizers"]) != len(self.optimizers):
            msg = (
                f"the checkpoint holds {len(state['optimizers'])} dense optimizers, this model "
                f"needs {len(self.optimizers)}"
            )
            raise RecpipeError(msg)
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        self.step = int(state["step"])
