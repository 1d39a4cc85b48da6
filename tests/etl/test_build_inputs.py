"""`etl build`'s inputs: every line counted whatever its length or line ends, paths never globs.

Regression tests of defects found by an adversarial pass (each failed before its fix): long
lines stopped or silently shortened the build, a `*` in a file name was read as a glob, a bare
`\\r` split a record in two, text inside JSON strings was taken for a trailing comma, and an
event without a label was quarantined with no detail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from etl import reasons
from etl.build import BuildConfig, build
from etl.shard import ShardConfig, shard
from schemas import parse_schema

#: the features the records below carry, and no others
SCHEMA = parse_schema(
    """
[dataset]
name = "inputs"
[[dense]]
name = "user_age"
[[sparse]]
name = "item_id"
kind = "item"
max_len = 8
"""
)
ENGINES = ("duckdb", "polars")


def _rec(rid: str, ts: int, *, session: str = "s", **extra) -> dict:
    return {
        "request_id": rid,
        "ts": ts,
        "session_id": session,
        "dense": {"user_age": 30.0},
        "sparse": {"item_id": [1, 2]},
        **extra,
    }


def _line(rid: str, ts: int, **extra) -> bytes:
    return json.dumps(_rec(rid, ts, **extra)).encode()


def _padded(rid: str, ts: int, size: int) -> bytes:
    """A valid record of exactly ``size`` bytes (a long string field pads it)."""
    base = _line(rid, ts, pad="")
    line = _line(rid, ts, pad="x" * (size - len(base)))
    assert len(line) == size
    return line


def _build(features, out: Path, *, events=None, **options) -> dict:
    return build(features, out, events=events, schema=SCHEMA, config=BuildConfig(**options))


def _quarantine(out: Path, name: str = "features") -> list[dict]:
    return pq.read_table(out / "_quarantine" / f"{name}.parquet").to_pylist()


def _reconciles(m: dict) -> None:
    assert m["rows_in"] == m["rows_out"] + m["rows_quarantined"] + m["rows_sampled_out"]
    assert m["reconciles"] is True


# --- long lines (issue 11, item 8) --------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_a_3mb_record_is_read_like_any_other(tmp_path, engine):
    """It used to stop the build with DuckDB's `CSV Error on Line: 2`."""
    src = tmp_path / "f.jsonl"
    src.write_bytes(b"\n".join([_line("a", 1), _padded("big", 2, 3_000_000), _line("c", 3)]))
    m = _build(src, tmp_path / "out", engine=engine)
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"]) == (3, 3)


@pytest.mark.parametrize("engine", ENGINES)
def test_long_lines_mid_file_and_last_are_all_counted(tmp_path, engine):
    """Mid-file one ended in `Not implemented Error: ... Parallel CSV Reader`."""
    lines = [
        _line("a", 1),
        _padded("big", 2, 2_500_000),
        b"x" * 2_500_000,  # long and not JSON
        _line("c", 3),
        _padded("last", 4, 2_200_000),
    ]
    src = tmp_path / "f.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines)))
    m = _build(src, tmp_path / "out", engine=engine)
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"]) == (5, 4)
    (q,) = _quarantine(tmp_path / "out")
    assert (q["line"], q["reason"]) == (3, reasons.MALFORMED_JSON)


@pytest.mark.slow
def test_a_last_line_over_32mb_is_not_dropped(tmp_path):
    """A last line of >= 33 MB was dropped silently: exit 0, `rows in 1` for two lines."""
    src = tmp_path / "f.jsonl"
    src.write_bytes(_line("a", 1) + b"\n" + _padded("huge", 2, 34 << 20))
    m = _build(src, tmp_path / "out")
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"]) == (2, 2)


@pytest.mark.parametrize("engine", ENGINES)
def test_lines_over_the_limit_are_quarantined_as_line_too_long_with_file_and_line(tmp_path, engine):
    limit = 1000
    lines = [_line("a", 1), _padded("b", 2, limit), _padded("c", 3, limit + 1), _line("d", 4)]
    (tmp_path / "f.jsonl").write_bytes(b"\r\n".join(lines) + b"\r\n" + b"\xc3\xa9" * 5000)
    events = tmp_path / "e.jsonl"
    events.write_bytes(b'{"request_id": "a", "label": 1, "pad": "' + b"y" * limit + b'"}\n')
    cfg = {"engine": engine, "max_line_bytes": limit}
    m = _build(tmp_path / "f.jsonl", tmp_path / "out", events=events, **cfg)
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"]) == (5, 3)
    assert m["quarantine_by_reason"][reasons.LINE_TOO_LONG] == 2
    assert m["events_quarantine_by_reason"][reasons.LINE_TOO_LONG] == 1
    q = _quarantine(tmp_path / "out")
    assert [(x["source"], x["line"], x["reason"]) for x in q] == [
        (str(tmp_path / "f.jsonl"), 3, reasons.LINE_TOO_LONG),
        (str(tmp_path / "f.jsonl"), 5, reasons.LINE_TOO_LONG),
    ]
    assert "line of 1001 bytes" in q[0]["detail"] and "`max_line_bytes` = 1000" in q[0]["detail"]
    assert q[0]["raw"] == lines[2].decode()  # shorter than the 1 KB kept
    assert q[1]["raw"] == "\u00e9" * 512  # its first 1 KB, cut between characters


def test_shard_then_build_count_every_line_whatever_its_length(tmp_path):
    """`_shard.json` counted 6 lines in and the build 5 (a long line lost between them)."""
    lines = [_line(f"r{i}", i, session=f"s{i % 2}") for i in range(5)]
    lines.insert(2, _padded("big", 9, 3_000_000))
    src = tmp_path / "raw.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    report = shard(src, tmp_path / "shards", schema=SCHEMA, config=ShardConfig(num_shards=2))
    m = _build(tmp_path / "shards", tmp_path / "out")
    assert report["lines_in"] == m["rows_in"] == m["rows_out"] == 6


def test_a_line_too_long_for_shard_is_quarantined_with_its_origin(tmp_path):
    lines = [_line("a", 1), _padded("big", 2, 5000), _line("c", 3)]
    src = tmp_path / "raw.jsonl"
    src.write_bytes(b"\n".join(lines))
    cfg = ShardConfig(num_shards=2, max_line_bytes=2000)
    report = shard(src, tmp_path / "shards", schema=SCHEMA, config=cfg)
    assert report["unroutable_by_reason"] == {reasons.LINE_TOO_LONG: 1}
    for engine in ENGINES:
        m = _build(tmp_path / "shards", tmp_path / engine, engine=engine)
        assert report["lines_in"] == m["rows_in"] == 3 and m["rows_out"] == 2
        (q,) = _quarantine(tmp_path / engine)
        assert (q["source"], q["line"], q["reason"]) == (str(src), 2, reasons.LINE_TOO_LONG)
        assert "line of 5000 bytes" in q["detail"]


# --- paths are not globs (item 9) ----------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_glob_characters_in_file_names_name_one_file(tmp_path, engine):
    """`p*q.jsonl` beside `pXq.jsonl` gave `rows in 3` and a false `duplicate_request_id`."""
    names = ["p*q", "pXq", "p?q", "p[X]q"]
    for i, name in enumerate(names):
        (tmp_path / f"{name}.jsonl").write_bytes(_line(f"r{i}", i) + b"\n")
        table = pa.Table.from_pylist([_rec(f"t{i}", i)])
        pq.write_table(table, tmp_path / f"{name}.parquet")
    files = [tmp_path / f"{n}.{ext}" for n in names for ext in ("jsonl", "parquet")]
    m = _build(files, tmp_path / "out", engine=engine)
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"], m["rows_duplicate"]) == (8, 8, 0)


# --- line ends and text inside strings (items 10, 11) -------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_text_that_looks_like_a_trailing_comma_inside_strings_is_text(tmp_path, engine):
    src = tmp_path / "f.jsonl"
    src.write_text(
        '{"request_id":"r,]","ts":1700000000001}\n'
        + json.dumps(_rec("q", 2, session="a, }"))
        + "\n"
        + '{"request_id": "t", "ts": 3, "x": "\\",]"}\n'
        + '{"request_id": "u", "ts": 4, "sparse": {"item_id": [1,]}}\n'  # a real one
    )
    m = _build(src, tmp_path / "out", engine=engine)
    assert (m["rows_in"], m["rows_out"]) == (4, 3)
    (q,) = _quarantine(tmp_path / "out")
    assert (q["line"], q["detail"]) == (4, "not valid JSON (trailing comma)")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bare_carriage_return_stays_inside_its_line(tmp_path, engine):
    """A lone `\\r` split a record into two malformed lines; `\\r\\n` is one line end."""
    whitespace = _line("a", 1).replace(b', "ts"', b',\r"ts"')
    in_string = _line("b", 2).replace(b'"b"', b'"b\rc"')
    src = tmp_path / "f.jsonl"
    src.write_bytes(whitespace + b"\r\n" + in_string + b"\n" + _line("d", 3) + b"\r")
    m = _build(src, tmp_path / "out", engine=engine)
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"]) == (3, 2)
    (q,) = _quarantine(tmp_path / "out")
    assert (q["line"], q["reason"], q["raw"]) == (2, reasons.MALFORMED_JSON, in_string.decode())


# --- details name the field (item 13) ------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_an_event_without_label_or_with_a_null_label_names_the_field(tmp_path, engine):
    feats = tmp_path / "f.jsonl"
    feats.write_bytes(_line("a", 1) + b"\n")
    events = tmp_path / "e.jsonl"
    events.write_text('{"request_id": "a", "ts": 5}\n{"request_id": "a", "label": null}\n')
    m = _build(feats, tmp_path / "out", events=events, engine=engine)
    assert m["events_quarantine_by_reason"][reasons.WRONG_TYPE] == 2
    q = _quarantine(tmp_path / "out", "events")
    assert [x["detail"] for x in q] == [
        "field `label`: missing",
        "field `label`: null, expected a number",
    ]


# --- one set of line rules, whatever the chunking, in `etl shard` and in `etl build` ---------


def _awkward_bytes() -> bytes:
    parts = [
        b"\xef\xbb\xbf" + _line("a", 1),  # a byte-order mark opens the file
        b"",
        b"   ",
        _line("b", 2).replace(b", ", b",\r "),  # `\r` as whitespace
        b"x" * 30 + b"\r",  # `\r\n`
        b"\r",  # an empty line ended by `\r\n`
        "\u00e9t\u00e9 \u20ac".encode() * 20,  # 180 bytes: over the limit
        _line("c", 3),
    ]
    return b"\n".join(parts) + b"\r\n" + b"tail\r"  # a last line without `\n` keeps its `\r`


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_the_reader_splits_the_same_lines_whatever_the_chunks(tmp_path, chunk):
    from etl.build.inputs import InputFile, read_lines
    from etl.rawio import iter_raw_lines

    path = tmp_path / "f.jsonl"
    path.write_bytes(_awkward_bytes())
    f = InputFile(path, "jsonl")

    def lines(size: int) -> list[tuple]:
        got = pa.concat_tables(read_lines(f, 0, max_line_bytes=150, chunk_bytes=size))
        return list(zip(*(got.column(c).to_pylist() for c in ("line_no", "line", "too_long"))))

    whole = lines(1 << 20)
    assert lines(chunk) == whole
    assert [n for n, _, _ in whole] == list(range(1, 10))
    assert whole[-1][1:] == ("tail\r", None) and whole[1][1] is None  # an empty line is NULL
    assert [(n, size) for n, line, size in whole if size] == [(7, 180)]
    # `etl shard`'s reader numbers the same lines, skipping the blank ones
    shard_lines = [
        (n, line.decode(), size if size > 150 else None)
        for n, line, size in iter_raw_lines(path, max_line_bytes=150)
    ]
    assert shard_lines == [(n, line, size) for n, line, size in whole if line and line.strip()]
