"""A batch's id plan: each table's distinct ids and each feature's positions among them.

The input-dist stage of the embedding lookups (TorchRec's ``input_dist`` -> ``lookup``),
computed once per batch and carried with it to every consumer::

    batch -> plan_batch(batch, tables)  ->  PlannedBatch(batch, IdPlan)
               per table: the distinct table ids (after table_ids), first appearance first
               per feature: the position of each id the collections look up among them
    exchange / caches   fetch the rows of plan.ids[t]                 (one [U, D] per table)
    collections         look feature f up at plan.positions[f]        (no search, no hashing)

The types (:class:`~trainer.modules.IdPlan`, :class:`~trainer.modules.PlannedBatch`) live with
the collections that read them; this module computes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer import _kernels as K
from trainer.modules import IdPlan, PlannedBatch, lookup_values, table_ids

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from trainer.config import TableConfig

__all__ = ["plan_batch", "unique_per_table"]

_serials = itertools.count(1)


def plan_batch(
    batch: Batch, tables: Sequence[TableConfig], *, device: torch.device | str = "cpu"
) -> PlannedBatch:
    """``batch`` with its :class:`~trainer.modules.IdPlan` over ``tables`` (each feature of a
    table is looked up where the collections look it up: :func:`~trainer.modules.lookup_values`).

    Args:
        batch: the batch as the model's collections will read it (deduplicated as the model
            deduplicates it: a later deduplication drops the plan).
        tables: the planned tables, in the order of the plan's ``ids``.
        device: where the positions go (the device of the rows they index).

    Raises:
        RecpipeError: a feature is in two of ``tables``.
    """
    features = [f for table in tables for f in table.features]
    if len(set(features)) != len(features):
        twice = sorted({f for f in features if features.count(f) > 1})
        msg = (
            f"features {twice!r} are each read by two planned tables; an id plan keys the "
            "lookups by feature, so give each feature one table"
        )
        raise RecpipeError(msg)
    values = lookup_values(batch, features)
    configs = [table for table in tables for _ in table.features]
    ids = [
        table_ids(c, values[f].detach().to("cpu")) for c, f in zip(configs, features, strict=True)
    ]
    per_table = [len(table.features) for table in tables]
    uniq, inverse = unique_per_table(ids, per_table)
    parts = torch.from_numpy(inverse).to(device).split([i.numel() for i in ids])
    plan = IdPlan(
        serial=next(_serials),
        tables=tuple(table.name for table in tables),
        ids=tuple(uniq),
        positions=dict(zip(features, parts, strict=True)),
        table_of={f: t for t, table in enumerate(tables) for f in table.features},
    )
    return PlannedBatch.of(batch, plan)


def unique_per_table(
    ids: Sequence[torch.Tensor], features_per_table: Sequence[int]
) -> tuple[list[np.ndarray], np.ndarray]:
    """Each table's distinct ids in order of first appearance, and where each value of ``ids``
    (int64 CPU tensors, one per feature, tables one after the other) sits among its table's.

    First appearance, not sorted: the rows of a batch then sit in the order its values first
    read them, so the poolings and their backward walk the rows nearly in order, and no sort
    of the distinct keys is needed.

    Every table's ids at once, the table's number in the key's high bits, when the ids leave
    room for it (non-negative, below ``2**(63 - bits)``): one hash pass. Table by table
    otherwise. Both give the same result.
    """
    n_tables = len(features_per_table)
    if not ids:
        return [np.zeros(0, dtype=np.int64) for _ in range(n_tables)], np.zeros(0, np.int64)
    sizes = np.asarray([i.numel() for i in ids], dtype=np.int64)
    flat = torch.cat(list(ids)) if len(ids) > 1 else ids[0]
    shift = 63 - max(n_tables - 1, 1).bit_length()
    feature_table = np.repeat(np.arange(n_tables, dtype=np.int64), features_per_table)
    first, inverse, ok = K.first_unique(flat.numpy(), sizes, feature_table, shift)
    if ok:  # features come table after table, so their keys do too
        starts = np.searchsorted(first >> shift, np.arange(n_tables + 1))
        inverse -= starts[np.repeat(feature_table, sizes)]  # index within the value's table
        ids_only = first & ((1 << shift) - 1)
        return [ids_only[starts[t] : starts[t + 1]] for t in range(n_tables)], inverse
    uniq, inverses, at = [], [], 0
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for n in features_per_table:
        part = flat[bounds[at] : bounds[at + n]].numpy()
        at += n
        sorted_ids, where, inv = np.unique(part, return_index=True, return_inverse=True)
        order = np.argsort(where, kind="stable")  # sorted -> first appearance
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        uniq.append(sorted_ids[order])
        inverses.append(rank[inv.reshape(-1)])
    return uniq, np.concatenate(inverses) if inverses else np.zeros(0, dtype=np.int64)
