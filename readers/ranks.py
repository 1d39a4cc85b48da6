"""Batches for the ranks of a distributed job: the same count on every rank, sessions intact.

A DDP job runs one step per batch on every rank in lockstep, so every rank must get the same
number of batches in an epoch (dealing row groups round-robin does not do that: 10 row groups
over 3 ranks give 4/3/3 row groups, 16/12/12 batches). Here the ranks cut one *global stream*
instead, the stream one reader with the same config would read::

    splits, shuffled with rng(seed, epoch)                  s5 s2 s7 s0 s3 s6 s1 s4
    windows of >= shuffle_buffer sessions, sessions permuted
    cut every batch_size rows: global batches               g0 g1 g2 ... g(T-1)   T = rows // B
    n = T // W batches per rank, contiguous ranges          rank 0: g0..g(n-1)  rank 1: gn..g(2n-1)
    remainder (not delivered this epoch, counted)           g(W*n)..g(T-1) and the last rows < B

Step ``t`` of the job trains on the *global batch* made of every rank's ``t``-th batch. A
session is cut only at a batch boundary (as with one reader); every row of the epoch is
delivered exactly once across ranks except the remainder: ``rows - W*n*B`` rows, fewer than
``W*B``, reported by :attr:`EpochLayout.remainder_rows`. A rank reads only the windows its
range touches (a window on a range boundary is read by both ranks).

The layout is computed by every rank from the split footers alone when ``shuffle=False``; with
shuffling the window boundaries need each split's session count, read once (the session column
only) and cached.

Resuming: the state (:meth:`RankBatchDataset.state_dict`) is the same on every rank: the epoch,
the layout's ranges and the batches each rank has delivered. Loaded at the same world size it
continues exactly. Loaded at another world size, the global batches no rank has delivered yet are
sorted and dealt again in contiguous ranges of equal length to the new ranks (the leftover, fewer
than the new world size, joins the remainder): every row is still delivered at most once.

**The cut.** Step ``t``'s global batch is a :class:`GlobalBatch`: the ranks' parts of the stream
in rank order, ``W*B`` rows. A :class:`RankCut` decides which of its rows each rank trains on;
the default, :class:`ContiguousCut`, gives rank ``r`` rows ``[r*B, (r+1)*B)`` (its own part, so
it reads nothing else). Another cut (e.g. one that sends samples to the rank owning their
embedding rows) plugs in through ``RankBatchDataset(cut=...)`` and, on the reader service,
``DatasetProducer(cut=...)``; see ``docs/distributed.md`` for its contract.

The reader service serves one client per rank with this very class (``recpipe serve`` runs a
:class:`RankBatchDataset` per rank, positioned by the client's :meth:`~RankBatchDataset.state_dict`),
so a rank gets the same batches in-process and through the service.

One concept, over 600 lines: the rank batches of a global batch (their layout, the cut, the
reader that delivers them and its state).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from readers.convert import BatchConverter
from readers.dataset import dataset_schema, make_pipeline
from readers.pipeline import Pipeline, PipelineSource
from readers.source import (
    DatasetSource,
    ReaderConfig,
    SourcePosition,
    Split,
    count_sessions,
    plan_splits,
)
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = [
    "ContiguousCut",
    "EpochLayout",
    "GlobalBatch",
    "RankBatchDataset",
    "RankCut",
    "RankLoader",
    "StreamGeometry",
    "check_rank_state",
    "rank_batches",
    "rank_state",
    "rank_steps",
]

STATE_VERSION = 1
STATE_KIND = "ranks"
_REOPEN_GAP = 8  # skip at most this many unwanted batches before reopening the stream further on
_WHOLE_BATCH_CHUNK = 8  # steps whose parts a whole-batch cut reads in one pass


# -------------------------------------------------------------------------------------------
# the global stream of an epoch


@dataclass(frozen=True)
class StreamGeometry:
    """Where the global batches of one epoch start in the split order.

    Attributes:
        order: the epoch's split order (shuffled with ``(seed, epoch)`` when shuffling).
        window_starts: int64 [windows] position in ``order`` of each window's first split.
        window_rows: int64 [windows + 1] rows before each window, then the total.
        batch_size: rows per batch B.
    """

    order: tuple[Split, ...]
    window_starts: np.ndarray
    window_rows: np.ndarray
    batch_size: int

    @property
    def total_rows(self) -> int:
        """Rows in the epoch."""
        return int(self.window_rows[-1])

    @property
    def num_batches(self) -> int:
        """Full global-stream batches, T = rows // B."""
        return self.total_rows // self.batch_size

    def position(self, batch: int) -> SourcePosition:
        """Where global batch ``batch`` starts: its window and the rows of it to skip."""
        row = batch * self.batch_size
        w = int(np.searchsorted(self.window_rows, row, side="right")) - 1
        return SourcePosition(int(self.window_starts[w]), row - int(self.window_rows[w]))


def stream_geometry(
    order: Sequence[Split], *, config: ReaderConfig, sessions: Mapping[int, int] | None = None
) -> StreamGeometry:
    """The window boundaries one reader would use for ``order`` (see :mod:`readers.source`).

    Args:
        order: the epoch's splits in reading order.
        config: the reader config (batch size, shuffle, shuffle buffer).
        sessions: ``{split.index: session runs}``, needed when shuffling.
    """
    need = config.shuffle_buffer if config.shuffle else 1
    starts, rows = [], []
    total, pos = 0, 0
    while pos < len(order):
        starts.append(pos)
        rows.append(total)
        held = 0
        while pos < len(order) and held < need:
            held += sessions[order[pos].index] if config.shuffle else need
            total += order[pos].num_rows
            pos += 1
    rows.append(total)
    return StreamGeometry(
        tuple(order),
        np.asarray(starts, dtype=np.int64),
        np.asarray(rows, dtype=np.int64),
        config.batch_size,
    )


# -------------------------------------------------------------------------------------------
# who reads which global batches


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """``[start, stop)`` runs of sorted batch indices."""
    out: list[list[int]] = []
    for k in indices:
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([int(k), int(k) + 1])
    return out


def _expand(runs: Sequence[Sequence[int]]) -> list[int]:
    return [k for start, stop in runs for k in range(start, stop)]


@dataclass(frozen=True)
class EpochLayout:
    """Which global batches every rank reads in one epoch (the same on every rank).

    Attributes:
        epoch: the epoch.
        world_size: ranks W.
        runs: per rank, ``[start, stop)`` ranges of global batch indices, in reading order.
        batches_per_rank: n, the same for every rank.
        remainder_rows: rows of the epoch no rank delivers (counted, not silently lost).
        remainder_batches: full global-stream batches among them.
        total_rows: rows of the epoch.
    """

    epoch: int
    world_size: int
    runs: tuple[tuple[tuple[int, int], ...], ...]
    batches_per_rank: int
    remainder_rows: int
    remainder_batches: int
    total_rows: int

    def batches_of(self, rank: int) -> list[int]:
        """The global batch indices ``rank`` reads, in order."""
        return _expand(self.runs[rank])

    @classmethod
    def fresh(cls, geometry: StreamGeometry, *, epoch: int, world_size: int) -> EpochLayout:
        """Contiguous ranges of ``T // W`` global batches, rank by rank."""
        total = geometry.num_batches
        n = total // world_size
        runs = tuple(((r * n, (r + 1) * n),) if n else () for r in range(world_size))
        return cls(
            epoch=epoch,
            world_size=world_size,
            runs=runs,
            batches_per_rank=n,
            remainder_rows=geometry.total_rows - world_size * n * geometry.batch_size,
            remainder_batches=total - world_size * n,
            total_rows=geometry.total_rows,
        )

    def redeal(self, *, delivered: int, world_size: int, batch_size: int) -> EpochLayout:
        """The batches not yet delivered (each rank delivered ``delivered``), dealt to
        ``world_size`` ranks in contiguous ranges of the sorted leftover list."""
        rest = sorted(k for r in range(self.world_size) for k in self.batches_of(r)[delivered:])
        n = len(rest) // world_size
        runs = tuple(tuple(map(tuple, _runs(rest[r * n : (r + 1) * n]))) for r in range(world_size))
        dropped = len(rest) - world_size * n
        return EpochLayout(
            epoch=self.epoch,
            world_size=world_size,
            runs=runs,
            batches_per_rank=n,
            remainder_rows=self.remainder_rows + dropped * batch_size,
            remainder_batches=self.remainder_batches + dropped,
            total_rows=self.total_rows,
        )

    def to_state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "world_size": self.world_size,
            "runs": [[list(run) for run in runs] for runs in self.runs],
            "batches_per_rank": self.batches_per_rank,
            "remainder_rows": self.remainder_rows,
            "remainder_batches": self.remainder_batches,
            "total_rows": self.total_rows,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> EpochLayout:
        runs = tuple(tuple((int(a), int(b)) for a, b in rank) for rank in state["runs"])
        return cls(
            epoch=int(state["epoch"]),
            world_size=int(state["world_size"]),
            runs=runs,
            batches_per_rank=int(state["batches_per_rank"]),
            remainder_rows=int(state["remainder_rows"]),
            remainder_batches=int(state["remainder_batches"]),
            total_rows=int(state["total_rows"]),
        )


# -------------------------------------------------------------------------------------------
# reading a list of global batches


def rank_batches(
    source: DatasetSource,
    geometry: StreamGeometry,
    batches: Sequence[int],
    *,
    epoch: int,
) -> Iterator[tuple[int, Any]]:
    """``(global batch index, Arrow table of B rows)`` for ``batches`` (ascending), in order.

    Each run of nearby indices is read with one pass over the stream from the first one's
    window; batches in between that are not wanted are cut but not converted.
    """
    order = list(geometry.order)
    i = 0
    while i < len(batches):
        first = batches[i]
        stream = source.iter_tables(order, epoch=epoch, start=geometry.position(first))
        try:
            current = first
            for table, _ in stream:
                if current == batches[i]:
                    yield current, table
                    i += 1
                    if i == len(batches) or batches[i] - current > _REOPEN_GAP:
                        break
                current += 1
            else:  # the stream ended before a wanted batch: the geometry is wrong
                msg = f"global batch {batches[i]} is past the end of epoch {epoch}'s stream"
                raise DataError(msg)
        finally:
            stream.close()


# -------------------------------------------------------------------------------------------
# global batches and the cut into rank micro-batches


@dataclass(frozen=True)
class GlobalBatch:
    """One step of a multi-rank epoch: the ranks' parts of the global stream, in rank order.

    Attributes:
        step: the step in the epoch's layout (``0 .. batches_per_rank - 1``).
        indices: the global stream batch each rank's part is (rank order).
        parts: Arrow tables of ``batch_size`` rows each, in rank order; ``None`` for the parts
            the cut does not read (a cut without :attr:`RankCut.whole_batch` gets only the
            part of the rank it cuts for).
    """

    step: int
    indices: tuple[int, ...]
    parts: tuple[pa.Table | None, ...]

    @property
    def table(self) -> pa.Table:
        """Every part concatenated in rank order (all must have been read)."""
        if any(p is None for p in self.parts):
            msg = "the global batch was read for one rank only: a whole-batch cut reads all parts"
            raise DataError(msg)
        return pa.concat_tables(self.parts)


class RankCut(Protocol):
    """Which rows of a :class:`GlobalBatch` each rank trains on (see ``docs/distributed.md``).

    ``cut(batch, rank)`` returns rank ``rank``'s micro-batch as an Arrow table. For every step,
    the tables of ranks ``0 .. W-1`` must together hold every row of the global batch exactly
    once and hold ``batch_size`` rows each (the trainer divides each rank's loss sum by
    ``W * batch_size``). Each rank (each reader process of the service) calls its own copy of
    the cut and the copies must agree: a pure function of the global batch and the rank does,
    and so does a cut whose state follows only the steps it is called for, which every rank
    sees in the same order (:class:`readers.dispatch.cut.DispatchCut`).

    Attributes:
        whole_batch: the cut reads every part of the global batch (``False``: only
            ``batch.parts[rank]`` is read, and the others are ``None``).
    """

    whole_batch: bool

    def __call__(self, batch: GlobalBatch, rank: int) -> pa.Table: ...


@dataclass(frozen=True)
class ContiguousCut:
    """The default cut: rank ``r`` trains on rows ``[r*B, (r+1)*B)`` of the global batch, i.e.
    on its own part of the stream (nothing else is read).

    >>> ContiguousCut().whole_batch
    False
    """

    whole_batch: ClassVar[bool] = False

    def __call__(self, batch: GlobalBatch, rank: int) -> pa.Table:
        part = batch.parts[rank]
        if part is None:
            msg = f"rank {rank}'s part of global batch {batch.step} was not read"
            raise DataError(msg)
        return part


def rank_steps(
    source: DatasetSource,
    geometry: StreamGeometry,
    layout: EpochLayout,
    rank: int,
    *,
    start: int = 0,
    cut: RankCut | None = None,
    worker_id: int = 0,
    num_workers: int = 1,
) -> Iterator[tuple[int, pa.Table]]:
    """``(step, rank's micro-batch)`` for the steps ``start + worker_id``, then every
    ``num_workers``-th, of ``layout``: the cut of each step's :class:`GlobalBatch`.

    A cut that reads the whole batch gets its parts read a few steps at a time (one pass over
    each rank's range per chunk).
    """
    cut = cut or ContiguousCut()
    steps = list(range(start + worker_id, layout.batches_per_rank, num_workers))
    lists = [layout.batches_of(r) for r in range(layout.world_size)]
    if not cut.whole_batch:  # one pass over this rank's own parts, streamed
        own = [lists[rank][t] for t in steps]
        tables = rank_batches(source, geometry, own, epoch=layout.epoch)
        for t, (_, table) in zip(steps, tables, strict=True):
            indices = tuple(lists[r][t] for r in range(layout.world_size))
            parts = tuple(table if r == rank else None for r in range(layout.world_size))
            yield t, cut(GlobalBatch(t, indices, parts), rank)
        return
    for at in range(0, len(steps), _WHOLE_BATCH_CHUNK):
        block = steps[at : at + _WHOLE_BATCH_CHUNK]
        wanted = sorted({lists[r][t] for t in block for r in range(layout.world_size)})
        tables = dict(rank_batches(source, geometry, wanted, epoch=layout.epoch))
        for t in block:
            indices = tuple(lists[r][t] for r in range(layout.world_size))
            yield t, cut(GlobalBatch(t, indices, tuple(tables[k] for k in indices)), rank)


# -------------------------------------------------------------------------------------------
# the rank reader


_SESSION_CACHE: collections.OrderedDict[tuple, dict[int, int]] = collections.OrderedDict()
_SESSION_CACHE_LOCK = threading.Lock()
_SESSION_CACHE_SIZE = 8  # split lists (a reader process of the service serves a few)


def _session_counts(source: DatasetSource, splits: Sequence[Split]) -> dict[int, int]:
    """Session runs of every split (reads the session column only, once per split list and
    process: the reader service builds a rank reader per client and epoch)."""
    key_of = tuple((s.path, s.row_group, s.num_rows, s.index, s.keep, s.file) for s in splits)
    with _SESSION_CACHE_LOCK:
        if key_of in _SESSION_CACHE:
            _SESSION_CACHE.move_to_end(key_of)
            return _SESSION_CACHE[key_of]
    counts = _read_session_counts(source, splits)
    with _SESSION_CACHE_LOCK:
        _SESSION_CACHE[key_of] = counts
        while len(_SESSION_CACHE) > _SESSION_CACHE_SIZE:
            _SESSION_CACHE.popitem(last=False)
    return counts


def _read_session_counts(source: DatasetSource, splits: Sequence[Split]) -> dict[int, int]:
    key = source.schema.session_key
    out: dict[int, int] = {}
    handles: dict[str, pq.ParquetFile] = {}
    try:
        for split in splits:
            handle = handles.get(split.path) or handles.setdefault(
                split.path, source.open_file(split)
            )
            split.check_unchanged()
            table = handle.read_row_group(split.row_group, columns=[key])
            out[split.index] = count_sessions(split.kept(table, session_key=key).column(0))
    finally:
        for handle in handles.values():
            handle.close()
    return out


def rank_state(
    *, epoch: int, delivered: int, batch_size: int, layout: EpochLayout | None
) -> dict[str, Any]:
    """A rank reader's position (what :meth:`RankBatchDataset.state_dict` returns): the epoch,
    the batches every rank delivered in it, and the layout (``None``: the epoch's fresh
    layout, before anything was delivered)."""
    return {
        "version": STATE_VERSION,
        "kind": STATE_KIND,
        "epoch": int(epoch),
        "delivered": int(delivered),
        "batch_size": int(batch_size),
        "layout": None if layout is None else layout.to_state(),
    }


def check_rank_state(state: Any, *, batch_size: int) -> dict[str, Any]:
    """``state`` if it is a rank reader position saved with ``batch_size`` rows per rank.

    Raises:
        DataError: not a rank reader state, or saved with another batch size.
    """
    if (
        not isinstance(state, Mapping)
        or state.get("kind") != STATE_KIND
        or state.get("version") != STATE_VERSION
        or any(k not in state for k in ("epoch", "delivered", "batch_size", "layout"))
    ):
        msg = f"`state` is not a rank reader state_dict (version {STATE_VERSION}): {state!r:.300}"
        raise DataError(msg)
    if int(state["batch_size"]) != batch_size:
        msg = (
            f"`state` was saved with batch_size={state['batch_size']!r} per rank, this "
            f"reader has {batch_size!r}; resume with the same batch size"
        )
        raise DataError(msg)
    if state["layout"] is None and int(state["delivered"]):
        msg = f"`state` delivered {state['delivered']!r} batches without a layout"
        raise DataError(msg)
    return dict(state)


class RankBatchDataset(IterableDataset):
    """The batches of one rank of a ``world_size``-rank job (see the module docstring).

    Every rank gets :attr:`EpochLayout.batches_per_rank` batches of exactly ``batch_size`` rows
    per epoch. Iterating in-process (or through :class:`RankLoader` with DataLoader workers)
    resumes where the last iteration stopped; an epoch that ends moves to the next one.

    Args:
        source: dataset directory, file, glob, or list of them.
        schema: the dataset schema (default: the manifest's).
        config: batch size, shuffling; ``last_batch`` is ignored (the tail is the remainder)
            and ``on_error`` must be ``"raise"`` (a skipped split would shift every later
            rank's rows).
        transforms: a :class:`~readers.pipeline.Pipeline` or its config.
        dedup: IKJTs for the schema's dedup groups.
        rank, world_size: this rank and how many there are.
        splits: use these splits instead of all of the source's (e.g. the training share).
        cut: which rows of each global batch this rank trains on (default
            :class:`ContiguousCut`).

    Example::

        ds = RankBatchDataset("data/dataset", config=ReaderConfig(batch_size=1024, shuffle=True),
                              rank=dist.get_rank(), world_size=dist.get_world_size())
        for batch in ds:  # the same number of batches on every rank
            ...
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[Any],
        *,
        schema: DatasetSchema | None = None,
        config: ReaderConfig | None = None,
        transforms: Pipeline | PipelineSource = None,
        dedup: bool = True,
        rank: int = 0,
        world_size: int = 1,
        splits: Sequence[Split] | None = None,
        cut: RankCut | None = None,
    ) -> None:
        super().__init__()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            msg = f"`world_size` must be a positive integer, got {world_size!r}"
            raise DataError(msg)
        if not 0 <= rank < world_size:
            msg = f"`rank` must be in [0, world_size={world_size}), got {rank!r}"
            raise DataError(msg)
        self.config = config or ReaderConfig()
        if self.config.on_error != "raise":
            msg = (
                f"`on_error` must be 'raise' with several ranks, got {self.config.on_error!r}: "
                "a skipped split would shift the rows of every later rank"
            )
            raise DataError(msg)
        self.schema = schema or dataset_schema(source)
        self.source = DatasetSource(source, schema=self.schema, config=self.config)
        if splits is not None:
            self.source.splits = list(splits)
        self.converter = BatchConverter(self.schema, dedup=dedup, extras=self.config.extras)
        self.pipeline = make_pipeline(transforms, self.schema, dataset=source)
        self.rank, self.world_size = rank, world_size
        self.cut = cut or ContiguousCut()
        self.epoch = 0
        self.delivered = 0  # batches of this epoch handed out (the same on every rank)
        self._sessions: dict[int, int] | None = None
        self._layout: EpochLayout | None = None

    # -- layout ---------------------------------------------------------------------------------
    def geometry(self, epoch: int | None = None) -> StreamGeometry:
        """The global stream of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        order = plan_splits(self.source.splits, config=self.config, epoch=epoch)
        if self.config.shuffle and self._sessions is None:
            self._sessions = _session_counts(self.source, self.source.splits)
        return stream_geometry(order, config=self.config, sessions=self._sessions)

    @property
    def layout(self) -> EpochLayout:
        """Which global batches every rank reads this epoch."""
        if self._layout is None or self._layout.epoch != self.epoch:
            self._layout = EpochLayout.fresh(
                self.geometry(), epoch=self.epoch, world_size=self.world_size
            )
        return self._layout

    @property
    def remainder_rows(self) -> int:
        """Rows of the current epoch no rank is given (counted, see the module docstring)."""
        return self.layout.remainder_rows

    def __len__(self) -> int:
        """Batches this rank delivers in the current epoch (all of them, delivered or not)."""
        return self.layout.batches_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning."""
        self.epoch = int(epoch)
        self.delivered = 0
        self._layout = None

    # -- reading --------------------------------------------------------------------------------
    def _convert(self, table: Any) -> Batch:
        batch = self.converter(table)
        return batch if self.pipeline is None else self.pipeline(batch)

    def iter_indexed(
        self, *, worker_id: int = 0, num_workers: int = 1
    ) -> Iterator[tuple[int, Batch]]:
        """``(global batch index, batch)`` from the current position, without advancing it;
        the index is that of this rank's own part of the step's global batch.

        With ``num_workers`` > 1, worker ``w`` takes every ``num_workers``-th remaining batch
        starting at the ``w``-th, so dealing them round-robin restores the rank's order.
        """
        layout = self.layout
        mine = layout.batches_of(self.rank)
        steps = rank_steps(
            self.source, self.geometry(), layout, self.rank, start=self.delivered, cut=self.cut,
            worker_id=worker_id, num_workers=num_workers,
        )  # fmt: skip
        for step, table in steps:
            yield mine[step], self._convert(table)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        if info is not None:  # a DataLoader worker: RankLoader counts what was delivered
            for _, batch in self.iter_indexed(worker_id=info.id, num_workers=info.num_workers):
                yield batch
            return
        for _, batch in self.iter_indexed():
            self.delivered += 1
            yield batch
        self._next_epoch()

    def _next_epoch(self) -> None:
        if self.delivered >= self.layout.batches_per_rank:
            self.set_epoch(self.epoch + 1)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered; the same on every rank."""
        return rank_state(epoch=self.epoch, delivered=self.delivered,
                          batch_size=self.config.batch_size, layout=self.layout)  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict` saved at any world size (see the module docstring;
        a state without a layout starts its epoch from the beginning).

        Raises:
            DataError: not a rank reader state, or saved with another batch size.
        """
        state = check_rank_state(state, batch_size=self.config.batch_size)
        self.set_epoch(int(state["epoch"]))
        if state["layout"] is None:
            return
        layout = EpochLayout.from_state(state["layout"])
        delivered = int(state["delivered"])
        if layout.epoch != self.epoch:
            msg = f"`state` holds the layout of epoch {layout.epoch} for epoch {self.epoch}"
            raise DataError(msg)
        if layout.world_size != self.world_size:
            layout = layout.redeal(
                delivered=delivered, world_size=self.world_size, batch_size=self.config.batch_size
            )
            delivered = 0
        self._layout = layout
        self.delivered = delivered
        if self.delivered >= layout.batches_per_rank:
            self.set_epoch(self.epoch + 1)


class RankLoader:
    """A ``DataLoader`` over a :class:`RankBatchDataset` that counts what it handed out.

    With ``num_workers`` > 0 each worker converts every ``num_workers``-th batch of the rank's
    list and the loader deals them round-robin, so the order is the rank's order; every worker
    reads the rank's whole range (decoding is repeated, conversion is not).
    ``state_dict()`` is the position right after the last batch handed out.

    Args:
        dataset: the rank's dataset.
        num_workers: DataLoader worker processes (0: read in this process).
        **loader_kwargs: passed to ``DataLoader`` (``pin_memory``, ``prefetch_factor``, ...).
    """

    def __init__(self, dataset: RankBatchDataset, *, num_workers: int = 0, **loader_kwargs: Any):
        self.dataset = dataset
        self.num_workers = num_workers
        self.loader_kwargs = loader_kwargs

    def __iter__(self) -> Iterator[Batch]:
        ds = self.dataset
        if self.num_workers == 0:
            yield from ds
            return
        loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers, **self.loader_kwargs)
        for batch in loader:
            ds.delivered += 1
            yield batch
        ds._next_epoch()

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.dataset.load_state_dict(state)
