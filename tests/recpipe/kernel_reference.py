"""Plain NumPy references of the kernels, written for obviousness, not speed (tests only)."""

from __future__ import annotations

import numpy as np

__all__ = [
    "ref_dedup_rows",
    "ref_jagged_index_add",
    "ref_jagged_index_select",
    "ref_partial_dedup",
    "ref_segment_reduce",
    "split_lists",
]


def split_lists(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The rows of a jagged array as a list of arrays."""
    return [values[offsets[b] : offsets[b + 1]] for b in range(len(offsets) - 1)]


def ref_dedup_rows(
    values: list[np.ndarray], offsets: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows (first occurrence, ascending) and the inverse lookup, via a dict of tuples."""
    per_key = [split_lists(v, o) for v, o in zip(values, offsets)]
    num_rows = len(offsets[0]) - 1
    seen: dict[tuple, int] = {}
    unique, inverse = [], []
    for b in range(num_rows):
        row = tuple(tuple(int(x) for x in lists[b]) for lists in per_key)
        if row not in seen:
            seen[row] = len(unique)
            unique.append(b)
        inverse.append(seen[row])
    return np.array(unique, np.int64), np.array(inverse, np.int64)


def ref_partial_dedup(
    values: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule of ``partial_dedup``'s docstring, spelled out with Python lists."""
    packed: list[int] = []
    win_offsets, win_lengths = [], []
    prev: list[int] | None = None
    for row in split_lists(values, offsets):
        cur = [int(x) for x in row]
        if prev is not None and cur == prev:
            start = win_offsets[-1]
        elif prev is not None and len(cur) == len(prev) + 1 and cur[:-1] == prev:
            start = win_offsets[-1]
            packed.append(cur[-1])
        elif prev is not None and prev and len(cur) == len(prev) and cur[:-1] == prev[1:]:
            start = win_offsets[-1] + 1
            packed.append(cur[-1])
        else:
            start = len(packed)
            packed.extend(cur)
        win_offsets.append(start)
        win_lengths.append(len(cur))
        prev = cur
    return (
        np.array(packed, dtype=values.dtype),
        np.array(win_offsets, np.int64),
        np.array(win_lengths, np.int64),
    )


def ref_jagged_index_select(
    values: np.ndarray, offsets: np.ndarray, indices: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the selected rows."""
    rows = split_lists(values, offsets)
    picked = [rows[i] for i in indices]
    lengths = [len(r) for r in picked]
    out_offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    if picked:
        out = np.concatenate(picked)
    else:
        out = np.empty((0, *values.shape[1:]), values.dtype)
    return out, out_offsets


def ref_jagged_index_add(
    grad: np.ndarray,
    out_offsets: np.ndarray,
    src_offsets: np.ndarray,
    indices: np.ndarray,
    num_src_values: int,
) -> np.ndarray:
    """``np.add.at`` of every output row onto its source row (in float64)."""
    result = np.zeros((num_src_values, *grad.shape[1:]), np.float64)
    for m, i in enumerate(indices):
        n = out_offsets[m + 1] - out_offsets[m]
        target = np.arange(src_offsets[i], src_offsets[i] + n)
        np.add.at(result, target, grad[out_offsets[m] : out_offsets[m + 1]].astype(np.float64))
    return result


def ref_segment_reduce(
    values: np.ndarray, offsets: np.ndarray, mode: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(out [B, ...] float64, argmax [B, D] with -1 for empty rows)``; max propagates NaN."""
    values2d = values.reshape(values.shape[0], int(np.prod(values.shape[1:]))).astype(np.float64)
    num_rows, width = len(offsets) - 1, values2d.shape[1]
    out = np.zeros((num_rows, width), np.float64)
    argmax = np.full((num_rows, width), -1, np.int64)
    for b in range(num_rows):
        seg = values2d[offsets[b] : offsets[b + 1]]
        if len(seg) == 0:
            continue
        if mode == "sum":
            out[b] = seg.sum(axis=0)
        elif mode == "mean":
            out[b] = seg.mean(axis=0)
        else:
            for d in range(width):
                col = seg[:, d]
                nans = np.flatnonzero(np.isnan(col))
                at = nans[0] if len(nans) else int(np.argmax(col))
                argmax[b, d] = offsets[b] + at
                out[b, d] = col[at]
    return out.reshape(num_rows, *values.shape[1:]), argmax
