"""CPU forms of the kernels: Numba ``@njit(cache=True, nogil=True)`` over zero-copy numpy views.

Each public function here takes and returns CPU torch tensors and does no validation beyond what
the kernels need (validation lives in :mod:`recpipe.kernels.ops`). Outputs are allocated with
torch, so torch's allocator (and its profiler) sees them, and handed to the kernels as numpy
views. Every loop over rows or keys runs inside Numba.

Hashing: a row's lists (every key of the group, each followed by its length) are folded into two
31-bit lanes by :func:`recpipe.kernels.bodies.fold_list` (the CUDA forms use the same body) and
finished with the murmur3 ``fmix64`` mixer. A hash match
is always verified element by element, so a collision costs time, never correctness;
``hash_mask`` (tests only) clears hash bits to force collisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numba import njit

from recpipe.errors import DataError
from recpipe.kernels.arrays import Array, as_bits, as_numpy, compute_dtype, flat2d, row_width
from recpipe.kernels.bodies import BASIS_A, BASIS_B, compile_bodies

__all__ = [
    "dedup_rows",
    "jagged_index_add",
    "jagged_index_select",
    "partial_dedup",
    "segment_reduce",
    "segment_reduce_backward",
]

_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_U33 = np.uint64(33)
_U31 = np.uint64(31)

_BODIES = compile_bodies(njit(nogil=True, inline="always"))
_lists_equal = _BODIES["lists_equal"]
_fold_list = _BODIES["fold_list"]
_appended_ids = _BODIES["appended_ids"]
_running_max = _BODIES["running_max"]


# --------------------------------------------------------------------------------------------
# dedup_rows


@njit(cache=True, nogil=True, inline="always")
def _fmix64(h: Any) -> Any:
    h ^= h >> _U33
    h *= _FMIX_1
    h ^= h >> _U33
    h *= _FMIX_2
    h ^= h >> _U33
    return h


@njit(cache=True, nogil=True, inline="always")
def _rows_equal(values: Array, offsets: Array, i: int, j: int) -> bool:
    for k in range(len(values)):
        key_offsets = offsets[k]
        if not _lists_equal(
            values[k], key_offsets[i], key_offsets[i + 1], key_offsets[j], key_offsets[j + 1]
        ):
            return False
    return True


@njit(cache=True, nogil=True)
def _dedup_group(
    values: Array, offsets: Array, hash_mask: Any, inverse: Array, first_rows: Array
) -> int:
    """Dedup the rows of a group given as tuples of per-key arrays (one dtype).

    Writes ``inverse[i]`` (the row's unique id, numbered by first occurrence) and
    ``first_rows[u]`` (the first row of unique id ``u``); returns the number of unique rows.
    """
    num_rows = offsets[0].shape[0] - 1
    capacity = 2
    while capacity < 2 * num_rows:
        capacity <<= 1
    slot_mask = np.uint64(capacity - 1)
    table = np.full(capacity, -1, np.int64)
    table_hash = np.empty(capacity, np.uint64)
    num_unique = 0
    for i in range(num_rows):
        # Session-clustered batches repeat the previous row most of the time: check it first.
        if i > 0 and _rows_equal(values, offsets, i - 1, i):
            inverse[i] = inverse[i - 1]
            continue
        a, b = BASIS_A, BASIS_B
        for k in range(len(values)):
            a, b = _fold_list(values[k], offsets[k][i], offsets[k][i + 1], a, b)
        h = _fmix64((np.uint64(a) << _U31) | np.uint64(b)) & hash_mask
        slot = h & slot_mask
        while True:
            u = table[slot]
            if u < 0:
                table[slot] = num_unique
                table_hash[slot] = h
                first_rows[num_unique] = i
                inverse[i] = num_unique
                num_unique += 1
                break
            if table_hash[slot] == h and _rows_equal(values, offsets, first_rows[u], i):
                inverse[i] = u
                break
            slot = (slot + np.uint64(1)) & slot_mask
    return num_unique


def dedup_rows(
    values: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    *,
    hash_mask: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU form of :func:`recpipe.kernels.dedup_rows`: one Numba pass over the rows.

    Args:
        values: per key, the ids ``[N_k]`` (int32 or int64; a group mixing both is widened to
            int64, a copy of its int32 keys).
        offsets: per key, ``[B + 1]`` int64.
        hash_mask: AND-ed into every hash; tests pass ``0`` to make every row collide.
    """
    num_rows = offsets[0].shape[0] - 1
    if len({v.dtype for v in values}) > 1:
        values = [v.to(torch.int64) for v in values]
    inverse = np.empty(num_rows, np.int64)
    first_rows = np.empty(num_rows, np.int64)
    num_unique = _dedup_group(
        tuple(as_numpy(v) for v in values),
        tuple(as_numpy(o) for o in offsets),
        np.uint64(hash_mask & 0xFFFFFFFFFFFFFFFF),
        inverse,
        first_rows,
    )
    return torch.from_numpy(first_rows[:num_unique].copy()), torch.from_numpy(inverse)


# --------------------------------------------------------------------------------------------
# partial_dedup


@njit(cache=True, nogil=True)
def _partial_windows(values: Array, offsets: Array, win_offsets: Array, win_lengths: Array) -> int:
    tail = 0
    for r in range(offsets.shape[0] - 1):
        n = offsets[r + 1] - offsets[r]
        tail += _appended_ids(values, offsets, r)
        win_offsets[r] = tail - n
        win_lengths[r] = n
    return tail


@njit(cache=True, nogil=True)
def _partial_fill(
    values: Array, offsets: Array, win_offsets: Array, win_lengths: Array, packed: Array
) -> None:
    tail = 0
    for r in range(offsets.shape[0] - 1):
        end = win_offsets[r] + win_lengths[r]
        src = offsets[r + 1] - (end - tail)
        for k in range(end - tail):
            packed[tail + k] = values[src + k]
        tail = end


def partial_dedup(
    values: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU form of :func:`recpipe.kernels.partial_dedup`."""
    num_rows = offsets.shape[0] - 1
    values_np = as_numpy(values)
    offsets_np = as_numpy(offsets)
    win_offsets = torch.empty(num_rows, dtype=torch.int64)
    win_lengths = torch.empty(num_rows, dtype=torch.int64)
    packed_len = _partial_windows(values_np, offsets_np, win_offsets.numpy(), win_lengths.numpy())
    packed = torch.empty(packed_len, dtype=values.dtype)
    _partial_fill(values_np, offsets_np, win_offsets.numpy(), win_lengths.numpy(), packed.numpy())
    return packed, win_offsets, win_lengths


# --------------------------------------------------------------------------------------------
# jagged_index_select / jagged_index_add


@njit(cache=True, nogil=True)
def _select_offsets(offsets: Array, indices: Array, out_offsets: Array) -> int:
    """Fill ``out_offsets``; return the position of the first index out of range, or -1."""
    num_rows = offsets.shape[0] - 1
    out_offsets[0] = 0
    for m in range(indices.shape[0]):
        i = indices[m]
        if i < 0 or i >= num_rows:
            return m
        out_offsets[m + 1] = out_offsets[m] + offsets[i + 1] - offsets[i]
    return -1


# Unsigned positions below: with signed ones Numba wraps negative indices, which keeps LLVM from
# vectorising the copy loops (several times slower).


@njit(cache=True, nogil=True)
def _select_copy(
    values: Array, offsets: Array, indices: Array, out_offsets: Array, width: int, out: Array
) -> None:
    for m in range(indices.shape[0]):
        src = np.uint64(offsets[indices[m]] * width)
        dst = np.uint64(out_offsets[m] * width)
        for k in range(np.uint64((out_offsets[m + 1] - out_offsets[m]) * width)):
            out[dst + k] = values[src + k]


@njit(cache=True, nogil=True)
def _index_add(
    grad: Array, out_offsets: Array, src_offsets: Array, indices: Array, width: int, out: Array
) -> None:
    for m in range(indices.shape[0]):
        src = np.uint64(out_offsets[m] * width)
        dst = np.uint64(src_offsets[indices[m]] * width)
        for k in range(np.uint64((out_offsets[m + 1] - out_offsets[m]) * width)):
            out[dst + k] += grad[src + k]


def _check_indices(bad: int, indices: torch.Tensor, num_rows: int) -> None:
    if bad >= 0:
        msg = (
            f"`indices`[{bad}] = {int(indices[bad])} is out of range for a batch of "
            f"{num_rows} rows (valid: 0..{num_rows - 1})"
        )
        raise DataError(msg)


def jagged_index_select(
    values: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    *,
    out_offsets: torch.Tensor | None = None,
    num_out_values: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU form of :func:`recpipe.kernels.jagged_index_select` (no autograd).

    A caller's ``out_offsets`` and ``num_out_values`` are checked against the selected rows
    (O(M) here, where nothing waits on a device).
    """
    num_rows = offsets.shape[0] - 1
    offsets_np = as_numpy(offsets)
    indices_np = as_numpy(indices)
    computed = torch.empty(indices.shape[0] + 1, dtype=torch.int64)
    _check_indices(_select_offsets(offsets_np, indices_np, computed.numpy()), indices, num_rows)
    total = int(computed[-1])
    _check_known_layout(out_offsets, num_out_values, computed)
    out = torch.empty((total, *values.shape[1:]), dtype=values.dtype)
    width = row_width(values)
    _select_copy(
        as_numpy(as_bits(values)).reshape(-1),
        offsets_np,
        indices_np,
        computed.numpy(),
        width,
        as_bits(out).numpy().reshape(-1),
    )
    return out, computed if out_offsets is None else out_offsets


def _check_known_layout(
    out_offsets: torch.Tensor | None, num_out_values: int | None, computed: torch.Tensor
) -> None:
    """Refuse a caller's output layout that is not the selected rows' one."""
    total = int(computed[-1])
    if num_out_values is not None and num_out_values != total:
        msg = (
            f"`num_out_values` = {num_out_values} but the selected rows hold {total} values\n"
            "hint: pass the sum of the selected rows' lengths, or leave it out"
        )
        raise DataError(msg)
    if out_offsets is not None and not torch.equal(out_offsets, computed):
        m = int(torch.nonzero(out_offsets != computed)[0, 0])
        msg = (
            f"`out_offsets`[{m}] = {int(out_offsets[m])} but the selected rows put "
            f"{int(computed[m])} there\n"
            "hint: pass the cumulative sum of the selected rows' lengths, or leave it out"
        )
        raise DataError(msg)


def jagged_index_add(
    grad_values: torch.Tensor,
    out_offsets: torch.Tensor,
    src_offsets: torch.Tensor,
    indices: torch.Tensor,
    num_src_values: int,
) -> torch.Tensor:
    """CPU form of :func:`recpipe.kernels.jagged_index_add`."""
    acc_dtype = compute_dtype(grad_values.dtype)
    grad = grad_values.to(acc_dtype)
    out = torch.zeros((num_src_values, *grad_values.shape[1:]), dtype=acc_dtype)
    width = row_width(grad_values)
    _index_add(
        as_numpy(grad).reshape(-1),
        as_numpy(out_offsets),
        as_numpy(src_offsets),
        as_numpy(indices),
        width,
        out.numpy().reshape(-1),
    )
    return out.to(grad_values.dtype)


# --------------------------------------------------------------------------------------------
# segment_reduce


@njit(cache=True, nogil=True)
def _segment_sum(values: Array, offsets: Array, mean: int, out: Array) -> None:
    for b in range(offsets.shape[0] - 1):
        start = offsets[b]
        end = offsets[b + 1]
        for p in range(start, end):
            for d in range(values.shape[1]):
                out[b, d] += values[p, d]
        if mean and end > start:
            for d in range(values.shape[1]):
                out[b, d] /= end - start


@njit(cache=True, nogil=True)
def _segment_max(values: Array, offsets: Array, out: Array, argmax: Array) -> None:
    for b in range(offsets.shape[0] - 1):
        start = offsets[b]
        end = offsets[b + 1]
        for d in range(values.shape[1]):
            if end == start:
                out[b, d] = 0
                argmax[b, d] = -1
                continue
            out[b, d], argmax[b, d] = _running_max(values, start, end, d)


@njit(cache=True, nogil=True)
def _segment_sum_backward(grad_out: Array, offsets: Array, mean: int, grad_values: Array) -> None:
    for b in range(offsets.shape[0] - 1):
        start = offsets[b]
        end = offsets[b + 1]
        scale = 1.0 / (end - start) if mean and end > start else 1.0
        for p in range(start, end):
            for d in range(grad_out.shape[1]):
                grad_values[p, d] = grad_out[b, d] * scale


@njit(cache=True, nogil=True)
def _segment_max_backward(grad_out: Array, argmax: Array, grad_values: Array) -> None:
    for b in range(argmax.shape[0]):
        for d in range(argmax.shape[1]):
            at = argmax[b, d]
            if at >= 0:
                grad_values[at, d] = grad_out[b, d]


def segment_reduce(
    values: torch.Tensor, offsets: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CPU form of :func:`recpipe.kernels.segment_reduce`.

    Returns:
        ``(out [B, D] in the dtype of values, argmax [B, D] int64 or None)``; argmax (``-1`` for
        an empty segment) is returned for ``mode="max"`` and feeds the backward.
    """
    num_rows = offsets.shape[0] - 1
    acc_dtype = compute_dtype(values.dtype)
    values2d = flat2d(values.detach().to(acc_dtype))
    out = torch.zeros((num_rows, values2d.shape[1]), dtype=acc_dtype)
    argmax = None
    if mode == "max":
        argmax = torch.empty((num_rows, values2d.shape[1]), dtype=torch.int64)
        _segment_max(as_numpy(values2d), as_numpy(offsets), out.numpy(), argmax.numpy())
    else:
        _segment_sum(as_numpy(values2d), as_numpy(offsets), mode == "mean", out.numpy())
    return out.reshape(num_rows, *values.shape[1:]).to(values.dtype), argmax


def segment_reduce_backward(
    grad_out: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    *,
    argmax: torch.Tensor | None,
    num_values: int,
) -> torch.Tensor:
    """Gradient of :func:`segment_reduce` w.r.t. its values, ``[N, ...]`` like the values."""
    acc_dtype = compute_dtype(grad_out.dtype)
    grad2d = flat2d(grad_out.to(acc_dtype))
    width = grad2d.shape[1]
    if mode == "max":
        if argmax is None:
            msg = "`argmax` (from the forward) is needed for the backward of mode 'max'"
            raise DataError(msg)
        grad_values = torch.zeros((num_values, width), dtype=acc_dtype)
        _segment_max_backward(as_numpy(grad2d), as_numpy(argmax), grad_values.numpy())
    else:
        grad_values = torch.empty((num_values, width), dtype=acc_dtype)
        _segment_sum_backward(
            as_numpy(grad2d), as_numpy(offsets), mode == "mean", grad_values.numpy()
        )
    return grad_values.reshape(num_values, *grad_out.shape[1:]).to(grad_out.dtype)
