"""Kernel bodies written once, compiled twice: by :mod:`recpipe.kernels.cpu` with ``numba.njit``
and by :mod:`recpipe.kernels.cuda` with ``numba.cuda.jit(device=True)``.

These are plain Python functions over array-likes and integers: no Numba decorator, no numpy
call, nothing either compiler lacks. :func:`compile_bodies` compiles all of them with one
decorator, a body that calls another bound to the other's compiled form; a backend binds the
results to module names (its kernels must see them as globals)::

    _b = compile_bodies(njit(nogil=True, inline="always"))  # or cuda.jit(device=True)
    _lists_equal, _fold_list = _b["lists_equal"], _b["fold_list"]

Numba's on-disk cache checks only the source file of the kernel it caches: after editing this
file, delete the cache (``make clean`` removes ``.numba_cache``) before timing or testing. Integer arithmetic stays below 2**63 (31-bit hash lanes
multiplied by primes below 2**25), so no operation overflows on a GPU, in Numba's CPU code or in
the CUDA simulator, which runs device code as Python over numpy scalars and would warn.

Tests compile them with the simulator too (``NUMBA_ENABLE_CUDASIM=1``), so the CUDA form of every
body runs in CI.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

__all__ = [
    "BASIS_A",
    "BASIS_B",
    "appended_ids",
    "compile_bodies",
    "fold_list",
    "lists_equal",
    "running_max",
]

_M31 = 0x7FFFFFFF
_P1 = 16777619  # FNV-1 32-bit prime
_P2 = 2246822519 & 0xFFFFFF  # a second odd multiplier below 2**24
BASIS_A = 0x011C9DC5
"""Start value of a row hash's first lane."""
BASIS_B = 0x0527D6B3
"""Start value of a row hash's second lane."""


def lists_equal(values: Any, a_start: int, a_end: int, b_start: int, b_end: int) -> bool:
    """``values[a_start:a_end] == values[b_start:b_end]``, element by element."""
    n = a_end - a_start
    if n != b_end - b_start:
        return False
    for k in range(n):  # noqa: SIM110 (no generators in Numba kernels)
        if values[a_start + k] != values[b_start + k]:
            return False
    return True


def fold_list(values: Any, start: int, end: int, a: int, b: int) -> tuple[int, int]:
    """Fold one list, then its length, into a row hash's two 31-bit lanes ``(a, b)``.

    Each id is xor-folded to 31 bits and mixed into lane ``a`` (FNV-1a modulo 2**31); at the
    end of the list its length goes into ``a`` and ``a`` into ``b``. Folding the length makes
    ``[1, 2] + []`` differ from ``[1] + [2]`` across keys. Start a row at ``(BASIS_A, BASIS_B)``
    and fold each key of the group in turn. The lanes combine to ``a << 31 | b``, whose low bits
    are weak: finalise it before using them. Equal hashes do not mean equal rows (compare them).
    """
    for p in range(start, end):
        v = values[p]
        a = ((a ^ ((v ^ (v >> 31)) & _M31)) * _P1) & _M31
    n = end - start
    return ((a ^ (n & _M31)) * _P1) & _M31, ((b ^ a ^ 0x5BD1E995) * _P2) & _M31


def appended_ids(values: Any, offsets: Any, r: int) -> Any:
    """Ids row ``r`` appends to the packed values of a partial dedup (see ``partial_dedup``).

    0 if its list equals the previous row's, 1 if it is the previous one extended or slid by
    one id, else its whole length (always for row 0).
    """
    start = offsets[r]
    end = offsets[r + 1]
    n = end - start
    if r == 0:
        return n
    prev = offsets[r - 1]
    prev_n = start - prev
    if n == prev_n and lists_equal(values, prev, start, start, end):
        return 0
    if (n == prev_n + 1 and lists_equal(values, prev, start, start, end - 1)) or (
        n == prev_n and n > 0 and lists_equal(values, prev + 1, start, start, end - 1)
    ):
        return 1
    return n


def running_max(values: Any, start: int, end: int, d: int) -> tuple[Any, int]:
    """``(max, position)`` of column ``d`` over rows ``start .. end - 1`` (``end > start``).

    NaN wins, as in ``torch.max``; otherwise the first maximum is kept.
    """
    best = values[start, d]
    at = start
    for p in range(start + 1, end):
        v = values[p, d]
        if best == best and (v > best or v != v):
            best = v
            at = p
    return best, at


_BODIES = ("lists_equal", "fold_list", "running_max", "appended_ids")  # callees first


def compile_bodies(jit: Callable[[Callable[..., Any]], Any]) -> dict[str, Any]:
    """Every body compiled by ``jit``; calls between bodies go to the compiled forms.

    Args:
        jit: a decorator such as ``numba.njit(nogil=True)`` or ``numba.cuda.jit(device=True)``.

    Returns:
        body name -> compiled function.
    """
    namespace = dict(globals())
    compiled: dict[str, Any] = {}
    for name in _BODIES:
        body = globals()[name]
        clone = types.FunctionType(body.__code__, namespace, name, body.__defaults__)
        clone.__qualname__, clone.__doc__ = body.__qualname__, body.__doc__
        clone.__module__ = body.__module__
        namespace[name] = compiled[name] = jit(clone)
    return compiled
