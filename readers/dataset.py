"""``torch.utils.data`` integration: a sharded, resumable ``IterableDataset`` of batches.

Sharding: the splits (row groups) of the dataset are dealt to trainer ranks (``rank``,
``world_size``) and, inside a rank, to DataLoader workers (found in ``__iter__`` with
``torch.utils.data.get_worker_info()``); see :func:`readers.source.plan_splits`. Every row is
delivered exactly once per epoch across all ranks and workers.

Resumable state that works with DataLoader workers: each worker's stream is deterministic, so its
position is two integers (the window start in its split list and the rows delivered from that
window, :class:`~readers.source.SourcePosition`). Workers run ahead of the consumer (prefetching),
so the position that matters is the one of the last batch the *consumer received*. Each batch
therefore travels with its :class:`ReaderPosition`; :class:`StatefulLoader` (what
:func:`make_dataloader` returns) strips it off, records it per worker, and its ``state_dict()``
is the position of everything handed to the training loop. Loading that state into a new loader
(same ``num_workers``, ``world_size`` and ``rank``) resumes every worker right after its last
delivered batch: nothing lost, nothing repeated. Without worker processes
(``num_workers=0``) the dataset itself tracks its position as it yields.

An epoch that finishes moves the state to the start of the next epoch (shuffles are seeded with
``(seed, epoch)``); :meth:`ParquetBatchDataset.set_epoch` chooses one explicitly.

Length: ``len(loader)`` (and ``len(dataset)``) is the number of batches the current epoch
delivers to this rank, computed from the row counts of the row groups each reader is dealt
(batches are cut every ``batch_size`` rows of a reader's stream, whatever the session
boundaries, and each reader ends with its own short batch unless ``last_batch="drop"``). It is
exact, except with ``on_error="skip"``, where splits skipped while reading make it an upper
bound. It depends on the worker layout, so a dataset read by a plain DataLoader with workers
must be told their number (``num_workers=``); a mismatch noticed in a worker is an error.

The state protocol of ``torchdata.stateful_dataloader.StatefulDataLoader`` works too: inside a
DataLoader worker, :meth:`ParquetBatchDataset.state_dict` is that worker's position after the
last batch it produced, and :meth:`~ParquetBatchDataset.load_state_dict` of that state resumes
the worker there (a finished worker stays finished). ``docs/loaders.md`` describes both.

Transport: with workers, :class:`StatefulLoader` has each worker pack a batch into one buffer
(:meth:`recpipe.batch.Batch.pack`) before it crosses to the main process, and unpacks it there
(views, no copy): one shared-memory segment per batch instead of one per tensor, one pinned
block with ``pin_memory=True``, and one host -> device copy in ``batch.to(device)``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from readers.convert import BatchConverter
from readers.groups import DedupGroups, resolve_dedup_groups
from readers.pipeline import Pipeline, PipelineSource
from readers.source import DatasetSource, ReaderConfig, SourcePosition, plan_splits
from readers.transforms import Transform
from recpipe.batch import PackedBatch
from recpipe.errors import DataError, RecpipeError, SchemaError

if TYPE_CHECKING:
    from readers.holdout import Holdout
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = [
    "ParquetBatchDataset",
    "ReaderPosition",
    "StatefulLoader",
    "dataset_schema",
    "iter_batches",
    "make_dataloader",
    "make_pipeline",
]

_STATE_VERSION = 1

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReaderPosition:
    """Where one reader (a worker of a rank) is after the batch it travels with.

    Attributes:
        epoch: the epoch of the batch.
        worker_id: the DataLoader worker that produced it (0 without workers).
        num_workers: workers of the loader (1 without workers).
        split_pos: window start in the worker's split list (see :class:`SourcePosition`).
        row: rows of that window delivered, this batch included.
        rows: rows in the batch.
        skipped: splits this worker skipped so far with ``on_error="skip"``.
    """

    epoch: int
    worker_id: int
    num_workers: int
    split_pos: int
    row: int
    rows: int
    skipped: int = 0


def dataset_schema(source: str | os.PathLike[str] | Sequence[Any]) -> DatasetSchema:
    """The schema of a clustered dataset: its ``_manifest.json`` ``schema``, else the default."""
    from schemas import default_schema, parse_schema

    if isinstance(source, str | os.PathLike) and Path(source).is_dir():
        manifest = Path(source) / "_manifest.json"
        if manifest.is_file():
            try:
                text = json.loads(manifest.read_text())["schema"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                msg = f"{manifest}: cannot read the `schema` of the manifest: {exc}"
                raise DataError(msg) from exc
            return parse_schema(text, source=f"{manifest} (schema)")
    return default_schema()


def make_pipeline(
    transforms: Pipeline | PipelineSource | Sequence[Transform],
    schema: DatasetSchema,
    *,
    dataset: str | os.PathLike[str] | Sequence[Any] | None = None,
    fitted: str | os.PathLike[str] | None = None,
) -> Pipeline | None:
    """A Pipeline from a Pipeline, a list of Transform objects, or a config (dict/list/file).

    A config's ``fit`` entries take their fitted state from the file ``fitted`` (``recpipe fit
    --out``), or else from ``dataset`` when it is a dataset directory (``recpipe fit``); a
    dataset directory must be the one the state was fitted on (see :mod:`readers.fitted`)."""
    is_list = isinstance(transforms, Sequence) and not isinstance(transforms, str)
    built = isinstance(transforms, Pipeline) or (
        is_list and transforms and all(isinstance(t, Transform) for t in transforms)
    )
    if fitted is not None and (transforms is None or built):
        msg = (
            f"`fitted` {os.fspath(fitted)!r} is given without a preprocessing config to fill "
            "from it (`transforms`: a TOML file or [[preprocess]] entries with `fit` keys)"
        )
        raise SchemaError(msg)
    if transforms is None:
        return None
    if isinstance(transforms, Pipeline):
        return transforms
    if built:
        return Pipeline(list(transforms), schema=schema)  # type: ignore[arg-type]
    root = dataset if isinstance(dataset, str | os.PathLike) and Path(dataset).is_dir() else None
    return Pipeline.from_config(transforms, schema=schema, dataset=root, fitted=fitted)


def _start_position(
    start_state: Mapping[str, Any] | SourcePosition | None,
    *,
    worker_id: int,
    num_workers: int,
    rank: int,
    world_size: int,
) -> tuple[int | None, SourcePosition | None]:
    """(epoch, position) of this worker in a state dict (``None`` entries: not given)."""
    if start_state is None:
        return None, None
    if isinstance(start_state, SourcePosition):
        return None, start_state
    _check_state(start_state, num_workers=num_workers, rank=rank, world_size=world_size)
    entry = start_state["positions"].get(str(worker_id))
    pos = None if entry is None else SourcePosition(int(entry[0]), int(entry[1]))
    return int(start_state["epoch"]), pos


def _check_num_workers(num_workers: object) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        msg = f"`num_workers` must be a non-negative integer, got {num_workers!r}"
        raise DataError(msg)


def _check_state(state: Mapping[str, Any], *, num_workers: int, rank: int, world_size: int) -> None:
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
        msg = f"`state` is not a reader state_dict (version {_STATE_VERSION}): {state!r}"
        raise DataError(msg)
    for name, want in (("num_workers", num_workers), ("rank", rank), ("world_size", world_size)):
        if state[name] != want:
            msg = (
                f"`state` was saved with {name}={state[name]!r} but this reader runs with "
                f"{name}={want!r}; resume with the same layout"
            )
            raise DataError(msg)


def _produce(
    source: DatasetSource,
    converter: BatchConverter,
    pipeline: Pipeline | None,
    *,
    epoch: int,
    rank: int,
    world_size: int,
    worker_id: int,
    num_workers: int,
    start: SourcePosition | None,
    end_marker: bool = False,
) -> Iterator[tuple[Batch | None, ReaderPosition]]:
    """The (batch, position) stream of one reader; with ``end_marker`` a final ``(None, pos)``
    tells a consumer that the worker finished (and how many splits it skipped)."""
    source = copy.copy(source)
    source.skipped = []
    splits = plan_splits(
        source.splits, config=source.config, epoch=epoch, rank=rank, world_size=world_size,
        worker_id=worker_id, num_workers=num_workers,
    )  # fmt: skip
    pos = start or SourcePosition()
    for table, pos in source.iter_tables(splits, epoch=epoch, start=start):
        batch = converter(table)
        if pipeline is not None:
            batch = pipeline(batch)
        yield batch, ReaderPosition(
            epoch, worker_id, num_workers, pos.split_pos, pos.row, table.num_rows,
            len(source.skipped),
        )  # fmt: skip
    if end_marker:
        yield (
            None,
            ReaderPosition(
                epoch, worker_id, num_workers, pos.split_pos, pos.row, 0, len(source.skipped)
            ),
        )


def iter_batches(
    dataset_dir: str | os.PathLike[str] | Sequence[Any],
    *,
    schema: DatasetSchema | None = None,
    config: ReaderConfig | None = None,
    transforms: Pipeline | PipelineSource = None,
    dedup: bool = True,
    rank: int = 0,
    world_size: int = 1,
    worker_id: int = 0,
    num_workers: int = 1,
    start_state: Mapping[str, Any] | SourcePosition | None = None,
    epoch: int = 0,
    with_positions: bool = False,
    holdout: Holdout | None = None,
    dedup_groups: DedupGroups = None,
    fitted: str | os.PathLike[str] | None = None,
) -> Iterator[Batch] | Iterator[tuple[Batch, ReaderPosition]]:
    """Produce the preprocessed batches of one reader: worker ``worker_id`` of ``rank``.

    This is what the reader service runs in each reader process.

    Args:
        dataset_dir: dataset directory, file, glob, or list of them.
        schema: the dataset schema (default: the manifest's, see :func:`dataset_schema`).
        config: batch size, shuffling, error policy, ``extras`` (pass-through columns to
            deliver in ``Batch.extras``, see :mod:`readers.extras`).
        transforms: a :class:`Pipeline`, a list of transforms, or a pipeline config (dict,
            ``[[preprocess]]`` entries, or a TOML file: see :meth:`Pipeline.from_config`).
        dedup: build one IKJT per schema dedup group (``False``: everything in one KJT).
        rank, world_size: the trainer rank and how many there are.
        worker_id, num_workers: this reader among the rank's readers.
        start_state: a :meth:`ParquetBatchDataset.state_dict` (its epoch and this worker's
            position are used) or a :class:`SourcePosition`.
        epoch: the epoch when ``start_state`` does not give one.
        with_positions: yield ``(batch, ReaderPosition)`` pairs instead of batches.
        holdout: read only this part of the dataset (its training or held-out splits, see
            :mod:`readers.holdout`); ``None``: every split.
        dedup_groups: the dedup groups to read with (see :mod:`readers.groups`; ``None``: the
            schema's).
        fitted: the fitted state of the config's ``fit`` entries (``recpipe fit --out``;
            ``None``: the dataset's own, see :mod:`readers.fitted`).
    """
    schema = schema or dataset_schema(dataset_dir)
    config = config or ReaderConfig()
    schema = resolve_dedup_groups(
        dedup_groups, schema=schema, dataset=dataset_dir, batch_size=config.batch_size
    )
    source = DatasetSource(dataset_dir, schema=schema, config=config)
    if holdout is not None:
        source.splits = holdout.select(source.splits, session_key=schema.session_key)
    state_epoch, start = _start_position(
        start_state, worker_id=worker_id, num_workers=num_workers, rank=rank,
        world_size=world_size,
    )  # fmt: skip
    stream = _produce(
        source, BatchConverter(schema, dedup=dedup, extras=config.extras),
        make_pipeline(transforms, schema, dataset=dataset_dir, fitted=fitted),
        epoch=epoch if state_epoch is None else state_epoch, rank=rank, world_size=world_size,
        worker_id=worker_id, num_workers=num_workers, start=start,
    )  # fmt: skip
    if with_positions:
        return stream
    return (batch for batch, _ in stream)


class ParquetBatchDataset(IterableDataset):
    """Session-packed, preprocessed :class:`~recpipe.batch.Batch` objects of a clustered dataset.

    Use with ``DataLoader(dataset, batch_size=None, ...)`` (batches are already batched), or
    through :func:`make_dataloader`, whose loader tracks the position of what it delivered.

    Args:
        source: dataset directory, file, glob, or list of them.
        schema: the dataset schema (default: the manifest's).
        config: batch size, shuffling, error policy, ``extras`` (pass-through columns to
            deliver in ``Batch.extras``, see :mod:`readers.extras`).
        transforms: a :class:`Pipeline` or its config.
        fitted: the fitted state of the config's ``fit`` entries (``recpipe fit --out``;
            ``None``: the dataset's own, see :mod:`readers.fitted`).
        dedup: IKJTs for the dedup groups (``False``: one plain KJT).
        rank, world_size: the trainer rank and how many there are.
        dedup_groups: the dedup groups (see :mod:`readers.groups`: ``None`` the schema's,
            ``"auto"`` the ``recpipe stats`` proposal at ``config.batch_size``, a TOML file, or
            a list of lists of names); ``self.schema`` carries them.
        num_workers: the DataLoader workers that will read the dataset (0: the consumer's own
            process). Only ``len()`` needs it (each worker ends with its own short batch);
            :func:`make_dataloader` sets it.

    Example::

        ds = ParquetBatchDataset("data/demo/dataset", config=ReaderConfig(batch_size=4096),
                                 num_workers=2)
        loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True)
        for batch in loader:  # len(loader) batches
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
        num_workers: int = 0,
        dedup_groups: DedupGroups = None,
        fitted: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            msg = f"`rank` must be in [0, world_size={world_size}), got {rank!r}"
            raise DataError(msg)
        _check_num_workers(num_workers)
        self.config = config or ReaderConfig()
        self.schema = resolve_dedup_groups(
            dedup_groups, schema=schema or dataset_schema(source), dataset=source,
            batch_size=self.config.batch_size,
        )  # fmt: skip
        self.source = DatasetSource(source, schema=self.schema, config=self.config)
        self.converter = BatchConverter(self.schema, dedup=dedup, extras=self.config.extras)
        self.pipeline = make_pipeline(transforms, self.schema, dataset=source, fitted=fitted)
        self.rank, self.world_size = rank, world_size
        self.num_workers = num_workers
        self.epoch = 0
        self.emit_positions = False
        self.pack_in_workers = False  # a StatefulLoader receives PackedBatch from its workers
        self.stream_epochs = False  # a worker goes on into the next epoch (StatefulLoader)
        self._managed = False  # a StatefulLoader advances the epoch
        self._generation = 0  # counts set_epoch / load_state_dict: a live stream is stale after
        self._resume: dict[str, Any] | None = None
        self._positions: dict[int, ReaderPosition] = {}
        self._num_workers = 1
        self._len_readers: int | None = None  # the readers len() counted for, once called

    @property
    def skipped(self) -> list:
        """Files left out at open time by ``on_error="skip"`` (see ``SkippedInput``)."""
        return list(self.source.skipped)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (shuffles are seeded with it)."""
        self.epoch = int(epoch)
        self._resume = None
        self._positions = {}
        self._generation += 1

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self._len_readers is not None and self._len_readers != num_workers:
            msg = (
                f"len() of this dataset counted the batches of {self._len_readers} reader(s), "
                f"but it is read by {num_workers}: give the dataset `num_workers={num_workers}` "
                "(the DataLoader's), or use make_dataloader"
            )
            raise DataError(msg)
        _, start = _start_position(
            self._resume, worker_id=worker_id, num_workers=num_workers, rank=self.rank,
            world_size=self.world_size,
        )  # fmt: skip
        self._num_workers = num_workers
        pack = self.pack_in_workers and info is not None
        epoch = self.epoch
        while True:
            stream = _produce(
                self.source, self.converter, self.pipeline, epoch=epoch, rank=self.rank,
                world_size=self.world_size, worker_id=worker_id, num_workers=num_workers,
                start=start, end_marker=True,
            )  # fmt: skip
            for batch, pos in stream:
                # the position of what this reader produced: the state a worker reports to a
                # StatefulDataLoader (and, in-process, what state_dict() returns)
                self._positions[worker_id] = pos
                if batch is not None:
                    sent = batch.pack() if pack else batch
                    yield (sent, pos) if self.emit_positions else sent
                elif self.emit_positions:  # the end marker, for a StatefulLoader
                    yield batch, pos
            if not (self.stream_epochs and info is not None):
                break
            epoch, start = epoch + 1, None  # the StatefulLoader cuts epochs at the end markers
        if info is None and not self._managed:
            self.set_epoch(self.epoch + 1)

    def num_batches(self, *, num_workers: int | None = None, epoch: int | None = None) -> int:
        """Batches an epoch delivers to this rank when ``num_workers`` workers read it.

        Computed from the row groups' row counts: each reader (worker) of this rank is dealt
        its splits (:func:`~readers.source.plan_splits`) and cuts a batch every ``batch_size``
        rows of them, ending with one short batch unless ``last_batch="drop"``. Exact, except
        with ``on_error="skip"``, where splits skipped while reading make it an upper bound.

        Args:
            num_workers: DataLoader workers (default: the dataset's ``num_workers``; 0 and 1
                both mean one reader).
            epoch: the epoch (default: the current one); with ``shuffle`` and several readers
                the split deal, hence the count, may change from epoch to epoch.
        """
        readers = max(self.num_workers if num_workers is None else num_workers, 1)
        epoch = self.epoch if epoch is None else epoch
        size, drop = self.config.batch_size, self.config.last_batch == "drop"
        total = 0
        for worker_id in range(readers):
            splits = plan_splits(
                self.source.splits, config=self.config, epoch=epoch, rank=self.rank,
                world_size=self.world_size, worker_id=worker_id, num_workers=readers,
            )  # fmt: skip
            rows = sum(split.num_rows for split in splits)
            total += rows // size if drop else -(-rows // size)
        return total

    def __len__(self) -> int:
        """:meth:`num_batches` of the current epoch for the dataset's ``num_workers``."""
        self._len_readers = max(self.num_workers, 1)
        return self.num_batches()

    def _state(self, positions: Mapping[int, ReaderPosition], num_workers: int) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": num_workers,
            "positions": {str(w): [p.split_pos, p.row] for w, p in sorted(positions.items())},
        }

    def state_dict(self) -> dict[str, Any]:
        """Position of the batches this dataset yielded in this process.

        In the consumer's process (``num_workers=0``) that is the position of everything
        delivered. Inside a DataLoader worker it is that worker's position, which is what
        ``torchdata``'s ``StatefulDataLoader`` collects from each worker. With a plain DataLoader
        and workers use :class:`StatefulLoader` (:func:`make_dataloader`): only the consumer knows
        which batches it received.
        """
        if self._resume is not None and not self._positions:
            return dict(self._resume)
        merged = {} if self._resume is None else _positions_of(self._resume)
        merged.update(self._positions)
        info = get_worker_info()  # in a worker: before its first batch too, its layout
        return self._state(merged, self._num_workers if info is None else info.num_workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict` (or a :meth:`StatefulLoader.state_dict`)."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            msg = f"`state` is not a reader state_dict (version {_STATE_VERSION}): {state!r}"
            raise DataError(msg)
        self.epoch = int(state["epoch"])
        self._resume = dict(state)
        self._positions = {}
        self._generation += 1
        self._num_workers = int(state["num_workers"])
        _log.debug("resuming epoch %d at %s", self.epoch, state["positions"])


def _positions_of(state: Mapping[str, Any]) -> dict[int, ReaderPosition]:
    epoch, nw = int(state["epoch"]), int(state["num_workers"])
    return {
        int(w): ReaderPosition(epoch, int(w), nw, int(p[0]), int(p[1]), 0)
        for w, p in state["positions"].items()
    }


class StatefulLoader:
    """A ``DataLoader`` over a :class:`ParquetBatchDataset` that knows what it delivered.

    Iterating yields :class:`~recpipe.batch.Batch` objects (pinned with ``pin_memory=True``).
    ``state_dict()`` at any point is the position right after the last batch handed out;
    ``load_state_dict()`` (before iterating) resumes there. Leaving a loop early and iterating
    again goes on from there too; epochs advance when one finishes.

    Args:
        dataset: the dataset.
        num_workers: DataLoader worker processes (0: read in this process).
        packed: workers send each batch packed in one buffer (:meth:`~recpipe.batch.Batch.pack`)
            and this loader unpacks it (``None``: whenever there are workers). The batches
            handed out are equal either way; packed, their tensors are views into one buffer,
            which also keeps it alive: clone a field kept across many batches.
        epochs_ahead: with workers, each worker goes on into the next epoch as soon as it has
            read its part of this one, and this loader keeps its workers and their prefetched
            batches from one epoch to the next: no pause at an epoch's end while every worker
            opens its first split again. Each epoch's batches (in each worker's order; the
            workers' turns may shift), its ``state_dict()`` and resuming are as without it; an
            error a worker meets in the next epoch can surface before this one ends.
            ``persistent_workers=True`` means the same (a DataLoader's own persistent workers
            would keep the dataset as it was when they started, and read its first epoch
            again every epoch).
        **loader_kwargs: passed to ``DataLoader`` (``pin_memory``, ``prefetch_factor``, ...;
            ``batch_size`` is always ``None``).
    """

    def __init__(
        self,
        dataset: ParquetBatchDataset,
        *,
        num_workers: int = 0,
        packed: bool | None = None,
        epochs_ahead: bool = False,
        **loader_kwargs: Any,
    ):
        if "batch_size" in loader_kwargs and loader_kwargs["batch_size"] is not None:
            msg = (
                f"`batch_size` is set by the dataset's config, got {loader_kwargs['batch_size']!r}"
            )
            raise DataError(msg)
        loader_kwargs.pop("batch_size", None)
        _check_num_workers(num_workers)
        self.dataset = dataset
        self.num_workers = num_workers
        dataset.num_workers = num_workers
        dataset.emit_positions = True
        dataset.pack_in_workers = num_workers > 0 if packed is None else bool(packed)
        persistent = bool(loader_kwargs.pop("persistent_workers", False))
        dataset.stream_epochs = (epochs_ahead or persistent) and num_workers > 0
        dataset._managed = True
        self.loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, **loader_kwargs)
        self._live: Iterator[Any] | None = None  # with epochs_ahead: the workers' endless stream
        self._live_generation = -1
        self._early: list[tuple[Any, ReaderPosition]] = []  # next epoch's, come before its turn
        self._positions: dict[int, ReaderPosition] = {}
        self.rows_delivered = 0
        self.batches_delivered = 0
        self.skipped_splits = 0

    def __iter__(self) -> Iterator[Batch]:
        dataset = self.dataset
        workers = max(self.num_workers, 1)
        if self._live is not None and self._live_generation != dataset._generation:
            self._stop_stream()  # set_epoch or load_state_dict since: start afresh
        if self._live is None:
            if self._positions:  # a loop left early: go on from what was handed out
                dataset.load_state_dict(self.state_dict())
            if dataset._resume is not None:
                _check_state(dataset._resume, num_workers=workers, rank=dataset.rank,
                             world_size=dataset.world_size)  # fmt: skip
                self._positions = _positions_of(dataset._resume)
            items: Iterator[Any] = iter(self.loader)
            if dataset.stream_epochs:
                self._live, self._live_generation = items, dataset._generation
        else:  # a loop left early, or the next epoch of the live stream
            items = self._live
        skipped: dict[int, int] = {}
        ended: set[int] = set()
        ready = [item for item in self._early if item[1].epoch == dataset.epoch]
        self._early = [item for item in self._early if item[1].epoch != dataset.epoch]
        try:
            while True:
                if ready:
                    batch, pos = ready.pop(0)
                else:
                    item = next(items, None)
                    if item is None:
                        break
                    batch, pos = item
                if self._live is not None and pos.epoch != dataset.epoch:  # the next, early
                    self._early.append((batch, pos))
                    continue
                skipped[pos.worker_id] = pos.skipped
                self.skipped_splits = sum(skipped.values())
                if batch is None:  # the worker finished (this epoch)
                    ended.add(pos.worker_id)
                    if self._live is not None and len(ended) == workers:
                        break
                    continue
                if isinstance(batch, PackedBatch):
                    batch = batch.unpack()
                self._positions[pos.worker_id] = pos
                self.rows_delivered += pos.rows
                self.batches_delivered += 1
                yield batch
        except RecpipeError as exc:
            ready = []
            self._stop_stream()
            plain = _from_worker(exc)
            if plain is exc:
                raise
            raise plain from None
        finally:
            self._early[:0] = ready  # a loop left early: they come first next time
        dataset.set_epoch(dataset.epoch + 1)
        self._positions = {}
        if self._live is not None:
            self._live_generation = dataset._generation

    def _stop_stream(self) -> None:
        """Let the live stream's workers go (their prefetched batches with them)."""
        self._live, self._early = None, []

    def __len__(self) -> int:
        """Batches the current epoch delivers (the whole epoch, also when resumed inside it);
        see :meth:`ParquetBatchDataset.num_batches`."""
        return self.dataset.num_batches(num_workers=self.num_workers)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return int(self.dataset.epoch)

    def state_dict(self) -> dict[str, Any]:
        """Position right after the last batch this loader handed out."""
        dataset = self.dataset
        if not self._positions and dataset._resume is not None:
            return dict(dataset._resume)
        return dataset._state(self._positions, max(self.num_workers, 1))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict` at the next iteration."""
        _check_state(state, num_workers=max(self.num_workers, 1), rank=self.dataset.rank,
                     world_size=self.dataset.world_size)  # fmt: skip
        self.dataset.load_state_dict(state)
        self._positions = _positions_of(state)


def _from_worker(exc: RecpipeError) -> RecpipeError:
    """A recpipe error of a DataLoader worker as the worker raised it.

    torch re-raises a worker's exception as ``type(exc)("Caught ... in DataLoader worker
    process N.\nOriginal Traceback ...")``: the error's one-line message (naming the file) would
    reach the user after a traceback. Errors raised in this process are returned as they are.
    """
    text = str(exc)
    if not text.startswith(f"Caught {type(exc).__name__} in DataLoader worker process"):
        return exc
    marker = f"{type(exc).__module__}.{type(exc).__qualname__}: "
    at = text.rfind(marker)
    if at < 0:
        return exc
    try:
        return type(exc)(text[at + len(marker) :].rstrip("\n"))
    except Exception:  # a subclass with another constructor: keep torch's text
        return exc


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def make_dataloader(
    source: str | os.PathLike[str] | Sequence[Any],
    *,
    schema: DatasetSchema | None = None,
    config: ReaderConfig | None = None,
    transforms: Pipeline | PipelineSource = None,
    dedup: bool = True,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
    dedup_groups: DedupGroups = None,
    fitted: str | os.PathLike[str] | None = None,
    packed: bool | None = None,
    epochs_ahead: bool = False,
    **loader_kwargs: Any,
) -> StatefulLoader:
    """A resumable loader of preprocessed batches (see :class:`StatefulLoader`).

    ``pin_memory=True`` pins batches when an accelerator is present (torch cannot pin memory
    without one; the request is then ignored instead of warning on every epoch).

    ``dedup_groups`` chooses the IKJT groups at read time, whatever the dataset was built with
    (see :mod:`readers.groups`): ``None`` the schema's, ``"auto"`` the groups ``recpipe stats``
    proposes at the config's batch size, a TOML file with a ``[dedup]`` table, or a list of
    lists of feature names. ``loader.dataset.schema`` carries the groups chosen (build the
    model from it).

    ``fitted`` is the fitted state of the config's ``fit`` entries that ``recpipe fit --out``
    wrote (``None``: the one ``recpipe fit`` wrote into the dataset; see :mod:`readers.fitted`).

    ``packed`` (default: with workers) has each worker send a batch as one buffer, pinned as
    one block, which ``batch.to(device, non_blocking=True)`` copies at once, and
    ``epochs_ahead=True`` lets the workers read on into the next epoch (see
    :class:`StatefulLoader`).

    Example::

        loader = make_dataloader("data/demo/dataset", config=ReaderConfig(batch_size=4096),
                                 transforms="preprocess.toml", num_workers=2, pin_memory=True)
        for step, batch in enumerate(loader):
            ...
            if step % 1000 == 0:
                torch.save({"reader": loader.state_dict(), ...}, "ckpt.pt")
    """
    dataset = ParquetBatchDataset(
        source, schema=schema, config=config, transforms=transforms, dedup=dedup, rank=rank,
        world_size=world_size, num_workers=num_workers, dedup_groups=dedup_groups, fitted=fitted,
    )  # fmt: skip
    if num_workers > 0:
        loader_kwargs.setdefault("persistent_workers", False)
    return StatefulLoader(
        dataset, num_workers=num_workers, packed=packed, epochs_ahead=epochs_ahead,
        pin_memory=pin_memory and _accelerator_available(), **loader_kwargs,
    )  # fmt: skip
