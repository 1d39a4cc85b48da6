"""`etl build`'s fast path: the compiled text tests accept exactly what the SQL ones accept."""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from etl.build import BuildConfig, build, engine_duckdb, inputs
from etl.build._kernels import LINE_FACT_COLUMNS, line_facts
from etl.build.validate import PENDING, feature_select, schema_keys
from schemas import default_schema

GOOD = {
    "request_id": "r-1",
    "session_id": "s-1",
    "user_id": 60399,
    "ts": 1700000000347,
    "dense": {"user_age": 31.0, "item_price": 7.04},
    "sparse": {"user_liked_items": [3, 1, 2], "item_id": [7]},
}


def _compact(rec) -> str:
    return json.dumps(rec, separators=(",", ":"))


def _variant(**change) -> str:
    return _compact({**GOOD, **change})


LINES = [
    _compact(GOOD),
    json.dumps(GOOD),  # spaced layout
    _variant(request_id=7, session_id=3, user_id="u-1"),
    _variant(request_id="12"),  # a numeric string id is a string
    _variant(session_id=None),
    _variant(dense={}, sparse={}),
    _compact({"request_id": "a", "ts": 5}),
    _compact({"ts": 5, "request_id": "a", "sparse": {"item_id": [1]}, "dense": {"user_age": 1}}),
    _variant(request_id="says true, false, 1.5E3 and ,]"),  # text inside a string
    _variant(ts="5"),
    _variant(ts=5.5),
    _variant(ts=True),
    _variant(request_id=1.5),
    _variant(user_id=False),
    _variant(dense={"user_age": "12"}),
    _variant(dense={"user_age": True}),
    _variant(dense=[1.0]),
    _variant(sparse=[1]),
    _variant(sparse={"item_id": ["12"]}),
    _variant(sparse={"item_id": [1.5]}),
    _variant(sparse={"item_id": [1.0]}),
    _variant(sparse={"item_id": [True]}),
    _variant(sparse={"item_id": [None]}),
    _variant(sparse={"item_id": [2**63]}),
    _variant(dense={"mystery": 1.0}),
    _compact(GOOD)[:-1] + ',"extra":"x"}',
    _compact(GOOD).replace('"ts":1700000000347', '"ts":1,"ts":2'),
    _compact(GOOD).replace("[3,1,2]", "[3,1,2,]"),
    _compact(GOOD).replace("[3,1,2]", "[3,1,2 , ]"),
    _compact(GOOD).replace(',"sparse"', ',}"sparse"'),
    _compact(GOOD).replace("[3,1,2]", "[3,1e5,2]"),
    _compact(GOOD).replace("[3,1,2]", "[3,1e-5,2]"),
    _compact(GOOD).replace("[3,1,2]", "[3,1e+5,2]"),
    _compact(GOOD).replace("[3,1,2]", "[3,1E5,2]"),
    _variant(request_id=7).replace("7", "1e-300", 1),  # DuckDB reads it as the text "1e-300"
    _variant(session_id=3).replace(":3,", ":1e2,", 1),
    _compact(GOOD).replace('"user_id":60399', '"user_id":-0'),
    _variant(request_id=2**63),  # an integer beyond int64 (UBIGINT)
    _variant(ts=2**62),  # an int64 outside the timestamps (ts_out_of_range)
    _variant(ts=-(2**62)),
    _compact(GOOD).replace('"dense":{', '"dense" :{'),
    _compact(GOOD).replace('"user_id":60399', '"user_id" : 60399'),
    _compact(GOOD).replace("31.0", "NaN"),
    _compact(GOOD).replace("31.0", "1e300"),
    _compact(GOOD).replace('"r-1"', '"r\\"1"'),
    _variant(session_id="sparse"),  # the key's name as a value before the key
    _compact(GOOD).replace('"sparse":{', '"sparse" : {'),
    '{"request_id": "b1", "ts": 5',
    "",
    "   ",
    "[1, 2]",
    "null",
]


def _accepted(con, src: str, *, facts: bool) -> list[bool]:
    sql = feature_select(default_schema(), src, fast=True, facts=facts)
    rows = con.execute(f"SELECT line_no, reason FROM ({sql}) ORDER BY line_no").fetchall()
    return [reason != PENDING for _, reason in rows]


def test_compiled_text_tests_accept_the_same_lines_as_sql():
    lines = pa.array(LINES, type=pa.string())
    facts = line_facts(lines, schema_keys(default_schema()))
    table = pa.table(
        {
            "file_id": pa.array([0] * len(LINES), pa.int32()),
            "line_no": pa.array(range(1, len(LINES) + 1), pa.int64()),
            "line": lines,
            "source": pa.nulls(len(LINES), pa.string()),
            "source_line": pa.nulls(len(LINES), pa.int64()),
            "too_long": pa.nulls(len(LINES), pa.int64()),
            **{name: pa.array(facts[name]) for name in LINE_FACT_COLUMNS},
        }
    )
    con = duckdb.connect()
    con.register("lines", table)
    sql_ok = _accepted(con, "lines", facts=False)
    facts_ok = _accepted(con, "lines", facts=True)
    assert facts_ok == sql_ok, [
        (line, a, b) for line, a, b in zip(LINES, sql_ok, facts_ok, strict=True) if a != b
    ]
    # the plain layouts take the fast path; null ids, look-alike text inside strings and every
    # lenient reading go to the full checks
    fast = {i for i, ok in enumerate(facts_ok) if ok}
    assert fast == {0, 1, 2, 3, 5, 6, 7, LINES.index(_compact(GOOD).replace(":60399", ":-0"))}


def test_fast_path_accepts_only_what_the_full_checks_accept_with_equal_values():
    numbers = ["1e-300", "1E2", "1e5", "1e+2", "-0", "0", "-7", "1.0", "NaN", "-Infinity"]
    numbers += ["9223372036854775807", "9223372036854775808", "-9223372036854775809"]
    lines = list(LINES)
    for key in ("request_id", "session_id", "user_id", "ts"):
        rest = {k: v for k, v in GOOD.items() if k != key}
        lines += ["{" + f'"{key}":{n},' + _compact(rest)[1:] for n in numbers]
    for n in numbers:
        lines.append(_compact(GOOD).replace("[3,1,2]", f"[3,{n},2]"))
    table = pa.table(
        {
            "file_id": pa.array([0] * len(lines), pa.int32()),
            "line_no": pa.array(range(1, len(lines) + 1), pa.int64()),
            "line": pa.array(lines, pa.string()),
            "source": pa.nulls(len(lines), pa.string()),
            "source_line": pa.nulls(len(lines), pa.int64()),
            "too_long": pa.nulls(len(lines), pa.int64()),
        }
    )
    con = duckdb.connect()
    con.register("lines", table)

    def rows(fast: bool) -> list[dict]:
        sql = feature_select(default_schema(), "lines", fast=fast)
        return con.sql(f"SELECT * FROM ({sql}) ORDER BY line_no").to_arrow_table().to_pylist()

    accepted = 0
    for line, fast, full in zip(lines, rows(True), rows(False), strict=True):
        if fast["reason"] == PENDING:
            continue
        accepted += 1
        assert full["reason"] is None, (line, full["reason"])
        assert {k: v for k, v in fast.items() if k != "unknown"} == {
            k: v for k, v in full.items() if k != "unknown"
        }, line
    assert accepted >= 10


def test_line_facts_reports_quotes_and_id_kinds():
    facts = line_facts(
        pa.array([_compact(GOOD), '{"ts": "5", "request_id" : 1}', None], pa.large_string()),
        ("request_id", "session_id", "user_id", "ts"),
    )
    assert facts["quotes"].tolist()[:2] == [_compact(GOOD).count('"'), 6]
    assert facts["kind_rk"].tolist() == [1, -1, -1]
    assert facts["kind_uk"].tolist() == [0, -1, -1]
    assert facts["kind_tk"].tolist() == [0, 1, -1]


@pytest.mark.slow
def test_fast_path_parallel_files_and_small_batches_give_the_same_dataset(
    synth_logs, tmp_path, monkeypatch
):
    """Compiled text tests, 2 files at a time, batches of 1000 lines vs SQL tests, 1 file."""

    def run(out, *, facts: bool, threads: int, batch: int):
        monkeypatch.setattr(engine_duckdb, "LINE_FACTS", facts)
        monkeypatch.setattr(inputs, "CHUNK_BYTES", batch * 1000)
        monkeypatch.setattr(inputs, "BATCH_LINES", batch)
        cfg = BuildConfig(threads=threads, row_group_size=4_096)
        return build(synth_logs.features, out, events=synth_logs.events, config=cfg)

    a = run(tmp_path / "a", facts=True, threads=2, batch=1_000)
    b = run(tmp_path / "b", facts=False, threads=1, batch=65_536)
    for key in ("rows_in", "rows_out", "quarantine_by_reason", "sessions", "unknown_features"):
        assert a[key] == b[key], key
    assert a["reconciles"] and a["quarantine_by_reason"] == {
        **a["quarantine_by_reason"],
        **{r: n for r, n in synth_logs.num_bad.items()},
    }
    for rel in [f["path"] for f in a["files"]] + ["_quarantine/features.parquet"]:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert (
        pq.read_table(tmp_path / "a" / "_quarantine" / "features.parquet").num_rows
        == (a["rows_quarantined"])
    )
