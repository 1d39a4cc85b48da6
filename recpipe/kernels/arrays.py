"""Zero-copy views of torch tensors for the Numba kernels.

The kernels never see torch: the CPU forms run on ``numpy`` views returned by :func:`as_numpy`
(``tensor.numpy()`` shares the tensor's memory) and the CUDA forms on Numba device arrays returned
by :func:`recpipe.kernels.cuda.as_device_array` (``numba.cuda.as_cuda_array``). Element types that
Numba cannot do arithmetic on (``float16``, ``bfloat16``, ``bool``) are viewed as a same-width
integer type by :func:`as_bits` wherever a kernel only moves bytes.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import torch

from recpipe.errors import DataError

__all__ = ["Array", "as_bits", "as_numpy", "bits_dtype", "compute_dtype", "flat2d", "row_width"]

Array: TypeAlias = Any
"""What a kernel's body indexes: a NumPy array (the CPU forms, the CUDA simulator) or a Numba
device array (the CUDA forms). Numba types the kernels from their arguments, not from hints."""

_BITS_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Return a ``numpy`` array sharing ``tensor``'s memory (a copy only if it is not contiguous).

    Args:
        tensor: a CPU tensor of a dtype numpy knows (not ``bfloat16``; use :func:`as_bits`).
    """
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.contiguous().numpy()


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width as ``dtype`` (for kernels that only move bytes)."""
    size = dtype.itemsize
    if size not in _BITS_BY_SIZE:
        msg = f"`values` dtype {dtype} has {size}-byte elements; supported widths are 1, 2, 4 and 8"
        raise DataError(msg)
    return _BITS_BY_SIZE[size]


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` (contiguous) as the integer dtype of the same width, sharing memory."""
    tensor = tensor.detach().contiguous()
    if not tensor.dtype.is_floating_point and tensor.dtype in _BITS_BY_SIZE.values():
        return tensor
    return tensor.view(bits_dtype(tensor.dtype))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic runs in: ``float32`` for the half types, ``dtype`` otherwise."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def flat2d(tensor: torch.Tensor) -> torch.Tensor:
    """View ``[N]`` or ``[N, ...]`` as ``[N, D]`` (``D = 1`` for 1-d), sharing memory."""
    return tensor.reshape(tensor.shape[0], row_width(tensor))


def row_width(tensor: torch.Tensor) -> int:
    """Elements per row of ``[N]`` (1) or ``[N, ...]`` (the product of the trailing sizes)."""
    width = 1
    for size in tensor.shape[1:]:
        width *= size
    return width
