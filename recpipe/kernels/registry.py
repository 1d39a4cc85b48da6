"""A registry of kernel forms by device type, and the one lookup every dispatcher uses.

Each backend is a module exposing one function per op under the same name (see :data:`OPS`):
``"cpu"`` is :mod:`recpipe.kernels.cpu` (Numba), ``"cuda"`` is :mod:`recpipe.kernels.cuda`
(Numba-CUDA, imported only when a CUDA tensor shows up, so CPU-only users never import it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from recpipe.errors import DataError

__all__ = ["BACKENDS", "OPS", "get_kernel"]

BACKENDS: dict[str, str] = {
    "cpu": "recpipe.kernels.cpu",
    "cuda": "recpipe.kernels.cuda",
}

OPS: tuple[str, ...] = (
    "dedup_rows",
    "partial_dedup",
    "jagged_index_select",
    "jagged_index_add",
    "segment_reduce",
    "segment_reduce_backward",
)

_CACHE: dict[tuple[str, str], Callable[..., Any]] = {}


def get_kernel(op: str, device: torch.device | str) -> Callable[..., Any]:
    """Return the form of ``op`` for ``device``'s type.

    Args:
        op: one of :data:`OPS`.
        device: a device (only its type matters) or a device type such as ``"cuda"``.

    Raises:
        DataError: ``op`` is unknown or no backend handles the device type.
    """
    device_type = device if isinstance(device, str) else device.type
    key = (op, device_type)
    fn = _CACHE.get(key)
    if fn is None:
        if op not in OPS:
            msg = f"`op` {op!r} is not a kernel; known: {', '.join(OPS)}"
            raise DataError(msg)
        if device_type not in BACKENDS:
            msg = f"no kernels for device type {device_type!r}; supported: {', '.join(BACKENDS)}"
            raise DataError(msg)
        fn = getattr(importlib.import_module(BACKENDS[device_type]), op)
        _CACHE[key] = fn
    return fn
