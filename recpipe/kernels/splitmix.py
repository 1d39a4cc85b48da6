"""splitmix64: the project's one integer hash, in Numba (scalar and array) and without torch.

Every deterministic id hash in recpipe is splitmix64's finaliser :func:`mix64` applied to
``x + add`` in wrapping uint64 arithmetic: the synthetic logs (``etl.synth``, ``add`` the golden
gamma), ``HashModulo`` / ``VocabLookup`` preprocessing (``add = GOLDEN * (salt + 1)``, see
:func:`salt_add`), and the embedding store's id index and row init (``mix64`` inside its own
kernels). This module imports NumPy and Numba only, so the ETL (which never imports torch) uses
it too; the torch form for tensors on any device is :mod:`recpipe.kernels.hashing`.

>>> import numpy as np
>>> splitmix64(np.array([0, 1], dtype=np.uint64)).tolist()
[16294208416658607535, 10451216379200822465]
>>> hash_modulo(np.array([-5, 7]), salt=0, modulus=10).tolist()
[4, 7]
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

__all__ = ["GOLDEN", "OWNER_ADD", "hash_modulo", "mix64", "owner_of", "salt_add", "splitmix64"]

GOLDEN = 0x9E3779B97F4A7C15
"""splitmix64's increment (the golden-ratio gamma), as a Python int."""
OWNER_ADD = 0xD6E8FEB86659FD93
"""The increment of :func:`owner_of`'s hash (rows' owners are part of checkpoints: never change)."""

_MASK_64 = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(cache=True, nogil=True, inline="always")
def mix64(x: Any) -> Any:
    """splitmix64's finaliser on one uint64: a bijection with good avalanche (Numba scalar).

    Call it from other ``@njit`` kernels; from Python use :func:`splitmix64` on arrays.
    """
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@njit(cache=True, nogil=True)
def _splitmix64_array(x: Any, add: Any, out: Any) -> None:
    for i in range(x.shape[0]):
        out[i] = mix64(x[i] + add)


@njit(cache=True, nogil=True)
def _hash_modulo_array(ids: Any, add: Any, modulus: Any, out: Any) -> None:
    """``out[i] = mix64(ids[i] + add)`` read as int64, mod ``modulus`` (Python's remainder)."""
    for i in range(ids.shape[0]):
        out[i] = np.int64(mix64(ids[i] + add)) % modulus


def salt_add(salt: int) -> int:
    """The increment a salted hash adds before mixing: ``GOLDEN * (salt + 1)`` mod 2**64."""
    return (GOLDEN * (int(salt) + 1)) & _MASK_64


def splitmix64(x: np.ndarray, *, add: int = GOLDEN) -> np.ndarray:
    """``mix64(x + add)`` element-wise, wrapping, as a new uint64 array of ``x``'s shape.

    Args:
        x: integers of any shape; signed ones are read as their two's-complement uint64.
        add: the increment (default :data:`GOLDEN`, i.e. one splitmix64 step from state ``x``).
    """
    flat = np.ascontiguousarray(np.asarray(x).astype(np.uint64, copy=False)).reshape(-1)
    out = np.empty(flat.shape[0], dtype=np.uint64)
    _splitmix64_array(flat, np.uint64(add & _MASK_64), out)
    return out.reshape(np.shape(x))


def hash_modulo(ids: np.ndarray, *, salt: int, modulus: int) -> np.ndarray:
    """``mix64(ids + salt_add(salt))`` read as int64, mod ``modulus`` (non-negative): int64.

    The hash behind ``readers.HashModulo`` (CPU); :func:`recpipe.kernels.hashing.hash_modulo_tensor`
    gives the same numbers for torch tensors on any device.

    Args:
        ids: 1-d int64 ids (negative and huge ones too).
        salt: seeds the hash.
        modulus: size of the output range, ``>= 1``.
    """
    flat = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
    out = np.empty(flat.shape[0], dtype=np.int64)
    _hash_modulo_array(flat, np.uint64(salt_add(salt)), np.int64(modulus), out)
    return out


def owner_of(ids: np.ndarray, world_size: int) -> np.ndarray:
    """The rank that owns each id when rows are spread over ``world_size`` ranks:
    ``mix64(id + OWNER_ADD) % world_size`` (int64, the ids' shape). The one map of the trainer's
    shards, caches and checkpoints and of the sample dispatcher's homes.

    >>> owner_of(np.arange(6), 4).tolist()
    [3, 3, 2, 1, 0, 0]
    """
    h = splitmix64(np.ascontiguousarray(ids, dtype=np.int64), add=OWNER_ADD)
    return (h % np.uint64(world_size)).astype(np.int64)
