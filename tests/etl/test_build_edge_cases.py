"""`etl build` on edge cases: shared unroutable line numbers, extreme labels, gaps and ts."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import zstandard

from etl import reasons
from etl.build import BuildConfig
from etl.build import engine_polars as polars_engine
from etl.build.engine import BuildJob
from etl.build.engine_duckdb import DuckDBEngine
from etl.build.validate import TS_RANGE, Validator
from etl.rawio import UNROUTABLE_NAME, unroutable_record
from recpipe.errors import RecpipeError
from schemas import default_schema
from tests.etl.test_build import (
    _dataset,
    _quarantine,
    _rec,
    _reconciles,
    _write,
    build_lenient,
)


def _rows_written(out) -> int:
    return sum(pq.read_metadata(p).num_rows for p in out.rglob("part-*.parquet"))


def _shards(tmp_path, records: list[bytes]):
    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "shard-00000.jsonl", [_rec("a", 1, session="s")])
    (shards / UNROUTABLE_NAME).write_bytes(
        zstandard.ZstdCompressor().compress(b"\n".join(records) + b"\n")
    )
    return shards


@pytest.mark.parametrize("bad_second", [False, True], ids=["two-good", "good-and-malformed"])
def test_unroutable_records_sharing_a_line_are_each_built_once(tmp_path, bad_second):
    second = (
        unroutable_record("raw/b.jsonl", 9, "malformed_json", b'{"request_id": "x"')
        if bad_second
        else unroutable_record("raw/b.jsonl", 9, "no_key", json.dumps(_rec("c", 3)).encode())
    )
    shards = _shards(
        tmp_path,
        [unroutable_record("raw/a.jsonl", 9, "no_key", json.dumps(_rec("b", 2)).encode()), second],
    )
    m = build_lenient(shards, tmp_path / "out")
    _reconciles(m)
    assert m["rows_in"] == 3
    assert m["rows_out"] == _rows_written(tmp_path / "out") == (2 if bad_second else 3)
    assert sorted(_dataset(tmp_path / "out").column("ts").to_pylist()) == (
        [1, 2] if bad_second else [1, 2, 3]
    )
    if bad_second:
        (q,) = _quarantine(tmp_path / "out")
        assert (q["source"], q["line"], q["reason"]) == ("raw/b.jsonl", 9, "malformed_json")


def test_quarantined_unroutable_records_sharing_a_line_keep_the_files_order(tmp_path):
    sources = ["raw/z.jsonl", "raw/a.jsonl", "raw/m.jsonl", "raw/b.jsonl"]
    shards = _shards(
        tmp_path,
        [unroutable_record(s, 4, "malformed_json", b"{" * (i + 1)) for i, s in enumerate(sources)],
    )
    for engine in ("duckdb", "polars"):
        m = build_lenient(shards, tmp_path / engine, config=BuildConfig(engine=engine))
        assert m["quarantine_by_reason"][reasons.MALFORMED_JSON] == 4
        q = _quarantine(tmp_path / engine)
        assert [(x["source"], x["line"], x["raw"]) for x in q] == [
            (s, 4, "{" * (i + 1)) for i, s in enumerate(sources)
        ]


def test_files_holding_other_than_rows_out_is_an_internal_error(tmp_path, monkeypatch):
    counts = DuckDBEngine.counts

    def off_by_one(engine):
        c = counts(engine)
        c.rows_out += 1
        return c

    monkeypatch.setattr(DuckDBEngine, "counts", off_by_one)
    src = _write(tmp_path / "f.jsonl", [_rec("a", 1, session="s")])
    with pytest.raises(RecpipeError, match="internal: the files hold 1 rows, the build counted 2"):
        build_lenient(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_labels_beyond_float32_are_quarantined_and_other_events_still_count(tmp_path):
    feats = _write(tmp_path / "f.jsonl", [_rec(f"r{i}", i, session=f"s{i}") for i in range(4)])
    evs = _write(
        tmp_path / "e.jsonl",
        [
            {"request_id": "r0", "label": 1e300},
            {"request_id": "r0", "label": 1},
            {"request_id": "r1", "label": -1e39},
            {"request_id": "r2", "label": 3.4028234663852886e38},  # float32's largest: kept
            {"request_id": "r3", "label": 0.5},
        ],
    )
    m = build_lenient(feats, tmp_path / "out", events=evs)
    _reconciles(m)
    assert m["events_quarantine_by_reason"][reasons.NON_FINITE] == 2
    labels = _dataset(tmp_path / "out").column("label").to_pylist()
    assert labels == [1.0, 0.0, pytest.approx(3.4028234663852886e38), 0.5]
    q = pq.read_table(tmp_path / "out" / "_quarantine" / "events.parquet").to_pylist()
    assert [(x["line"], x["reason"]) for x in q] == [(1, "non_finite"), (3, "non_finite")]
    assert all("field `label`: expected a number within float32" in x["detail"] for x in q)


def test_user_records_more_than_2_63_ms_apart_start_a_new_session(tmp_path):
    """Out-of-range ts are quarantined at parse, so the sessionizers are tested directly."""
    import polars as pl

    far = [-(2**62) * 3 // 2, 2**62 * 3 // 2, 2**62 * 3 // 2 + 5]  # 2^63 + 2^62 ms apart
    schema = default_schema()
    job = BuildJob(
        schema, BuildConfig(), [], [], Validator(schema), tmp_path, bar=lambda *a, **k: None
    )
    engine = DuckDBEngine(job)
    con = engine.con
    con.execute(
        "CREATE TABLE feat AS SELECT 0 AS file_id, i::BIGINT + 1 AS line_no, NULL AS reason, "
        "'r' || i AS request_id, NULL::VARCHAR AS session_key, 'u' AS user_key, ts "
        f"FROM (SELECT unnest(range(3)) AS i, unnest({far}::BIGINT[]) AS ts)"
    )
    con.execute("CREATE TABLE labels AS SELECT 'r0' AS request_id, 1.0 AS label")
    engine.sessionize()
    got = con.execute("SELECT line_no, skey FROM rowkeys ORDER BY line_no").fetchall()
    engine.close()
    assert got == [(1, "u:u:1"), (2, "u:u:2"), (3, "u:u:2")]
    good = pl.DataFrame(
        {
            "file_id": [0] * 3,
            "line_no": [1, 2, 3],
            "request_id": ["r0", "r1", "r2"],
            "session_key": [None] * 3,
            "user_key": ["u"] * 3,
            "ts": far,
        },
        schema_overrides={"file_id": pl.Int32, "session_key": pl.String},
    )
    keys = polars_engine._session_keys(good, BuildConfig().session_gap_ms).sort("line_no")
    assert keys.get_column("skey").to_list() == ["u:u:1", "u:u:2", "u:u:2"]


@pytest.mark.parametrize("partition_by", ["none", "hour"])
def test_ts_outside_the_timestamps_is_quarantined(tmp_path, partition_by):
    lo, hi = TS_RANGE
    lines = [_rec(f"r{i}", ts, session=f"s{i}") for i, ts in enumerate([lo, hi, 0])]
    lines += [_rec("low", lo - 1), _rec("high", hi + 1), _rec("max", 2**63 - 1)]
    src = _write(tmp_path / "f.jsonl", lines)
    m = build_lenient(src, tmp_path / "out", config=BuildConfig(partition_by=partition_by))
    _reconciles(m)
    assert m["rows_out"] == _rows_written(tmp_path / "out") == 3
    assert m["quarantine_by_reason"][reasons.TS_OUT_OF_RANGE] == 3
    q = _quarantine(tmp_path / "out")
    assert [x["line"] for x in q] == [4, 5, 6]
    assert all(x["detail"].startswith("field `ts`: expected epoch milliseconds in") for x in q)
    if partition_by == "hour":  # the extreme hours have names (DuckDB's strftime)
        parts = [f["path"].split("/")[0] for f in m["files"]]
        assert len(set(parts)) == 3 and parts[1] == "dt=1970-01-01-00"
