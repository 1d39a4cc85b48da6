"""Splits of a clustered dataset and session-packed batches of Arrow rows.

A *split* is one Parquet row group. The ETL writes row groups that never cut a session (unless
a session alone exceeds the row-group size), so splits can be shuffled and handed to different
readers without breaking sessions.

The stream one reader produces is fully determined by ``(splits, config, epoch, rank,
world_size, worker_id, num_workers)``::

    all splits (dataset order)                    s0 s1 s2 s3 s4 s5 s6 s7
    shuffled with rng(seed, epoch) if shuffle     s5 s2 s7 s0 s3 s6 s1 s4
    rank r takes [r::world_size]     (rank 0)     s5    s7    s3    s1
    worker w takes [w::num_workers]  (worker 1)      s7          s1
    windows: consecutive splits until they hold >= shuffle_buffer sessions
    sessions of a window permuted with rng(seed, epoch, first split) if shuffle
    rows cut every batch_size rows -> batches (a session is split only at a batch boundary)

Rows of a session are never reordered or separated except at a batch boundary. Because the stream
is deterministic, a reader's position is just ``(split_pos, row)``: the window that starts at
position ``split_pos`` of the reader's split list and the number of its (permuted) rows already
delivered. Resuming rebuilds that window and skips ``row`` rows.

Last batch policy: ``last_batch="partial"`` emits the final rows of a reader's stream as a
smaller batch; ``"drop"`` drops them (every batch then has exactly ``batch_size`` rows).

Read-ahead: a background thread reads and decodes the next ``read_ahead`` splits while the
current window is consumed; the stream, its positions, errors and skips are the same as with 0.

One concept, over 600 lines: the dataset as the readers see it (its files, splits and
session-packed reads).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from readers.extras import check_extras
from readers.listing import Listed, discover_files, is_hidden, list_files
from recpipe.errors import CorruptInputError, DataError
from recpipe.integrity import (
    MANIFEST_NAME,
    FileChangedError,
    FileId,
    check_digest,
    check_unchanged,
)

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = [
    "COMMAND_READER_DEFAULTS",
    "COMMAND_READER_OPTIONS",
    "DatasetSource",
    "ReaderConfig",
    "SkippedInput",
    "SourcePosition",
    "Split",
    "count_sessions",
    "discover_files",
    "plan_splits",
]

_log = logging.getLogger("recpipe.readers")

PathLike = str | os.PathLike[str]

_MAX_HANDLES = 8  # open Parquet files a reader keeps
_READ_ERRORS = (DataError, pa.ArrowException, OSError)  # what ``on_error`` decides about


@dataclass
class ReaderConfig:
    """How a reader turns splits into batches.

    Attributes:
        batch_size: rows per batch (B).
        shuffle: shuffle row groups and, inside a shuffle buffer, whole sessions (seeded).
        seed: seed of every shuffle; the epoch number is mixed in.
        shuffle_buffer: sessions mixed together at least: consecutive splits are read into one
            window until it holds this many sessions (only used when ``shuffle``).
        last_batch: ``"partial"`` keeps a short final batch, ``"drop"`` drops it.
        on_error: ``"raise"`` on a corrupt file / bad schema, or ``"skip"`` it and count it.
        use_threads: let Arrow decode with its thread pool (off: one core per reader).
        read_ahead: splits a background thread reads and decodes ahead of the one being consumed
            (at most this many extra row groups in memory); 0 reads each split when the stream
            reaches it, on the reader's one core. The stream is the same either way; what it
            gains is measured by ``read_ahead_speedup`` in ``benchmarks/service.py``.
        verify: how much of the files' bytes is checked. ``"pages"`` (the default) verifies
            each Parquet page's checksum (CRC) as it is read, so a corrupt page raises
            :class:`~recpipe.errors.CorruptInputError` naming the file, row group and column (or
            is skipped and counted with ``on_error="skip"``) instead of decoding to different
            lists; files written without page checksums read as with ``"off"``. ``"full"`` also
            compares every file's sha256 with the dataset's ``_manifest.json`` when the source
            opens (reading every byte once); a file the manifest does not list with a digest
            is an error. ``"off"`` checks no bytes. Whatever the level, the files read are the
            ones the manifest lists, with its sizes, rows and row groups, and each read checks
            (one ``stat``) that its file is still the one the source opened (see
            :class:`DatasetSource`).
    """

    batch_size: int = 4096
    shuffle: bool = False
    seed: int = 0
    shuffle_buffer: int = 4096
    last_batch: Literal["partial", "drop"] = "partial"
    on_error: Literal["raise", "skip"] = "raise"
    use_threads: bool = False
    read_ahead: int = 1
    verify: Literal["off", "pages", "full"] = "pages"
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            msg = f"`batch_size` must be a positive integer, got {self.batch_size!r}"
            raise DataError(msg)
        if not isinstance(self.shuffle_buffer, int) or self.shuffle_buffer < 1:
            msg = f"`shuffle_buffer` must be a positive integer (sessions), got {self.shuffle_buffer!r}"
            raise DataError(msg)
        if self.last_batch not in ("partial", "drop"):
            msg = f"`last_batch` must be 'partial' or 'drop', got {self.last_batch!r}"
            raise DataError(msg)
        if self.on_error not in ("raise", "skip"):
            msg = f"`on_error` must be 'raise' or 'skip', got {self.on_error!r}"
            raise DataError(msg)
        if not isinstance(self.seed, int):
            msg = f"`seed` must be an integer, got {self.seed!r}"
            raise DataError(msg)
        if isinstance(self.read_ahead, bool) or not (
            isinstance(self.read_ahead, int) and self.read_ahead >= 0
        ):
            msg = f"`read_ahead` must be a non-negative integer (splits), got {self.read_ahead!r}"
            raise DataError(msg)
        if self.verify not in ("off", "pages", "full"):
            msg = f"`verify` must be 'off', 'pages' or 'full', got {self.verify!r}"
            raise DataError(msg)
        self.extras = _checked_extras(self.extras)


# The ReaderConfig fields every command that reads batches exposes as options (`recpipe serve`
# from ReaderConfig itself, `recpipe train` from TrainConfig's fields of the same names), and the
# defaults of the commands where they differ from the dataclass's: a command reads to train, so
# it shuffles (--no-shuffle turns it off).
COMMAND_READER_OPTIONS: tuple[str, ...] = (
    "batch_size", "shuffle", "seed", "read_ahead", "verify", "on_error",
)  # fmt: skip
COMMAND_READER_DEFAULTS: dict[str, Any] = {"shuffle": True}


def _checked_extras(extras: object) -> tuple[str, ...]:
    """``extras`` as a tuple of distinct, non-empty column names."""
    if isinstance(extras, str) or not isinstance(extras, Sequence):
        msg = f"`extras` must be a list of column names, got {extras!r}"
        raise DataError(msg)
    names = tuple(extras)
    for name in names:
        if not isinstance(name, str) or not name:
            msg = f"`extras` must hold non-empty column names, got {name!r}"
            raise DataError(msg)
    if len(set(names)) != len(names):
        msg = f"`extras` names a column twice: {list(names)!r}"
        raise DataError(msg)
    return names


@dataclass(frozen=True)
class Split:
    """One row group of one Parquet file.

    Attributes:
        path: the Parquet file.
        row_group: index of the row group in the file.
        num_rows: rows in the row group.
        index: position of the split in the dataset order (files sorted by path).
        compressed_bytes: compressed size of the columns a reader reads.
        partition: Hive partition values from the path (``dt=2024-01-01-00`` -> {"dt": ...}).
        keep: which rows of the row group the split holds: a filter of session ids with a
            ``mask(ids)`` method (a :class:`readers.holdout.SessionFilter`: one holdout part);
            ``None``: all of them. ``num_rows`` counts the rows kept.
        file: the identity (size, mtime, inode) of the file when the source opened it; every
            read checks that the file is still that one (``None``: not checked). Not part of
            the split's equality.
    """

    path: str
    row_group: int
    num_rows: int
    index: int
    compressed_bytes: int = 0
    partition: tuple[tuple[str, str], ...] = ()
    keep: Any = None
    file: FileId | None = field(default=None, compare=False)

    def check_unchanged(self) -> None:
        """Raise :class:`~recpipe.integrity.FileChangedError` if the file is no longer the one
        the source opened (one ``stat``)."""
        if self.file is not None:
            check_unchanged(self.path, self.file)

    def kept(self, table: pa.Table, *, session_key: str) -> pa.Table:
        """The rows of ``table`` (the whole row group) that this split holds."""
        if self.keep is None:
            return table
        mask = self.keep.mask(table.column(session_key).to_numpy())
        return table if mask.all() else table.filter(pa.array(mask))


@dataclass(frozen=True)
class SkippedInput:
    """An input that ``on_error="skip"`` left out, and why."""

    path: str
    row_group: int | None
    rows: int
    reason: str


@dataclass(frozen=True)
class SourcePosition:
    """Where a reader is in its stream: window start (in its split list) and rows delivered."""

    split_pos: int = 0
    row: int = 0


def _check_listed_digest(path: Path, listed: Listed | None) -> None:
    """``verify="full"``: ``path``'s size and sha256 against its dataset's manifest.

    Raises:
        CorruptInputError: the size or digest differs.
        DataError: no manifest lists the file with a digest.
    """
    if listed is None:
        msg = (
            f"{path}: verify='full' needs the dataset's {MANIFEST_NAME}, and no folder above "
            "the file has one that lists files"
        )
        raise DataError(msg)
    if listed.entry.sha256 is None:
        msg = (
            f"{path}: verify='full', but {os.fspath(listed.root / MANIFEST_NAME)!r} records no "
            "sha256 for it\nhint: rebuild the dataset to record digests, or read with "
            "verify='pages'"
        )
        raise DataError(msg)
    problems = check_digest(listed.root, listed.entry)
    if problems:
        msg = f"{path}: {'; '.join(problems)} (verify='full')"
        raise CorruptInputError(msg)


def _differs_from(path: Path, listed: Listed, what: str) -> CorruptInputError:
    """A listed file that differs from its manifest entry."""
    msg = (
        f"{path}: {what} ({os.fspath(listed.root / MANIFEST_NAME)!r})\n"
        "hint: the file changed after the build: rebuild the dataset or copy it again "
        "(`recpipe etl verify DATASET` checks every file)"
    )
    return CorruptInputError(msg)


def _read_footer(path: Path, listed: Listed | None) -> tuple[FileId, pq.FileMetaData]:
    """The identity and footer of ``path``, checked against its manifest entry (its size
    before the footer is parsed, then its rows and row groups).

    Raises:
        CorruptInputError: the file cannot be read or differs from its entry.
        FileChangedError: it changed while the footer was read.
    """
    try:
        opened = FileId.of(path)
    except OSError as exc:
        msg = f"{path}: cannot be read: {exc}"
        raise CorruptInputError(msg) from exc
    if listed is not None and opened.size != listed.entry.bytes:
        what = f"the manifest says {listed.entry.bytes:,} bytes, the file has {opened.size:,}"
        raise _differs_from(path, listed, f"size differs: {what}")
    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        msg = f"{path}: not a readable Parquet file: {exc}"
        raise CorruptInputError(msg) from exc
    check_unchanged(path, opened)
    if listed is not None and (meta.num_rows, meta.num_row_groups) != (
        listed.entry.rows,
        listed.entry.row_groups,
    ):
        what = (
            f"the manifest says {listed.entry.rows:,} rows in {listed.entry.row_groups:,} row "
            f"groups, the file has {meta.num_rows:,} in {meta.num_row_groups:,}"
        )
        raise _differs_from(path, listed, what)
    return opened, meta


def _partition_of(path: Path) -> tuple[tuple[str, str], ...]:
    pairs = []
    for part in path.parent.parts:
        if "=" in part and not is_hidden(part):
            key, _, value = part.partition("=")
            pairs.append((key, value))
    return tuple(pairs)


class DatasetSource:
    """The splits of a clustered dataset, validated once, and a reader of their rows.

    Opening a source takes the file list from the dataset's ``_manifest.json`` (a missing or
    stray file, or totals that differ from the list, are an error naming them: see
    :mod:`readers.listing`), reads every file's footer, checks its size, rows and row groups
    against its manifest entry and that it has the columns the schema needs with the right
    types, lists the row groups, and records each file's identity (size, mtime, inode) in its
    splits. Nothing is validated again per batch except that identity: every split read first
    checks (one ``stat``) that its file is still the one opened, and raises
    :class:`~recpipe.integrity.FileChangedError` naming it otherwise (a dataset rebuilt or
    copied over during a run), whatever ``on_error`` says. A folder without a manifest is read
    as plain Parquet.

    Args:
        source: dataset directory, file, glob, or a list of them (see :func:`discover_files`).
        schema: the dataset schema; the columns read are its session key, label, dense and sparse
            features (the timestamp is not needed by the batches), then ``config.extras``.
        config: reader options (``on_error`` decides what a bad file does: raise, or skip and
            count it in ``skipped``, a missing or stray file included).
    """

    def __init__(
        self,
        source: PathLike | Sequence[PathLike],
        *,
        schema: DatasetSchema,
        config: ReaderConfig | None = None,
    ) -> None:
        self.schema = schema
        self.config = config or ReaderConfig()
        expected = schema.arrow_schema()
        names = [schema.session_key, schema.label_key, *schema.dense_names, *schema.sparse_names]
        reserved = [n for n in self.config.extras if n in names]
        if reserved:
            msg = (
                f"`extras` column `{reserved[0]}` is a model input of the batch already "
                "(session key, label or feature); extras are the other columns"
            )
            raise DataError(msg)
        self.columns: list[str] = [*names, *self.config.extras]
        self.extras_types: dict[str, pa.DataType] = {}  # of the first file
        self.expected_types: dict[str, pa.DataType] = {n: expected.field(n).type for n in names}
        self.skipped: list[SkippedInput] = []
        self.splits: list[Split] = []
        listing = list_files(source)
        self.files = listing.files
        if listing.problems:
            if self.config.on_error == "raise":
                listing.raise_problems()
            for p in listing.problems:
                self._skip(SkippedInput(p.full_path, None, p.rows, f"{p.full_path}: {p.what}"))
        for path in self.files:
            listed = listing.listed.get(os.fspath(path))
            try:
                if self.config.verify == "full":
                    _check_listed_digest(path, listed)
                self.splits.extend(self._file_splits(path, listed, start=len(self.splits)))
            except FileChangedError:
                raise
            except DataError as exc:
                if self.config.on_error == "raise":
                    raise
                self._skip(SkippedInput(os.fspath(path), None, 0, str(exc)))

    @property
    def num_rows(self) -> int:
        """Rows in all (not skipped) splits."""
        return sum(s.num_rows for s in self.splits)

    def _skip(self, item: SkippedInput) -> None:
        self.skipped.append(item)
        _log.warning("skipped input (on_error='skip'): %s", item.reason)

    def open_file(self, split: Split) -> pq.ParquetFile:
        """Open the file of ``split`` (with page checksums unless ``verify="off"``), checking
        that it is still the file the source opened.

        Raises:
            FileChangedError: it is not.
            OSError, pyarrow.ArrowException: it cannot be opened.
        """
        split.check_unchanged()
        handle = pq.ParquetFile(split.path, page_checksum_verification=self.config.verify != "off")
        try:
            split.check_unchanged()  # the name was not pointed at another file meanwhile
        except FileChangedError:
            handle.close()
            raise
        return handle

    def _file_splits(self, path: Path, listed: Listed | None, *, start: int) -> list[Split]:
        opened, meta = _read_footer(path, listed)
        arrow = meta.schema.to_arrow_schema()
        for name, want in self.expected_types.items():
            idx = arrow.get_field_index(name)
            if idx < 0:
                msg = f"{path}: column `{name}` is missing (expected type {want})"
                raise DataError(msg)
            got = arrow.field(idx).type
            if not got.equals(want):
                msg = f"{path}: column `{name}` has type {got}, expected {want}"
                raise DataError(msg)
        check_extras(self.config.extras, arrow, where=os.fspath(path))
        for name in self.config.extras:
            got = arrow.field(name).type
            want = self.extras_types.setdefault(name, got)
            if not got.equals(want):
                msg = f"{path}: extras column `{name}` has type {got}, other files {want}"
                raise DataError(msg)
        wanted = {*self.expected_types, *self.config.extras}
        wanted_leaves = [
            i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] in wanted
        ]
        partition = _partition_of(path)
        splits = []
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            size = sum(group.column(i).total_compressed_size for i in wanted_leaves)
            splits.append(
                Split(
                    path=os.fspath(path),
                    row_group=rg,
                    num_rows=group.num_rows,
                    index=start + len(splits),
                    compressed_bytes=size,
                    partition=partition,
                    file=opened,
                )
            )
        return splits

    def read_split(self, split: Split, *, handle: pq.ParquetFile | None = None) -> pa.Table:
        """Read one split's columns.

        Raises:
            FileChangedError: the file is no longer the one the source opened.
            CorruptInputError: the row group cannot be decoded; the message names the file, the
                row group and (when it can be found) the column.
            DataError: a session key or label is null; the message names file, row and column.
        """
        split.check_unchanged()
        try:
            pf = handle or self.open_file(split)
            table = pf.read_row_group(
                split.row_group, columns=self.columns, use_threads=self.config.use_threads
            )
        except (pa.ArrowException, OSError) as exc:
            column = self._find_bad_column(split)
            where = f" column `{column}`" if column else ""
            msg = f"{split.path}: row group {split.row_group}{where} cannot be decoded: {exc}"
            if "checksum" in str(exc).lower():
                msg += (
                    "\nhint: a page does not match its checksum: the file is corrupt; "
                    "`recpipe etl verify DATASET` checks every file"
                )
            raise CorruptInputError(msg) from exc
        footer_rows = pf.metadata.row_group(split.row_group).num_rows
        if table.num_rows != footer_rows:
            msg = (
                f"{split.path}: row group {split.row_group} has {table.num_rows} rows, "
                f"its footer says {footer_rows}"
            )
            raise CorruptInputError(msg)
        for name in (self.schema.session_key, self.schema.label_key):
            column = table.column(name)
            if column.null_count:  # O(1); a null would become a garbage int64 / NaN downstream
                row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                msg = (
                    f"{split.path}: row group {split.row_group} row {row}: `{name}` is null "
                    f"({column.null_count} null rows in the row group)"
                )
                raise DataError(msg)
        table = split.kept(table, session_key=self.schema.session_key)
        if table.num_rows != split.num_rows:
            msg = (
                f"{split.path}: row group {split.row_group} holds {table.num_rows} rows of "
                f"this part, {split.num_rows} when the dataset was divided: has it changed?"
            )
            raise CorruptInputError(msg)
        return table

    def _find_bad_column(self, split: Split) -> str | None:
        try:
            pf = self.open_file(split)
        except (DataError, pa.ArrowException, OSError):
            return None
        with pf:
            for name in self.columns:
                try:
                    pf.read_row_group(split.row_group, columns=[name], use_threads=False)
                except (pa.ArrowException, OSError):
                    return name
        return None

    def iter_tables(
        self,
        splits: Sequence[Split],
        *,
        epoch: int = 0,
        start: SourcePosition | None = None,
    ) -> Iterator[tuple[pa.Table, SourcePosition]]:
        """Yield session-packed batches of rows from ``splits`` in order.

        With ``config.read_ahead > 0`` a thread, started on the first ``next()``, reads the
        splits ahead; it stops when the iterator ends, is closed or is garbage collected. A
        split's error or skip surfaces when the stream reaches that split, as without it.

        Args:
            splits: this reader's split list (see :func:`plan_splits`).
            epoch: mixed into the session shuffle seed.
            start: resume position; ``None`` starts at the beginning.

        Yields:
            ``(table, position)``: a table of ``batch_size`` rows (the last one may be shorter with
            ``last_batch="partial"``) and the position just after it.
        """
        cfg = self.config
        bsz = cfg.batch_size
        pos = start or SourcePosition()
        pending: list[pa.Table] = []
        pending_rows = 0
        split_pos = pos.split_pos
        skip_rows = pos.row
        reads: _SplitReads | _ReadAhead = self._read_splits(splits[split_pos:])
        if cfg.read_ahead and split_pos < len(splits):
            reads = _ReadAhead(reads, depth=cfg.read_ahead)
        try:
            while split_pos < len(splits):
                window, next_pos = self._read_window(splits, split_pos, reads)
                window_start = split_pos
                split_pos = next_pos
                if window is None:
                    continue
                if cfg.shuffle:
                    window = _shuffle_sessions(
                        window,
                        self.schema.session_key,
                        np.random.default_rng([cfg.seed, epoch, splits[window_start].index]),
                    )
                offset, n = skip_rows, window.num_rows
                skip_rows = 0
                while offset < n:
                    take = min(bsz - pending_rows, n - offset)
                    pending.append(window.slice(offset, take))
                    pending_rows += take
                    offset += take
                    if pending_rows == bsz:
                        here = (
                            SourcePosition(window_start, offset)
                            if offset < n
                            else SourcePosition(split_pos, 0)
                        )
                        yield _concat(pending), here
                        pending, pending_rows = [], 0
        finally:
            reads.close()
        if pending_rows and cfg.last_batch == "partial":
            yield _concat(pending), SourcePosition(len(splits), 0)

    def _read_splits(self, splits: Sequence[Split]) -> _SplitReads:
        """Read ``splits`` in order: ``(table, None)`` or ``(None, error)`` for each.

        The Parquet files stay open (the last few) in this generator, so only the thread that
        runs it touches them; they are closed when it ends or is closed.
        """
        handles: dict[str, pq.ParquetFile] = {}
        try:
            for split in splits:
                try:
                    handle = handles.get(split.path)
                    if handle is None:
                        if len(handles) >= _MAX_HANDLES:
                            _close_all(handles)
                        handle = handles[split.path] = self.open_file(split)
                    result: _SplitRead = (self.read_split(split, handle=handle), None)
                except Exception as exc:  # handed to the consumer, which decides (on_error)
                    result = (None, exc)
                yield result
        finally:
            _close_all(handles)

    def _read_window(
        self, splits: Sequence[Split], split_pos: int, reads: Iterator[_SplitRead]
    ) -> tuple[pa.Table | None, int]:
        """Take splits from ``split_pos`` (read by ``reads``) until the window holds enough
        sessions; a split that failed raises or is skipped here, when the stream reaches it."""
        tables = []
        sessions = 0
        need = self.config.shuffle_buffer if self.config.shuffle else 1
        while split_pos < len(splits) and sessions < need:
            split = splits[split_pos]
            split_pos += 1
            table, exc = next(reads)
            if exc is not None:
                if isinstance(exc, FileChangedError) or not isinstance(exc, _READ_ERRORS):
                    raise exc  # a file changed under the run: never skipped
                if self.config.on_error == "raise":
                    if isinstance(exc, DataError):
                        raise exc
                    msg = f"{split.path}: row group {split.row_group} cannot be read: {exc}"
                    raise CorruptInputError(msg) from exc
                self._skip(SkippedInput(split.path, split.row_group, split.num_rows, str(exc)))
                continue
            tables.append(table)
            if self.config.shuffle:
                sessions += count_sessions(table.column(self.schema.session_key))
            else:
                sessions = need
        if not tables:
            return None, split_pos
        return _concat(tables), split_pos


_SplitRead = tuple[pa.Table | None, BaseException | None]
_SplitReads = Generator[_SplitRead, None, None]


def _close_all(handles: dict[str, pq.ParquetFile]) -> None:
    for handle in handles.values():
        handle.close()
    handles.clear()


class _ReadAhead(Iterator[_SplitRead]):
    """Runs ``reads`` in a background thread, at most ``depth`` results ahead of the consumer.

    The thread takes a slot before it reads a split and the consumer gives the slot back when it
    takes the result, so at most ``depth`` row groups wait in memory. :meth:`close` stops the
    thread and joins it; the generator that owns this object calls it in a ``finally``.
    """

    _END = object()

    def __init__(self, reads: _SplitReads, *, depth: int) -> None:
        self._reads = reads
        self._slots = threading.Semaphore(depth)
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recpipe-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._slots.acquire()
                if self._stop.is_set():
                    break
                item = next(self._reads, self._END)
                self._results.put(item)
                if item is self._END:
                    break
        except BaseException as exc:  # not a read error (those are results): a bug, hand it on
            self._results.put((None, exc))
            self._results.put(self._END)  # and end the stream after it: nothing follows
        finally:
            self._reads.close()  # closes its Parquet files in this thread

    def __next__(self) -> _SplitRead:
        item = self._results.get()
        if item is self._END:
            self._results.put(item)
            raise StopIteration
        self._slots.release()
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the split it is decoding) and drop what it read."""
        self._stop.set()
        self._slots.release()  # wakes the thread if it waits for a slot
        if threading.current_thread() is not self._thread:
            self._thread.join()
        while not self._results.empty():
            self._results.get_nowait()


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _session_bounds(column: pa.ChunkedArray) -> np.ndarray:
    """Start row of every run of equal session ids, plus the row count at the end."""
    sid = column.to_numpy()
    n = len(sid)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    change = np.flatnonzero(sid[1:] != sid[:-1]) + 1
    return np.concatenate(([0], change, [n])).astype(np.int64)


def count_sessions(column: pa.ChunkedArray) -> int:
    """Runs of equal session ids in a session column (a session cut by a row group boundary
    counts in both row groups)."""
    return len(_session_bounds(column)) - 1


def _shuffle_sessions(table: pa.Table, session_key: str, rng: np.random.Generator) -> pa.Table:
    """Permute whole sessions (runs of equal session id) of ``table``; rows of a run stay in order."""
    bounds = _session_bounds(table.column(session_key))
    starts, lengths = bounds[:-1], np.diff(bounds)
    if len(starts) <= 1:
        return table
    perm = rng.permutation(len(starts))
    new_lengths = lengths[perm]
    new_starts = np.concatenate(([0], np.cumsum(new_lengths)[:-1]))
    # row i of the output comes from starts[perm][s] + (i - new_starts[s]) for its session s
    indices = np.repeat(starts[perm] - new_starts, new_lengths) + np.arange(
        table.num_rows, dtype=np.int64
    )
    return table.take(pa.array(indices))


def plan_splits(
    splits: Sequence[Split],
    *,
    config: ReaderConfig,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    worker_id: int = 0,
    num_workers: int = 1,
) -> list[Split]:
    """The splits one reader (a worker of a rank) reads in an epoch, in order.

    Every split goes to exactly one ``(rank, worker_id)``: the (seeded, per-epoch) shuffled list
    is dealt round-robin to ranks, then each rank's share round-robin to its workers. Ranks may
    get different row counts when row groups differ in size.

    Raises:
        DataError: ``rank``/``worker_id`` out of range.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        msg = f"`rank` must be in [0, world_size={world_size}), got {rank!r}"
        raise DataError(msg)
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        msg = f"`worker_id` must be in [0, num_workers={num_workers}), got {worker_id!r}"
        raise DataError(msg)
    order = list(splits)
    if config.shuffle:
        perm = np.random.default_rng([config.seed, epoch]).permutation(len(order))
        order = [order[i] for i in perm]
    return order[rank::world_size][worker_id::num_workers]
