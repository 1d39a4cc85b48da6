"""Row-wise Adagrad's CUDA kernel (one launch per table) against the CPU kernel.

Under ``NUMBA_ENABLE_CUDASIM=1`` (CI) the kernel runs in Numba's simulator on CPU tensors; on a
GPU the optimizer itself runs on CUDA tensors and is compared with the same steps on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recpipe.kernels import cuda as kc
from trainer import _kernels
from trainer.optim import RowwiseAdagrad

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not kc.is_simulator(), reason="needs NUMBA_ENABLE_CUDASIM=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dense", [True, False])
def test_the_cuda_kernel_updates_as_the_cpu_kernel_in_the_simulator(dtype, dense):
    """Every listed row (or every row) moves as the CPU kernel moves it, the others not at all
    (the simulator computes the square root in float64: a tolerance, not bits)."""
    from trainer import _cuda_kernels

    gen = torch.Generator().manual_seed(7)
    values = torch.randn(40, 5, generator=gen, dtype=dtype)
    state = torch.rand(40, generator=gen, dtype=dtype)
    rows = None if dense else torch.tensor([3, 0, 17, 39, 8])
    grads = torch.randn(40 if dense else 5, 5, generator=gen, dtype=dtype)
    want_values, want_state = values.clone(), state.clone()
    all_rows = torch.arange(40) if rows is None else rows
    t = {torch.float32: np.float32, torch.float64: np.float64}[dtype]
    _kernels.rowwise_adagrad(
        want_values.numpy(), want_state.numpy(), all_rows.numpy(), grads.numpy(), t(0.1),
        t(1e-8), t(5),
    )  # fmt: skip
    _cuda_kernels.rowwise_adagrad(values, state, rows, grads, lr=0.1, eps=1e-8)
    torch.testing.assert_close(values, want_values, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state, want_state, rtol=1e-6, atol=1e-7)
    if rows is not None:
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(values[untouched], want_values[untouched])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("sparse", [False, True])
def test_rowwise_adagrad_on_a_gpu_trains_as_on_the_cpu(sparse):
    """Five steps of RowwiseAdagrad on a CUDA table (the one-launch kernel) and on a CPU table
    (the CPU kernel), same gradients: the same rows move, by the same amounts to float32
    rounding (a fused multiply-add on the device may move a last bit)."""
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(1000, 16, generator=gen)
    tables = {d: torch.nn.Parameter(init.clone().to(d)) for d in ("cpu", "cuda")}
    opts = {d: RowwiseAdagrad([t], lr=0.05) for d, t in tables.items()}
    for _ in range(5):
        ids = torch.randint(0, 1000, (300,), generator=gen)
        for d, table in tables.items():
            opts[d].zero_grad()
            emb = torch.nn.functional.embedding(ids.to(d), table, sparse=sparse)
            (emb * torch.arange(16, device=d)).sum().backward()
            opts[d].step()
    torch.testing.assert_close(tables["cuda"].detach().cpu(), tables["cpu"].detach())
