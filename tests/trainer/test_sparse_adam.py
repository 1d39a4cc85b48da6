"""``trainer.optim.sparse_adam_``: the lazy Adam every table backend other than parameter tables
applies (the store's host rows and hot set, sharded rows and hot replicas). It gives
``torch.optim.SparseAdam``'s bits, on the store's layout (values and moments side by side in one
slab), and a NumPy transcription of the formula in float64 its values to rounding (not bit for
bit: torch's CPU ``sqrt`` is not the correctly rounded one NumPy's is)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recpipe.errors import RecpipeError
from trainer.optim import ADAM_BETAS, sparse_adam_

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _steps(dtype, gen, rows_n=40, dim=6, steps=25):
    """(step, rows, grads) of ``steps`` steps, each a random subset of rows in random order;
    every 6th step touches no row; a touched row may have a zero gradient."""
    for step in range(1, steps + 1):
        n = int(torch.randint(1, 15, (1,), generator=gen)) if step % 6 else 0
        rows = torch.randperm(rows_n, generator=gen)[:n]
        grads = torch.randn(n, dim, generator=gen, dtype=dtype)
        if n > 1:
            grads[1] = 0.0
        yield step, rows, grads


@DTYPES
def test_sparse_adam_is_torch_sparse_adam_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    rows_n, dim, lr = 40, 6, 0.01
    start = torch.randn(rows_n, dim, generator=gen, dtype=dtype)
    weight = torch.nn.Parameter(start.clone())
    reference = torch.optim.SparseAdam([weight], lr=lr)
    # the store's layout: values and moments side by side in one [rows, 3D] slab (views)
    slab = torch.cat([start, torch.zeros(rows_n, 2 * dim, dtype=dtype)], 1)
    for step, rows, grads in _steps(dtype, gen, rows_n, dim):
        weight.grad = torch.sparse_coo_tensor(
            rows.unsqueeze(0), grads, (rows_n, dim), check_invariants=True
        )
        reference.step()
        sparse_adam_(slab[:, :dim], slab[:, dim:], rows, grads, lr=lr, eps=1e-8, step=step)
        state = reference.state[weight]
        assert torch.equal(slab[:, :dim], weight.detach()), step
        assert torch.equal(slab[:, dim : 2 * dim], state["exp_avg"]), step
        assert torch.equal(slab[:, 2 * dim :], state["exp_avg_sq"]), step
    assert not torch.equal(slab[:, :dim], start)


def _numpy_adam(values, state, rows, grads, *, lr, eps, step):
    """The formula in float64 NumPy, element by element."""
    beta1, beta2 = ADAM_BETAS
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    dim = values.shape[1]
    for i, r in enumerate(rows):
        for j in range(dim):
            g, m, v = grads[i, j], state[r, j], state[r, dim + j]
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            state[r, j], state[r, dim + j] = m, v
            values[r, j] -= step_size * m / (math.sqrt(v) + eps)


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_sparse_adam_is_the_numpy_formula(dtype, rtol):
    rng = np.random.default_rng(5)
    rows_n, dim, lr = 30, 5, 0.02
    values = rng.standard_normal((rows_n, dim)).astype(dtype)
    state = np.zeros((rows_n, 2 * dim), dtype=dtype)
    want_values, want_state = values.astype(np.float64), state.astype(np.float64)
    touched = np.zeros(rows_n, dtype=bool)
    for step in range(1, 16):
        rows = rng.permutation(rows_n)[: rng.integers(1, 12)].astype(np.int64)
        grads = rng.standard_normal((rows.size, dim)).astype(dtype)
        sparse_adam_(torch.from_numpy(values), torch.from_numpy(state), torch.from_numpy(rows),
                     torch.from_numpy(grads), lr=lr, eps=1e-8, step=step)  # fmt: skip
        _numpy_adam(want_values, want_state, rows, grads.astype(np.float64), lr=lr, eps=1e-8,
                    step=step)  # fmt: skip
        touched[rows] = True
        np.testing.assert_allclose(values, want_values, rtol=rtol, atol=0)
        np.testing.assert_allclose(state, want_state, rtol=rtol * 10, atol=0)
    assert touched.sum() > 20


def test_sparse_adam_refuses_what_it_cannot_mean():
    values, state = torch.zeros(2, 2), torch.zeros(2, 4)
    with pytest.raises(RecpipeError, match="must be >= 1"):  # the step counts this update
        sparse_adam_(values, state, torch.tensor([0]), torch.ones(1, 2), lr=0.1, eps=1e-8, step=0)
    with pytest.raises(RecpipeError, match=r"\[rows, 2D\]"):
        sparse_adam_(values, torch.zeros(2), torch.tensor([0]), torch.ones(1, 2), lr=0.1,
                     eps=1e-8, step=1)  # fmt: skip
    sparse_adam_(values, state, torch.tensor([], dtype=torch.int64), torch.ones(0, 2), lr=0.1,
                 eps=1e-8, step=0)  # no rows: nothing to do, nothing checked  # fmt: skip
