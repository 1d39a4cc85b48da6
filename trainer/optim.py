"""Row-wise Adagrad: what ``--optimizer adagrad`` means for an embedding table in every backend.

fbgemm's (and TorchRec's) embedding optimizer: one accumulator per row, not per element::

    s[r] += mean(g[r]²)          w[r] -= lr · g[r] / (sqrt(s[r]) + eps)

Parameter tables train with :class:`RowwiseAdagrad`; the store and the sharded tables of a
multi-rank job apply the same formula through the same kernel
(:func:`rowwise_adagrad_`), so one process, ``--store hybrid``, ``--nproc N`` and towers
train the same model. Dense parameters keep torch's element-wise Adagrad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer import _kernels

__all__ = ["RowwiseAdagrad", "rowwise_adagrad_"]

_NUMBA_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def rowwise_adagrad_(
    values: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """Row-wise Adagrad in place on ``values[rows]`` and ``state[rows]`` with ``grads``
    ``[n, D]`` (``rows`` distinct): one compiled pass on CPU, torch ops elsewhere, rounding
    alike (``lr``, ``eps`` and ``D`` in the values' float type)."""
    if rows.numel() == 0:
        return
    dim = grads.shape[1]
    if values.device.type == "cpu" and values.dtype in _NUMBA_DTYPES and dim:
        float_type = _NUMBA_DTYPES[values.dtype]
        _kernels.rowwise_adagrad(
            values.numpy(), state.numpy(), rows.to(torch.int64).contiguous().numpy(),
            grads.to(values.dtype).contiguous().numpy(), float_type(lr), float_type(eps),
            float_type(dim),
        )  # fmt: skip
        return
    acc = (grads * grads).sum(1)  # (n,)
    s = state.index_select(0, rows) + acc / dim
    state.index_copy_(0, rows, s)
    mult = lr / (s.sqrt() + eps)  # (n,)
    values.index_add_(0, rows, grads * mult.unsqueeze(1), alpha=-1.0)


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for ``[rows, D]`` embedding tables (sparse or dense gradients).

    A sparse gradient updates the rows it holds (after summing duplicates); a dense one updates
    every row, and a row whose gradient is zero does not move (its accumulator gains zero).
    State per table: ``row_sum`` ``[rows]``.

    Args:
        params: the tables' weights.
        lr: learning rate.
        eps: added to the accumulator's square root.
    """

    def __init__(
        self, params: Iterable[torch.Tensor], *, lr: float = 0.05, eps: float = 1e-8
    ) -> None:
        if not lr > 0:
            msg = f"`lr` must be > 0, got {lr!r}"
            raise RecpipeError(msg)
        super().__init__(params, {"lr": float(lr), "eps": float(eps)})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "row_sum" not in state:
                    if state:
                        msg = (
                            "this table's optimizer state is not row-wise Adagrad's (a checkpoint "
                            f"from an element-wise Adagrad: keys {sorted(state)!r}); start a new run"
                        )
                        raise RecpipeError(msg)
                    state["row_sum"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()
                    rows, grads = grad.indices()[0], grad.values()
                else:
                    rows = torch.arange(p.shape[0], device=p.device)
                    grads = grad
                rowwise_adagrad_(p.data, state["row_sum"], rows, grads,
                                 lr=group["lr"], eps=group["eps"])  # fmt: skip
        return loss
