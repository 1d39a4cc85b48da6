"""The Numba-CUDA kernels against the CPU kernels and the NumPy references.

On a GPU the tensors live on ``cuda`` and the public dispatchers pick the CUDA forms by device.
Without one, under ``NUMBA_ENABLE_CUDASIM=1`` (CI), the registry is pointed at the CUDA module for
CPU tensors, so the same tests (autograd included) run every CUDA kernel in the simulator. The
simulator runs each GPU thread as Python: sizes stay tiny.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recpipe.kernels import (
    cpu,
    dedup_rows,
    jagged_index_add,
    jagged_index_select,
    partial_dedup,
    registry,
    segment_reduce,
)
from tests.recpipe.kernel_reference import (
    ref_dedup_rows,
    ref_jagged_index_add,
    ref_jagged_index_select,
    ref_partial_dedup,
    ref_segment_reduce,
)
from tests.recpipe.test_kernels import groups, id_lists, jagged, reduce_cases, select_cases

pytestmark = pytest.mark.cuda

SIM_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _simulator_enabled() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@pytest.fixture
def device(monkeypatch) -> str:
    """``"cuda"`` on a GPU; under the simulator ``"cpu"`` with the registry routed to CUDA forms."""
    if torch.cuda.is_available():
        return "cuda"
    if not _simulator_enabled():
        pytest.skip("no GPU and NUMBA_ENABLE_CUDASIM is not set")
    monkeypatch.setitem(registry.BACKENDS, "cpu", "recpipe.kernels.cuda")
    monkeypatch.setattr(registry, "_CACHE", {})
    return "cpu"


def _use_layout(monkeypatch, layout: str) -> None:
    """``"word"`` / ``"row"``: both kernels in that layout; ``"run"``: the row select and the
    add by runs of equal indices."""
    from recpipe.kernels import cuda as kc

    monkeypatch.setattr(kc, "SELECT_LAYOUT", "row" if layout == "run" else layout)
    monkeypatch.setattr(kc, "ADD_LAYOUT", layout)


def test_routing_reaches_the_cuda_forms(device):
    from recpipe.kernels import cuda

    assert registry.get_kernel("dedup_rows", device) is cuda.dedup_rows


@SIM_SETTINGS
@given(groups(), st.sampled_from([-1, 0]))
def test_dedup_rows_cuda(device, group, hash_mask):
    keys, dtypes = group
    keys = [k[:8] for k in keys]
    tensors = [jagged(lists, dtype) for lists, dtype in zip(keys, dtypes)]
    values = [v for v, _ in tensors]
    offsets = [o for _, o in tensors]
    unique, inverse = dedup_rows(
        [v.to(device) for v in values], [o.to(device) for o in offsets], hash_mask=hash_mask
    )
    cpu_unique, cpu_inverse = cpu.dedup_rows(values, offsets)
    ref_unique, ref_inverse = ref_dedup_rows(
        [v.numpy() for v in values], [o.numpy() for o in offsets]
    )
    assert torch.equal(unique.cpu(), cpu_unique) and torch.equal(inverse.cpu(), cpu_inverse)
    np.testing.assert_array_equal(unique.cpu().numpy(), ref_unique)
    np.testing.assert_array_equal(inverse.cpu().numpy(), ref_inverse)


def test_dedup_rows_cuda_forced_collisions(device):
    keys = [[[1, 2], [1, 2], [1, 2], [1, 3], [1, 2], []], [[9], [8], [9], [9], [9], []]]
    values = [jagged(k)[0].to(device) for k in keys]
    offsets = [jagged(k)[1].to(device) for k in keys]
    unique, inverse = dedup_rows(values, offsets, hash_mask=0)
    assert unique.tolist() == [0, 1, 3, 5]
    assert inverse.tolist() == [0, 1, 0, 2, 0, 3]


@SIM_SETTINGS
@given(id_lists(max_rows=8), st.sampled_from([torch.int32, torch.int64]))
def test_partial_dedup_cuda(device, lists, dtype):
    values, offsets = jagged(lists, dtype)
    got = partial_dedup(values.to(device), offsets.to(device))
    want = cpu.partial_dedup(values, offsets)
    ref = ref_partial_dedup(values.numpy(), offsets.numpy())
    for g, w, r in zip(got, want, ref):
        assert torch.equal(g.cpu(), w)
        np.testing.assert_array_equal(g.cpu().numpy(), r)


def _small(case):
    """Trim a select/reduce case so the simulator stays fast (very long rows become 40 long)."""
    values, offsets, extra = case
    lengths = (offsets[1:] - offsets[:-1]).clamp(max=40)
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    keep = (
        torch.cat(
            [
                torch.arange(int(offsets[b]), int(offsets[b]) + int(lengths[b]))
                for b in range(len(lengths))
            ]
        )
        if len(lengths)
        else torch.zeros(0, dtype=torch.int64)
    )
    return values[keep], new_offsets, extra


@SIM_SETTINGS
@given(select_cases(), st.sampled_from(["word", "row", "run"]), st.booleans())
def test_jagged_index_select_and_add_cuda(device, monkeypatch, case, layout, known):
    """Every layout of the select and add kernels, with and without the caller's known output
    layout (which the CUDA form trusts), against the CPU forms and the NumPy reference."""
    _use_layout(monkeypatch, layout)
    values, offsets, indices = _small(case)
    want, want_offsets = cpu.jagged_index_select(values, offsets, indices)
    layout_args = (
        {"out_offsets": want_offsets.to(device), "num_out_values": int(want_offsets[-1])}
        if known
        else {}
    )
    out, out_offsets = jagged_index_select(
        values.to(device), offsets.to(device), indices.to(device), **layout_args
    )
    assert torch.equal(out.cpu(), want) and torch.equal(out_offsets.cpu(), want_offsets)
    ref_values = values.double().numpy() if values.dtype == torch.bfloat16 else values.numpy()
    ref_out, _ = ref_jagged_index_select(ref_values, offsets.numpy(), indices.numpy())
    np.testing.assert_array_equal(out.cpu().double().numpy(), ref_out.astype(np.float64))
    if values.dtype.is_floating_point:
        grad = want + 0.5
        got = jagged_index_add(
            grad.to(device), out_offsets, offsets.to(device), indices.to(device), values.shape[0]
        )
        expect = cpu.jagged_index_add(grad, want_offsets, offsets, indices, values.shape[0])
        tol = 1e-2 if values.dtype in (torch.float16, torch.bfloat16) else 1e-6
        torch.testing.assert_close(got.cpu(), expect, rtol=tol, atol=tol)
        ref_grad = ref_jagged_index_add(
            grad.double().numpy(), want_offsets.numpy(), offsets.numpy(), indices.numpy(),
            values.shape[0],
        )  # fmt: skip
        np.testing.assert_allclose(got.cpu().double().numpy(), ref_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["word", "row", "run"])
def test_select_and_add_kernels_with_empty_rows_and_repeats(device, monkeypatch, layout):
    """Empty rows between, before and after full ones: the word layout's binary search steps
    over them (the case a search gets wrong first); runs of repeated rows for the run layout."""
    _use_layout(monkeypatch, layout)
    values = torch.arange(24, dtype=torch.float32).reshape(8, 3).to(device)
    offsets = torch.tensor([0, 0, 3, 3, 3, 8, 8], device=device)
    indices = torch.tensor([0, 1, 3, 4, 1, 5, 0, 4, 4], device=device)
    out, out_offsets = jagged_index_select(values, offsets, indices)
    want, want_offsets = cpu.jagged_index_select(values.cpu(), offsets.cpu(), indices.cpu())
    assert torch.equal(out.cpu(), want) and torch.equal(out_offsets.cpu(), want_offsets)
    got = jagged_index_add(out, out_offsets, offsets, indices, 8)
    expect = ref_jagged_index_add(
        want.double().numpy(), want_offsets.numpy(), offsets.cpu().numpy(), indices.cpu().numpy(), 8
    )
    np.testing.assert_array_equal(got.cpu().double().numpy(), expect)  # small integers: exact


@pytest.mark.parametrize("layout", ["row", "run"])
def test_add_over_runs_of_repeated_rows(device, monkeypatch, layout):
    """Runs of equal indices as a session-clustered batch has them: one at the start, one
    longer than a piece (70 rows cross two multiples of 32), a row repeated in two separate
    runs, single rows between; small integers, so every sum is exact."""
    _use_layout(monkeypatch, layout)
    values = torch.arange(40, dtype=torch.float32).reshape(20, 2).to(device)
    offsets = torch.tensor([0, 3, 3, 7, 8, 20], device=device)
    runs = [(2, 5), (0, 70), (4, 1), (1, 3), (2, 2), (3, 33)]
    indices = torch.cat([torch.full((n,), r) for r, n in runs]).to(device)
    out, out_offsets = jagged_index_select(values, offsets, indices)
    got = jagged_index_add(out, out_offsets, offsets, indices, 20)
    expect = ref_jagged_index_add(
        out.cpu().double().numpy(), out_offsets.cpu().numpy(), offsets.cpu().numpy(),
        indices.cpu().numpy(), 20,
    )  # fmt: skip
    np.testing.assert_array_equal(got.cpu().double().numpy(), expect)


@SIM_SETTINGS
@given(reduce_cases())
def test_segment_reduce_cuda(device, case):
    values, offsets, mode = _small(case)
    values = values[:, :2] if values.dim() == 2 else values
    got = segment_reduce(values.to(device), offsets.to(device), mode)
    want, _ = cpu.segment_reduce(values, offsets, mode)
    ref, _ = ref_segment_reduce(values.numpy(), offsets.numpy(), mode)
    tol = 1e-2 if values.dtype == torch.float16 else 1e-6
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got.cpu().double().numpy(), ref, rtol=tol, atol=tol)


def test_jagged_index_select_gradcheck_cuda(device):
    values = torch.randn(7, 2, dtype=torch.float64, device=device, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 7], device=device)
    indices = torch.tensor([2, 0, 2, 1], device=device)
    assert torch.autograd.gradcheck(
        lambda v: jagged_index_select(v, offsets, indices)[0], (values,)
    )


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_segment_reduce_gradcheck_cuda(device, mode):
    values = torch.randperm(12, dtype=torch.float64).reshape(6, 2).to(device).requires_grad_(True)
    offsets = torch.tensor([0, 2, 2, 6], device=device)
    assert torch.autograd.gradcheck(lambda v: segment_reduce(v, offsets, mode), (values,))


def test_cuda_forms_refuse_cpu_tensors_without_simulator(monkeypatch):
    from recpipe.errors import DependencyError
    from recpipe.kernels import cuda

    monkeypatch.setattr(cuda, "is_simulator", lambda: False)
    with pytest.raises(DependencyError, match="the CUDA kernels need CUDA tensors"):
        cuda.as_device_array(torch.zeros(2))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (the simulator has no compiled kernels)"
)
def test_kernels_launch_without_numbas_dispatcher_on_a_gpu():
    """On a GPU every CUDA form launches its compiled kernel directly (the fallback through the
    dispatcher is for other numba-cuda versions), and the result is still the reference's."""
    from recpipe.kernels import cuda as kc

    values = torch.randn(7, 3, device="cuda")
    offsets = torch.tensor([0, 2, 2, 7], device="cuda")
    indices = torch.tensor([2, 0, 2, 1], device="cuda")
    out, out_offsets = jagged_index_select(values, offsets, indices)
    want, want_offsets = cpu.jagged_index_select(values.cpu(), offsets.cpu(), indices.cpu())
    assert torch.equal(out.cpu(), want) and torch.equal(out_offsets.cpu(), want_offsets)
    got = jagged_index_add(out, out_offsets, offsets, indices, 7)
    expect = cpu.jagged_index_add(want, want_offsets, offsets.cpu(), indices.cpu(), 7)
    torch.testing.assert_close(got.cpu(), expect)
    compiled = {key[0]: kernel for key, kernel in kc._DIRECT.items()}
    launched = {
        "the selected rows' offsets": kc._selected_offsets,
        f"the {kc.SELECT_LAYOUT!r} select": {"row": kc._select_rows, "word": kc._select_words}[
            kc.SELECT_LAYOUT
        ],
        f"the {kc.ADD_LAYOUT!r} add": {
            "run": kc._add_runs, "row": kc._add_rows, "word": kc._add_words
        }[kc.ADD_LAYOUT],
    }  # fmt: skip
    assert {name: compiled.get(kernel) is not None for name, kernel in launched.items()} == {
        name: True for name in launched
    }


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (too many threads for the simulator)"
)
@pytest.mark.parametrize("layout", ["word", "row", "run"])
@pytest.mark.parametrize("dim", [1, 3, 64])
def test_select_and_add_layouts_at_a_batchs_size_on_a_gpu(monkeypatch, layout, dim):
    """Thousands of rows, many tiles of 256 threads: every layout equals the CPU forms (the
    select bitwise, the atomic add to float32 rounding)."""
    _use_layout(monkeypatch, layout)
    gen = torch.Generator().manual_seed(dim)
    lengths = torch.randint(0, 40, (3000,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randn(int(offsets[-1]), dim, generator=gen)
    indices = torch.randint(0, 3000, (5000,), generator=gen)
    indices = indices.repeat_interleave(torch.randint(1, 12, (5000,), generator=gen))  # runs
    want, want_offsets = cpu.jagged_index_select(values, offsets, indices)
    for known in ({}, {"out_offsets": want_offsets.cuda(), "num_out_values": len(want)}):
        out, out_offsets = jagged_index_select(
            values.cuda(), offsets.cuda(), indices.cuda(), **known
        )
        assert torch.equal(out.cpu(), want) and torch.equal(out_offsets.cpu(), want_offsets)
    grad = torch.randn(want.shape, generator=gen)
    got = jagged_index_add(grad.cuda(), out_offsets, offsets.cuda(), indices.cuda(), len(values))
    expect = cpu.jagged_index_add(grad, want_offsets, offsets, indices, len(values))
    torch.testing.assert_close(got.cpu(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (the simulator launches through Numba)"
)
@pytest.mark.parametrize("layout", ["row", "run"])
def test_the_driver_launch_route_on_a_gpu(monkeypatch, layout):
    """``RECPIPE_CUDA_LAUNCH=driver``: every kernel of a select and its add launched by
    ``cuLaunchKernel`` with the packed parameter buffer gives the CPU forms' results."""
    from recpipe.kernels import cuda as kc

    monkeypatch.setenv("RECPIPE_CUDA_LAUNCH", "driver")
    monkeypatch.setattr(kc, "_DRIVER", [])
    _use_layout(monkeypatch, layout)
    assert kc._driver() is not None
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 30, (2000,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randn(int(offsets[-1]), 16, generator=gen)
    indices = torch.randint(0, 2000, (3000,), generator=gen).repeat_interleave(3)
    want, want_offsets = cpu.jagged_index_select(values, offsets, indices)
    out, out_offsets = jagged_index_select(values.cuda(), offsets.cuda(), indices.cuda())
    assert torch.equal(out.cpu(), want) and torch.equal(out_offsets.cpu(), want_offsets)
    grad = torch.randn(want.shape, generator=gen)
    got = jagged_index_add(grad.cuda(), out_offsets, offsets.cuda(), indices.cuda(), len(values))
    expect = cpu.jagged_index_add(grad, want_offsets, offsets, indices, len(values))
    torch.testing.assert_close(got.cpu(), expect, rtol=1e-5, atol=1e-5)
    assert kc._DRIVER[0]._functions  # the driver launched them


def test_an_unknown_launch_route_is_refused_by_name(monkeypatch):
    """A misspelt ``RECPIPE_CUDA_LAUNCH`` is an error naming the variable, not a silent fall
    back to the default route."""
    from recpipe.errors import RecpipeError
    from recpipe.kernels import cuda as kc

    monkeypatch.setenv("RECPIPE_CUDA_LAUNCH", "drivr")
    with pytest.raises(RecpipeError, match="`RECPIPE_CUDA_LAUNCH` must be one of core, driver, "
                       "dispatcher, got 'drivr'"):  # fmt: skip
        kc._route()
