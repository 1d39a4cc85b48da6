"""Numba-CUDA kernels of the trainer's optimizers (private; imported only for CUDA tensors).

On a GPU, row-wise Adagrad as torch ops is about a dozen launches per table and step (the
squares, their row sums, the accumulator's gather and scatter, the square root, the scaled
update); a training step of a deduplicated batch is short enough that the host's work to
launch them shows as idle device time. Here one launch updates a whole table: a thread per row,
the row's squares summed in column order, as the CPU kernel (``trainer._kernels``) sums them.
"""

from __future__ import annotations

import math

import torch

from recpipe.kernels import cuda as kc
from recpipe.kernels.arrays import Array

cuda = kc.cuda

# private: used by trainer.optim
__all__: list[str] = []

_SCALARS: dict[tuple[float, float, int, torch.dtype, torch.device], torch.Tensor] = {}


@cuda.jit(cache=True)
def _rowwise_adagrad_rows(
    values: Array, state: Array, rows: Array, grads: Array, scalars: Array
) -> None:
    """Thread ``i`` updates row ``rows[i]`` with ``grads[i]``; ``scalars`` = (lr, eps, D) in
    the values' float type."""
    i = cuda.grid(1)
    if i < rows.shape[0]:
        _update(values, state, rows[i], grads, i, scalars)


@cuda.jit(cache=True)
def _rowwise_adagrad_all(values: Array, state: Array, grads: Array, scalars: Array) -> None:
    """Thread ``i`` updates row ``i`` with ``grads[i]`` (a dense gradient: every row)."""
    i = cuda.grid(1)
    if i < grads.shape[0]:
        _update(values, state, i, grads, i, scalars)


@cuda.jit(device=True)
def _update(values: Array, state: Array, r: int, grads: Array, i: int, scalars: Array) -> None:
    acc = grads[i, 0] * grads[i, 0]
    for j in range(1, grads.shape[1]):
        acc += grads[i, j] * grads[i, j]
    s = state[r] + acc / scalars[2]
    state[r] = s
    mult = scalars[0] / (math.sqrt(s) + scalars[1])
    for j in range(grads.shape[1]):
        values[r, j] -= grads[i, j] * mult


def rowwise_adagrad(
    values: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor | None,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """Row-wise Adagrad in place (see :func:`trainer.optim.rowwise_adagrad_`) in one launch:
    ``rows`` the distinct rows ``grads`` updates, ``None`` for every row (a dense gradient).
    ``values`` ``[rows, D]`` and ``state`` ``[rows]`` contiguous, of one float type."""
    dim = grads.shape[1]
    key = (lr, eps, dim, values.dtype, values.device)
    scalars = _SCALARS.get(key)
    if scalars is None:  # made once: no host-to-device copy per step
        scalars = torch.tensor([lr, eps, dim], dtype=values.dtype, device=values.device)
        _SCALARS[key] = scalars
    grads = grads.to(values.dtype).contiguous()
    threads = kc._threads(256)
    n = grads.shape[0] if rows is None else rows.shape[0]
    blocks = kc._blocks(n, threads, cap=2**31 - 1)
    if rows is None:
        kc.launch(_rowwise_adagrad_all, blocks, threads, values.device, values, state, grads,
                  scalars)  # fmt: skip
    else:
        kc.launch(
            _rowwise_adagrad_rows, blocks, threads, values.device, values, state,
            rows.to(torch.int64), grads, scalars,
        )  # fmt: skip
