"""The batch stream of one rank of a ``world_size``-rank job (one process: rank 0 of 1).

A job steps its ranks in lockstep, so every rank must get the same number of batches in an
epoch (dealing row groups round-robin does not do that: 10 row groups over 3 ranks give
4/3/3 row groups, 16/12/12 batches). Here the ranks cut one *global stream* instead, the
stream one reader with the same config reads, into *global batches* of ``G = W*B``
consecutive rows (``B`` rows per rank)::

    splits, shuffled with rng(seed, epoch)                  s5 s2 s7 s0 s3 s6 s1 s4
    windows of >= shuffle_buffer sessions, sessions permuted
    cut every G = W*B rows: global batches                  g0 g1 g2 ... g(n-1)   n = rows // G
    the cut (ContiguousCut): rank r gets rows [r*B, (r+1)*B) of each g_t
    remainder (not delivered this epoch, counted)           the last rows < G

Step ``t`` trains on global batch ``g_t``: the stream one process reads at batch size ``G``.
So ``W`` ranks at batch size ``B`` read exactly the batches of one process at batch size
``W*B``, and every row of the epoch is delivered once except the remainder, ``rows - n*G``
rows (:attr:`EpochLayout.remainder_rows`). With ``drop_remainder=False`` (one rank only) the
remainder is delivered as a last, shorter batch: the whole stream, as for evaluation. A
session is cut only at a batch boundary, as with one reader. Rank ``r``'s part of ``g_t`` is
batch ``t*W + r`` of the stream cut every ``B`` rows; a rank reads only the windows its parts
touch (the session shuffle does not depend on the batch size, so both cuts see the same rows).

The layout is computed by every rank from the split footers alone when ``shuffle=False``; with
shuffling the window boundaries need each split's session count, read once (the session column
only) and cached.

**The position** (:meth:`RankBatchDataset.state_dict`) is the same on every rank and counts
rows of the global stream, not batches of one layout (mosaicml streaming's ``sample_in_epoch``)::

    {"version": 2, "kind": "stream", "epoch": 3, "sample_in_epoch": 8192,
     "global_batch_size": 1024, "rows": 100000, "shuffle": True, "seed": 0,
     "shuffle_buffer": 4096}

``sample_in_epoch`` rows of epoch ``epoch`` were delivered (``steps * global_batch_size``);
``rows``, ``shuffle``, ``seed`` and ``shuffle_buffer`` say which stream it is (``None``: not
known yet, e.g. a service client that has not connected), and a reader of another stream
refuses the state in one line. Any world size and batch size resume it: the rest of the epoch
is cut into global batches of the new size from row ``sample_in_epoch`` on, so ``W`` ranks at
``B`` resume a checkpoint of one process at ``W*B`` (and the reverse) on exactly the global
batches that run would have read; at another global batch size the epoch goes on from the same
row. The reader service uses this very format (:class:`readers.service.client.ServiceRankDataset`).

**The cut.** Step ``t``'s global batch is a :class:`GlobalBatch`: the ranks' parts of the stream
in rank order, ``W*B`` rows. A :class:`RankCut` decides which of its rows each rank trains on;
the default, :class:`ContiguousCut`, gives rank ``r`` rows ``[r*B, (r+1)*B)`` (its own part, so
it reads nothing else). Another cut (e.g. one that sends samples to the rank owning their
embedding rows) plugs in through ``RankBatchDataset(cut=...)`` and, on the reader service,
``DatasetProducer(cut=...)``; see ``docs/distributed.md`` for its contract.

The reader service serves one client per rank with this very class (``recpipe serve`` runs a
:class:`RankBatchDataset` per rank, positioned by the client's :meth:`~RankBatchDataset.state_dict`),
so a rank gets the same batches in-process and through the service.
"""

from __future__ import annotations

import collections
import dataclasses
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
    "check_stream_state",
    "epoch_steps",
    "rank_batches",
    "rank_steps",
    "state_problem",
    "stream_state",
]

STATE_VERSION = 2
STATE_KIND = "stream"
# which stream a position belongs to: a state of another stream is refused
STREAM_KEYS = ("rows", "shuffle", "seed", "shuffle_buffer")
_WHOLE_BATCH_CHUNK = 8  # steps whose parts a whole-batch cut reads in one pass


# -------------------------------------------------------------------------------------------
# the global stream of an epoch


@dataclass(frozen=True)
class StreamGeometry:
    """Where the batches of one epoch's stream, cut every B rows from row ``origin``, start in
    the split order.

    Attributes:
        order: the epoch's split order (shuffled with ``(seed, epoch)`` when shuffling).
        window_starts: int64 [windows] position in ``order`` of each window's first split.
        window_rows: int64 [windows + 1] rows before each window, then the total.
        batch_size: rows per batch B.
        origin: the row of the epoch batch 0 starts at.
    """

    order: tuple[Split, ...]
    window_starts: np.ndarray
    window_rows: np.ndarray
    batch_size: int
    origin: int = 0

    @property
    def total_rows(self) -> int:
        """Rows in the epoch."""
        return int(self.window_rows[-1])

    @property
    def num_batches(self) -> int:
        """Full batches from ``origin``, ``(rows - origin) // B``."""
        return max(self.total_rows - self.origin, 0) // self.batch_size

    def window_of(self, row: int) -> int:
        """The window that holds row ``row`` of the epoch."""
        return int(np.searchsorted(self.window_rows, row, side="right")) - 1

    def position(self, batch: int) -> SourcePosition:
        """Where batch ``batch`` starts: its window and the rows of it to skip."""
        row = self.origin + batch * self.batch_size
        w = self.window_of(row)
        return SourcePosition(int(self.window_starts[w]), row - int(self.window_rows[w]))

    def skips_a_window(self, batch: int, later: int) -> bool:
        """Reading on from the end of ``batch`` to batch ``later`` would pass a whole window
        neither touches (reopening the stream at ``later`` is then cheaper)."""
        end = self.window_of(self.origin + (batch + 1) * self.batch_size - 1)
        return self.window_of(self.origin + later * self.batch_size) > end + 1


def stream_geometry(
    order: Sequence[Split],
    *,
    config: ReaderConfig,
    sessions: Mapping[int, int] | None = None,
    origin: int = 0,
) -> StreamGeometry:
    """The window boundaries one reader would use for ``order`` (see :mod:`readers.source`).

    Args:
        order: the epoch's splits in reading order.
        config: the reader config (batch size, shuffle, shuffle buffer).
        sessions: ``{split.index: session runs}``, needed when shuffling.
        origin: the row batch 0 starts at.
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
        origin,
    )


# -------------------------------------------------------------------------------------------
# who reads which global batches


def epoch_steps(rows: int, *, origin: int, global_batch_size: int, drop_remainder: bool) -> int:
    """Global batches of ``global_batch_size`` rows from row ``origin`` of an epoch of ``rows``
    rows (the last one shorter, unless ``drop_remainder``).

    >>> epoch_steps(100, origin=0, global_batch_size=32, drop_remainder=True)
    3
    >>> epoch_steps(100, origin=40, global_batch_size=32, drop_remainder=False)
    2
    """
    left = max(rows - origin, 0)
    return left // global_batch_size if drop_remainder else -(-left // global_batch_size)


@dataclass(frozen=True)
class EpochLayout:
    """Which stream batches every rank reads in one epoch (the same on every rank).

    The epoch's stream from row ``origin`` on (0, or the row a resumed epoch goes on from) is
    cut every ``batch_size`` rows; step ``t``'s global batch is batches ``t*W .. t*W + W-1`` of
    that cut, and rank ``r``'s part of it is batch ``t*W + r``.

    Attributes:
        epoch: the epoch.
        world_size: ranks W.
        batch_size: rows per rank and step B.
        origin: rows of the epoch delivered before this layout's first step.
        steps: global batches from ``origin`` (every rank reads one part of each).
        total_rows: rows of the epoch.
        drop_remainder: the rows after the last whole global batch are not delivered.
    """

    epoch: int
    world_size: int
    batch_size: int
    origin: int
    steps: int
    total_rows: int
    drop_remainder: bool = True

    @classmethod
    def of(
        cls, *, epoch: int, world_size: int, batch_size: int, origin: int, total_rows: int,
        drop_remainder: bool = True,
    ) -> EpochLayout:  # fmt: skip
        """The layout of an epoch of ``total_rows`` rows from row ``origin`` on."""
        steps = epoch_steps(
            total_rows, origin=origin, global_batch_size=world_size * batch_size,
            drop_remainder=drop_remainder,
        )  # fmt: skip
        return cls(epoch, world_size, batch_size, origin, steps, total_rows, drop_remainder)

    @property
    def global_batch_size(self) -> int:
        """Rows of a step, ``W*B`` (the last step of a layout that keeps the remainder may
        hold fewer)."""
        return self.world_size * self.batch_size

    @property
    def batches_per_rank(self) -> int:
        """Steps of the layout: the same number on every rank."""
        return self.steps

    @property
    def remainder_rows(self) -> int:
        """Rows after the last global batch, not delivered this epoch (counted, not lost)."""
        return max(self.total_rows - self.origin - self.steps * self.global_batch_size, 0)

    def rows_after(self, steps: int) -> int:
        """``sample_in_epoch`` after ``steps`` steps of this layout."""
        return min(self.origin + steps * self.global_batch_size, self.total_rows)

    def batches_of(self, rank: int) -> list[int]:
        """The stream batches (cut every B rows from ``origin``) ``rank`` reads, in order."""
        w = self.world_size
        return [t * w + rank for t in range(self.steps)]


# -------------------------------------------------------------------------------------------
# reading a list of global batches


def rank_batches(
    source: DatasetSource,
    geometry: StreamGeometry,
    batches: Sequence[int],
    *,
    epoch: int,
) -> Iterator[tuple[int, Any]]:
    """``(batch index, Arrow table)`` for ``batches`` (ascending) of ``geometry``'s cut, in
    order: ``B`` rows each, the stream's last batch fewer.

    One pass over the stream reads on from a wanted batch to the next while no whole window
    lies between them (the batches in between are cut, not converted); otherwise the stream is
    opened again at the next one's window, so only the windows the batches touch are read.
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
                    if i == len(batches) or geometry.skips_a_window(current, batches[i]):
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
        step: the step in the epoch's layout (``0 .. steps - 1``).
        indices: the stream batch each rank's part is (rank order: ``step*W .. step*W + W-1``
            of the layout's cut).
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
    the steps of a chunk: their global batches are consecutive); one with an ``ahead(batch)``
    method is handed each global batch one step before it is cut for it.
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
    # a cut with `ahead` (readers.dispatch.cut.DispatchOnceCut) gets each global batch one
    # step before it is cut: its dispatch of step t + 1 overlaps step t
    ahead = getattr(cut, "ahead", None)
    batches = _global_batches(source, geometry, layout, steps)
    current = next(batches, None)
    if current is not None and ahead is not None:
        ahead(current)
    while current is not None:
        following = next(batches, None)
        if following is not None and ahead is not None:
            ahead(following)
        yield current.step, cut(current, rank)
        current = following


def _global_batches(
    source: DatasetSource, geometry: StreamGeometry, layout: EpochLayout, steps: Sequence[int]
) -> Iterator[GlobalBatch]:
    """The whole global batches of ``steps`` (ascending), their parts read a few steps at a
    time (one pass over the steps of a chunk: their global batches are consecutive)."""
    lists = [layout.batches_of(r) for r in range(layout.world_size)]
    for at in range(0, len(steps), _WHOLE_BATCH_CHUNK):
        block = steps[at : at + _WHOLE_BATCH_CHUNK]
        wanted = sorted({lists[r][t] for t in block for r in range(layout.world_size)})
        tables = dict(rank_batches(source, geometry, wanted, epoch=layout.epoch))
        for t in block:
            indices = tuple(lists[r][t] for r in range(layout.world_size))
            yield GlobalBatch(t, indices, tuple(tables[k] for k in indices))


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


def stream_state(
    *, epoch: int, sample_in_epoch: int, global_batch_size: int, stream: Mapping[str, Any]
) -> dict[str, Any]:
    """A stream position (what :meth:`RankBatchDataset.state_dict` returns; see the module
    docstring): ``sample_in_epoch`` rows of epoch ``epoch`` delivered, in global batches of
    ``global_batch_size`` rows, of the stream ``stream`` (its :data:`STREAM_KEYS`)."""
    return {
        "version": STATE_VERSION,
        "kind": STATE_KIND,
        "epoch": int(epoch),
        "sample_in_epoch": int(sample_in_epoch),
        "global_batch_size": int(global_batch_size),
        **{key: stream.get(key) for key in STREAM_KEYS},
    }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def state_problem(state: Any) -> str | None:
    """What is wrong with the form of ``state`` as a stream position (``None``: nothing)."""
    if not isinstance(state, Mapping):
        return f"`state` is not a stream position (a dict), got {state!r:.100}"
    if state.get("kind") == "ranks" and state.get("version") == 1:
        return (
            "`state` is a rank reader position of version 1 (per-rank batch ranges), which "
            "this version cannot place in its stream: start the run afresh (without --resume)"
        )
    if state.get("kind") != STATE_KIND or state.get("version") != STATE_VERSION:
        return f"`state` is not a stream position (version {STATE_VERSION}): {state!r:.200}"
    want = {"version", "kind", "epoch", "sample_in_epoch", "global_batch_size", *STREAM_KEYS}
    if set(state) != want:
        return f"`state` has the keys {sorted(state)}, a stream position has {sorted(want)}"
    for key in ("epoch", "sample_in_epoch"):
        if not _is_count(state[key]):
            return f"`state` has an invalid `{key}` {state[key]!r:.50}"
    if not _is_count(state["global_batch_size"]) or not state["global_batch_size"]:
        return f"`state` has an invalid `global_batch_size` {state['global_batch_size']!r:.50}"
    for key in ("rows", "shuffle_buffer"):
        if state[key] is not None and not _is_count(state[key]):
            return f"`state` has an invalid `{key}` {state[key]!r:.50}"
    if not isinstance(state["shuffle"], bool | None):
        return f"`state` has an invalid `shuffle` {state['shuffle']!r:.50}"
    if state["seed"] is not None and not (
        isinstance(state["seed"], int) and not isinstance(state["seed"], bool)
    ):
        return f"`state` has an invalid `seed` {state['seed']!r:.50}"
    return None


def check_stream_state(state: Any, *, stream: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` if it is a stream position (:func:`stream_state`) of the stream ``stream``.

    Entries of ``stream`` or of the state that are ``None`` are not known and not compared;
    ``seed`` and ``shuffle_buffer`` only matter (and are compared) when both shuffle.

    Raises:
        DataError: not a stream position, one of another stream (other rows, shuffle, seed or
            shuffle buffer: the message names the field and both values), or past its end.
    """
    problem = state_problem(state)
    if problem is not None:
        raise DataError(problem)
    keys = ["rows", "shuffle"]
    if state["shuffle"] and stream.get("shuffle"):
        keys += ["seed", "shuffle_buffer"]
    for key in keys:
        saved, mine = state[key], stream.get(key)
        if saved is not None and mine is not None and saved != mine:
            what = "rows in the epoch (another dataset or part)" if key == "rows" else f"`{key}`"
            msg = (
                f"`state` is a position in another stream: saved with {what} = {saved!r}, "
                f"this reader has {mine!r}; resume with the reader settings it was saved with"
            )
            raise DataError(msg)
    rows = state["rows"] if state["rows"] is not None else stream.get("rows")
    if rows is not None and state["sample_in_epoch"] > rows:
        msg = (
            f"`state` is at row {state['sample_in_epoch']:,} of epoch {state['epoch']}, "
            f"which has {rows:,} rows: it was saved for other data"
        )
        raise DataError(msg)
    return dict(state)


class RankBatchDataset(IterableDataset):
    """The batches of one rank of a ``world_size``-rank job (see the module docstring); one
    process is rank 0 of a world of 1.

    Every rank gets the same number of batches per epoch (:meth:`__len__`), of exactly
    ``batch_size`` rows each: its part of the step's global batch of ``world_size *
    batch_size`` consecutive rows of the stream. Iterating in-process (or through
    :class:`RankLoader` with DataLoader workers) resumes where the last iteration stopped; an
    epoch that ends moves to the next one.

    Args:
        source: dataset directory, file, glob, or list of them.
        schema: the dataset schema (default: the manifest's).
        config: batch size (per rank), shuffling; ``last_batch`` is ignored (see
            ``drop_remainder``) and ``on_error`` must be ``"raise"`` (a skipped split would
            shift every later rank's rows).
        transforms: a :class:`~readers.pipeline.Pipeline` or its config.
        dedup: IKJTs for the schema's dedup groups.
        rank, world_size: this rank and how many there are.
        splits: use these splits instead of all of the source's (e.g. the training share).
        cut: which rows of each global batch this rank trains on (default
            :class:`ContiguousCut`).
        drop_remainder: leave out the rows after the last whole global batch (counted in
            :attr:`remainder_rows`); ``False`` delivers them as a last, shorter batch, which
            only one rank can (``world_size=1``: every rank evaluating the same batches).

    Example::

        ds = RankBatchDataset("data/dataset", config=ReaderConfig(batch_size=1024, shuffle=True),
                              rank=dist.get_rank(), world_size=dist.get_world_size())
        for batch in ds:  # the same number of batches on every rank
            ...
        held = RankBatchDataset("data/dataset", config=ReaderConfig(batch_size=world * 1024),
                                splits=held_out, drop_remainder=False)  # every row, on any rank
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
        drop_remainder: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            msg = f"`world_size` must be a positive integer, got {world_size!r}"
            raise DataError(msg)
        if not 0 <= rank < world_size:
            msg = f"`rank` must be in [0, world_size={world_size}), got {rank!r}"
            raise DataError(msg)
        if not drop_remainder and world_size > 1:
            msg = (
                f"`drop_remainder=False` needs world_size=1, got {world_size}: the ranks step "
                "together on equal parts\nhint: to evaluate every row on every rank, read with "
                "rank=0, world_size=1 and the global batch size"
            )
            raise DataError(msg)
        self.config = config or ReaderConfig()
        if self.config.on_error != "raise":
            msg = (
                f"`on_error` must be 'raise' with several ranks, got {self.config.on_error!r}: "
                "a skipped split would shift the rows of every later rank"
            )
            raise DataError(msg)
        self.schema = schema or dataset_schema(source)
        # the stream's own last batch is read when the remainder is delivered
        read = dataclasses.replace(self.config, last_batch="partial")
        self.source = DatasetSource(source, schema=self.schema, config=read)
        if splits is not None:
            self.source.splits = list(splits)
        self.converter = BatchConverter(self.schema, dedup=dedup, extras=self.config.extras)
        self.pipeline = make_pipeline(transforms, self.schema, dataset=source)
        self.rank, self.world_size = rank, world_size
        self.cut = cut or ContiguousCut()
        self.drop_remainder = drop_remainder
        self.epoch = 0
        self.origin = 0  # the row of the epoch its first step starts at (resumed: not 0)
        self.delivered = 0  # steps of this epoch handed out from there (the same on every rank)
        self._sessions: dict[int, int] | None = None
        self._geometry: StreamGeometry | None = None
        self._geometry_epoch = -1

    # -- layout ---------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """Rows of a step over all ranks, ``world_size * batch_size``."""
        return self.world_size * self.config.batch_size

    @property
    def total_rows(self) -> int:
        """Rows in an epoch (of the splits read)."""
        return sum(split.num_rows for split in self.source.splits)

    @property
    def stream(self) -> dict[str, Any]:
        """Which stream this is: the :data:`STREAM_KEYS` of a position."""
        cfg = self.config
        return {"rows": self.total_rows, "shuffle": cfg.shuffle, "seed": cfg.seed,
                "shuffle_buffer": cfg.shuffle_buffer}  # fmt: skip

    def geometry(self) -> StreamGeometry:
        """The current epoch's stream, cut every ``batch_size`` rows from :attr:`origin`."""
        cached = self._geometry
        if cached is not None and (cached.origin, self._geometry_epoch) == (
            self.origin,
            self.epoch,
        ):
            return cached
        order = plan_splits(self.source.splits, config=self.config, epoch=self.epoch)
        if self.config.shuffle and self._sessions is None:
            self._sessions = _session_counts(self.source, self.source.splits)
        self._geometry = stream_geometry(
            order, config=self.config, sessions=self._sessions, origin=self.origin
        )
        self._geometry_epoch = self.epoch
        return self._geometry

    @property
    def layout(self) -> EpochLayout:
        """Which stream batches every rank reads in the rest of the current epoch."""
        return EpochLayout.of(
            epoch=self.epoch, world_size=self.world_size, batch_size=self.config.batch_size,
            origin=self.origin, total_rows=self.total_rows, drop_remainder=self.drop_remainder,
        )  # fmt: skip

    @property
    def remainder_rows(self) -> int:
        """Rows of the current epoch no rank is given (counted, see the module docstring)."""
        return self.layout.remainder_rows

    def __len__(self) -> int:
        """Batches this rank delivers in the current epoch (from its start, or from the row a
        resumed epoch went on from; delivered or not)."""
        return self.layout.steps

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning."""
        self.epoch = int(epoch)
        self.origin = 0
        self.delivered = 0

    # -- reading --------------------------------------------------------------------------------
    def _convert(self, table: Any) -> Batch:
        batch = self.converter(table)
        return batch if self.pipeline is None else self.pipeline(batch)

    def iter_indexed(
        self, *, worker_id: int = 0, num_workers: int = 1
    ) -> Iterator[tuple[int, Batch]]:
        """``(stream batch index, batch)`` from the current position, without advancing it; the
        index is that of this rank's own part in the layout's cut (:meth:`EpochLayout.batches_of`).

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
        if self.delivered >= len(self):
            self.set_epoch(self.epoch + 1)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered, the same on every rank (see the
        module docstring)."""
        return stream_state(
            epoch=self.epoch, sample_in_epoch=self.layout.rows_after(self.delivered),
            global_batch_size=self.global_batch_size, stream=self.stream,
        )  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a :meth:`state_dict` saved at any world size and batch size, in-process
        or by a :class:`~readers.service.client.ServiceRankDataset`: the rest of its epoch is cut
        into this reader's global batches from its ``sample_in_epoch`` row on.

        Raises:
            DataError: not a stream position, or one of another stream.
        """
        state = check_stream_state(state, stream=self.stream)
        self.set_epoch(int(state["epoch"]))
        self.origin = int(state["sample_in_epoch"])
        self._next_epoch()


class RankLoader:
    """A ``DataLoader`` over a :class:`RankBatchDataset` that counts what it handed out.

    With ``num_workers`` > 0 each worker converts every ``num_workers``-th batch of the rank's
    list and the loader deals them round-robin, so the order is the rank's order; every worker
    reads the windows of the rank's parts (decoding is repeated, conversion is not).
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
