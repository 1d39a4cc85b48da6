"""Bring your own logs: hand-written log sets in each layout of docs/data-contract.md, taken
through `etl shard` + `etl build` (as `make etl` runs them) and a short `recpipe train`; and
`etl validate` on planted mistakes, each flagged with its fix.

The logs here are written from docs/data-contract.md alone (not from `recpipe synth`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from etl.validate_logs import validate_logs
from recpipe_cli import main
from schemas import load_schema

T0 = 1_700_000_000_000  # epoch milliseconds
USERS, SESSIONS_PER_USER, REQUESTS_PER_SESSION = 12, 4, 10

FEATURES = """
[[dense]]
name = "user_age"
[[dense]]
name = "item_price"

[[sparse]]
name = "user_clicks"
kind = "user"
max_len = 5
[[sparse]]
name = "item_id"
kind = "item"
max_len = 1
"""

NESTED = (
    """
[dataset]
name = "shop"
passthrough = ["country"]
"""
    + FEATURES
)

FLAT_RENAMED = (
    """
[dataset]
name = "shop_flat"
layout = "flat"
session_key = "sid"
user_key = "uid"
time_key = "t_ms"
label_key = "clicked"
passthrough = ["country"]

[keys]
request_id = "req"
user_age = "age"
item_id = "item"
"""
    + FEATURES
)


def _requests():
    """(request, session, user, ts, age, price, clicks, item, label) of the log set (the
    user's country is ``country(user)``)."""
    out = []
    for u in range(USERS):
        for s in range(SESSIONS_PER_USER):
            sid = f"u{u}-s{s}"
            start = T0 + (u * SESSIONS_PER_USER + s) * 3_600_000
            for r in range(REQUESTS_PER_SESSION):
                rid = f"{sid}-r{r}"
                item = (u * 7 + s * 3 + r) % 50
                out.append(
                    (rid, sid, u, start + r * 1000, 20.0 + u, 1.5 * item,
                     [u, u + 100, s], item, int((item + u) % 3 == 0))
                )  # fmt: skip
    return out


def country(user: int) -> str | None:
    """The pass-through value of a user: a string, or absent for every fifth user."""
    return None if user % 5 == 4 else f"c{user % 3}"


def _with_country(rec: dict, user: int) -> dict:
    return rec if country(user) is None else rec | {"country": country(user)}


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _nested_logs(root: Path) -> tuple[Path, Path]:
    feats, events = [], []
    for rid, sid, uid, ts, age, price, clicks, item, label in _requests():
        feats.append(_with_country(
            {"request_id": rid, "session_id": sid, "user_id": uid, "ts": ts,
             "dense": {"user_age": age, "item_price": price},
             "sparse": {"user_clicks": clicks, "item_id": [item]}}, uid,
        ))  # fmt: skip
        events.append({"request_id": rid, "ts": ts + 500, "label": label})
    _write_jsonl(root / "features" / "a.jsonl", feats[::2])
    _write_jsonl(root / "features" / "b.jsonl", feats[1::2])
    _write_jsonl(root / "events" / "e.jsonl", events)
    return root / "features", root / "events"


def _flat_logs(root: Path) -> tuple[Path, Path]:
    feats, events = [], []
    for rid, sid, uid, ts, age, price, clicks, item, label in _requests():
        feats.append(_with_country(
            {"req": rid, "sid": sid, "uid": uid, "t_ms": ts, "age": age,
             "item_price": price, "user_clicks": clicks, "item": [item]}, uid,
        ))  # fmt: skip
        events.append({"req": rid, "t_ms": ts + 500, "clicked": bool(label)})
    _write_jsonl(root / "features" / "a.jsonl", feats)
    _write_jsonl(root / "events" / "e.jsonl", events)
    return root / "features", root / "events"


def _parquet_logs(root: Path) -> tuple[Path, Path]:
    rows = _requests()
    dense = pa.StructArray.from_arrays(
        [pa.array([r[4] for r in rows]), pa.array([r[5] for r in rows])],
        names=["user_age", "item_price"],
    )
    sparse = pa.StructArray.from_arrays(
        [pa.array([r[6] for r in rows], pa.list_(pa.int64())),
         pa.array([[r[7]] for r in rows], pa.list_(pa.int64()))],
        names=["user_clicks", "item_id"],
    )  # fmt: skip
    feats = pa.table(
        {
            "request_id": [r[0] for r in rows],
            "session_id": [r[1] for r in rows],
            "user_id": pa.array([r[2] for r in rows], pa.int64()),
            "ts": pa.array([r[3] for r in rows], pa.int64()),
            "dense": dense,
            "sparse": sparse,
            "country": pa.array([country(r[2]) for r in rows], pa.string()),
        }
    )
    events = pa.table(
        {
            "request_id": [r[0] for r in rows],
            "ts": pa.array([r[3] + 500 for r in rows], pa.int64()),
            "label": pa.array([float(r[8]) for r in rows], pa.float32()),
        }
    )
    (root / "features").mkdir(parents=True)
    (root / "events").mkdir(parents=True)
    half = feats.num_rows // 2
    pq.write_table(feats.slice(0, half), root / "features" / "a.parquet")
    pq.write_table(feats.slice(half), root / "features" / "b.parquet")
    pq.write_table(events, root / "events" / "e.parquet")
    return root / "features", root / "events"


LAYOUTS = {
    "nested": (NESTED, _nested_logs),
    "flat_renamed": (FLAT_RENAMED, _flat_logs),
    "parquet": (NESTED, _parquet_logs),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_own_logs_through_etl_and_train(layout, tmp_path, capsys):
    text, write = LAYOUTS[layout]
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(text)
    schema = load_schema(schema_path)
    feats, events = write(tmp_path / "raw")
    report = validate_logs(feats, schema=schema)
    assert report.ok and not report.quarantined, report.findings
    assert not [f for f in report.findings if f.kind != "unknown_key"], report.findings

    shards, dataset = tmp_path / "shards", tmp_path / "dataset"
    s = ["--schema", str(schema_path)]
    # what `make etl INPUT=... EVENTS=... SCHEMA=...` runs
    assert main(["etl", "shard", str(feats), "--out", str(shards), "--num-shards", "2", *s]) == 0
    assert main(["etl", "build", str(shards), "--events", str(events), "--out", str(dataset),
                 "--no-progress", *s]) == 0  # fmt: skip
    manifest = json.loads((dataset / "_manifest.json").read_text())
    n = USERS * SESSIONS_PER_USER * REQUESTS_PER_SESSION
    assert manifest["rows_out"] == n and manifest["rows_quarantined"] == 0
    assert manifest["sessions"] == USERS * SESSIONS_PER_USER
    assert manifest["features_missing"] == {}
    # a small dataset still gets 8 row groups (splits), cut at session boundaries
    assert manifest["parquet"]["row_group_size"] == 64  # ceil(480 / 8) = 60, at least 64
    assert manifest["row_groups"] >= 7

    table = pq.read_table(sorted(dataset.glob("part-*.parquet")))
    truth = {r[0]: r for r in _requests()}
    sk, tk, lk = schema.session_key, schema.time_key, schema.label_key
    assert table.schema == schema.dataset_arrow_schema()
    for row in table.to_pylist():
        _, sid, uid, ts, age, price, clicks, item, label = truth[row["request_id"]]
        assert row["session_id_raw"] == sid and row["user_id"] == str(uid)
        assert row["country"] == country(uid)
        assert row[tk] == ts and row[lk] == label
        assert row["user_age"] == age and row["item_price"] == pytest.approx(price)
        assert row["user_clicks"] == clicks and row["item_id"] == [item]
    # one int64 session id per raw session id
    pairs = set(zip(table.column(sk).to_pylist(), table.column("session_id_raw").to_pylist()))
    assert len(pairs) == len({p[0] for p in pairs}) == len({p[1] for p in pairs})

    capsys.readouterr()
    args = ["train", str(dataset), "--steps", "3", "--batch-size", "32", "--embedding-dim", "4",
            "--num-embeddings", "200", "--eval-batches", "1", "--no-progress", "--dedup", "on",
            "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
    assert main(args) == 0
    assert "recpipe train: done" in capsys.readouterr().out


def _good(i: int) -> dict:
    return {
        "request_id": f"r{i}", "session_id": f"s{i // 5}", "user_id": i // 10,
        "ts": T0 + i * 1000,
        "dense": {"user_age": 30.0, "item_price": 2.5},
        "sparse": {"user_clicks": [1, 2], "item_id": [i]},
    }  # fmt: skip


def _planted(tmp_path: Path, name: str, change) -> Path:
    records = []
    for i in range(40):
        rec = _good(i)
        change(rec)
        records.append(rec)
    return _write_jsonl(tmp_path / f"{name}.jsonl", records)


def _seconds(rec: dict) -> None:
    rec["ts"] //= 1000


def _missing(rec: dict) -> None:
    rec["dense"]["usr_age"] = rec["dense"].pop("user_age")


def _string_ids(rec: dict) -> None:
    rec["sparse"]["item_id"] = [str(i) for i in rec["sparse"]["item_id"]]


def _flat(rec: dict) -> None:
    rec.update(rec.pop("dense"))
    rec.update(rec.pop("sparse"))


PLANTED = {
    # name: (change, finding kind, severity, field, words of the fix)
    "seconds": (_seconds, "ts_unit", "error", "ts", 'time_unit = "s"'),
    "missing": (_missing, "missing_feature", "error", "dense.user_age", 'user_age = "usr_age"'),
    "string_ids": (_string_ids, "string_ids", "warning", "sparse.item_id", "JSON integers"),
    "flat": (_flat, "layout", "error", "dense/sparse", 'layout = "flat"'),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_validate_flags_each_planted_mistake(name, tmp_path, capsys):
    change, kind, severity, field, fix = PLANTED[name]
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(NESTED)
    path = _planted(tmp_path, name, change)
    report = validate_logs(path, schema=load_schema(schema_path))
    hits = [f for f in report.findings if f.kind == kind]
    assert len(hits) == 1, report.findings
    hit = hits[0]
    assert hit.severity == severity and hit.field == field and fix in hit.fix
    assert hit.example == f"{path}:1" and hit.count == 40
    # the CLI prints the finding with file, line and field, and exits 1 on what the build refuses
    # (string ids: every record quarantined)
    code = main(["etl", "validate", str(path), "--schema", str(schema_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"at {path}:1 field `{field}`" in out and fix in out


def test_validate_passes_clean_logs_and_names_lines_the_build_quarantines(tmp_path, capsys):
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(NESTED)
    records = [_good(i) for i in range(30)]
    records[6]["dense"]["item_price"] = "cheap"
    path = _write_jsonl(tmp_path / "logs.jsonl", records)
    with path.open("a") as fh:
        fh.write('{"request_id": "r99", "ts": \n')
    report = validate_logs(path, schema=load_schema(schema_path))
    assert report.ok and report.quarantined == {"wrong_type": 1, "malformed_json": 1}
    where = {f.example: f for f in report.findings if f.kind == "quarantine"}
    assert where[f"{path}:7"].field == "dense.item_price"
    assert f"{path}:31" in where
    assert main(["etl", "validate", str(path), "--schema", str(schema_path)]) == 0
    assert main(["etl", "validate", str(path), "--schema", str(schema_path), "--strict"]) == 1


def test_validate_session_key_that_never_repeats(tmp_path):
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(NESTED)
    records = [_good(i) | {"session_id": f"unique-{i}"} for i in range(30)]
    path = _write_jsonl(tmp_path / "logs.jsonl", records)
    report = validate_logs(path, schema=load_schema(schema_path))
    (hit,) = [f for f in report.findings if f.kind == "session_key"]
    assert hit.field == "session_id" and "session_key" in hit.fix and report.ok


def _build(logs: Path, events: Path, out: Path, schema_path: Path, *extra: str) -> dict:
    args = ["etl", "build", str(logs), "--events", str(events), "--out", str(out),
            "--schema", str(schema_path), "--no-progress", *extra]  # fmt: skip
    assert main(args) == 0
    return json.loads((out / "_manifest.json").read_text())


def test_row_groups_sized_for_small_datasets_and_flat_logs_on_both_engines(tmp_path):
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(FLAT_RENAMED)
    feats, events = _flat_logs(tmp_path / "raw")
    n = USERS * SESSIONS_PER_USER * REQUESTS_PER_SESSION  # 480 rows
    auto = _build(feats, events, tmp_path / "auto", schema_path, "--min-row-groups", "4")
    assert auto["parquet"]["row_group_size"] == n // 4 and auto["row_groups"] >= 4
    assert auto["parquet"]["row_group_size_max"] == 65_536
    fixed = _build(feats, events, tmp_path / "fixed", schema_path, "--min-row-groups", "1")
    assert fixed["parquet"]["row_group_size"] == n and fixed["row_groups"] == 1
    # never above the configured maximum
    small = _build(feats, events, tmp_path / "small", schema_path, "--row-group-size", "50")
    assert small["parquet"]["row_group_size"] == 50 and small["row_groups"] >= 9
    # the Polars engine reads the flat, renamed logs into the same bytes
    polars = _build(feats, events, tmp_path / "polars", schema_path, "--min-row-groups", "4",
                    "--engine", "polars")  # fmt: skip
    assert [f["sha256"] for f in polars["files"]] == [f["sha256"] for f in auto["files"]]


def test_flat_layout_quarantines_with_file_line_and_field(tmp_path):
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(FLAT_RENAMED)
    feats, events = _flat_logs(tmp_path / "raw")
    path = feats / "a.jsonl"
    lines = path.read_text().splitlines()
    bad = json.loads(lines[4])
    bad["age"] = "old"
    lines[4] = json.dumps(bad)
    lines[9] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    _build(feats, events, tmp_path / "ds", schema_path)
    q = pq.read_table(tmp_path / "ds" / "_quarantine" / "features.parquet").to_pylist()
    got = {(Path(r["source"]).name, r["line"], r["reason"]) for r in q}
    assert got == {("a.jsonl", 5, "wrong_type"), ("a.jsonl", 10, "malformed_json")}
    detail = next(r["detail"] for r in q if r["reason"] == "wrong_type")
    assert "dense.user_age" in detail and "old" in detail


def test_passthrough_values_of_every_json_type_on_both_engines(tmp_path):
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(NESTED)
    values = ["de", 7, {"a": [1, "b"]}, None, 'q"uote', 1.5, True, "ü"]
    records = []
    for i in range(40):
        rec = _good(i)
        if i % 9 != 8:  # absent from some records
            rec["country"] = values[i % len(values)]
        records.append(rec)
    feats = _write_jsonl(tmp_path / "f" / "a.jsonl", records)
    events = _write_jsonl(tmp_path / "e" / "e.jsonl", [{"request_id": "r0", "label": 1}])
    duck = _build(feats, events, tmp_path / "duck", schema_path)
    polars = _build(feats, events, tmp_path / "polars", schema_path, "--engine", "polars")
    assert [f["sha256"] for f in polars["files"]] == [f["sha256"] for f in duck["files"]]
    assert duck["unknown_keys"] == {}
    got = pq.read_table(sorted((tmp_path / "duck").glob("part-*.parquet")))
    by_request = dict(zip(got.column("request_id").to_pylist(), got.column("country").to_pylist()))
    for i, rec in enumerate(records):
        v = rec.get("country")
        want = v if isinstance(v, str) or v is None else json.dumps(v, separators=(",", ":"))
        assert by_request[f"r{i}"] == want, (i, v)
