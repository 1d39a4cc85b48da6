"""The Numba kernel behind :func:`readers.extras.string_keys` (kept apart so that importing
:mod:`readers.extras`, hence :mod:`readers.source`, does not import Numba)."""

from __future__ import annotations

import numpy as np
from numba import njit

from recpipe.kernels.splitmix import mix64

__all__ = ["string_hashes"]


@njit(cache=True, nogil=True)
def string_hashes(offsets, data, golden, out):
    """``out[i]``: the key hash (uint64) of bytes ``data[offsets[i]:offsets[i + 1]]``."""
    eight = np.uint64(8)
    for i in range(out.shape[0]):
        start, end = offsets[i], offsets[i + 1]
        h = mix64(np.uint64(end - start) + golden)
        j = start
        while j < end:
            word = np.uint64(0)
            k = 0
            while k < 8 and j + k < end:
                word |= np.uint64(data[j + k]) << (eight * np.uint64(k))
                k += 1
            h = mix64((h ^ word) + golden)
            j += 8
        out[i] = h
