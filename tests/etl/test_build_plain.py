"""`etl build`'s compiled tier: plain lines read by a Numba kernel give the SQL tiers' rows."""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etl.build import BuildConfig, build, engine_duckdb
from etl.build._plain import plain_select, split_plain, usable_schema
from etl.build.validate import feature_select
from schemas import default_schema, parse_schema
from tests.etl.test_build_fastpath import GOOD, LINES, _compact

SCHEMA = default_schema()
NUMBERS = ["1e-300", "1E2", "1e5", "1e+2", "-0", "0", "-7", "1.0", "-0.0", "0.5e1", "1e400"]
NUMBERS += ["3.5e38", "3.4e38", "12345678901234567", "123456789012345678", "1234567890123456789"]
NUMBERS += ["00", "01", "-", "1.", ".5", "NaN", "-Infinity", "9223372036854775807"]
NUMBERS += ["-9223372036854775809", "4.9e-324", "2.2250738585072014e-308", "0.1000000000000000055"]


_GOOD = _compact(GOOD)
#: plain layouts, read by the tier: compact, spaced, integer ids, keys in another order, empty
#: objects and lists, blanks around tokens, lists cut to max_len or at it
READ_HERE = [
    _GOOD,
    json.dumps(GOOD),
    _compact({**GOOD, "request_id": 7, "session_id": 3, "user_id": "u-1"}),
    '{"ts":5,"request_id":7,"dense":{},"sparse":{}}',
    _GOOD.replace("[3,1,2]", "[ 3 , 1 ]"),
    _GOOD.replace("[3,1,2]", "[]"),
    " \t" + _GOOD + " ",
    _GOOD.replace("[3,1,2]", "[" + ",".join(["1"] * 300) + "]"),
    _GOOD.replace('"item_id":[7]', '"item_tags":[1,2,3,4,5,6,7,8]'),
]
#: left to SQL: escapes, non-ASCII, repeats, fractions or exponents where an integer belongs,
#: -0, lists beyond max_len (not truncated), numbers beyond float32
LEFT_TO_SQL = [
    _GOOD.replace("r-1", "r\u00e9"),
    _GOOD.replace("r-1", "r\\u0031"),
    _GOOD.replace('"item_id":[7]', '"item_id":[7],"item_id":[8]'),
    _GOOD.replace("[3,1,2]", "[3,1e5,2]"),
    _GOOD.replace("[3,1,2]", "[3,-0,2]"),
    _GOOD.replace("31.0", "-0"),
    _GOOD.replace("31.0", "3.5e38"),
    _GOOD.replace('"item_id":[7]', '"item_tags":[1,2,3,4,5,6,7,8,9]'),
]


def _edge_lines() -> list[str]:
    lines = list(LINES) + READ_HERE + LEFT_TO_SQL
    for key in ("request_id", "session_id", "user_id", "ts"):
        rest = {k: v for k, v in GOOD.items() if k != key}
        lines.append(_compact(rest))  # the key absent
        lines += ["{" + f'"{key}":{n},' + _compact(rest)[1:] for n in NUMBERS]
    for n in NUMBERS:
        lines.append(_GOOD.replace("[3,1,2]", f"[3,{n},2]"))
        lines.append(_GOOD.replace("31.0", n))
    lines += [
        _GOOD.replace("[3,1,2]", "[ ]"),
        _GOOD.replace("[3,1,2]", "[3,,2]"),
        _GOOD.replace("[3,1,2]", "[3 2]"),
        _GOOD + "x",
        _GOOD + "}",
        _GOOD[:-1],
        _GOOD.replace("r-1", "r\t1"),  # a control character
        _GOOD.replace('"item_price":7.04', '"item_price":7.04,"item_price":1'),
        _GOOD.replace('"item_price":7.04', '"item_price":{"x":1}'),
        _GOOD.replace('"item_price":7.04', '"item_price":null'),
        _GOOD.replace('"dense":{', '"dense":null,"x":{'),
        _GOOD.replace('"sparse":{', '"sparse":null,"x":{'),
        _GOOD.replace('"request_id":"r-1"', '"request_id":null'),
        _GOOD.replace('"user_id":60399', '"user_id":[1]'),
        _GOOD.replace("{", "{ ", 1).replace(":", " : "),
        _GOOD + "\r",
        '{"request_id":"a","ts":5}',
        "{}",
        "{",
    ]
    return lines


def _lines_table(lines: list[str | None], too_long: list[int | None] | None = None) -> pa.Table:
    n = len(lines)
    return pa.table(
        {
            "file_id": pa.array([0] * n, pa.int32()),
            "line_no": pa.array(range(1, n + 1), pa.int64()),
            "line": pa.array(lines, pa.large_string()),
            "source": pa.nulls(n, pa.large_string()),
            "source_line": pa.nulls(n, pa.int64()),
            "too_long": pa.array(too_long or [None] * n, pa.int64()),
        }
    )


def _exact(row: dict) -> dict:
    """``row`` without ``unknown``, floats as their ``repr`` (``-0.0`` is not ``0.0`` here)."""
    return {k: repr(v) if isinstance(v, float) else v for k, v in row.items() if k != "unknown"}


def _compare(lines: list[str], schema=SCHEMA) -> tuple[set[int], set[int]]:
    """Line numbers the plain tier read, and those the full checks call good; asserts the
    tier's rows equal the full checks' rows."""
    table = _lines_table(lines)
    parsed, rest = split_plain(schema, table)
    con = duckdb.connect()
    con.register("lines", table)
    full = {
        r["line_no"]: r
        for r in con.sql(feature_select(schema, "lines", fast=False)).to_arrow_table().to_pylist()
    }
    read: set[int] = set()
    if parsed is not None:
        con.register("parsed", parsed)
        for row in con.sql(plain_select(schema, "parsed")).to_arrow_table().to_pylist():
            line = row["line_no"]
            read.add(line)
            assert _exact(row) == _exact(full[line]), lines[line - 1]
    # every line is in exactly one of the two parts
    assert sorted(read | set(rest.column("line_no").to_pylist())) == list(range(1, len(lines) + 1))
    assert not read & set(rest.column("line_no").to_pylist())
    good = {k for k, r in full.items() if r["reason"] is None}
    return read, good


def test_plain_tier_rows_equal_the_full_checks_rows_on_edge_lines():
    lines = _edge_lines()
    read, valid = _compare(lines)
    assert read <= valid
    for line in READ_HERE:
        assert lines.index(line) + 1 in read, line
    for line in LEFT_TO_SQL:
        assert lines.index(line) + 1 not in read, line


_number = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(allow_nan=False, allow_infinity=False, width=32).map(lambda x: f"{x:.9g}"),
    st.sampled_from(NUMBERS),
)
_id = st.one_of(
    st.integers(min_value=-(10**19), max_value=10**19).map(str),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x24F), max_size=6).map(
        json.dumps
    ),
)
_blank = st.sampled_from(["", " ", "\t", "  "])


@st.composite
def _line(draw) -> str:
    """A record written by hand: plain or nearly so, numbers in any form, random blanks."""
    b = lambda: draw(_blank)  # noqa: E731
    fields = [f'"request_id"{b()}:{b()}{draw(_id)}', f'"ts":{b()}{draw(_number)}']
    if draw(st.booleans()):
        fields.append(f'"session_id":{b()}{draw(_id)}')
    if draw(st.booleans()):
        fields.append(f'"user_id":{draw(_id)}')
    names = [f.name for f in SCHEMA.dense]
    dense = [f'"{n}":{b()}{draw(_number)}' for n in draw(st.lists(st.sampled_from(names)))]
    fields.append('"dense":{' + f",{b()}".join(dense) + "}")
    sparse = []
    for n in draw(st.lists(st.sampled_from([f.name for f in SCHEMA.sparse]), max_size=4)):
        ids = draw(st.lists(_number, max_size=5))
        sparse.append(f'"{n}":{b()}[{b()}' + f",{b()}".join(ids) + f"{b()}]")
    fields.append('"sparse":{' + ",".join(sparse) + "}")
    order = draw(st.permutations(fields))
    return b() + "{" + f",{b()}".join(order) + "}" + b()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(_line(), min_size=1, max_size=20))
def test_plain_tier_rows_equal_the_full_checks_rows_on_random_records(lines):
    read, good = _compare(lines)
    assert read <= good


def test_lines_cut_or_null_go_to_sql_and_schemas_with_passthrough_skip_the_tier():
    table = _lines_table([_GOOD, _GOOD, None], too_long=[None, 10**7, None])
    parsed, rest = split_plain(SCHEMA, table)
    assert parsed.column("line_no").to_pylist() == [1]
    assert rest.column("line_no").to_pylist() == [2, 3]
    text = '[dataset]\nname = "p"\npassthrough = ["country"]\n[[dense]]\nname = "a"\n'
    schema = parse_schema(text)
    assert not usable_schema(schema)
    parsed, rest = split_plain(schema, table)
    assert parsed is None and rest.num_rows == 3


def test_chunked_batches_are_read_chunk_by_chunk():
    one = _lines_table([_GOOD, "bad", json.dumps(GOOD)])
    two = pa.concat_tables([one, one.slice(1)])  # the line column in two chunks
    parsed, rest = split_plain(SCHEMA, two)
    assert two.column("line").num_chunks == 2
    assert parsed.column("line_no").to_pylist() == [1, 3, 3]
    assert rest.column("line_no").to_pylist() == [2, 2]


@pytest.mark.slow
def test_build_with_and_without_the_plain_tier_gives_the_same_bytes(
    synth_logs, tmp_path, monkeypatch
):
    def run(out, *, tier: bool):
        monkeypatch.setattr(engine_duckdb, "PLAIN_TIER", tier)
        cfg = BuildConfig(row_group_size=4_096)
        return build(synth_logs.features, out, events=synth_logs.events, config=cfg)

    a, b = run(tmp_path / "a", tier=True), run(tmp_path / "b", tier=False)
    for key in ("rows_in", "rows_out", "quarantine_by_reason", "sessions", "features_missing"):
        assert a[key] == b[key], key
    assert a["rows_quarantined"] > 0 and a["reconciles"]
    paths = [f["path"] for f in a["files"]] + ["_quarantine/features.parquet"]
    assert [f["path"] for f in a["files"]] == [f["path"] for f in b["files"]]
    for rel in paths:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
