"""The rows one rank owns of one table, and the sparse optimizers that update rows in place.

A :class:`RowShard` is built on the embedding store's pieces: its collision-free growing id index
(:class:`trainer.store.IdIndex`) and its deterministic row init (:func:`trainer.store.init_rows`,
a row is a hash of (seed, id)), so a row starts with the same values whichever rank creates it
and whenever, exactly as in a single-process store. Values and the optimizer state sit in
tensors of any float dtype (float64 for exactness checks)::

    index    id -> row (dense 0, 1, 2, ... in order of first appearance)
    ids      [rows]        int64, the id of each row
    values   [rows, D]     the embeddings
    state    [rows]        row-wise Adagrad's accumulator, or
             [rows, 2D]    Adam's first and second moments m | v (absent for SGD)
    step     int           the optimizer steps the table took (Adam's bias correction)

Row owner: ``owner_of(id, W)`` (:func:`recpipe.kernels.splitmix.owner_of`) = splitmix64(id + salt) mod W. The salt keeps it independent of
the index's own hash of the id (which picks shard and slot from the same mix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from recpipe.errors import RecpipeError
from recpipe.kernels.splitmix import owner_of
from trainer.distributed import _kernels as K
from trainer.optim import ADAM_BETAS, rowwise_adagrad_, sparse_adam_
from trainer.store import IdIndex, init_rows

__all__ = ["RowShard", "SparseOptimizer", "owner_of", "pack_rows", "sparse_optimizer"]


SparseKind = Literal["sgd", "rowwise_adagrad", "adam"]
SPARSE_KINDS: tuple[str, ...] = ("sgd", "rowwise_adagrad", "adam")
_OF_OPTIMIZER = {"sgd": "sgd", "adagrad": "rowwise_adagrad", "adam": "adam"}


@dataclass(frozen=True)
class SparseOptimizer:
    """The row update shared by hot replicas, cached copies and owned rows.

    ``sgd``: ``w -= lr * g``. ``rowwise_adagrad`` (fbgemm's): ``s += mean(g²)``;
    ``w -= lr * g / (sqrt(s) + eps)``. ``adam``: torch's ``SparseAdam`` on the rows given
    (lazy Adam: rows not in the step keep their moments), with torch's arithmetic in torch's
    order, so a float tensor gets the bits ``SparseAdam`` gives it::

        m += (g - m)·(1 - β1)     v += (g² - v)·(1 - β2)
        w -= lr·sqrt(1 - β2^t)/(1 - β1^t) · m / (sqrt(v) + eps)      t: the table's step
    """

    kind: SparseKind = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    betas: tuple[float, float] = ADAM_BETAS

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_KINDS:
            msg = f"`kind` must be one of {list(SPARSE_KINDS)}, got {self.kind!r}"
            raise RecpipeError(msg)
        if not self.lr > 0:
            msg = f"`lr` must be > 0, got {self.lr!r}"
            raise RecpipeError(msg)
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            msg = f"`betas` must be two numbers in [0, 1), got {self.betas!r}"
            raise RecpipeError(msg)

    @property
    def has_state(self) -> bool:
        return self.kind != "sgd"

    def state_shape(self, dim: int) -> tuple[int, ...] | None:
        """The optimizer state of one row of ``dim`` values: ``()`` (row-wise Adagrad's
        accumulator), ``(2 * dim,)`` (Adam's m | v) or ``None`` (SGD keeps none)."""
        return {"sgd": None, "rowwise_adagrad": (), "adam": (2 * dim,)}[self.kind]

    def apply(
        self,
        values: torch.Tensor,
        state: torch.Tensor | None,
        rows: torch.Tensor,
        grads: torch.Tensor,
        *,
        step: int = 0,
    ) -> None:
        """Update ``values[rows]`` (and ``state[rows]``) with ``grads`` [n, D]; rows unique.
        ``step``: the table's optimizer step, counting this one (Adam's bias correction)."""
        if rows.numel() == 0:
            return
        if self.kind == "sgd":
            values.index_add_(0, rows, grads, alpha=-self.lr)
            return
        if self.kind == "adam":
            if state is None:
                msg = "Adam keeps [rows, 2D] state: build the shard with state_shape=(2D,)"
                raise RecpipeError(msg)
            sparse_adam_(values, state, rows, grads, lr=self.lr, eps=self.eps, step=step,
                         betas=self.betas)  # fmt: skip
            return
        rowwise_adagrad_(values, state, rows, grads, lr=self.lr, eps=self.eps)


def sparse_optimizer(optimizer: str, lr: float) -> SparseOptimizer:
    """The row update ``--optimizer`` means for embedding rows: ``sgd``, row-wise Adagrad for
    ``adagrad``, lazy (``SparseAdam``'s) Adam for ``adam``."""
    if optimizer not in _OF_OPTIMIZER:
        msg = f"`optimizer` must be one of {list(_OF_OPTIMIZER)}, got {optimizer!r}"
        raise RecpipeError(msg)
    return SparseOptimizer(_OF_OPTIMIZER[optimizer], lr)  # type: ignore[arg-type]


def pack_rows(values: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """``[n, D + S]``: each row's values then its state (``S`` = 0, 1 or 2D columns), what
    travels when a row moves with its optimizer state; :func:`unpack_state` reads it back."""
    if state is None:
        return values
    columns = state.reshape(state.shape[0], math.prod(state.shape[1:]))  # (n, S)
    return torch.cat([values, columns.to(values.dtype)], 1)


def unpack_state(packed: torch.Tensor, dim: int, like: torch.Tensor) -> torch.Tensor:
    """The state columns of :func:`pack_rows`'s ``packed`` rows, shaped per row as ``like``."""
    return packed[:, dim:].reshape(packed.shape[0], *like.shape[1:]).to(like.dtype)


class RowShard:
    """Rows of one table owned by one rank (see the module docstring).

    Args:
        dim: embedding dimension D.
        dtype: float dtype of values and state.
        device: where values and state live.
        seed: row init seed (the store's ``StoreConfig.seed``).
        init_scale: rows start uniform in ``±init_scale``.
        with_state: keep optimizer state.
        state_shape: one row's state (:meth:`SparseOptimizer.state_shape`): ``()`` for
            row-wise Adagrad's accumulator, ``(2 * dim,)`` for Adam's moments.
    """

    def __init__(
        self,
        *,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_scale: float = 0.05,
        with_state: bool = True,
        state_shape: tuple[int, ...] = (),
    ) -> None:
        self.dim, self.dtype, self.device = dim, dtype, torch.device(device)
        self.seed, self.init_scale = int(seed), float(init_scale)
        self.index = IdIndex()
        self.ids = np.zeros(0, dtype=np.int64)
        self.values = torch.zeros(0, dim, dtype=dtype, device=self.device)
        self.state = (
            torch.zeros(0, *state_shape, dtype=dtype, device=self.device) if with_state else None
        )
        self.step = 0  # optimizer steps taken: every rank's shards step together, every step

    @classmethod
    def like(cls, shard: RowShard) -> RowShard:
        """An empty shard built as ``shard`` (its dim, dtype, device, init and state)."""
        state = shard.state
        return cls(dim=shard.dim, dtype=shard.dtype, device=shard.device, seed=shard.seed,
                   init_scale=shard.init_scale, with_state=state is not None,
                   state_shape=() if state is None else tuple(state.shape[1:]))  # fmt: skip

    def emptied(self) -> RowShard:
        """A shard like this one with no rows (what a resume fills)."""
        return RowShard.like(self)

    @property
    def row_state_shape(self) -> tuple[int, ...] | None:
        """One row's optimizer state (``None``: it keeps none)."""
        return None if self.state is None else tuple(self.state.shape[1:])

    @property
    def num_rows(self) -> int:
        return self.index.num_rows

    def init_values(self, ids: np.ndarray) -> torch.Tensor:
        """The values ``ids`` start with ``[n, D]`` (whoever creates them)."""
        rows = init_rows(ids, self.dim, seed=self.seed, scale=self.init_scale)
        return torch.from_numpy(rows).to(self.device, self.dtype)

    def _reserve(self, rows: int) -> None:
        cap = self.values.shape[0]
        if rows <= cap:
            return
        new = max(rows, 2 * cap, 1024)
        self.ids = np.concatenate([self.ids, np.zeros(new - cap, dtype=np.int64)])
        grown = self.values.new_zeros(new, self.dim)
        grown[:cap] = self.values
        self.values = grown
        if self.state is not None:
            state = self.state.new_zeros(new, *self.state.shape[1:])
            state[:cap] = self.state
            self.state = state

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (int64 [n]), creating (and initialising) the new ones."""
        rows, first_new = self.index.insert(np.ascontiguousarray(ids, dtype=np.int64))
        n = self.index.num_rows
        if n > first_new:
            self._reserve(n)
            fresh = rows >= first_new
            self.ids[rows[fresh]] = ids[fresh]
            self.values[first_new:n] = self.init_values(self.ids[first_new:n])
            if self.state is not None:
                self.state[first_new:n] = 0
        return rows

    def lookup(self, ids: np.ndarray) -> torch.Tensor:
        """Values of ``ids`` without creating rows (unknown ids get their init values)."""
        rows = self.index.lookup(ids)
        known = rows >= 0
        out = torch.empty(ids.size, self.dim, dtype=self.dtype, device=self.device)
        if known.any():
            sel = torch.from_numpy(np.flatnonzero(known)).to(self.device)
            out[sel] = self.values.index_select(0, torch.from_numpy(rows[known]).to(self.device))
        if not known.all():
            sel = torch.from_numpy(np.flatnonzero(~known)).to(self.device)
            out[sel] = self.init_values(ids[~known])
        return out

    def gather(self, rows: np.ndarray) -> torch.Tensor:
        return self.values.index_select(0, torch.from_numpy(rows).to(self.device))

    def gather_into(self, rows: np.ndarray, out: torch.Tensor, at: np.ndarray) -> None:
        """``out[at[i]] = values[rows[i]]`` (``out`` [m, D] of the values' dtype and device)."""
        if self.device.type == "cpu":
            K.copy_rows(self.values.numpy(), rows, out.numpy(), at)
            return
        out.index_copy_(0, torch.from_numpy(at).to(self.device), self.gather(rows))

    def apply(self, optimizer: SparseOptimizer, rows: np.ndarray, grads: torch.Tensor) -> None:
        """Optimizer step :attr:`step` on ``rows`` (unique) with ``grads`` [n, D]."""
        at = torch.from_numpy(rows).to(self.device)
        optimizer.apply(self.values, self.state, at, grads, step=self.step)

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values and state of ``ids`` (created when new)."""
        idx = torch.from_numpy(self.rows(ids)).to(self.device)
        state = None if self.state is None else self.state.index_select(0, idx)
        return self.values.index_select(0, idx), state

    def write(self, ids: np.ndarray, values: torch.Tensor, state: torch.Tensor | None) -> None:
        """Set the values (and state) of ``ids`` (created when new)."""
        idx = torch.from_numpy(self.rows(ids)).to(self.device)
        self.values.index_copy_(0, idx, values.to(self.device, self.dtype))
        if self.state is not None and state is not None:
            self.state.index_copy_(0, idx, state.to(self.device, self.dtype))

    def export(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor | None]:
        """Every row: ``(ids, values [n, D], state [n, ...] or None)`` in row order (copies)."""
        n = self.num_rows
        state = None if self.state is None else self.state[:n].clone()
        return self.ids[:n].copy(), self.values[:n].clone(), state
