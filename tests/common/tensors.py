"""Tensors from Python lists, and back: the obvious builders the tests compare against."""

from __future__ import annotations

import numpy as np
import torch

from recpipe.jagged import KeyedJaggedTensor, lengths_to_offsets

__all__ = ["jagged_from_rows", "kjt_from_rows", "rows_of"]


def kjt_from_rows(rows_per_key: dict[str, list[list[int]]], dtype=np.int64) -> KeyedJaggedTensor:
    """The KJT of ``{key: rows}`` (python lists), built without any dedup through NumPy arrays."""
    values = [np.array([v for r in rows for v in r], dtype=dtype) for rows in rows_per_key.values()]
    offsets = [np.cumsum([0] + [len(r) for r in rows]) for rows in rows_per_key.values()]
    return KeyedJaggedTensor.from_arrays(list(rows_per_key), values, offsets)


def jagged_from_rows(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` int64 of a list of id lists."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    values = torch.tensor([x for r in rows for x in r], dtype=torch.int64)
    return values, lengths_to_offsets(lengths)


def rows_of(values: torch.Tensor, offsets: torch.Tensor) -> list[list]:
    """The rows of a jagged ``(values, offsets)`` as python lists."""
    return [values[a:b].tolist() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
