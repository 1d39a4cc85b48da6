"""String ids (`[[sparse]] ids = "hash"`) and `[dataset] time_unit`: every tier of the validation
and every engine store the same ids and milliseconds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from etl import reasons
from etl.build import BuildConfig, build
from etl.build._plain import plain_select, split_plain
from etl.build.validate import Validator, feature_select
from etl.validate_logs import validate_logs
from recpipe.errors import SchemaError
from schemas import parse_schema
from tests.etl.test_build_plain import _exact, _lines_table

SCHEMA_TOML = """
[dataset]
name = "shop"
time_unit = "{unit}"
[[dense]]
name = "price"
[[sparse]]
name = "item"
kind = "item"
max_len = 1
ids = "{ids}"
[[sparse]]
name = "hist"
kind = "user"
max_len = 3
ids = "{ids}"
"""


def _schema(unit: str = "ms", ids: str = "hash"):
    return parse_schema(SCHEMA_TOML.format(unit=unit, ids=ids))


def stable_id(text: str) -> int:
    """The documented hash of a string id (docs/data-contract.md)."""
    return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "little") & (2**63 - 1)


def _line(rid: str, ts: int, item: list, hist: list, **extra) -> str:
    rec = {"request_id": rid, "user_id": "u1", "ts": ts, "dense": {"price": 1.5}}
    rec["sparse"] = {"item": item, "hist": hist}
    return json.dumps({**rec, **extra})


def _tiers(schema, lines: list[str], *, fast: set[int] | None = None) -> dict[int, dict]:
    """Each line's row from the full checks; asserts the compiled tier and the fast path (its
    SQL and its precomputed-facts forms) give the same row for every line they accept, and
    that they accept the lines ``fast`` (line numbers) at least."""
    table = _lines_table(lines)
    con = duckdb.connect()
    con.register("lines", table)
    full = {
        r["line_no"]: r
        for r in con.sql(feature_select(schema, "lines", fast=False)).to_arrow_table().to_pylist()
    }
    parsed, _ = split_plain(schema, table)
    accepted = []
    if parsed is not None:
        con.register("parsed", parsed)
        accepted += con.sql(plain_select(schema, "parsed")).to_arrow_table().to_pylist()
    con.register("facts", Validator(schema).with_facts(table))
    for src, facts in (("lines", False), ("facts", True)):
        sql = feature_select(schema, src, fast=True, facts=facts)
        accepted += [
            r for r in con.sql(sql).to_arrow_table().to_pylist() if r["reason"] != "pending"
        ]
    for row in accepted:
        if row["reason"] is None:
            assert _exact(row) == _exact(full[row["line_no"]]), lines[row["line_no"] - 1]
    assert (fast or set()) <= {r["line_no"] for r in accepted if r["reason"] is None}
    return full


def test_string_ids_are_hashed_by_the_documented_hash_in_every_tier():
    lines = [
        _line("a", 5, ["sku-1"], ["x", "y", "z", "w"]),  # cut to the last 3
        _line("b", 6, [5], [1, 2]),  # plain integers: the fast path
        _line("c", 7, ["5"], []),  # "5" and 5 are one id
        _line("d", 8, ["é ü"], [18446744073709551615]),  # UTF-8; beyond int64: hashed as text
        _line("e", 9, [1.5], []),
        _line("f", 10, [None], []),
        _line("g", 11, [True], []),
        _line("h", 12, "sku-1", []),
    ]
    rows = _tiers(_schema(), lines, fast={1, 2, 3})  # string ids need no second look
    good = {r["request_id"]: (r["s0"], r["s1"]) for r in rows.values() if r["reason"] is None}
    h = stable_id
    assert good == {
        "a": ([h("sku-1")], [h("y"), h("z"), h("w")]),
        "b": ([h("5")], [h("1"), h("2")]),
        "c": ([h("5")], []),
        "d": ([h("é ü")], [h("18446744073709551615")]),
    }
    bad = {rows[n]["reason"] for n in range(5, 9)}
    assert bad == {reasons.WRONG_TYPE}
    assert "expected a list of string or integer ids" in rows[5]["detail"]
    # text a fast test could misread: every tier still agrees with the full checks
    tricky = [
        ["a,]"],
        ["1e5"],
        ["true"],
        ['x"y'],
        [""],
        [" "],
        ["\u0000"],
        ["-0"],
        ["007"],
        ["é"],
        ['"sparse": {'],
        [-0],
        [10**18],
        [-(2**63)],
        ["a", None],
        [[1]],
        [{"a": 1}],
    ]
    more = [_line(f"t{k}", 5, v, v) for k, v in enumerate(tricky)]
    more += ['{"request_id": "u", "ts": 5, "sparse": {"item": ["a"], "item": ["b"]}}']
    more += ['{"request_id": "v", "ts": 5, "sparse": {"item": ["a" , 5 ]}}']
    got = _tiers(_schema(), more)
    assert got[1]["s0"] == [h("a,]")] and got[8]["s0"] == [h("-0")] and got[12]["s0"] == [h("0")]
    # the same lines under `ids = "int"`: strings are wrong_type, as before
    rows = _tiers(_schema(ids="int"), lines)
    assert rows[1]["reason"] == reasons.WRONG_TYPE and rows[2]["reason"] is None


@pytest.mark.parametrize(
    ("unit", "scale"), [("s", 1 / 1000), ("ms", 1), ("us", 1000)], ids=["s", "ms", "us"]
)
def test_time_unit_gives_milliseconds_in_every_tier(unit, scale):
    ms = [1_700_000_000_000, 1_700_000_005_000, -3_000, 0]
    lines = [_line(f"r{i}", int(t * scale), [i], [i]) for i, t in enumerate(ms)]
    lines.append(_line("odd", int(ms[0] * scale), [1], [1], extra_key=1))  # the full checks
    schema = _schema(unit=unit, ids="int")
    rows = _tiers(schema, lines)
    assert [rows[n]["ts"] for n in range(1, 6)] == [*ms, ms[0]]


def test_time_unit_microseconds_floor_and_seconds_out_of_range():
    rows = _tiers(
        _schema(unit="us", ids="int"), [_line("a", -1, [1], []), _line("b", 1999, [1], [])]
    )
    assert (rows[1]["ts"], rows[2]["ts"]) == (-1, 1)
    rows = _tiers(_schema(unit="s", ids="int"), [_line("a", 10**16, [1], [])])
    assert rows[1]["reason"] == reasons.TS_OUT_OF_RANGE and "epoch seconds" in rows[1]["detail"]


def _build_both(tmp_path: Path, schema, lines: list[str]) -> dict[str, object]:
    """Build ``lines`` with the DuckDB and Polars engines; asserts the same files, byte for byte."""
    src = tmp_path / "f.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = {}
    for engine in ("duckdb", "polars"):
        out[engine] = build(
            src, tmp_path / engine, schema=schema, config=BuildConfig(engine=engine)
        )
    a, b = out["duckdb"], out["polars"]
    assert a["quarantine_by_reason"] == b["quarantine_by_reason"]
    for f in a["files"]:
        assert (tmp_path / "duckdb" / f["path"]).read_bytes() == (
            tmp_path / "polars" / f["path"]
        ).read_bytes()
    return a


def test_engines_agree_on_hashed_ids_and_seconds(tmp_path):
    schema = _schema(unit="s")
    lines = [
        _line(f"r{i}", 1_700_000_000 + 60 * i, [f"sku-{i % 3}"], [i, f"q{i}"]) for i in range(20)
    ]
    lines.append(_line("bad", 1_700_000_000, [None], []))
    manifest = _build_both(tmp_path, schema, lines)
    assert manifest["rows_out"] == 20 and manifest["quarantine_by_reason"][reasons.WRONG_TYPE] == 1
    table = pq.ParquetDataset(sorted((tmp_path / "duckdb").rglob("part-*.parquet"))).read()
    row = next(r for r in table.to_pylist() if r["request_id"] == "r4")
    assert row["ts"] == (1_700_000_000 + 240) * 1000
    assert row["item"] == [stable_id("sku-1")] and row["hist"] == [stable_id("4"), stable_id("q4")]


def test_schema_checks_time_unit_and_ids():
    with pytest.raises(
        SchemaError, match=r"\[dataset\]: `time_unit` must be one of \['s', 'ms', 'us'\], got 'sec'"
    ):
        _schema(unit="sec")
    with pytest.raises(SchemaError, match=r"sparse feature `item`: `ids` must be one of"):
        _schema(ids="str")
    schema = _schema(unit="us")
    assert parse_schema(schema.to_toml()) == schema
    assert 'time_unit = "us"' in schema.to_toml() and 'ids = "hash"' in schema.to_toml()
    assert "time_unit" not in _schema(ids="int").to_toml()


def test_validate_reads_the_declared_unit_and_hashed_ids(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text(
        "".join(_line(f"r{i}", 1_700_000_000 + i, [f"sku{i}"], []) + "\n" for i in range(30))
    )
    report = validate_logs(path, schema=_schema(unit="s"))
    assert report.ok and not report.findings and report.quarantined == {}
    report = validate_logs(path, schema=_schema(unit="ms", ids="int"))
    kinds = {f.kind: f for f in report.findings}
    assert 'time_unit = "s"' in kinds["ts_unit"].fix
    assert 'ids = "hash"' in kinds["string_ids"].fix
    ms = tmp_path / "ms.jsonl"
    ms.write_text("".join(_line(f"r{i}", 1_700_000_000_000 + i, [i], []) + "\n" for i in range(30)))
    report = validate_logs(ms, schema=_schema(unit="s"))  # milliseconds read as seconds
    assert 'time_unit = "ms"' in {f.kind: f for f in report.findings}["ts_unit"].fix


@pytest.mark.slow  # starts a local Spark
def test_spark_engine_reads_hashed_ids_and_seconds_as_duckdb_does(tmp_path):
    pytest.importorskip("pyspark")
    schema = _schema(unit="s")
    lines = [
        _line(f"r{i}", 1_700_000_000 + 60 * i, [f"sku-{i % 3}"], [i, f"q{i}"]) for i in range(20)
    ]
    lines.append(_line("bad", 1_700_000_000, [None], []))
    src = tmp_path / "f.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rows = {}
    for engine in ("duckdb", "spark"):
        cfg = BuildConfig(engine=engine, spark_partitions=2) if engine == "spark" else None
        m = build(src, tmp_path / engine, schema=schema, config=cfg or BuildConfig(engine=engine))
        assert m["rows_out"] == 20 and m["quarantine_by_reason"][reasons.WRONG_TYPE] == 1
        table = pq.ParquetDataset(sorted((tmp_path / engine).rglob("part-*.parquet"))).read()
        rows[engine] = sorted(
            table.select(["request_id", "ts", "item", "hist"]).to_pylist(), key=str
        )
    assert rows["spark"] == rows["duckdb"]
