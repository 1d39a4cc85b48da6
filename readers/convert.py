"""Arrow rows -> :class:`~recpipe.batch.Batch` (RecD O3).

One table of B rows becomes::

    dense        [B, F] float32   one column per dense feature, schema order (nulls -> NaN)
    labels       [B]    float32
    session_ids  [B]    int64
    kjt          the sparse features of no dedup group, schema order
    ikjts        {group name: IKJT} one per ``[dedup] groups`` entry of the schema, and one
                 partial IKJT of the ``[dedup] partial`` features (each packed on its own)
    extras       {column: [B] int64} the ``extras`` columns asked for (see :mod:`readers.extras`)

Arrow ``list<int64>`` columns are shared with torch where possible (one flat values buffer and
B + 1 offsets per key); duplicates are found by the Numba row-hash kernel behind
:meth:`InverseKeyedJaggedTensor.from_arrow` and verified on hash matches. Nothing loops over
rows in Python. With ``dedup=False`` every sparse feature goes into the one KJT (the pre-RecD
baseline path).

A group's name is its keys joined by ``"+"`` (:func:`group_name`), e.g.
``"user_liked_items+user_liked_sellers"``; so is the partial group's (``"user_recent_items"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from readers.extras import extra_column_keys
from recpipe.batch import Batch, DedupFeatures
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = ["BatchConverter", "group_name", "to_batch"]


def group_name(keys: Sequence[str]) -> str:
    """The name of a dedup group in ``Batch.ikjts``: its keys joined by ``"+"``."""
    return "+".join(keys)


def _column_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return arr.to_numpy(zero_copy_only=False)


class BatchConverter:
    """Converts Arrow tables of the clustered dataset into :class:`Batch` objects.

    The column layout (which keys are plain, which are grouped) is worked out once here.

    Args:
        schema: the dataset schema (its ``[dedup] groups`` define the IKJTs, its
            ``[dedup] partial`` features the partial IKJT).
        dedup: ``False`` puts every sparse feature into the one KJT.
        extras: columns of the table to put into ``Batch.extras`` as int64 keys
            (:func:`readers.extras.extra_column_keys`); ``ReaderConfig.extras``.
    """

    def __init__(
        self, schema: DatasetSchema, *, dedup: bool = True, extras: Sequence[str] = ()
    ) -> None:
        self.schema = schema
        self.dedup = dedup
        self.extras: tuple[str, ...] = tuple(extras)
        groups = [tuple(g) for g in schema.dedup_groups] if dedup else []
        self.partial: tuple[str, ...] = tuple(schema.dedup_partial) if dedup else ()
        grouped = {k for g in groups for k in g} | set(self.partial)
        self.groups: dict[str, tuple[str, ...]] = {group_name(g): g for g in groups}
        self.plain: list[str] = [k for k in schema.sparse_names if k not in grouped]
        self.dense: list[str] = list(schema.dense_names)

    def __call__(self, table: pa.Table) -> Batch:
        """Convert ``table`` (B rows with the schema's columns) into a Batch."""
        schema = self.schema
        num_rows = table.num_rows
        dense = np.empty((num_rows, len(self.dense)), dtype=np.float32)  # (B, F)
        for j, name in enumerate(self.dense):
            dense[:, j] = _column_numpy(table.column(name))
        labels = _column_numpy(table.column(schema.label_key)).astype(np.float32, copy=False)
        sessions = _column_numpy(table.column(schema.session_key)).astype(np.int64, copy=False)
        if self.plain:
            kjt = KeyedJaggedTensor.from_arrow(
                {k: table.column(k) for k in self.plain}, validate=False
            )
        else:
            kjt = KeyedJaggedTensor(
                [], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                stride=num_rows, validate=False,
            )  # fmt: skip
        ikjts: dict[str, DedupFeatures] = {
            name: InverseKeyedJaggedTensor.from_arrow(
                {k: table.column(k) for k in keys}, validate=False
            )
            for name, keys in self.groups.items()
        }
        if self.partial:
            ikjts[group_name(self.partial)] = PartialInverseKeyedJaggedTensor.from_arrow(
                {k: table.column(k) for k in self.partial}, validate=False
            )
        return Batch(
            dense=torch.from_numpy(dense),
            labels=_as_tensor(labels),
            kjt=kjt,
            ikjts=ikjts,
            session_ids=_as_tensor(sessions),
            extras={
                name: _as_tensor(extra_column_keys(name, table.column(name)))
                for name in self.extras
            },
        )


def _as_tensor(arr: np.ndarray) -> torch.Tensor:
    # Arrow-backed numpy views are read-only; copy (B elements) rather than share them so the
    # batch is an ordinary writable tensor.
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def to_batch(
    table: pa.Table, *, schema: DatasetSchema, dedup: bool = True, extras: Sequence[str] = ()
) -> Batch:
    """Convert one table into a Batch (see :class:`BatchConverter` to convert many)."""
    return BatchConverter(schema, dedup=dedup, extras=extras)(table)
