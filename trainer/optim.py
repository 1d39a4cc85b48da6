"""What ``--optimizer adagrad`` and ``--optimizer adam`` mean for an embedding table in every
backend.

fbgemm's (and TorchRec's) embedding optimizer: one accumulator per row, not per element::

    s[r] += mean(g[r]²)          w[r] -= lr · g[r] / (sqrt(s[r]) + eps)

Parameter tables train with :class:`RowwiseAdagrad`; the store and the sharded tables of a
multi-rank job apply the same formula through the same kernel
(:func:`rowwise_adagrad_`), so one process, ``--store hybrid``, ``--nproc N`` and towers
train the same model. Dense parameters keep torch's element-wise Adagrad.

Adam for a table is torch's ``SparseAdam`` (lazy Adam: a row's moments move only in the steps
that look it up), its bias correction counting the table's optimizer steps. Parameter tables
train with ``torch.optim.SparseAdam`` itself; the store and the sharded tables apply
:func:`sparse_adam_`, which gives its bits (the same operations in the same order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer import _kernels

__all__ = ["ADAM_BETAS", "RowwiseAdagrad", "rowwise_adagrad_", "sparse_adam_"]

_NUMBA_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
ADAM_BETAS = (0.9, 0.999)
"""Adam's β1, β2 for the tables (torch's defaults, which ``SparseAdam`` uses)."""


def rowwise_adagrad_(
    values: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor | None,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """Row-wise Adagrad in place on ``values[rows]`` and ``state[rows]`` with ``grads``
    ``[n, D]`` (``rows`` distinct; ``None``: every row, a dense gradient): one compiled pass on
    CPU (every CPU engine runs it), one Numba-CUDA launch on a GPU (``trainer._cuda_kernels``),
    torch ops elsewhere: the same operations (``lr``, ``eps`` and ``D`` in the values' float
    type), except that torch's CPU ``sqrt`` is not always the correctly rounded one the kernel's
    is (measured here: the torch form moves about one row in five by a last bit), and that on a
    GPU the compiler may fuse a multiply and an add (the CUDA kernel and the CPU one can differ
    in a last bit)."""
    if grads.shape[0] == 0 or (rows is not None and rows.numel() == 0):
        return
    dim = grads.shape[1]
    if (
        values.device.type == "cuda"
        and values.dtype in _NUMBA_DTYPES
        and dim
        and values.is_contiguous()
        and state.is_contiguous()
    ):
        from trainer import _cuda_kernels  # needs numba-cuda: imported only for CUDA tensors

        _cuda_kernels.rowwise_adagrad(values, state, rows, grads, lr=lr, eps=eps)
        return
    if rows is None:
        rows = torch.arange(values.shape[0], device=values.device)
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


def sparse_adam_(
    values: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
    step: int,
    betas: tuple[float, float] = ADAM_BETAS,
) -> None:
    """torch's ``SparseAdam`` in place on ``values[rows]`` (``[n, D]`` ``grads``, ``rows``
    distinct) and their moments ``state[rows]`` (``[rows, 2D]``: m then v)::

        m += (g - m)·(1 - β1)     v += (g² - v)·(1 - β2)
        w -= lr·sqrt(1 - β2^t)/(1 - β1^t) · m / (sqrt(v) + eps)      t = ``step``

    ``step`` counts this update (>= 1). ``torch.optim._functional.sparse_adam``'s tensor
    operations in its order on every device (its ``update + m_old`` is the new ``m``; the
    denominator's square root is taken of the new ``v``), so a float tensor gets the bits
    ``SparseAdam`` gives it. No compiled kernel: torch's float32 ``sqrt`` on the CPU is not
    the correctly rounded one (it differs in the last bit for about one value in ten), so a
    kernel's would break the equality."""
    if rows.numel() == 0:
        return
    if step < 1:
        msg = f"Adam's `step` counts this update, so it must be >= 1, got {step!r}"
        raise RecpipeError(msg)
    dim = values.shape[1]
    if tuple(state.shape[1:]) != (2 * dim,):
        msg = f"Adam keeps [rows, 2D] state (m then v), got {tuple(state.shape)} for D = {dim}"
        raise RecpipeError(msg)
    beta1, beta2 = betas
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    grads = grads.to(values.dtype)
    old = state.index_select(0, rows)  # (n, 2D)
    m_old, v_old = old[:, :dim], old[:, dim:]
    m_new = grads.sub(m_old).mul_(1 - beta1).add_(m_old)  # (n, D)
    v_new = grads.pow(2).sub_(v_old).mul_(1 - beta2).add_(v_old)  # (n, D)
    state.index_copy_(0, rows, torch.cat([m_new, v_new], 1))
    denom = v_new.sqrt_().add_(eps)
    values.index_add_(0, rows, -step_size * m_new.div_(denom))


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
                    rows, grads = None, grad  # every row
                rowwise_adagrad_(p.data, state["row_sum"], rows, grads,
                                 lr=group["lr"], eps=group["eps"])  # fmt: skip
        return loss
