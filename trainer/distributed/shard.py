"""The rows one rank owns of one table, and the sparse optimizers that update rows in place.

A :class:`RowShard` is built on the embedding store's pieces: its collision-free growing id index
(:class:`trainer.store.IdIndex`) and its deterministic row init (:func:`trainer.store.init_rows`,
a row is a hash of (seed, id)), so a row starts with the same values whichever rank creates it
and whenever, exactly as in a single-process store. Values and the optimizer state sit in
tensors of any float dtype (float64 for exactness checks)::

    index    id -> row (dense 0, 1, 2, ... in order of first appearance)
    ids      [rows]        int64, the id of each row
    values   [rows, D]     the embeddings
    state    [rows]        row-wise Adagrad's accumulator (absent for SGD)

Row owner: ``owner_of(id, W)`` = splitmix64(id + salt) mod W. The salt keeps it independent of
the index's own hash of the id (which picks shard and slot from the same mix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.distributed import _kernels as K
from trainer.store import IdIndex, init_rows

__all__ = ["RowShard", "SparseOptimizer", "owner_of"]

_NUMBA_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}

_SALT = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def owner_of(ids: np.ndarray, world_size: int) -> np.ndarray:
    """The rank owning each id: ``splitmix64(id + salt) % world_size`` (int64 [n])."""
    x = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64) + _SALT
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(world_size)).astype(np.int64)


@dataclass(frozen=True)
class SparseOptimizer:
    """The row update shared by hot replicas and owned rows (the store's formulas).

    ``sgd``: ``w -= lr * g``. ``rowwise_adagrad`` (fbgemm's): ``s += mean(g²)``;
    ``w -= lr * g / (sqrt(s) + eps)``.
    """

    kind: Literal["sgd", "rowwise_adagrad"] = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in ("sgd", "rowwise_adagrad"):
            msg = f"`kind` must be 'sgd' or 'rowwise_adagrad', got {self.kind!r}"
            raise RecpipeError(msg)
        if not self.lr > 0:
            msg = f"`lr` must be > 0, got {self.lr!r}"
            raise RecpipeError(msg)

    @property
    def has_state(self) -> bool:
        return self.kind == "rowwise_adagrad"

    def apply(
        self,
        values: torch.Tensor,
        state: torch.Tensor | None,
        rows: torch.Tensor,
        grads: torch.Tensor,
    ) -> None:
        """Update ``values[rows]`` (and ``state[rows]``) with ``grads`` [n, D]; rows unique."""
        if rows.numel() == 0:
            return
        if self.kind == "sgd":
            values.index_add_(0, rows, grads, alpha=-self.lr)
            return
        if values.device.type == "cpu" and values.dtype in _NUMBA_DTYPES and grads.shape[1]:
            float_type = _NUMBA_DTYPES[values.dtype]  # one compiled loop, no temporaries
            K.rowwise_adagrad(values.numpy(), state.numpy(), rows.contiguous().numpy(),
                              grads.to(values.dtype).contiguous().numpy(), float_type(self.lr),
                              float_type(self.eps), float_type(grads.shape[1]))  # fmt: skip
            return
        acc = (grads * grads).sum(1)  # (n,)
        s = state.index_select(0, rows) + acc / grads.shape[1]
        state.index_copy_(0, rows, s)
        mult = self.lr / (s.sqrt() + self.eps)  # (n,)
        values.index_add_(0, rows, grads * mult.unsqueeze(1), alpha=-1.0)


class RowShard:
    """Rows of one table owned by one rank (see the module docstring).

    Args:
        dim: embedding dimension D.
        dtype: float dtype of values and state.
        device: where values and state live.
        seed: row init seed (the store's ``StoreConfig.seed``).
        init_scale: rows start uniform in ``±init_scale``.
        with_state: keep a row-wise optimizer accumulator.
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
    ) -> None:
        self.dim, self.dtype, self.device = dim, dtype, torch.device(device)
        self.seed, self.init_scale = int(seed), float(init_scale)
        self.index = IdIndex()
        self.ids = np.zeros(0, dtype=np.int64)
        self.values = torch.zeros(0, dim, dtype=dtype, device=self.device)
        self.state = torch.zeros(0, dtype=dtype, device=self.device) if with_state else None

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
            state = self.state.new_zeros(new)
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
        """Optimizer step on ``rows`` (unique) with ``grads`` [n, D]."""
        optimizer.apply(self.values, self.state, torch.from_numpy(rows).to(self.device), grads)

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
        """Every row: ``(ids, values [n, D], state [n] or None)`` in row order (copies)."""
        n = self.num_rows
        state = None if self.state is None else self.state[:n].clone()
        return self.ids[:n].copy(), self.values[:n].clone(), state
