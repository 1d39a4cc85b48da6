"""The inputs of ``etl build``: files, integrity checks, and the one reader of numbered lines.

Every engine reads its input through :func:`read_lines` (or follows its rules exactly), so a line's
number, its text and the way it is split never depend on the engine:

- JSON Lines (plain, zstd or gzip, detected by their magic bytes): ``\\n`` ends a line, a ``\\r``
  right before it belongs to the line end, any other ``\\r`` is data; a UTF-8 byte-order mark
  opening the file is dropped; an empty line is a NULL line (quarantined as ``malformed_json``);
  a last line without ``\\n`` counts. A line longer than ``max_line_bytes`` is never held whole:
  its row carries the first :data:`etl.rawio.LONG_LINE_PREFIX` bytes and, in ``too_long``, its
  length, and validation quarantines it as ``line_too_long``. A file that is not UTF-8 text
  stops the build with a :class:`~recpipe.errors.CorruptInputError` naming the file and line.
- Parquet files: each row becomes the JSON object DuckDB's ``to_json`` writes, numbered in file
  order, so one validator serves both formats.
- ``etl shard``'s ``_unroutable.jsonl.zst``: each record's raw line, numbered by its place in that
  file, with the file and line it came from (``source``, ``source_line``).

Paths are never handed to DuckDB or Polars as globs: :func:`duckdb_path` escapes them.

The manifest's ``inputs`` describe exactly the bytes parsed: each file's status is taken before
anything reads it (:func:`check_structure`), its digest must be of the file in that state
(:func:`digest`), the reader refuses a file that changes under it, and the build ends by
comparing every status again (:func:`check_unchanged`); a file that changed is an error naming it.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from etl.build._kernels import split_lines
from etl.rawio import (
    LONG_LINE_PREFIX,
    UNROUTABLE_NAME,
    PartialLine,
    check_unchanged_read,
    expand_inputs,
    file_stamp,
    iter_lines,
    line_prefix,
    read_chunks,
)
from recpipe.errors import CorruptInputError, DataError

__all__ = [
    "INPUT_PATTERNS",
    "LINE_COLUMNS",
    "LINE_SCHEMA",
    "RACY_S",
    "InputFile",
    "check_structure",
    "check_unchanged",
    "digest",
    "duckdb_path",
    "empty_lines",
    "list_inputs",
    "read_error",
    "read_lines",
    "read_lines_at",
    "read_parquet_rows",
]

INPUT_PATTERNS: tuple[str, ...] = ("*.jsonl", "*.jsonl.zst", "*.parquet")
#: columns of every batch :func:`read_lines` yields
LINE_COLUMNS: tuple[str, ...] = ("file_id", "line_no", "line", "source", "source_line", "too_long")
LINE_SCHEMA = pa.schema(
    [
        ("file_id", pa.int32()),
        ("line_no", pa.int64()),
        ("line", pa.large_string()),
        ("source", pa.large_string()),
        ("source_line", pa.int64()),
        ("too_long", pa.int64()),
    ]
)
#: decompressed bytes split into lines at a time
CHUNK_BYTES = 16 << 20
#: lines per batch :func:`read_lines` yields: each batch costs the engines a statement, so
#: batches are large (a few tens of MB)
BATCH_LINES = 65_536
_ZSTD_MAGIC = 0xFD2FB528
_PARQUET_MAGIC = b"PAR1"
_GLOB_CHARS = re.compile(r"([*?\[])")


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


def duckdb_path(path: str | Path) -> str:
    """``path`` with DuckDB's glob characters escaped (``*`` -> ``[*]``): it names one file."""
    return _GLOB_CHARS.sub(r"[\1]", str(path))


def read_error(path: Path, exc: Exception) -> CorruptInputError:
    """A DuckDB (or Arrow) error met while reading ``path``, as an error naming the file."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "unicode" in str(exc).lower() or "utf-8" in str(exc).lower():
        first += " (the file is not UTF-8 text: binary, corrupt or not JSON Lines)"
    return CorruptInputError(f"{path}: cannot read input: {first}")


# ---------------------------------------------------------------------------------------------
# integrity


def _check_zstd_frames(path: Path, fh: io.BufferedReader, size: int) -> None:
    """Walk the zstd frame and block headers (no decompression) to catch a truncated file."""
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


def check_structure(f: InputFile) -> os.stat_result:
    """Fail fast, before parsing, on a file that would be misread or rejected obscurely.

    Catches a truncated zstd file (a streaming reader stops silently at the cut), a ``.parquet``
    that is not Parquet, a Parquet file handed in as JSON Lines and a ``.zst`` that is not zstd.

    Returns:
        the file's status as it was checked: what :func:`digest` and :func:`check_unchanged`
        compare it with.

    Raises:
        CorruptInputError: naming the file.
    """
    path = f.path
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            size = st.st_size
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
    return st


def digest(f: InputFile, checked: os.stat_result | None = None) -> dict:
    """``{path, bytes, sha256}`` of one input file (for the manifest).

    Args:
        f: the file.
        checked: its status from :func:`check_structure`: the bytes hashed are the file as it
            was then, or this is an error.

    Raises:
        DataError: the file cannot be read, or changed since ``checked`` or while hashed.
    """
    h = hashlib.sha256()
    try:
        with open(f.path, "rb") as fh:
            opened = os.fstat(fh.fileno())
            if checked is not None and file_stamp(opened) != file_stamp(checked):
                raise _changed(f.path, checked, opened)
            while chunk := fh.read(1 << 22):
                h.update(chunk)
            check_unchanged_read(f.path, fh, opened)
    except OSError as exc:
        raise DataError(f"cannot read input {str(f.path)!r}: {exc}") from None
    return {"path": str(f.path), "bytes": opened.st_size, "sha256": h.hexdigest()}


#: seconds within which a file modified before a build may still change with the same time
#: stamps (they are coarser than the clock): :func:`check_unchanged` hashes such a file again
RACY_S = 2.0


def check_unchanged(f: InputFile, checked: os.stat_result, recorded: dict, *, since: float) -> None:
    """Refuse an input that changed during the build: its status differs from ``checked``
    (taken by :func:`check_structure` before anything was read), so the bytes the build parsed
    may not be the bytes its manifest records (``recorded``, from :func:`digest`).

    A file modified within :data:`RACY_S` seconds before ``since`` (the wall-clock time the
    statuses were taken) could have changed again without changing its time stamps: it is
    hashed again and compared with ``recorded``.

    Raises:
        DataError: naming the file.
    """
    try:
        now = f.path.stat()
    except OSError as exc:
        raise DataError(f"{f.path}: the input changed during the build ({exc.strerror})") from None
    if file_stamp(now) != file_stamp(checked):
        raise _changed(f.path, checked, now)
    if max(checked.st_mtime_ns, checked.st_ctime_ns) >= (since - RACY_S) * 1e9:
        again = digest(f, checked)
        if again["sha256"] != recorded["sha256"]:
            raise _changed(f.path, checked, now)


def _changed(path: Path, before: os.stat_result, now: os.stat_result) -> DataError:
    return DataError(
        f"{path}: the input changed during the build ({before.st_size:,} bytes when checked, "
        f"{now.st_size:,} now): the dataset would not match what its manifest records\n"
        "hint: run again once the file is complete"
    )


# ---------------------------------------------------------------------------------------------
# numbered lines


def read_lines(
    f: InputFile,
    file_id: int,
    *,
    max_line_bytes: int,
    chunk_bytes: int | None = None,
    batch_lines: int | None = None,
) -> Iterator[pa.Table]:
    """Numbered lines of one input file, in file order, as tables of :data:`LINE_SCHEMA`.

    Args:
        f: the file.
        file_id: its place in the build's input list (the ``file_id`` column).
        max_line_bytes: a longer line (or Parquet row as JSON) comes as its first bytes, with
            its length in ``too_long`` (NULL for every other line).
        chunk_bytes: decompressed bytes split at a time (JSON Lines; default
            :data:`CHUNK_BYTES`).
        batch_lines: lines per table, but the last (default :data:`BATCH_LINES`; a table
            may hold up to one chunk's lines more).

    Raises:
        CorruptInputError: the file cannot be decoded (not UTF-8, corrupt zstd or Parquet);
            the message names it, and the line where there is one.
    """
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    if f.kind == "jsonl":
        splitter = _Splitter(f.path, file_id, max_line_bytes)
        blocks = itertools.chain(
            itertools.chain.from_iterable(
                splitter.split(chunk) for chunk in read_chunks(f.path, size=chunk_bytes)
            ),
            splitter.finish(),
        )
        yield from _batched(blocks, batch_lines or BATCH_LINES)
    elif f.kind == "parquet":
        yield from _parquet_lines(f.path, file_id, max_line_bytes, batch_lines or BATCH_LINES)
    else:
        yield from _unroutable_lines(f.path, file_id, max_line_bytes)


def _batched(tables: Iterable[pa.Table], lines: int) -> Iterator[pa.Table]:
    """``tables`` regrouped into tables of at least ``lines`` rows (but the last)."""
    held: list[pa.Table] = []
    rows = 0
    for table in tables:
        held.append(table)
        rows += table.num_rows
        if rows >= lines:
            yield held[0] if len(held) == 1 else pa.concat_tables(held)
            held, rows = [], 0
    if held:
        yield held[0] if len(held) == 1 else pa.concat_tables(held)


def empty_lines() -> pa.Table:
    """A batch of no lines (:data:`LINE_SCHEMA`)."""
    return LINE_SCHEMA.empty_table()


def read_lines_at(files: list[InputFile], wanted: pa.Table, *, max_line_bytes: int) -> pa.Table:
    """The lines at ``wanted``'s ``(file_id, line_no)`` read again: ``file_id``, ``line_no``,
    ``raw``, ``source``, ``source_line`` (any order)."""
    import pyarrow.compute as pc

    out = [LINE_SCHEMA.empty_table().select(LINE_COLUMNS[:5])]
    for fid in pc.unique(wanted.column("file_id")).to_pylist():
        mine = pc.equal(wanted.column("file_id"), fid)
        lines = wanted.filter(mine).column("line_no")
        for batch in read_lines(files[fid], fid, max_line_bytes=max_line_bytes):
            hit = pc.is_in(batch.column("line_no"), value_set=lines.combine_chunks())
            out.append(batch.filter(hit).select(LINE_COLUMNS[:5]))
    return pa.concat_tables(out).rename_columns(["file_id", "line_no", "raw", *LINE_COLUMNS[3:5]])


def _table(
    file_id: int,
    first: int,
    lines: pa.Array,
    *,
    too_long: pa.Array | None = None,
    source: pa.Array | None = None,
    source_line: pa.Array | None = None,
) -> pa.Table:
    n = len(lines)
    return pa.Table.from_arrays(
        [
            pa.array(np.full(n, file_id, dtype=np.int32)),
            pa.array(np.arange(first, first + n, dtype=np.int64)),
            lines,
            source if source is not None else pa.nulls(n, pa.large_string()),
            source_line if source_line is not None else pa.nulls(n, pa.int64()),
            too_long if too_long is not None else pa.nulls(n, pa.int64()),
        ],
        schema=LINE_SCHEMA,
    )


def _cap(lines: pa.Array, max_line_bytes: int) -> tuple[pa.Array, pa.Array | None]:
    """``lines`` with the longer ones cut to their prefix, and their lengths (or None)."""
    lines = lines.cast(pa.large_string())
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[
        lines.offset : lines.offset + len(lines) + 1
    ]
    over = np.flatnonzero(np.diff(offsets) > max_line_bytes)
    if not over.size:
        return lines, None
    values = lines.to_pylist()
    sizes: list[int | None] = [None] * len(values)
    for i in over.tolist():
        data = values[i].encode()
        sizes[i] = len(data)
        values[i] = line_prefix(data).decode()
    return pa.array(values, pa.large_string()), pa.array(sizes, pa.int64())


def read_parquet_rows(
    f: InputFile, file_id: int, start: int, end: int, *, max_line_bytes: int
) -> Iterator[pa.Table]:
    """The numbered lines of rows ``[start, end)`` (0-based, file order) of the Parquet input
    ``f``: those :func:`read_lines` gives for them, numbered ``start + 1`` on (DuckDB reads
    only the row groups that hold them)."""
    yield from _parquet_lines(f.path, file_id, max_line_bytes, BATCH_LINES, rows=(start, end))


def _parquet_lines(
    path: Path,
    file_id: int,
    max_line_bytes: int,
    batch_lines: int,
    *,
    rows: tuple[int, int] | None = None,
) -> Iterator[pa.Table]:
    import duckdb

    con = duckdb.connect()
    first = 1
    source = f"read_parquet({_sql_str(duckdb_path(path))}) t"
    if rows is not None:  # the file's own row numbers pick the rows (and prune row groups)
        first = rows[0] + 1
        source = (
            f"(SELECT * EXCLUDE (file_row_number) FROM read_parquet("
            f"{_sql_str(duckdb_path(path))}, file_row_number = true) WHERE file_row_number "
            f">= {int(rows[0])} AND file_row_number < {int(rows[1])}) t"
        )
    try:
        con.execute("SET enable_progress_bar = false")
        rel = con.sql(f"SELECT to_json(t)::VARCHAR AS line FROM {source}")
        for batch in rel.to_arrow_reader(batch_lines):
            lines, sizes = _cap(batch.column(0), max_line_bytes)
            yield _table(file_id, first, lines, too_long=sizes)
            first += len(lines)
    except (duckdb.Error, OSError) as exc:
        raise read_error(path, exc) from None
    finally:
        con.close()


def _unroutable_lines(path: Path, file_id: int, max_line_bytes: int) -> Iterator[pa.Table]:
    """``etl shard``'s unroutable records: the raw line (``\\x`` + hex when it was not UTF-8)."""
    lines: list[str] = []
    sources: list[str] = []
    source_lines: list[int] = []
    sizes: list[int | None] = []
    for _, data in iter_lines(path):
        try:
            rec = orjson.loads(data)
            line = rec["raw"] if "raw" in rec else "\\x" + rec["raw_hex"]
            size = int(rec["bytes"]) if rec["reason"] == "line_too_long" else None
            lines.append(str(line))
            sources.append(str(rec["source"]))
            source_lines.append(int(rec["line"]))
            sizes.append(size)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptInputError(
                f"{path}: record {len(lines) + 1}: not an unroutable-line record of `etl shard` "
                f"({type(exc).__name__}: {exc})"
            ) from None
    capped, over = _cap(pa.array(lines, pa.large_string()), max_line_bytes)
    if over is not None:
        sizes = [s if s is not None else o for s, o in zip(sizes, over.to_pylist())]
    yield _table(
        file_id,
        1,
        capped,
        too_long=pa.array(sizes, pa.int64()),
        source=pa.array(sources, pa.large_string()),
        source_line=pa.array(source_lines, pa.int64()),
    )


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class _Splitter:
    """Split a JSON Lines byte stream into numbered lines (the rules of the module docstring)."""

    def __init__(self, path: Path, file_id: int, max_line_bytes: int) -> None:
        self.path = path
        self.file_id = file_id
        self.limit = max_line_bytes
        self.pending = PartialLine(max_line_bytes)
        self.next_line = 1

    def split(self, chunk: bytes) -> Iterator[pa.Table]:
        """The lines that end in ``chunk``; what follows its last ``\\n`` waits for more."""
        last = chunk.rfind(b"\n")
        if last < 0:
            self.pending.add(chunk)
            return
        start = 0
        if self.pending.size:  # the line begun in an earlier chunk ends here
            first = chunk.find(b"\n")
            self.pending.add(chunk[:first])
            yield self._one(*self.pending.take(line_end=True))
            start = first + 1
        if start <= last:
            yield self._block(np.frombuffer(chunk, dtype=np.uint8), start, last + 1)
        self.pending.add(chunk[last + 1 :])

    def finish(self) -> Iterator[pa.Table]:
        """The last line, when the stream does not end with ``\\n`` (a ``\\r`` there is data)."""
        if self.pending.size:
            yield self._one(*self.pending.take(line_end=False))

    def _one(self, line: bytes, size: int) -> pa.Table:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise self._not_utf8(self.next_line) from None
        first, self.next_line = self.next_line, self.next_line + 1
        too_long = pa.array([size if size > self.limit else None], pa.int64())
        lines = pa.array([text or None], pa.large_string())
        return _table(self.file_id, first, lines, too_long=too_long)

    def _block(self, data: np.ndarray, start: int, stop: int) -> pa.Table:
        """The lines of ``data[start:stop]``, which ends with ``\\n``."""
        text, offsets, sizes = split_lines(
            data, start, stop, limit=self.limit, prefix=LONG_LINE_PREFIX
        )
        n = sizes.size
        valid = offsets[1:] > offsets[:-1]
        mask = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
        lines = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(text), mask)
        first, self.next_line = self.next_line, self.next_line + n
        try:
            lines.validate(full=True)
        except pa.ArrowInvalid:
            raise self._not_utf8(first + _first_bad(lines)) from None
        long = sizes >= 0
        too_long = pa.array(sizes, mask=~long) if long.any() else None
        return _table(self.file_id, first, lines, too_long=too_long)

    def _not_utf8(self, line: int) -> CorruptInputError:
        return CorruptInputError(
            f"{self.path}: cannot read input: line {line} is not valid UTF-8 "
            "(the file is not UTF-8 text: binary, corrupt or not JSON Lines)"
        )


def _first_bad(lines: pa.LargeStringArray) -> int:
    """Index of the first line of ``lines`` that is not valid UTF-8."""
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)
    data = lines.buffers()[2]
    for i in range(len(lines)):
        try:
            data[int(offsets[i]) : int(offsets[i + 1])].to_pybytes().decode("utf-8")
        except UnicodeDecodeError:
            return i
    return 0
