"""Byte ranges of plain JSON Lines inputs and row ranges of Parquet inputs, read by Spark
tasks with exact line numbers.

A plain (uncompressed) JSON Lines file larger than :data:`SPLIT_BYTES` is read by several
tasks, one per byte range ``[start, end)``; a Parquet file larger than that, by one task per
run of whole row groups of about :data:`SPLIT_BYTES` (compressed), its rows ``[start, end)``
(0-based, numbered ``start + 1`` on, as the whole file numbers them); a compressed file (zstd,
gzip) stays one task (a zstd frame cannot be entered in the middle), and so does a Parquet file
of one row group or with a column named ``file_row_number`` (the row numbers DuckDB reads).

A range owns the lines that *begin* in it: it skips to the byte after the first ``\\n`` at or
after ``start - 1`` (the range at 0 starts at 0) and reads through the ``\\n`` that ends the
line running over ``end - 1`` (or to the end of the file). Its first line's number is one more
than the lines begun before it, which a first, cheap job counts: the ``\\n`` bytes of
``[start - 1, end - 1)`` per range (a sum over the earlier ranges of a file gives the ``\\n``
bytes before ``start - 1``). The lines themselves go through the shared splitter of
:mod:`etl.build.inputs` (line ends, empty and over-long lines, the UTF-8 check, whose error
names the file's own line number), so a file gives the same numbered lines in one task or in
many; only the range at 0 drops a byte-order mark, as the whole-file reader does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from etl.build.inputs import CHUNK_BYTES, InputFile, _Splitter, read_lines, read_parquet_rows

__all__ = ["SPLIT_BYTES", "Split", "count_newlines", "plan_splits", "read_split"]

#: a plain JSON Lines file larger than this is read by several tasks, a range each
SPLIT_BYTES = 128 << 20
_BOM = b"\xef\xbb\xbf"
_COMPRESSED = (b"\x28\xb5\x2f\xfd", b"\x1f\x8b")  # zstd, gzip magic bytes
#: one task's input: ``(file_id, start, end)``, bytes of a JSON Lines file or rows of a
#: Parquet file; ``start`` -1 is the whole file
Split = tuple[int, int, int]
#: DuckDB's column of a Parquet file's row numbers (a file with a column of that name is one task)
_ROW_NUMBER = "file_row_number"


def _splittable(f: InputFile) -> bool:
    if f.kind != "jsonl":
        return False
    with open(f.path, "rb") as fh:
        head = fh.read(4)
    return not head.startswith(_COMPRESSED)


def plan_splits(files: list[InputFile], split_bytes: int | None = None) -> list[Split]:
    """The tasks' inputs: a byte range of each ``split_bytes`` (default :data:`SPLIT_BYTES`)
    of a plain JSON Lines file, the whole file otherwise."""
    size = int(split_bytes or SPLIT_BYTES)
    out: list[Split] = []
    for file_id, f in enumerate(files):
        total = os.path.getsize(f.path)
        if total > size and f.kind == "parquet":
            out.extend((file_id, a, b) for a, b in _row_ranges(f.path, size))
        elif total > size and _splittable(f):
            out.extend((file_id, a, min(a + size, total)) for a in range(0, total, size))
        else:
            out.append((file_id, -1, -1))
    return out


def _row_ranges(path: Path, size: int) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` of runs of whole row groups of ``path`` of about ``size``
    compressed bytes each; ``[(-1, -1)]`` (the whole file) when it cannot be split."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    if meta.num_row_groups < 2 or _ROW_NUMBER in meta.schema.names:
        return [(-1, -1)]
    out, start, rows, held = [], 0, 0, 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        rows += group.num_rows
        held += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if held >= size or i == meta.num_row_groups - 1:
            out.append((start, rows))
            start, held = rows, 0
    return out


def count_newlines(path: Path, start: int, end: int) -> int:
    """The ``\\n`` bytes of ``[start - 1, end - 1)`` (from 0 for the range at 0)."""
    a, b = max(0, start - 1), max(0, end - 1)
    n = 0
    with open(path, "rb") as fh:
        fh.seek(a)
        left = b - a
        while left > 0:
            chunk = fh.read(min(left, CHUNK_BYTES))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def read_split(
    f: InputFile, file_id: int, split: Split, newlines_before: int, *, max_line_bytes: int
) -> Iterator[pa.Table]:
    """The numbered lines (:data:`etl.build.inputs.LINE_SCHEMA`) that begin in ``split`` (or,
    of a Parquet file, of its rows); ``newlines_before``: the ``\\n`` bytes of a JSON Lines
    file before ``start - 1``."""
    _, start, end = split
    if start < 0:
        yield from read_lines(f, file_id, max_line_bytes=max_line_bytes)
        return
    if f.kind == "parquet":  # rows [start, end)
        yield from read_parquet_rows(f, file_id, start, end, max_line_bytes=max_line_bytes)
        return
    splitter = _Splitter(f.path, file_id, max_line_bytes)
    with open(f.path, "rb") as fh:
        if start == 0:
            pos, first = 0, 1
        else:
            fh.seek(start - 1)
            pos = start - 1
            while True:  # the byte after the first \n at or after start - 1
                chunk = fh.read(1 << 16)
                if not chunk:
                    return
                at = chunk.find(b"\n")
                if at >= 0:
                    pos += at + 1
                    break
                pos += len(chunk)
            if pos >= end:  # no line begins in the range
                return
            first = newlines_before + 2  # lines begun before: those \n, and line 1
            fh.seek(pos)
        splitter.next_line = first
        head = True
        while True:
            chunk = fh.read(CHUNK_BYTES)
            if not chunk:
                yield from splitter.finish()
                return
            if head and start == 0 and chunk.startswith(_BOM):
                chunk, pos = chunk[len(_BOM) :], pos + len(_BOM)
            head = False
            if pos + len(chunk) >= end:  # the range's last line ends at the next \n
                at = chunk.find(b"\n", max(0, end - 1 - pos))
                if at >= 0:
                    yield from splitter.split(chunk[: at + 1])
                    return
            yield from splitter.split(chunk)
            pos += len(chunk)
