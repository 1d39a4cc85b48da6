"""The Parquet writer of ``etl build``: sorted rows in, session-aligned part files out.

:class:`SessionAlignedWriter` streams sorted Arrow batches and cuts row groups only at session
boundaries (a session straddles two row groups only when it alone is larger than a row group),
rolls over to a new ``part-NNNNN.parquet`` when a file passes its size cap, and writes rows of
each Hive-style ``dt=YYYY-MM-DD-HH/`` partition apart (:func:`split_hours` labels them). Pages
carry CRC checksums, and each closed file's size and sha256 are recorded. Nothing time- or
host-dependent goes into the files, so the same rows and settings give byte-identical Parquet.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "SessionAlignedWriter",
    "choose_dictionary",
    "file_sha256",
    "hour_label",
    "split_hours",
]

_HOUR_MS = 3_600_000


def choose_dictionary(table: pa.Table, *, level: int, min_gain: float = 0.02) -> dict[str, dict]:
    """Measure, per column, zstd bytes with and without dictionary encoding on ``table``.

    The columns are measured side by side on the CPU cores (pyarrow writes without the GIL).

    Returns:
        ``{column: {"dict": bytes, "plain": bytes, "use": bool}}``; a column uses dictionary
        encoding when that saves at least ``min_gain`` of its plain size.
    """

    def measure(name: str) -> dict:
        sizes = {}
        col = table.select([name])
        for use in (True, False):
            buf = io.BytesIO()
            pq.write_table(
                col, buf, compression="zstd", compression_level=level, use_dictionary=use
            )
            sizes[use] = buf.tell()
        return {
            "dict": sizes[True],
            "plain": sizes[False],
            "use": sizes[True] <= (1.0 - min_gain) * sizes[False],
        }

    names = table.column_names
    workers = max(1, min(len(names), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(measure, names)))


class _Encoder:
    """Runs calls in order on a second thread, ``depth`` at most waiting.

    The first error is raised by the next :meth:`submit` or by :meth:`finish`; after it the
    thread runs nothing more, but keeps taking calls so the submitting side never blocks.
    """

    _DONE = object()

    def __init__(self, depth: int) -> None:
        self._calls: queue.Queue = queue.Queue(maxsize=depth)
        self._failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="recpipe-parquet", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not self._DONE:
            if not self._failed:
                try:
                    call[0](*call[1:])
                except BaseException as exc:  # raised on the submitting thread
                    self._failed.append(exc)

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        if self._failed:
            self.finish()
        self._calls.put((fn, *args))

    def finish(self) -> None:
        """Wait for every call submitted; raise the first error."""
        if self._thread.is_alive():
            self._calls.put(self._DONE)
            self._thread.join()
        if self._failed:
            raise self._failed[0]


@dataclass
class _FileStats:
    """One part file of the manifest's ``files``."""

    path: str
    rows: int = 0
    row_groups: int = 0
    bytes: int = 0
    sessions: int = 0  # distinct session ids with rows in this file
    sha256: str = ""  # of the closed file's bytes


@dataclass
class SessionAlignedWriter:
    """Write sorted batches as ``part-NNNNN.parquet`` files with session-aligned row groups.

    Args:
        root: dataset directory (the temporary one).
        schema: Arrow schema of the files.
        session_col: the session id column; row groups are cut where it changes.
        row_group_size: target rows per row group (a row group ends at the last session
            boundary at or before it; a longer single session is split).
        zstd_level: zstd compression level.
        dictionary: columns that use dictionary encoding (``None``: measure on the first
            row group with :func:`choose_dictionary`).
        max_file_bytes: start a new file once one passes this size.
        align_sessions: False for the time-ordered baseline (cut every ``row_group_size``).
        background: encode row groups on a second thread (pyarrow's Parquet encoding is
            single-threaded), while the caller fetches and cuts the next ones; the files are
            the same bytes. Errors of that thread are raised by a later :meth:`write` or by
            :meth:`close`; call :meth:`abort` when giving up without :meth:`close`.

    Session counts: a file's ``sessions`` is the number of distinct session ids with rows in
    it, so a session that a file or partition boundary cuts counts in every file it reaches.
    :attr:`sessions` counts each session once, :attr:`session_continuations` the times one
    carries on into a later file (``sum(files' sessions) == sessions + session_continuations``)
    and :attr:`sessions_split_across_files` the sessions that do. The counts need session ids
    that ascend in order of first appearance, as the build's do (ranked by first ts, written in
    session or in ts order): an id is then new exactly when it exceeds every id written before.
    """

    root: Path
    schema: pa.Schema
    session_col: str
    row_group_size: int
    zstd_level: int
    dictionary: Sequence[str] | None = None
    max_file_bytes: int = 256 << 20
    align_sessions: bool = True
    background: bool = False
    files: list[_FileStats] = field(default_factory=list)
    dictionary_measured: dict[str, dict] | None = None
    _pending: list[pa.Table] = field(default_factory=list)
    _pending_rows: int = 0
    _partition: str | None = None
    _writer: pq.ParquetWriter | None = None
    _sink: pa.OSFile | None = None
    sessions: int = field(default=0, init=False)
    session_continuations: int = field(default=0, init=False)
    _max_session: int | None = field(default=None, init=False)  # largest session id written
    _file_floor: int | None = field(default=None, init=False)  # largest before the open file
    _file_new: int = field(default=0, init=False)  # sessions first seen in the open file
    _file_old: list[np.ndarray] = field(default_factory=list, init=False)  # ids <= the floor
    _split: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), init=False)
    _encoder: _Encoder | None = field(default=None, init=False)

    @property
    def sessions_split_across_files(self) -> int:
        """Sessions with rows in more than one file."""
        return int(self._split.size)

    @property
    def split_session_ids(self) -> np.ndarray:
        """The ids of the sessions counted in :attr:`sessions_split_across_files`."""
        return self._split

    def continue_after(self, session_id: int) -> None:
        """Take the session ids up to ``session_id`` as written before, by another writer of
        the same dataset (a Spark task's writer after the earlier tasks' ones): their rows here
        count as continuations. Call before the first :meth:`write`."""
        self._max_session = self._file_floor = int(session_id)

    def write(self, batch: pa.RecordBatch | pa.Table, *, partition: str | None = None) -> None:
        """Append sorted rows (all of one partition; ``partition`` is e.g. ``dt=2024-...``)."""
        if partition != self._partition:
            self._flush(final=True)
            self._encode(self._close_file)
            self._partition = partition
        table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self._flush(final=False)

    def close(self) -> list[dict]:
        """Flush what is buffered, close the last file; return per-file statistics."""
        self._flush(final=True)
        self._encode(self._close_file)
        if self._encoder is not None:
            encoder, self._encoder = self._encoder, None
            encoder.finish()
        return [vars(f).copy() for f in self.files]

    def abort(self) -> None:
        """Stop without writing what is buffered (after an error); the files stay incomplete."""
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            with contextlib.suppress(Exception):  # the caller reports its own error
                encoder.finish()
        for handle in (self._writer, self._sink):
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.close()
        self._writer = self._sink = None

    def _encode(self, fn: Callable[..., None], *args: object) -> None:
        """Run a step that touches the open file: here, or in order on the second thread."""
        if not self.background:
            fn(*args)
            return
        if self._encoder is None:
            self._encoder = _Encoder(depth=1)  # one group waits: bounds the memory held
        self._encoder.submit(fn, *args)

    def _flush(self, *, final: bool) -> None:
        r = self.row_group_size
        while self._pending_rows > r or (final and self._pending_rows):
            table = pa.concat_tables(self._pending).combine_chunks()
            self._pending = []
            self._pending_rows = 0
            while table.num_rows > r or (final and table.num_rows):
                cut = self._cut(table) if table.num_rows > r else table.num_rows
                self._encode(self._write_group, table.slice(0, cut), self._partition)
                table = table.slice(cut)
            if table.num_rows:
                self._pending = [table]
                self._pending_rows = table.num_rows

    def _cut(self, table: pa.Table) -> int:
        """Rows of the next row group: up to the last session start at or before the target."""
        r = self.row_group_size
        if not self.align_sessions:
            return r
        sid = table.column(self.session_col).slice(0, r + 1).to_numpy()
        starts = np.flatnonzero(sid[1:] != sid[:-1]) + 1  # row i starts a new session
        return int(starts[-1]) if starts.size else r

    def _write_group(self, group: pa.Table, partition: str | None) -> None:
        if self._writer is None:
            self._open_file(group, partition)
        assert self._writer is not None and self._sink is not None
        self._writer.write_table(group, row_group_size=group.num_rows)
        stats = self.files[-1]
        stats.rows += group.num_rows
        stats.row_groups += 1
        self._count_sessions(group.column(self.session_col).to_numpy())
        if self._sink.tell() >= self.max_file_bytes:
            self._close_file()

    def _count_sessions(self, sid: np.ndarray) -> None:
        """Count the sessions of one row group (ids ``sid``) written to the open file."""
        low = np.iinfo(np.int64).min
        prev = low if self._max_session is None else self._max_session
        seen = np.maximum.accumulate(sid)  # the largest id up to each row
        before = np.concatenate(([prev], np.maximum(seen[:-1], prev)))
        self._file_new += int(np.count_nonzero(sid > before))  # first appearances
        self._max_session = max(prev, int(seen[-1]))
        if self._file_floor is not None:
            old = sid[sid <= self._file_floor]
            if old.size:
                self._file_old.append(np.unique(old))

    def _open_file(self, first_group: pa.Table, partition: str | None) -> None:
        if self.dictionary is None:
            sample = first_group.slice(0, min(first_group.num_rows, 32768))
            self.dictionary_measured = choose_dictionary(sample, level=self.zstd_level)
            self.dictionary = [c for c, m in self.dictionary_measured.items() if m["use"]]
        folder = self.root / partition if partition else self.root
        folder.mkdir(parents=True, exist_ok=True)
        index = sum(1 for f in self.files if Path(f.path).parent == Path(partition or "."))
        rel = Path(partition or ".") / f"part-{index:05d}.parquet"
        self._sink = pa.OSFile(str(self.root / rel), "wb")
        sorting = (
            [pq.SortingColumn(0), pq.SortingColumn(1)]
            if self.align_sessions
            else [pq.SortingColumn(1)]
        )
        self._writer = pq.ParquetWriter(
            self._sink,
            self.schema,
            compression="zstd",
            compression_level=self.zstd_level,
            use_dictionary=list(self.dictionary),
            write_statistics=True,
            write_page_checksum=True,
            sorting_columns=sorting,
        )
        self.files.append(_FileStats(path=rel.as_posix()))

    def _close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        assert self._sink is not None
        self._sink.close()
        stats = self.files[-1]
        stats.bytes = os.path.getsize(self.root / stats.path)
        stats.sha256 = file_sha256(self.root / stats.path)
        old = np.unique(np.concatenate(self._file_old)) if self._file_old else self._split[:0]
        stats.sessions = self._file_new + int(old.size)
        self.sessions += self._file_new
        self.session_continuations += int(old.size)
        self._split = np.union1d(self._split, old)
        self._file_new = 0
        self._file_old = []
        self._file_floor = self._max_session
        self._writer = None
        self._sink = None


def file_sha256(path: str | Path) -> str:
    """The sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hour_label(hour: int) -> str:
    """``YYYY-MM-DD-HH`` of an hour since the epoch, as DuckDB's ``strftime(..., '%Y-%m-%d-%H')``.

    Proleptic Gregorian with a year 0 (days to civil date by H. Hinnant's algorithm); the year
    zero-padded to 4 digits within 0..9999 and written plainly outside, as DuckDB writes it.

    >>> hour_label(0), hour_label(-1), hour_label(472_222 * 24 + 5)
    ('1970-01-01-00', '1969-12-31-23', '3262-11-24-05')
    """
    z = hour // 24 + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1_460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (month <= 2)
    year_text = f"{year:04d}" if 0 <= year <= 9999 else str(year)
    return f"{year_text}-{month:02d}-{day:02d}-{hour % 24:02d}"


def split_hours(
    batches: Iterable[pa.RecordBatch], *, column: str | None
) -> Iterator[tuple[str | None, pa.RecordBatch]]:
    """Split sorted batches into runs of one hour of ``column`` (epoch ms); drop that column.

    Yields:
        ``("dt=YYYY-MM-DD-HH", rows)`` (``(None, batch)`` when ``column`` is None).
    """
    for batch in batches:
        if column is None:
            yield None, batch
            continue
        hours = np.floor_divide(batch.column(column).to_numpy(), _HOUR_MS)
        data = batch.drop_columns([column])
        edges = np.flatnonzero(hours[1:] != hours[:-1]) + 1
        start = 0
        for end in [*edges.tolist(), len(hours)]:
            yield f"dt={hour_label(int(hours[start]))}", data.slice(start, end - start)
            start = end
