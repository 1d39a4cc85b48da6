"""The kernel bodies shared by the CPU and CUDA forms: compiled both ways, they agree with Python.

The bodies are plain Python, so running them uncompiled is the reference. The CUDA form runs in a
one-thread kernel (in Numba's simulator without a GPU: ``NUMBA_ENABLE_CUDASIM=1``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from recpipe._deps import has_module
from recpipe.kernels import bodies

CPU = bodies.compile_bodies(njit)


@st.composite
def jagged_rows(draw):
    """Rows that often repeat, extend or slide the previous row (what partial dedup looks for)."""
    rows: list[list[int]] = []
    for _ in range(draw(st.integers(1, 8))):
        prev = rows[-1] if rows else []
        how = draw(st.sampled_from(["new", "same", "extend", "slide"]))
        new_id = draw(st.integers(-(2**63), 2**63 - 1))
        if how == "same":
            rows.append(list(prev))
        elif how == "extend":
            rows.append([*prev, new_id])
        elif how == "slide" and prev:
            rows.append([*prev[1:], new_id])
        else:
            rows.append(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5)))
    values = np.array([v for r in rows for v in r], dtype=np.int64)
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    return values, offsets


def _cpu_results(values, offsets):
    rows = len(offsets) - 1
    hashes = [CPU["fold_list"](values, offsets[r], offsets[r + 1], 7, 9) for r in range(rows)]
    appended = [CPU["appended_ids"](values, offsets, r) for r in range(rows)]
    equal = [
        CPU["lists_equal"](values, offsets[r - 1], offsets[r], offsets[r], offsets[r + 1])
        for r in range(1, rows)
    ]
    return hashes, appended, equal


def _python_results(values, offsets):
    rows = len(offsets) - 1
    hashes = [bodies.fold_list(values, offsets[r], offsets[r + 1], 7, 9) for r in range(rows)]
    appended = [bodies.appended_ids(values, offsets, r) for r in range(rows)]
    equal = [
        bodies.lists_equal(values, offsets[r - 1], offsets[r], offsets[r], offsets[r + 1])
        for r in range(1, rows)
    ]
    return hashes, appended, equal


@settings(max_examples=50, deadline=None)
@given(case=jagged_rows())
def test_njit_bodies_match_python(case):
    values, offsets = case
    with np.errstate(over="raise"):  # no body may overflow int64, even as Python over numpy
        expected = _python_results(values, offsets)
    got = _cpu_results(values, offsets)
    assert [tuple(int(x) for x in h) for h in got[0]] == [
        tuple(int(x) for x in h) for h in expected[0]
    ]
    assert got[1:] == (
        [int(x) for x in expected[1]],
        [bool(x) for x in expected[2]],
    )
    rows = [values[offsets[r] : offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]
    assert got[2] == [rows[r - 1] == rows[r] for r in range(1, len(rows))]


def test_running_max_keeps_the_first_maximum_and_nan_wins():
    x = np.array([[1.0, 2.0], [3.0, np.nan], [3.0, 5.0]])
    assert CPU["running_max"](x, 0, 3, 0) == (3.0, 1)
    best, at = CPU["running_max"](x, 0, 3, 1)
    assert np.isnan(best) and at == 1


@functools.cache
def _cuda_bodies_kernel():
    """A one-thread kernel running the CUDA-compiled bodies, built once per test run (a kernel
    defined inside the test would be a new kernel, compiled again, for every example)."""
    from numba import cuda

    dev = bodies.compile_bodies(cuda.jit(device=True))
    fold, appended_ids = dev["fold_list"], dev["appended_ids"]

    @cuda.jit
    def kernel(values, offsets, hashes, appended):
        for r in range(offsets.shape[0] - 1):
            hashes[r, 0], hashes[r, 1] = fold(values, offsets[r], offsets[r + 1], 7, 9)
            appended[r] = appended_ids(values, offsets, r)

    return kernel


@pytest.mark.cuda
@settings(max_examples=10, deadline=None)
@given(case=jagged_rows())
def test_cuda_bodies_match_the_cpu_ones(case):
    from numba import config

    if not has_module("numba.cuda") or not (config.ENABLE_CUDASIM or _has_gpu()):
        pytest.skip("no GPU and NUMBA_ENABLE_CUDASIM is not set")
    values, offsets = case
    rows = len(offsets) - 1
    from numba import cuda

    dev = [cuda.to_device(a) for a in (values, offsets, np.zeros((rows, 2), np.int64))]
    dev.append(cuda.to_device(np.zeros(rows, np.int64)))
    _cuda_bodies_kernel()[1, 1](*dev)
    hashes, appended = dev[2].copy_to_host(), dev[3].copy_to_host()
    cpu_hashes, cpu_appended, _ = _cpu_results(values, offsets)
    assert [tuple(h) for h in hashes.tolist()] == [tuple(int(x) for x in h) for h in cpu_hashes]
    assert appended.tolist() == cpu_appended


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
