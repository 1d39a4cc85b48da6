"""Input and output plumbing of ``etl build``: input files, integrity checks, the Parquet writer.

The Parquet writer streams sorted Arrow batches and cuts row groups only at session boundaries
(a session straddles two row groups only when it alone is larger than a row group), rolls over
to a new ``part-NNNNN.parquet`` when a file passes its size cap, and optionally splits rows into
Hive-style ``dt=YYYY-MM-DD-HH/`` partitions. Nothing time- or host-dependent goes into the
files, so the same rows and settings give byte-identical Parquet.
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

from etl.rawio import UNROUTABLE_NAME, expand_inputs
from recpipe.errors import CorruptInputError, DataError

__all__ = [
    "LINE_FACT_COLUMNS",
    "InputFile",
    "SessionAlignedWriter",
    "check_structure",
    "choose_dictionary",
    "digest",
    "iter_partitioned",
    "line_facts",
    "list_inputs",
    "source_sql",
]

INPUT_PATTERNS: tuple[str, ...] = ("*.jsonl", "*.jsonl.zst", "*.parquet")
_ZSTD_MAGIC = 0xFD2FB528
_PARQUET_MAGIC = b"PAR1"
_NO_DELIM = "\\x01"  # the line reader's delimiter: a control byte that JSON text never holds raw


@dataclass(frozen=True)
class InputFile:
    """One input file and how to read it."""

    path: Path
    kind: str  # "jsonl" | "parquet" | "unroutable"


def list_inputs(inputs: str | Path | Iterable[str | Path]) -> list[InputFile]:
    """Expand ``inputs`` (files, directories, globs) into files in a stable order.

    A directory written by ``etl shard`` also yields its ``_unroutable.jsonl.zst``, whose lines
    are validated (and usually quarantined) with their original file and line number.
    """
    items = [inputs] if isinstance(inputs, str | Path) else list(inputs)
    files = [
        InputFile(p, "parquet" if p.name.endswith(".parquet") else "jsonl")
        for p in expand_inputs(items, patterns=INPUT_PATTERNS)
    ]
    for item in items:
        extra = Path(item) / UNROUTABLE_NAME
        if Path(item).is_dir() and extra.is_file():
            files.append(InputFile(extra, "unroutable"))
    for f in files:
        if f.path.name == UNROUTABLE_NAME and f.kind != "unroutable":
            files[files.index(f)] = InputFile(f.path, "unroutable")
    return files


def _check_zstd_frames(path: Path, fh: io.BufferedReader, size: int) -> None:
    """Walk the zstd frame and block headers (no decompression) to catch a truncated file.

    DuckDB's reader silently stops at a truncated frame; this walk does not.
    """
    pos = 0
    while pos < size:
        fh.seek(pos)
        head = fh.read(4)
        if len(head) < 4:
            raise CorruptInputError(f"{path}: truncated zstd file (partial frame at byte {pos})")
        magic = int.from_bytes(head, "little")
        if magic & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame
            n = int.from_bytes(fh.read(4), "little")
            pos += 8 + n
            continue
        if magic != _ZSTD_MAGIC:
            raise CorruptInputError(
                f"{path}: not a zstd file or corrupt (bad frame magic {head!r} at byte {pos})"
            )
        fhd_b = fh.read(1)
        if not fhd_b:
            raise CorruptInputError(f"{path}: truncated zstd file (frame header at byte {pos})")
        fhd = fhd_b[0]
        single = (fhd >> 5) & 1
        fcs = (0 if not single else 1, 2, 4, 8)[fhd >> 6]
        header = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
        checksum = 4 if (fhd >> 2) & 1 else 0
        pos += header
        while True:
            fh.seek(pos)
            bh = fh.read(3)
            if len(bh) < 3:
                raise CorruptInputError(
                    f"{path}: truncated zstd file (the last frame ends early at byte {pos} of "
                    f"{size}); the file is incomplete"
                )
            h = int.from_bytes(bh, "little")
            btype = (h >> 1) & 3
            if btype == 3:
                raise CorruptInputError(f"{path}: corrupt zstd data (reserved block at byte {pos})")
            pos += 3 + (1 if btype == 1 else h >> 3)
            if h & 1:
                break
        pos += checksum
        if pos > size:
            raise CorruptInputError(
                f"{path}: truncated zstd file (the last frame ends early: needs {pos} bytes, "
                f"has {size}); the file is incomplete"
            )


def check_structure(f: InputFile) -> None:
    """Fail fast, before parsing, on a file DuckDB would misread or reject obscurely.

    Catches a truncated zstd file (DuckDB reads it silently up to the cut), a ``.parquet``
    that is not Parquet, a Parquet file handed in as JSON Lines and a ``.zst`` that is not zstd.

    Raises:
        CorruptInputError: naming the file.
    """
    path = f.path
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(4)
            if f.kind == "parquet":
                fh.seek(max(size - 4, 0))
                if size < 12 or head != _PARQUET_MAGIC or fh.read(4) != _PARQUET_MAGIC:
                    raise CorruptInputError(
                        f"{path}: not a Parquet file (missing PAR1 magic bytes); the file is "
                        "corrupt, truncated or mislabelled"
                    )
            elif head == _PARQUET_MAGIC:
                raise CorruptInputError(
                    f"{path}: is a Parquet file, not JSON Lines; name it `*.parquet`"
                )
            elif len(head) == 4 and int.from_bytes(head, "little") == _ZSTD_MAGIC:
                _check_zstd_frames(path, fh, size)
            elif path.name.endswith(".zst") and size:
                raise CorruptInputError(
                    f"{path}: not a zstd file (bad magic bytes {head!r}); corrupt or renamed"
                )
    except OSError as exc:
        raise DataError(f"cannot read input {str(path)!r}: {exc}") from None


def digest(f: InputFile) -> dict:
    """``{path, bytes, sha256}`` of one input file (for the manifest)."""
    h = hashlib.sha256()
    try:
        with open(f.path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        size = f.path.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read input {str(f.path)!r}: {exc}") from None
    return {"path": str(f.path), "bytes": size, "sha256": h.hexdigest()}


def source_sql(f: InputFile, file_id: int, sql_str) -> str:
    """A relation ``(file_id, line_no, line, source, source_line)`` over one input file, in order.

    JSON Lines are read as raw text by DuckDB's CSV reader with a delimiter, quote and escape
    that never occur, so every line is one VARCHAR (zstd handled by DuckDB); Parquet rows are
    turned back into JSON objects so one validator serves both. ``(file_id, line_no)`` is
    unique: it is the row key of every later join. ``source`` and ``source_line`` are NULL but
    for ``etl shard``'s unroutable records, numbered by their place in that file and carrying
    the file and line they came from (records of several files may share a line number).
    """
    path = sql_str(str(f.path))
    if f.kind == "jsonl":
        return (
            f"(SELECT {int(file_id)} AS file_id, row_number() OVER () AS line_no, line, "
            f"NULL::VARCHAR AS source, NULL::BIGINT AS source_line "
            f"FROM read_csv({path}, columns={{'line': 'VARCHAR'}}, delim='{_NO_DELIM}', "
            f"quote='', escape='', header=false, auto_detect=false, strict_mode=false, "
            f"compression='auto'))"
        )
    if f.kind == "parquet":
        return (
            f"(SELECT {int(file_id)} AS file_id, row_number() OVER () AS line_no, "
            f"to_json(t)::VARCHAR AS line, "
            f"NULL::VARCHAR AS source, NULL::BIGINT AS source_line FROM read_parquet({path}) t)"
        )
    return (  # unroutable records of `etl shard`: the raw line and where it came from
        f"(SELECT {int(file_id)} AS file_id, row_number() OVER () AS line_no, "
        f"coalesce(raw, '\\x' || raw_hex) AS line, source, line AS source_line "
        f"FROM read_json({path}, format='newline_delimited', columns={{'source': 'VARCHAR', "
        f"'line': 'BIGINT', 'reason': 'VARCHAR', 'raw': 'VARCHAR', 'raw_hex': 'VARCHAR'}}))"
    )


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


def iter_partitioned(
    reader: pa.RecordBatchReader, *, column: str | None
) -> Iterator[tuple[str | None, pa.RecordBatch]]:
    """Split sorted batches where ``column`` (a partition label) changes; drop that column."""
    for batch in reader:
        if column is None:
            yield None, batch
            continue
        labels = batch.column(column).to_numpy(zero_copy_only=False)
        data = batch.drop_columns([column])
        edges = np.flatnonzero(labels[1:] != labels[:-1]) + 1
        start = 0
        for end in [*edges.tolist(), len(labels)]:
            yield f"dt={labels[start]}", data.slice(start, end - start)
            start = end


#: the text facts :func:`line_facts` reports per line (columns of its result)
LINE_FACT_COLUMNS: tuple[str, ...] = (
    "quotes",
    "text_ok",
    "kind_rk",
    "kind_sk",
    "kind_uk",
    "kind_tk",
)


def _find(data, start, end, pat, p0, p1):  # pragma: no cover - compiled by Numba
    """First index >= start of ``pat[p0:p1]`` in ``data[start:end]``, or -1."""
    m = p1 - p0
    first = pat[p0]
    i = start
    while i + m <= end:
        if data[i] == first:
            k = 1
            while k < m and data[i + k] == pat[p0 + k]:
                k += 1
            if k == m:
                return i
        i += 1
    return -1


def _after_blanks(data, i, end):  # pragma: no cover - compiled by Numba
    """The first byte at or after ``i`` that is not a space or tab (-1 at the end)."""
    while i < end and (data[i] == 32 or data[i] == 9):
        i += 1
    return data[i] if i < end else -1


def _facts_kernel(offsets, data, pat, pat_off, quotes, text_ok, kinds):  # pragma: no cover
    """Per line: quotes, text_ok and the four id kinds (see :func:`line_facts`).

    ``pat`` holds `"rk":`, `"sk":`, `"uk":`, `"tk":`, `"dense":`, `"sparse":`, `"dense"`,
    `"sparse"` (bounds in ``pat_off``).
    """
    n = offsets.shape[0] - 1
    for r in range(n):
        start, end = offsets[r], offsets[r + 1]
        for k in range(4):  # ids: 1 = a string value, 0 = another value, -1 = key not found
            at = _find(data, start, end, pat, pat_off[k], pat_off[k + 1])
            if at < 0:
                kinds[r, k] = -1
            else:
                c = _after_blanks(data, at + pat_off[k + 1] - pat_off[k], end)
                kinds[r, k] = 1 if c == 34 else 0
        ok = True
        tail = start  # the first `"sparse"` (the whole line without one)
        for k in (4, 5):  # a map must open an object, or its key be absent in any spelling
            name = _find(data, start, end, pat, pat_off[k + 2], pat_off[k + 3])  # `"key"`
            if name < 0:
                continue
            if k == 5:
                tail = name
            at = name  # `"key":` is usually where `"key"` first is
            if (
                at + pat_off[k + 1] - pat_off[k] > end
                or data[at + pat_off[k + 3] - pat_off[k + 2]] != 58
            ):
                at = _find(data, name, end, pat, pat_off[k], pat_off[k + 1])
            if at < 0 or _after_blanks(data, at + pat_off[k + 1] - pat_off[k], end) != 123:
                ok = False
        q = 0
        i = start
        while ok and i < end:
            c = data[i]
            i += 1
            if c >= 48 and c <= 57:  # digits: most bytes of a line
                continue
            if c == 34:
                q += 1
            elif c == 44:  # a trailing comma: `,` then blanks then `]` or `}`
                j = i
                while j < end and (data[j] == 32 or data[j] == 9 or data[j] == 10 or data[j] == 13):
                    j += 1
                if j < end and (data[j] == 93 or data[j] == 125):
                    ok = False
            elif c == 116 and i + 3 <= end:  # `true`
                ok = not (data[i] == 114 and data[i + 1] == 117 and data[i + 2] == 101)
            elif c == 102 and i + 4 <= end:  # `false`
                ok = not (
                    data[i] == 97
                    and data[i + 1] == 108
                    and data[i + 2] == 115
                    and data[i + 3] == 101
                )
            elif i > tail and (
                c == 46 or c == 69 or (c == 101 and data[i - 2] >= 48 and data[i - 2] <= 57)
            ):  # no fraction or exponent (`.`, `E`, a digit then `e`) among the sparse ids
                ok = False
        quotes[r] = q
        text_ok[r] = ok


def _line_kernel():
    """Compile the kernel of :func:`line_facts` (once per process; cached on disk by Numba)."""
    from numba import njit

    global _find, _after_blanks
    jit = njit(cache=True, nogil=True)
    # the kernel calls the helpers through these module globals: compile them first
    _find = jit(_find)
    _after_blanks = jit(_after_blanks)
    return jit(_facts_kernel)


_KERNEL = None
_KERNEL_LOCK = threading.Lock()


def line_facts(lines: pa.Array, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Text facts of raw JSON lines that a typed (lenient) parse cannot tell, in one pass.

    For each line: ``quotes`` (count of ``"``); ``text_ok`` (no trailing comma, no
    ``true``/``false``, no ``.``, ``E`` or digit followed by ``e`` after the first ``"sparse"``
    (the whole line when there is none), ``dense``/``sparse`` written as objects or absent); ``kind_rk`` ..
    ``kind_tk`` for the four id keys ``keys`` (request id, session id, user id, ts): 1 when
    the value after the first ``"key":`` is a string, 0 when it is something else, -1 when
    the key is not written that way. The checks are conservative: a line they flag is only
    checked again in full.

    Args:
        lines: an Arrow ``string`` or ``large_string`` array (nulls read as empty lines).
        keys: the request id, session id, user id and time keys.
    """
    global _KERNEL
    with _KERNEL_LOCK:  # files are parsed on several threads
        if _KERNEL is None:
            _KERNEL = _line_kernel()
    if pa.types.is_string(lines.type):
        off_type = np.int32
    elif pa.types.is_large_string(lines.type):
        off_type = np.int64
    else:
        lines = lines.cast(pa.large_string())
        off_type = np.int64
    n = len(lines)
    bufs = lines.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_type, count=lines.offset + n + 1)[lines.offset :]
    data = (
        np.frombuffer(bufs[2], dtype=np.uint8)
        if bufs[2] is not None and bufs[2].size
        else np.zeros(1, dtype=np.uint8)
    )
    words = [f'"{k}":' for k in keys] + ['"dense":', '"sparse":', '"dense"', '"sparse"']
    encoded = [w.encode() for w in words]
    pat = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    pat_off = np.cumsum([0] + [len(w) for w in encoded]).astype(np.int64)
    quotes = np.zeros(n, dtype=np.int32)
    text_ok = np.zeros(n, dtype=np.bool_)
    kinds = np.zeros((n, 4), dtype=np.int8)
    _KERNEL(offsets.astype(np.int64), data, pat, pat_off, quotes, text_ok, kinds)
    out = {"quotes": quotes, "text_ok": text_ok}
    for k, name in enumerate(LINE_FACT_COLUMNS[2:]):
        out[name] = np.ascontiguousarray(kinds[:, k])
    return out
