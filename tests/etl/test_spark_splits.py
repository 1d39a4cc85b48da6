"""Byte ranges of plain JSON Lines files give the whole-file reader's numbered lines."""

from __future__ import annotations

import pyarrow as pa
import pytest

from etl.build.inputs import InputFile, read_lines
from etl.build.spark_splits import count_newlines, plan_splits, read_split
from recpipe.errors import CorruptInputError

_LIMIT = 40


def _tricky() -> bytes:
    """A byte-order mark, empty lines, CRLF ends, a lone CR, over-long lines (longer than the
    ranges), multi-byte characters, and a last line without its newline."""
    lines = [
        b'{"a": 1}',
        b"",
        b'{"b": "\xc3\xa9t\xc3\xa9"}\r',
        b"x" * 300,
        b"",
        b"",
        b'{"c": "a\rb"}',
        b"\xe2\x82\xac" * 30,
        b"short",
    ]
    return b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n" + b'{"last": true}'


def _read_in_ranges(f: InputFile, size: int) -> pa.Table:
    splits = plan_splits([f], size)
    before, held = [], 0
    for _, a, b in splits:
        before.append(held)
        if a >= 0:
            held += count_newlines(f.path, a, b)
    tables = [
        t for s, n in zip(splits, before) for t in read_split(f, 0, s, n, max_line_bytes=_LIMIT)
    ]
    return pa.concat_tables(tables) if tables else None


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 16, 41, 100, 1000])
def test_ranges_of_any_size_give_the_whole_files_lines(tmp_path, size):
    path = tmp_path / "f.jsonl"
    path.write_bytes(_tricky())
    f = InputFile(path, "jsonl")
    want = pa.concat_tables(read_lines(f, 0, max_line_bytes=_LIMIT))
    assert want.num_rows == 10
    assert len(plan_splits([f], size)) == (-(-path.stat().st_size // size) if size < 1000 else 1)
    assert _read_in_ranges(f, size).equals(want)


def test_a_range_names_the_files_own_line_that_is_not_utf8(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 50 + b"\xff\xfe\n" + b'{"a": 2}\n')
    f = InputFile(path, "jsonl")
    with pytest.raises(CorruptInputError) as whole:
        list(read_lines(f, 0, max_line_bytes=_LIMIT))
    with pytest.raises(CorruptInputError) as ranged:
        _read_in_ranges(f, 64)
    assert str(ranged.value) == str(whole.value) and "line 51" in str(whole.value)


def test_a_compressed_or_small_file_stays_one_task(tmp_path):
    import zstandard

    plain, packed = tmp_path / "a.jsonl", tmp_path / "b.jsonl.zst"
    plain.write_bytes(b'{"a": 1}\n' * 100)
    packed.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    files = [InputFile(plain, "jsonl"), InputFile(packed, "jsonl")]
    assert plan_splits(files, 10**6) == [(0, -1, -1), (1, -1, -1)]
    splits = plan_splits(files, 300)
    assert splits[-1] == (1, -1, -1) and [s[1] for s in splits[:-1]] == [0, 300, 600]


def test_parquet_files_split_by_row_groups_give_the_whole_files_numbered_lines(tmp_path):
    """A Parquet file of several row groups is read in runs of whole row groups (rows
    ``[start, end)``): together, the lines and numbers of the whole file; a file of one row
    group, or with a column named like DuckDB's row numbers, stays whole."""
    import pyarrow.parquet as pq

    rows = [{"request_id": f"r{i}", "ts": i, "note": "é" * (i % 7)} for i in range(50)]
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=8)  # 7 row groups
    f = InputFile(path, "parquet")
    splits = plan_splits([f], split_bytes=1)
    assert splits == [(0, a, min(a + 8, 50)) for a in range(0, 50, 8)]
    whole = pa.concat_tables(read_lines(f, 0, max_line_bytes=_LIMIT))
    parts = [t for s in splits for t in read_split(f, 0, s, 0, max_line_bytes=_LIMIT)]
    assert pa.concat_tables(parts).equals(whole) and whole.num_rows == 50
    assert whole.column("line_no").to_pylist() == list(range(1, 51))
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    assert plan_splits([f], split_bytes=1) == [(0, -1, -1)]
    clash = tmp_path / "g.parquet"
    pq.write_table(pa.table({"file_row_number": list(range(20))}), clash, row_group_size=4)
    assert plan_splits([InputFile(clash, "parquet")], split_bytes=1) == [(0, -1, -1)]
