"""An embedding bag backed by an :class:`~trainer.store.store.EmbeddingStore`, under autograd.

It works on the unique rows of an IKJT (RecD O5): look up and pool the U unique rows' lists, then
expand the pooled [U, D] output to the batch with the inverse lookup::

    ikjt values  [v0 v1 | v2 | v3 v4 v5]     offsets [0, 2, 3, 6]   (U = 3 unique rows)
    inverse_lookup [0 0 1 2 2 2 1]            (B = 7 batch rows)
    pooled  [p0, p1, p2]  ->  out [p0 p0 p1 p2 p2 p2 p1]

Backward pushes the gradients of the looked-up rows to the store; the optimizer step is
``store.update()`` (fused and sparse: only touched rows are written), not a torch optimizer.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from recpipe.errors import StoreError
from trainer.store import _kernels as K
from trainer.store.store import EmbeddingStore, Locations

__all__ = ["StoreEmbeddingBag"]


class _StoreLookup(torch.autograd.Function):
    """rows = store.pull(loc); backward: store.push(loc, grad)."""

    @staticmethod
    def forward(ctx, anchor, store, loc):
        ctx.store = store
        ctx.loc = loc
        return store.pull(loc)

    @staticmethod
    def backward(ctx, grad):
        ctx.store.push(ctx.loc, grad.contiguous())
        return None, None, None


class _StorePool(torch.autograd.Function):
    """CPU: pooled = pool(store.pull(loc)) in one Numba kernel; backward scatters the pooled
    gradient to the unique rows in one kernel and pushes it."""

    @staticmethod
    def forward(ctx, anchor, store, loc, offsets, mean):
        rows = store.pull(loc)  # (Uid, D)
        inverse = loc.inverse.numpy()
        out = torch.empty(offsets.numel() - 1, rows.shape[1])  # (U, D)
        K.pool_forward(rows.numpy(), inverse, offsets.numpy(), mean, out.numpy())
        ctx.store, ctx.loc, ctx.offsets, ctx.mean = store, loc, offsets, mean
        return out

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(torch.float32).contiguous()
        rows = torch.empty(ctx.loc.num_unique, g.shape[1])  # (Uid, D)
        K.pool_backward(g.numpy(), ctx.loc.inverse.numpy(), ctx.offsets.numpy(), ctx.mean,
                        rows.numpy())  # fmt: skip
        ctx.store.push(ctx.loc, rows)
        return None, None, None, None, None


class StoreEmbeddingBag(nn.Module):
    """``nn.EmbeddingBag``-like pooling whose table lives in an embedding store.

    Args:
        store: the store holding the table.
        mode: ``"sum"`` or ``"mean"`` pooling.

    Example:
        >>> bag = StoreEmbeddingBag(store)                             # doctest: +SKIP
        >>> out = bag(ikjt_values, unique_offsets, inverse_lookup=inv)  # doctest: +SKIP
        >>> loss(out).backward(); store.update()                        # doctest: +SKIP
    """

    def __init__(self, store: EmbeddingStore, *, mode: Literal["sum", "mean"] = "sum") -> None:
        super().__init__()
        if mode not in ("sum", "mean"):
            raise StoreError(f"`mode` must be 'sum' or 'mean', got {mode!r}")
        self.store = store
        self.mode = mode
        # A zero-size tensor that requires grad, so the lookup is recorded by autograd; not a
        # Parameter, so torch optimizers never see it.
        self._anchor = torch.zeros(0, requires_grad=True)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        *,
        inverse_lookup: torch.Tensor | None = None,
        locations: Locations | None = None,
    ) -> torch.Tensor:
        """Pool the bags of ``ids`` and optionally expand them.

        Args:
            ids: int64 [n] ids of the U bags (e.g. an IKJT key's values over unique rows).
            offsets: int64 [U + 1] bag boundaries in ``ids``.
            inverse_lookup: int64 [B] bag of each batch row; None returns the [U, D] bags.
            locations: ``store.prefetch(ids)`` done ahead (e.g. in a loader thread).

        Returns:
            float32 [B, D] (or [U, D] without ``inverse_lookup``).
        """
        loc = self.store.prefetch(ids) if locations is None else locations
        if loc.inverse.numel() != ids.numel():
            msg = f"`locations` cover {loc.inverse.numel()} ids, `ids` has {ids.numel()}"
            raise StoreError(msg)
        pooled = self.pool(loc, offsets)  # (U, D)
        if inverse_lookup is None:
            return pooled
        return pooled.index_select(0, inverse_lookup.to(self.store.device))  # (B, D)

    def pool(self, loc: Locations, offsets: torch.Tensor) -> torch.Tensor:
        """The ``[U, D]`` bags (``offsets`` [U + 1]) of the ids whose rows ``loc`` locates
        (``loc.inverse``: each id's row among the prefetched ones, e.g. one feature's ids among
        the distinct ids of a batch's table, :class:`trainer.store.table.StoreTable`)."""
        dev = self.store.device
        if dev.type == "cpu":
            offsets = offsets.to("cpu", torch.int64).contiguous()
            return _StorePool.apply(self._anchor, self.store, loc, offsets, self.mode == "mean")
        rows = _StoreLookup.apply(self._anchor, self.store, loc)  # (Uid, D) unique ids
        return F.embedding_bag(
            loc.inverse.to(dev), rows, offsets.to(dev), mode=self.mode, include_last_offset=True
        )  # (U, D)
