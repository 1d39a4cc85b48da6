"""Kernels over jagged tensors: dedup, partial dedup, jagged index select/add, segment pooling.

Each op has a Numba CPU form (:mod:`recpipe.kernels.cpu`) and a Numba-CUDA form
(:mod:`recpipe.kernels.cuda`) working on the same torch tensors without copies; the functions
exported here check their arguments and dispatch on ``tensor.device.type``
(:func:`recpipe.kernels.registry.get_kernel`).
"""

from __future__ import annotations

from recpipe.kernels.arrays import as_bits, as_numpy
from recpipe.kernels.ops import (
    ReduceMode,
    dedup_rows,
    jagged_index_add,
    jagged_index_select,
    partial_dedup,
    segment_reduce,
)
from recpipe.kernels.registry import get_kernel

__all__ = [
    "ReduceMode",
    "as_bits",
    "as_numpy",
    "dedup_rows",
    "get_kernel",
    "jagged_index_add",
    "jagged_index_select",
    "partial_dedup",
    "segment_reduce",
]
