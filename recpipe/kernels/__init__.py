"""Kernels over jagged tensors: dedup, partial dedup, jagged index select/add, segment pooling.

Each op has a Numba CPU form (:mod:`recpipe.kernels.cpu`) and a Numba-CUDA form
(:mod:`recpipe.kernels.cuda`) working on the same torch tensors without copies; the functions
exported here check their arguments and dispatch on ``tensor.device.type``
(:func:`recpipe.kernels.registry.get_kernel`). The one integer hash of the project, splitmix64,
lives here too: :mod:`recpipe.kernels.splitmix` (NumPy/Numba, no torch: the ETL uses it) and
:mod:`recpipe.kernels.hashing` (torch tensors on any device).

Names are re-exported lazily (PEP 562), so ``from recpipe.kernels.splitmix import mix64``
imports neither torch nor the jagged kernels.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "GOLDEN",
    "ReduceMode",
    "as_bits",
    "as_numpy",
    "dedup_rows",
    "get_kernel",
    "hash_modulo",
    "hash_modulo_tensor",
    "jagged_index_add",
    "jagged_index_select",
    "mix64",
    "partial_dedup",
    "segment_reduce",
    "splitmix64",
    "splitmix64_tensor",
]

_WHERE = {
    "recpipe.kernels.arrays": ("as_bits", "as_numpy"),
    "recpipe.kernels.ops": (
        "ReduceMode", "dedup_rows", "jagged_index_add", "jagged_index_select", "partial_dedup",
        "segment_reduce",
    ),
    "recpipe.kernels.registry": ("get_kernel",),
    "recpipe.kernels.splitmix": ("GOLDEN", "hash_modulo", "mix64", "splitmix64"),
    "recpipe.kernels.hashing": ("hash_modulo_tensor", "splitmix64_tensor"),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
