"""Dispatch as a rank cut: the rows of each global batch a rank trains on, chosen by a policy.

:class:`DispatchCut` is a :class:`readers.ranks.RankCut` that places each global batch with a
:class:`~readers.dispatch.dispatcher.Dispatcher` (``esd``, ``laia``, ``random`` or
``round-robin``); :func:`rank_cut` makes the cut a ``--dispatch`` option names (``contiguous``:
the readers' default cut, nothing dispatched).

**Agreement between ranks.** Every rank (every reader process of the service) calls its own
copy of the cut, and the copies must give the same placement. A dispatcher's placement depends
on its cache shadow, i.e. on the batches it dispatched before, so the cut keeps its shadow only
while the steps come in order: step ``t + 1`` after step ``t`` continues it; any other step (a
new epoch, a resumed job, a DataLoader or service reader taking every k-th step) starts from
empty caches. Every rank sees the same steps in the same order, so the copies agree. Several
ranks calling one copy (in one process) get the same placement from a short memo of the last
steps it dispatched.

A rank's micro-batch holds its rows in the global batch's order; the rows of a session (a
piece) go to one rank, interleaved with other sessions' rows where the batch interleaves them.
Every rank gets exactly ``batch_size`` rows and every row goes to one
rank (:class:`~readers.dispatch.dispatcher.Dispatcher` guarantees both).

The cut prices the ids the batch holds (before any preprocessing, one table per sparse
feature) and does not know the trainer's hot set: its shadow models per-rank caches of every
row the ranks read.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from readers.dispatch.dispatcher import POLICIES, Dispatch, DispatchConfig, Dispatcher
from readers.dispatch.keys import TableMap
from recpipe.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from readers.ranks import GlobalBatch
    from schemas import DatasetSchema

__all__ = ["DISPATCH_CHOICES", "DispatchCut", "rank_cut"]

DISPATCH_CHOICES = ("contiguous", *sorted(POLICIES))
"""What ``--dispatch`` takes: ``contiguous`` (the readers' default cut) or a policy."""

_MEMO_STEPS = 64  # dispatches kept for ranks of the same process that lag behind


class DispatchCut:
    """A :class:`readers.ranks.RankCut` placing each global batch with a dispatcher (see the
    module docstring).

    Args:
        config: the policy, ``alpha``, the ranks' caches and bandwidths.
        schema: the dataset schema (the sparse features, one embedding table each, are the rows
            a sample reads).
    """

    whole_batch: ClassVar[bool] = True

    def __init__(self, config: DispatchConfig, *, schema: DatasetSchema) -> None:
        self.config = config
        self.schema = schema
        self._reset()

    def _reset(self) -> None:
        self._dispatcher: Dispatcher | None = None
        self._converter: Any = None
        self._last_step: int | None = None
        self._memo: collections.OrderedDict[tuple[Any, ...], Dispatch] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a copy starts afresh (and without its lock)
        return {"config": self.config, "schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config, self.schema = state["config"], state["schema"]
        self._reset()

    def dispatch(self, batch: GlobalBatch) -> Dispatch:
        """The placement of ``batch`` (dispatched once; later calls for it reuse it)."""
        table = batch.table
        sessions = table.column(self.schema.session_key).to_numpy()
        # the stream's batch numbers repeat every epoch: the content tells epochs apart
        content = hashlib.blake2b(np.ascontiguousarray(sessions).tobytes(), digest_size=16)
        key = (batch.step, tuple(batch.indices), content.digest())
        with self._lock:
            if key in self._memo:
                return self._memo[key]
            w = len(batch.parts)
            m, rest = divmod(table.num_rows, w)
            if rest:
                msg = f"global batch {batch.step} has {table.num_rows} rows for {w} ranks"
                raise DataError(msg)
            d = self._dispatcher
            continues = self._last_step is not None and batch.step == self._last_step + 1
            if d is None or not continues or d.world_size != w or d.micro_batch != m:
                d = self._dispatcher = self._new_dispatcher(world_size=w, micro_batch=m)
                self._memo.clear()
            if self._converter is None:
                from readers.convert import BatchConverter

                self._converter = BatchConverter(self.schema, dedup=True)
            out = d.dispatch(self._converter(table))
            self._last_step = batch.step
            self._memo[key] = out
            while len(self._memo) > _MEMO_STEPS:
                self._memo.popitem(last=False)
            return out

    def recent(self) -> list[Dispatch]:
        """The dispatches kept for the last steps (up to 64), oldest first."""
        with self._lock:
            return list(self._memo.values())

    def row_pairs(self, rows: np.ndarray) -> np.ndarray:
        """``[n, 2]`` int64 (table, id) of the shadow's rows (tables numbered in the schema's
        sparse feature order), sorted: the form of a rank cache's records
        (:class:`trainer.distributed.cache.CacheRecord`)."""
        if self._dispatcher is None:
            msg = "row_pairs() before any dispatch"
            raise DataError(msg)
        index = self._dispatcher.index
        rows = np.asarray(rows, dtype=np.int64)
        tables, ids = index.table_of_row[rows].astype(np.int64), index.id_of_row[rows]
        order = np.lexsort((ids, tables))
        return np.stack([tables[order], ids[order]], axis=1).astype(np.int64, copy=False)

    def _new_dispatcher(self, *, world_size: int, micro_batch: int) -> Dispatcher:
        tables = TableMap.per_feature(list(self.schema.sparse_names),
                                      id_modulus=self.config.id_modulus)  # fmt: skip
        return Dispatcher(self.config, world_size=world_size, micro_batch=micro_batch,
                          tables=tables)  # fmt: skip

    def __call__(self, batch: GlobalBatch, rank: int) -> pa.Table:
        """Rank ``rank``'s micro-batch: its rows of ``batch``, in the batch's order."""
        rows = self.dispatch(batch).rows[rank]
        return batch.table.take(np.asarray(rows, dtype=np.int64))


def rank_cut(dispatch: str, *, schema: DatasetSchema, alpha: float = 1.0, **options: Any) -> Any:
    """The cut ``--dispatch`` names: ``contiguous`` (:class:`readers.ranks.ContiguousCut`) or a
    :class:`DispatchCut` with that policy.

    Args:
        dispatch: one of :data:`DISPATCH_CHOICES`.
        schema: the dataset schema.
        alpha: ``esd``'s exact share (see :class:`DispatchConfig`).
        **options: other :class:`DispatchConfig` fields (``bandwidths``, ``cache_rows``, ...).

    Raises:
        DataError: an unknown ``dispatch`` or a bad option.
    """
    if dispatch not in DISPATCH_CHOICES:
        msg = f"`dispatch` must be one of {list(DISPATCH_CHOICES)}, got {dispatch!r}"
        raise DataError(msg)
    if dispatch == "contiguous":
        from readers.ranks import ContiguousCut

        return ContiguousCut()
    return DispatchCut(DispatchConfig(policy=dispatch, alpha=alpha, **options), schema=schema)
