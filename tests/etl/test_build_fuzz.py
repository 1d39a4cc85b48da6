"""Fuzzing `etl build`: random bytes, random JSON and mutated records never end in a traceback.

Whatever the input, a build either refuses it with a :class:`RecpipeError` naming the file, or
accounts for every line: ``rows in = rows out + quarantined``, every quarantined line with a
reason and a detail, the files holding exactly the rows counted. The engines agree.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etl.build import BuildConfig, build
from recpipe.errors import RecpipeError
from schemas import parse_schema

SCHEMA = parse_schema(
    """
[dataset]
name = "fuzz"
[[dense]]
name = "user_age"
[[sparse]]
name = "item_id"
kind = "item"
max_len = 4
truncate = false
"""
)
VALID = [
    {
        "request_id": "r1",
        "ts": 1,
        "session_id": "s",
        "dense": {"user_age": 3.5},
        "sparse": {"item_id": [1, 2]},
    },
    {"request_id": 2, "ts": 1700000000000, "user_id": 7, "dense": {}, "sparse": {"item_id": []}},
    {"request_id": "r3", "ts": -5, "sparse": {"item_id": [9223372036854775807]}},
]
EVENTS = [{"request_id": "r1", "ts": 2, "label": 1}, {"request_id": 2, "label": 0.5}]
SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["request_id", "ts", "session_id", "user_id", "dense", "sparse", "label"]
            )
            | st.text(max_size=6),
            inner,
            max_size=5,
        )
    ),
    max_leaves=12,
)


@st.composite
def _mutated(draw) -> bytes:
    """A valid record's text with a few bytes inserted, deleted or replaced."""
    data = bytearray(json.dumps(draw(st.sampled_from(VALID))).encode())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        byte = draw(st.sampled_from(list(b'{}[],:"\\ \r\t0-9.eE\x00\x7f\xc3\xe9')))
        if op == "insert":
            data.insert(at, byte)
        elif data and at < len(data):
            if op == "delete":
                del data[at]
            else:
                data[at] = byte
    return bytes(data)


def _check(lines: list[bytes], *, events: list[bytes] = (), max_line_bytes: int = 1 << 20):
    """Build ``lines`` with both engines; assert the promises of the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "f.jsonl"
        src.write_bytes(b"\n".join(lines))
        ev = tmp / "e.jsonl"
        ev.write_bytes(b"\n".join(events))
        got = {}
        for engine in ("duckdb", "polars"):
            out = tmp / engine
            cfg = BuildConfig(
                engine=engine, allow_missing_features=True, max_line_bytes=max_line_bytes
            )
            try:
                m = build(src, out, events=ev if events else None, schema=SCHEMA, config=cfg)
            except RecpipeError as exc:
                assert str(src) in str(exc) or str(ev) in str(exc), exc
                got[engine] = type(exc).__name__
                continue
            assert m["rows_in"] == m["rows_out"] + m["rows_quarantined"], m
            assert m["reconciles"] is True
            q = pq.read_table(out / "_quarantine" / "features.parquet").to_pylist()
            assert len(q) == m["rows_quarantined"]
            assert all(x["reason"] and x["detail"] and x["line"] >= 1 for x in q), q
            evq = pq.read_table(out / "_quarantine" / "events.parquet").to_pylist()
            assert all(x["reason"] and x["detail"] for x in evq), evq
            parts = sorted(out.rglob("part-*.parquet"))
            assert sum(pq.read_metadata(p).num_rows for p in parts) == m["rows_out"]
            got[engine] = {k: m[k] for k in ("rows_in", "rows_out", "quarantine_by_reason")}
        assert got["duckdb"] == got["polars"]


@SETTINGS
@given(lines=st.lists(st.binary(max_size=40), max_size=12))
def test_random_bytes(lines):
    _check(lines)


#: events of a known request with any (or no) label and ts
_event = st.fixed_dictionaries(
    {"request_id": st.sampled_from(["r1", 2, "r3"])}, optional={"label": _json, "ts": _json}
)


@SETTINGS
@given(
    values=st.lists(_json, max_size=12),
    events=st.lists(_event | _json, max_size=4),
    max_line_bytes=st.sampled_from([1 << 20, 40]),
)
def test_random_json(values, events, max_line_bytes):
    def text(v) -> bytes:
        return json.dumps(v, allow_nan=True).encode()

    _check(
        [text(v) for v in values], events=[text(e) for e in events], max_line_bytes=max_line_bytes
    )


@SETTINGS
@given(
    lines=st.lists(
        _mutated() | st.sampled_from([json.dumps(r).encode() for r in VALID]), max_size=12
    )
)
def test_mutated_records(lines):
    _check(lines, events=[json.dumps(e).encode() for e in EVENTS])
