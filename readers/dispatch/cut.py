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

**Dispatching once.** :class:`DispatchOnceCut` makes one rank (``source``) dispatch each global
batch and hand every rank its placement, an int64 ``row_rank`` of the ``W * m`` rows (a fixed
size: one broadcast, no counts), through a ``share`` collective the caller provides (the
trainer: a gloo group of its own with the job's timeout). The other ranks neither convert nor
dispatch the batch; they take their rows. The source runs its dispatches on one thread of their
own, in the order the batches are handed to :meth:`DispatchOnceCut.ahead` (the reader hands
over step ``t + 1`` before cutting step ``t``), so the dispatch of the next batch overlaps the
current step and the dispatcher sees exactly the sequence of batches it would see called
step by step: the decisions do not change.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from readers.dispatch.dispatcher import POLICIES, Dispatch, DispatchConfig, Dispatcher
from readers.dispatch.keys import TableMap
from recpipe.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from readers.ranks import GlobalBatch
    from schemas import DatasetSchema

__all__ = ["DISPATCH_CHOICES", "DispatchCut", "DispatchOnceCut", "pairs_digest", "rank_cut"]

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


def pairs_digest(pairs: np.ndarray) -> int:
    """A 64-bit digest of ``[n, 2]`` (table, id) pairs (the form of
    :meth:`DispatchCut.row_pairs` and of a rank cache's records): equal pairs, equal digests."""
    pairs = np.ascontiguousarray(pairs, dtype=np.int64).reshape(-1, 2)
    digest = hashlib.blake2b(
        pairs.tobytes(), digest_size=8, salt=pairs.shape[0].to_bytes(8, "little")
    )
    return int(np.frombuffer(digest.digest(), dtype="<i8")[0])


class DispatchOnceCut:
    """A :class:`readers.ranks.RankCut` for one rank of a job in which one rank dispatches each
    global batch for all (see the module docstring).

    Every rank makes one and calls it for every step, in the same order (each call is a
    collective). The payload ``share`` moves is int64: the rank of every row of the global
    batch, then, with ``check_kinds``, ``W * len(check_kinds)`` digests (:func:`pairs_digest`)
    of the transfers the dispatcher's shadow predicts for each rank, so every rank can check its
    cache's transfers against them (:attr:`last_digests`).

    Args:
        cut: the dispatching cut (used on ``source`` only).
        rank, world_size: this rank and the job's ranks W.
        share: ``share(payload)`` -> ``source``'s payload, on every rank (a broadcast: collective;
            the payload has the same size on every rank).
        source: the dispatching rank.
        check_kinds: :class:`~readers.dispatch.shadow.StepTransfers` fields whose predicted
            rows travel as digests (none: only the placement).
    """

    whole_batch: ClassVar[bool] = True

    def __init__(
        self,
        cut: DispatchCut,
        *,
        rank: int,
        world_size: int,
        share: Callable[[np.ndarray], np.ndarray],
        source: int = 0,
        check_kinds: Sequence[str] = (),
    ) -> None:
        if not 0 <= source < world_size or not 0 <= rank < world_size:
            msg = f"`rank` {rank!r} and `source` {source!r} must be in [0, world_size={world_size})"
            raise DataError(msg)
        self.cut, self.rank, self.world_size = cut, rank, world_size
        self.share, self.source = share, source
        self.check_kinds = tuple(check_kinds)
        self.last_digests = np.zeros((world_size, len(self.check_kinds)), dtype=np.int64)
        self._pending: collections.OrderedDict[
            int, tuple[GlobalBatch, concurrent.futures.Future[np.ndarray]]
        ] = collections.OrderedDict()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    def ahead(self, batch: GlobalBatch) -> None:
        """Start dispatching ``batch`` (on the source; elsewhere nothing). Batches are
        dispatched in the order they are handed over, and each must then be cut, in that
        order, before a later one (a batch handed over and never cut still advances the
        dispatcher, as cutting it would have)."""
        if self.rank != self.source or id(batch) in self._pending:
            return
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="recpipe-dispatch"
            )
        self._pending[id(batch)] = (batch, self._thread.submit(self._payload, batch))

    def _payload(self, batch: GlobalBatch) -> np.ndarray:
        """The source's payload for ``batch`` (on the dispatch thread)."""
        out = self.cut.dispatch(batch)
        b = sum(rows.size for rows in out.rows)
        payload = np.empty(b + self.world_size * len(self.check_kinds), dtype=np.int64)
        for j, rows in enumerate(out.rows):
            payload[rows] = j
        digests = payload[b:].reshape(self.world_size, len(self.check_kinds))
        for k, kind in enumerate(self.check_kinds):
            for j, rows in enumerate(getattr(out.transfers, kind)):
                digests[j, k] = pairs_digest(self.cut.row_pairs(rows))
        return payload

    def _source_payload(self, batch: GlobalBatch) -> np.ndarray:
        if id(batch) not in self._pending:  # (a batch held there is never another's id)
            self.ahead(batch)
        while True:  # batches handed over before this one and never cut are dropped
            key, (_, future) = self._pending.popitem(last=False)
            if key == id(batch):
                return future.result()

    def __call__(self, batch: GlobalBatch, rank: int) -> pa.Table:
        """Rank ``rank``'s micro-batch (collective: every rank calls it for the step)."""
        if rank != self.rank:
            msg = f"this cut serves rank {self.rank}, asked for rank {rank}'s rows"
            raise DataError(msg)
        table = batch.table
        w = self.world_size
        size = table.num_rows + w * len(self.check_kinds)
        if self.rank == self.source:
            payload = self._source_payload(batch)
        else:
            payload = np.zeros(size, dtype=np.int64)
        payload = self.share(payload)
        if payload.shape != (size,):
            msg = (
                f"the placement of global batch {batch.step} has {payload.shape} values, not {size}"
            )
            raise DataError(msg)
        row_rank = payload[: table.num_rows]
        self.last_digests = payload[table.num_rows :].reshape(w, len(self.check_kinds)).copy()
        rows = np.flatnonzero(row_rank == rank)
        if rows.size * w != table.num_rows:
            msg = (
                f"the placement of global batch {batch.step} gives rank {rank} {rows.size} "
                f"rows, not {table.num_rows // w}"
            )
            raise DataError(msg)
        return table.take(rows)

    def close(self) -> None:
        """Stop the dispatch thread (dispatches under way finish first)."""
        self._pending.clear()
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None

    def __getstate__(self) -> dict[str, Any]:
        msg = "a DispatchOnceCut is one rank's collective: it cannot be copied to another process"
        raise DataError(msg)


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
