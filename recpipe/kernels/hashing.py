"""splitmix64 for torch tensors on any device: the same numbers as :mod:`recpipe.kernels.splitmix`.

torch has no uint64 arithmetic, so the torch form runs in int64 with wrapping multiplies and a
logical right shift built from the arithmetic one. On CPU :func:`hash_modulo_tensor` hands the
tensor's memory to the Numba kernel instead (one pass, no temporaries).

>>> import torch
>>> hash_modulo_tensor(torch.tensor([-5, 7]), salt=0, modulus=10).tolist()
[4, 7]
"""

from __future__ import annotations

import torch

from recpipe.kernels.splitmix import GOLDEN, hash_modulo, salt_add

__all__ = ["hash_modulo_tensor", "splitmix64_tensor"]

_MASK_64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    x &= _MASK_64
    return x - (1 << 64) if x >= 1 << 63 else x


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_tensor(x: torch.Tensor, *, add: int = GOLDEN) -> torch.Tensor:
    """``mix64(x + add)`` element-wise over int64 (bits as uint64), on ``x``'s device.

    Args:
        x: int64 tensor of any shape.
        add: the increment (default :data:`~recpipe.kernels.splitmix.GOLDEN`).

    Returns:
        int64 tensor holding the uint64 hashes' bits.
    """
    x = x + _signed(add)
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def hash_modulo_tensor(ids: torch.Tensor, *, salt: int, modulus: int) -> torch.Tensor:
    """``mix64(ids + salt_add(salt))`` read as int64, mod ``modulus``: int64 in ``[0, modulus)``.

    One Numba pass on CPU (:func:`recpipe.kernels.splitmix.hash_modulo`), torch elsewhere.

    Args:
        ids: 1-d int64 tensor.
        salt: seeds the hash.
        modulus: size of the output range, ``>= 1``.
    """
    if ids.device.type != "cpu":
        return torch.remainder(splitmix64_tensor(ids, add=salt_add(salt)), modulus)
    return torch.from_numpy(hash_modulo(ids.contiguous().numpy(), salt=salt, modulus=modulus))
