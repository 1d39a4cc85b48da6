"""Small tensor helpers shared by the jagged types and :class:`recpipe.batch.Batch`.

Private: the public surface is the ``to``/``pin_memory`` methods of the types themselves.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from recpipe.errors import DataError

__all__ = [
    "as_index_tensor",
    "as_tensor",
    "can_pin_memory",
    "move_tensor",
    "pin_optional",
    "pin_tensor",
    "quote",
    "tensors_equal",
]


@functools.cache
def can_pin_memory() -> bool:
    """Whether page-locked host memory is available (it needs an accelerator).

    In torch 2.13 ``Tensor.pin_memory()`` raises ``RuntimeError: Cannot access accelerator device
    when none is available`` on a CPU-only machine, so the ``pin_memory()`` methods of recpipe's
    types are a no-op there (pinning only speeds up host -> accelerator copies, of which there
    are none).
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.pin_memory()`` where pinning is possible; ``tensor`` itself otherwise."""
    if tensor.device.type != "cpu" or not can_pin_memory() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def move_tensor(
    tensor: torch.Tensor | None, device: torch.device | str, *, non_blocking: bool
) -> torch.Tensor | None:
    """``tensor.to(device, non_blocking=...)``; ``None`` (not yet derived) stays ``None``."""
    return None if tensor is None else tensor.to(device, non_blocking=non_blocking)


def pin_optional(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`pin_tensor`, passing ``None`` (a field not derived yet) through."""
    return None if tensor is None else pin_tensor(tensor)


def as_tensor(array: Any, *, name: str) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory where possible (``torch.from_numpy``).

    Args:
        array: a ``torch.Tensor``, a ``numpy.ndarray`` or anything ``numpy.asarray`` accepts
            (a pyarrow array without nulls, a list).
        name: the argument's name, quoted in errors.
    """
    if isinstance(array, torch.Tensor):
        return array
    try:
        arr = np.asarray(array)
    except Exception as exc:
        msg = f"`{name}` cannot be read as an array: {type(array).__name__} ({exc})"
        raise DataError(msg) from exc
    if arr.dtype == object:
        msg = f"`{name}` has object dtype (ragged or mixed input?): {quote(arr)}"
        raise DataError(msg)
    if not arr.flags.writeable:
        # Arrow buffers and mmaps are read-only; torch.from_numpy shares them but warns (and
        # warnings are errors in the test suite). recpipe never writes through these tensors.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)


def as_index_tensor(array: Any, *, name: str, device: torch.device | None = None) -> torch.Tensor:
    """``array`` as a 1-d int64 tensor (a copy only when the dtype or device differs)."""
    tensor = as_tensor(array, name=name)
    if tensor.dim() != 1:
        msg = f"`{name}` must be 1-d, got shape {tuple(tensor.shape)}"
        raise DataError(msg)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        msg = f"`{name}` must hold integers, got dtype {tensor.dtype}"
        raise DataError(msg)
    return tensor.to(device=device, dtype=torch.int64)


def tensors_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Exact equality: same dtype, same shape, same elements (``None`` equals only ``None``).

    NaNs in the same positions count as equal (a dense feature without a fill is NaN, and a
    batch must equal itself).
    """
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def quote(value: Any, *, limit: int = 8) -> str:
    """A short printable form of ``value`` for error messages (first ``limit`` elements)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().reshape(-1)
        head = value[:limit].tolist()
        more = ", ..." if value.numel() > limit else ""
        return f"[{', '.join(map(str, head))}{more}] (numel {value.numel()})"
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        more = ", ..." if flat.size > limit else ""
        return f"[{', '.join(map(str, flat[:limit].tolist()))}{more}] (numel {flat.size})"
    if isinstance(value, Sequence) and not isinstance(value, str):
        head = list(value[:limit])
        more = ", ..." if len(value) > limit else ""
        return f"[{', '.join(map(repr, head))}{more}]"
    return repr(value)
