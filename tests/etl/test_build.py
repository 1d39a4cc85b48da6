"""`etl build`: validation + quarantine, sessions, labels, clustering, row groups, determinism."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard

from etl import reasons
from etl.build import BuildConfig, build, format_summary
from recpipe.errors import CorruptInputError, DataError
from schemas import default_schema


def build_lenient(features, out_dir, *, config: BuildConfig | None = None, **kwargs) -> dict:
    """:func:`etl.build.build` that allows schema features missing from every record: the
    corpora here carry 4 of the bundled schema's 17 features (the check that refuses them by
    default is tested in test_build_features.py)."""
    config = replace(config or BuildConfig(), allow_missing_features=True)
    return build(features, out_dir, config=config, **kwargs)


def _dataset(path: Path):
    files = sorted(path.rglob("part-*.parquet"))
    return pq.ParquetDataset(files).read() if files else None


def _rec(rid, ts, *, session=None, user=None, dense=None, sparse=None, **extra) -> dict:
    r = {"request_id": rid, "ts": ts}
    if session is not None:
        r["session_id"] = session
    if user is not None:
        r["user_id"] = user
    r["dense"] = dense if dense is not None else {"user_age": 30.0, "item_price": 1.5}
    r["sparse"] = sparse if sparse is not None else {"user_liked_items": [1, 2, 3], "item_id": [7]}
    r.update(extra)
    return r


def _write(path: Path, lines: list) -> Path:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    if path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _quarantine(out: Path) -> list[dict]:
    return pq.read_table(out / "_quarantine" / "features.parquet").to_pylist()


def _reconciles(m: dict) -> None:
    assert m["rows_in"] == m["rows_out"] + m["rows_quarantined"] + m["rows_sampled_out"]
    assert m["rows_quarantined"] == sum(m["quarantine_by_reason"].values())
    assert m["reconciles"] is True


GOOD = [_rec(f"g{i}", 1000 + i, session="s1", user=1) for i in range(3)]

BAD_CASES = [
    ('{"request_id": "b1", "ts": 5', reasons.MALFORMED_JSON, "JSON"),
    ('{"request_id": "b1", "ts": 5,}', reasons.MALFORMED_JSON, "trailing comma"),
    (_rec(None, 5), reasons.MISSING_REQUEST_ID, "request_id"),
    ({"ts": 5}, reasons.MISSING_REQUEST_ID, "request_id"),
    ({"request_id": "b1"}, reasons.MISSING_TS, "ts"),
    (_rec("b1", "yesterday"), reasons.WRONG_TYPE, "`ts`"),
    (_rec("b1", 12.5), reasons.WRONG_TYPE, "`ts`"),
    (_rec("b1", 2**62), reasons.TS_OUT_OF_RANGE, "`ts`"),
    (_rec("b1", 5, dense={"user_age": "old"}), reasons.WRONG_TYPE, "dense.user_age"),
    (_rec("b1", 5, sparse={"item_id": ["abc"]}), reasons.WRONG_TYPE, "sparse.item_id"),
    (_rec("b1", 5, sparse={"item_id": [1.5]}), reasons.WRONG_TYPE, "sparse.item_id"),
    (_rec("b1", 5, sparse={"item_id": 7}), reasons.WRONG_TYPE, "sparse.item_id"),
    (_rec("b1", 5, dense=[1.0]), reasons.WRONG_TYPE, "dense"),
    (
        '{"request_id": "b1", "ts": 5, "dense": {"item_price": NaN}}',
        reasons.NON_FINITE,
        "dense.item_price",
    ),
    (
        '{"request_id": "b1", "ts": 5, "dense": {"item_price": -Infinity}}',
        reasons.NON_FINITE,
        "item_price",
    ),
    (_rec("b1", 5, dense={"item_price": 1e300}), reasons.NON_FINITE, "item_price"),
    (_rec("b1", 5, sparse={"item_id": [2**63]}), reasons.ID_OUT_OF_RANGE, "sparse.item_id"),
    (_rec("b1", 5, sparse={"item_id": [10**20]}), reasons.ID_OUT_OF_RANGE, "sparse.item_id"),
    (_rec("b1", 5, sparse={"item_tags": list(range(9))}), reasons.LIST_TOO_LONG, "item_tags"),
]


@pytest.mark.parametrize(("line", "reason", "field"), BAD_CASES)
def test_each_bad_kind_is_quarantined_with_its_reason(tmp_path, line, reason, field):
    src = _write(tmp_path / "f.jsonl", [*GOOD, line])
    m = build_lenient(src, tmp_path / "out")
    _reconciles(m)
    assert m["rows_in"] == 4 and m["rows_out"] == 3
    assert m["quarantine_by_reason"][reason] == 1
    (q,) = _quarantine(tmp_path / "out")
    assert q["reason"] == reason
    assert field in q["detail"]
    assert q["line"] == 4
    assert q["source"] == str(src)
    assert q["raw"] == (line if isinstance(line, str) else json.dumps(line))


def test_duplicate_request_id_keeps_the_first_in_file_order(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_rec("r1", 10, session="s"), _rec("r2", 11, session="s")])
    b = _write(tmp_path / "b.jsonl.zst", [_rec("r1", 5, session="t"), _rec("r3", 12, session="s")])
    m = build_lenient([a, b], tmp_path / "out")
    _reconciles(m)
    assert m["quarantine_by_reason"][reasons.DUPLICATE_REQUEST_ID] == 1
    (q,) = _quarantine(tmp_path / "out")
    assert (q["source"], q["line"], q["reason"]) == (str(b), 1, reasons.DUPLICATE_REQUEST_ID)
    assert q["raw"] == json.dumps(_rec("r1", 5, session="t"))
    assert "a.jsonl:1" in q["detail"]
    assert _dataset(tmp_path / "out").column("ts").to_pylist() == [10, 11, 12]


def test_lenient_but_valid_records_are_accepted(tmp_path):
    lines = [
        _rec("a", 1, session="s", dense={"user_age": None}, sparse={"item_id": None}),
        _rec(7, 2, session=3, user="u-1"),  # integer ids, string user id
        '{"request_id": "b", "ts": 3, "session_id": "s", "dense": {"user_age": 1}, "sparse": {}}',
        {"request_id": "c", "ts": 4, "session_id": "s"},  # no feature maps at all
        _rec("d", 5, session="s", sparse={"user_liked_items": list(range(80))}),  # truncated
        _rec("e", 6, session="s", dense={"mystery": 1.0}, sparse={"unknown_list": [1]}),
    ]
    m = build_lenient(_write(tmp_path / "f.jsonl", lines), tmp_path / "out")
    _reconciles(m)
    assert m["rows_quarantined"] == 0, _quarantine(tmp_path / "out")
    assert m["unknown_features"] == {"dense.mystery": 1, "sparse.unknown_list": 1}
    t = _dataset(tmp_path / "out").to_pylist()
    by_ts = {r["ts"]: r for r in t}
    assert by_ts[1]["user_age"] == 0.0 and by_ts[1]["item_id"] == []
    assert by_ts[3]["user_age"] == 1.0
    assert by_ts[4]["user_liked_items"] == [] and by_ts[4]["item_price"] == 0.0
    assert by_ts[5]["user_liked_items"] == list(range(30, 80))  # keeps the last max_len=50


#: events of requests r0..r3: labels 1, 0, 1 and none; one of an unknown request, two bad ones
LABEL_EVENTS = [
    {"request_id": "r0", "ts": 9, "label": 0},
    {"request_id": "r0", "ts": 9, "label": 1},
    {"request_id": "r1", "ts": 9, "label": 0},
    {"request_id": "r2", "label": True},
    {"request_id": "nope", "ts": 9, "label": 1},
    '{"request_id": "r3", "label": 1',
    {"request_id": "r3", "label": "yes"},
]


def test_labels_are_the_max_event_and_bad_events_are_quarantined(tmp_path):
    feats = _write(tmp_path / "f.jsonl", [_rec(f"r{i}", i, session="s") for i in range(4)])
    evs = _write(tmp_path / "e.jsonl", LABEL_EVENTS)
    m = build_lenient(feats, tmp_path / "out", events=evs)
    assert _dataset(tmp_path / "out").column("label").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    assert m["events_in"] == 7 and m["events_quarantined"] == 2
    assert m["events_quarantine_by_reason"][reasons.MALFORMED_JSON] == 1
    assert m["events_quarantine_by_reason"][reasons.WRONG_TYPE] == 1
    assert m["events_unknown_request"] == 1
    assert m["rows_without_event"] == 1
    q = pq.read_table(tmp_path / "out" / "_quarantine" / "events.parquet").to_pylist()
    assert [(x["line"], x["reason"]) for x in q] == [(6, "malformed_json"), (7, "wrong_type")]


def test_sessions_from_user_and_gap_when_no_session_id(tmp_path):
    gap = 30 * 60 * 1000
    lines = [
        _rec("a", 1_000, user=1),
        _rec("b", 1_000 + gap, user=1),  # exactly the gap: same session
        _rec("c", 2_000 + 2 * gap + 5, user=1),  # new session
        _rec("d", 1_500, user=2),
        _rec("e", 1_200),  # no session, no user: a session of its own
    ]
    m = build_lenient(_write(tmp_path / "f.jsonl", lines), tmp_path / "out")
    assert m["sessions"] == 4
    t = _dataset(tmp_path / "out")
    pairs = list(zip(t.column("session_id").to_pylist(), t.column("ts").to_pylist()))
    # ids rank sessions by first ts: user 1 (1000), alone (1200), user 2 (1500), user 1 again
    assert pairs == [(0, 1_000), (0, 1_000 + gap), (1, 1_200), (2, 1_500), (3, 2_000 + 2 * gap + 5)]


def test_clustered_sorted_and_row_groups_never_split_a_session(tmp_path):
    import random

    rnd = random.Random(0)
    lines = []
    for s in range(60):
        start = rnd.randrange(0, 10_000)
        lines += [
            _rec(f"r{s}-{k}", start + rnd.randrange(0, 500), session=f"s{s}")
            for k in range(rnd.randrange(1, 30))
        ]
    rnd.shuffle(lines)
    src = _write(tmp_path / "f.jsonl.zst", lines)
    m = build_lenient(src, tmp_path / "out", config=BuildConfig(row_group_size=50))
    t = _dataset(tmp_path / "out")
    sid, ts = t.column("session_id").to_pylist(), t.column("ts").to_pylist()
    assert sid == sorted(sid) and m["sessions"] == 60
    firsts = {}
    for s, x in zip(sid, ts):
        firsts.setdefault(s, x)
    assert list(firsts.values()) == sorted(firsts.values())  # sessions by first ts
    for a, b, x, y in zip(sid, sid[1:], ts, ts[1:]):
        assert a != b or x <= y
    assert t.schema == default_schema().dataset_arrow_schema()
    pf = pq.ParquetFile(sorted((tmp_path / "out").glob("part-*.parquet"))[0])
    seen = set()
    for g in range(pf.num_row_groups):
        ids = pf.read_row_group(g, columns=["session_id"]).column(0).to_pylist()
        assert len(ids) <= 50 or len(set(ids)) == 1
        assert not (set(ids) & seen) or (len(set(ids)) == 1)
        seen |= set(ids[:-1]) if len(ids) > 50 else set(ids)
    assert m["row_groups"] == pf.num_row_groups > 1
    md = pf.metadata.row_group(0).column(0)
    assert md.compression == "ZSTD"


def test_time_order_baseline_and_sampling(tmp_path):
    lines = [_rec(f"r{i}", (i * 37) % 101, session=f"s{i % 7}") for i in range(100)]
    src = _write(tmp_path / "f.jsonl", lines)
    m = build_lenient(src, tmp_path / "t", config=BuildConfig(order="time"))
    ts = _dataset(tmp_path / "t").column("ts").to_pylist()
    assert ts == sorted(ts) and m["order"] == "time"
    a = build_lenient(src, tmp_path / "a", config=BuildConfig(sample_sessions=0.5, seed=3))
    build_lenient(src, tmp_path / "b", config=BuildConfig(sample_sessions=0.5, seed=3))
    _reconciles(a)
    assert 0 < a["sessions"] < 7 and a["rows_sampled_out"] > 0
    assert _dataset(tmp_path / "a").equals(_dataset(tmp_path / "b"))


def _straddling_sessions() -> list[dict]:
    """Sessions of 1 to 40 rows over three hours, interleaved in time; one runs all along."""
    hour = 3_600_000
    lines = [_rec(f"long-{k}", k * hour // 14, session="long") for k in range(40)]
    for s in range(15):
        start = (s * 2 * hour) // 15
        lines += [
            _rec(f"r{s}-{k}", start + k * 90_000, session=f"s{s}") for k in range(1 + s * 7 % 23)
        ]
    return lines


@pytest.mark.parametrize(
    ("order", "partition_by", "max_file_bytes"),
    [
        ("session", "none", 1),  # a file per row group: sessions cut at file boundaries
        ("session", "hour", 1),
        ("time", "hour", 256 << 20),  # sessions cut at hour-partition boundaries
        ("time", "none", 1),
    ],
)
def test_file_session_counts_match_the_files(tmp_path, order, partition_by, max_file_bytes):
    src = _write(tmp_path / "f.jsonl", _straddling_sessions())
    cfg = BuildConfig(
        order=order, partition_by=partition_by, max_file_bytes=max_file_bytes, row_group_size=8
    )
    m = build_lenient(src, tmp_path / "out", config=cfg)
    ids = [
        set(pq.read_table(tmp_path / "out" / f["path"]).column("session_id").to_pylist())
        for f in m["files"]
    ]
    files_of: dict[int, int] = {}
    for got in ids:
        for sid in got:
            files_of[sid] = files_of.get(sid, 0) + 1
    assert [f["sessions"] for f in m["files"]] == [len(got) for got in ids]
    assert m["sessions"] == len(files_of) == 16
    assert m["sessions_split_across_files"] == sum(n > 1 for n in files_of.values()) > 0
    assert m["session_continuations"] == sum(n - 1 for n in files_of.values())
    assert sum(f["sessions"] for f in m["files"]) == m["sessions"] + m["session_continuations"]
    if order == "session":  # the 40-row session alone fills five row groups, each its own file
        assert max(files_of.values()) == 5
        assert m["session_continuations"] > m["sessions_split_across_files"]
    if partition_by == "hour":  # by the session's first hour, or by the row's hour
        parts: dict[int, set[str]] = {}
        for f, got in zip(m["files"], ids):
            for sid in got:
                parts.setdefault(sid, set()).add(f["path"].split("/")[0])
        straddling = sum(len(p) > 1 for p in parts.values())
        assert straddling == 0 if order == "session" else straddling > 0
    _reconciles(m)


def test_same_inputs_give_byte_identical_parquet_and_atomic_overwrite(tmp_path):
    lines = [_rec(f"r{i}", 1000 + i, session=f"s{i % 5}", user=i % 3) for i in range(200)]
    src = _write(tmp_path / "f.jsonl.zst", lines)
    build_lenient(src, tmp_path / "a", config=BuildConfig(row_group_size=16))
    build_lenient(src, tmp_path / "b", config=BuildConfig(row_group_size=16))
    pa_ = sorted(p.name for p in (tmp_path / "a").glob("part-*.parquet"))
    assert pa_ == sorted(p.name for p in (tmp_path / "b").glob("part-*.parquet"))
    for name in pa_:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(DataError, match="already exists"):
        build_lenient(src, tmp_path / "a")
    m = build_lenient(src, tmp_path / "a", overwrite=True, config=BuildConfig(partition_by="hour"))
    assert [f["path"] for f in m["files"]] == ["dt=1970-01-01-00/part-00000.parquet"]
    assert not list(tmp_path.glob(".a.*"))
    manifest = json.loads((tmp_path / "a" / "_manifest.json").read_text())
    assert manifest["inputs"][0]["sha256"] and manifest["parquet"]["compression"] == "zstd"


def corrupt_inputs() -> dict[str, bytes]:
    """Input files every engine must refuse with an error naming the file, by name."""
    text = "\n".join(json.dumps(_rec(f"r{i}", i, session="s")) for i in range(3000)) + "\n"
    blob = zstandard.ZstdCompressor().compress(text.encode())
    return {
        "trunc.jsonl.zst": blob[: len(blob) // 2],
        "garbage.jsonl.zst": b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 4,
        "binary.jsonl": b"\x00\xff\xfe binary \x80\x81\n" * 10,
        # past the first batch the lines stream through pyarrow, whose error is an OSError
        "late_binary.jsonl": text.encode() * 2 + b"\xc3(\n",
        "fake.parquet": b"this is not parquet at all",
        "renamed.jsonl.zst": text.encode(),
    }


def test_corrupt_inputs_raise_errors_naming_the_file(tmp_path):
    for name, data in corrupt_inputs().items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(CorruptInputError, match=name):
            build_lenient(p, tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists()
        assert not list(tmp_path.glob(f".out-{name}*"))


def test_parquet_input_and_config_errors(tmp_path):
    import pyarrow as pa

    rows = [_rec(f"r{i}", i, session="s") for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "f.parquet")
    m = build_lenient(tmp_path / "f.parquet", tmp_path / "out")
    assert m["rows_out"] == 5 and m["rows_quarantined"] == 0
    assert "rows out" in format_summary(m)
    with pytest.raises(DataError, match="`sample_sessions`"):
        BuildConfig(sample_sessions=0)
    with pytest.raises(DataError, match="`memory_limit`"):
        BuildConfig(memory_limit="lots")
    with pytest.raises(DataError, match="does not exist"):
        build_lenient(tmp_path / "missing.jsonl", tmp_path / "o2")


def test_empty_input_and_mistyped_parquet_column(tmp_path):
    import pyarrow as pa

    (tmp_path / "empty.jsonl").write_bytes(b"")
    m = build_lenient(tmp_path / "empty.jsonl", tmp_path / "out")
    assert m["rows_in"] == m["rows_out"] == 0 and m["compression_ratio"] is None
    assert "Parquet = n/a" in format_summary(m)
    pq.write_table(pa.table({"request_id": ["a"], "ts": ["noon"]}), tmp_path / "t.parquet")
    m = build_lenient(tmp_path / "t.parquet", tmp_path / "out2")
    assert m["quarantine_by_reason"][reasons.WRONG_TYPE] == 1
    (bad,) = _quarantine(tmp_path / "out2")
    assert bad["source"].endswith("t.parquet") and bad["line"] == 1
    assert bad["detail"].startswith("field `ts`: expected an int64")


def test_synth_logs_reconcile_with_the_injected_bad_records(synth_logs, tmp_path):
    m = build_lenient(synth_logs.features, tmp_path / "out", events=synth_logs.events)
    _reconciles(m)
    assert m["rows_in"] == synth_logs.num_requests
    for reason, n in synth_logs.num_bad.items():
        assert m["quarantine_by_reason"][reason] == n, reason
    assert m["events_quarantined"] == sum(synth_logs.summary["num_bad_events"].values())
    assert m["sessions"] == synth_logs.summary["num_sessions"]
    # each phase's wall and CPU seconds, side by side (where a core idles)
    assert list(m["phase_cpu_s"]) == list(m["phase_s"]) == [
        "setup", "parse", "dedup_join_sessionize", "quarantine", "write"
    ]  # fmt: skip
    assert m["phase_cpu_s"]["parse"] > 0 and m["phase_cpu_s"]["write"] > 0


def test_unroutable_lines_of_etl_shard_are_validated_with_their_origin(tmp_path):
    from etl.rawio import UNROUTABLE_NAME, unroutable_record

    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "shard-00000.jsonl", [_rec("a", 1, session="s")])
    rows = [
        unroutable_record("raw/f.jsonl", 7, "malformed_json", b'{"request_id": "x"'),
        unroutable_record("raw/f.jsonl", 9, "no_key", json.dumps(_rec("b", 2)).encode()),
    ]
    (shards / UNROUTABLE_NAME).write_bytes(
        zstandard.ZstdCompressor().compress(b"\n".join(rows) + b"\n")
    )
    m = build_lenient(shards, tmp_path / "out")
    _reconciles(m)
    assert (m["rows_in"], m["rows_out"], m["rows_quarantined"]) == (3, 2, 1)
    (q,) = _quarantine(tmp_path / "out")
    assert (q["source"], q["line"], q["reason"]) == ("raw/f.jsonl", 7, reasons.MALFORMED_JSON)


def test_cli_builds_and_prints_a_summary(tmp_path, capsys):
    from recpipe_cli import main

    src = _write(tmp_path / "f.jsonl", [*GOOD, "oops"])
    out = tmp_path / "out"
    args = ["etl", "build", str(src), "--out", str(out), "--no-progress"]
    assert main([*args, "--session-gap", "10m", "--allow-missing-features"]) == 0
    text = capsys.readouterr().out
    assert "rows in" in text and "malformed_json" in text
    assert main(["etl", "build", str(src), "--out", str(out), "--no-progress"]) == 1
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["etl", "build", "--help"])
    assert "session" in capsys.readouterr().out


@pytest.mark.parametrize("order", ["session", "time"])
def test_sorting_in_key_ranges_gives_the_same_files(tmp_path, monkeypatch, order):
    from etl.build import engine_duckdb

    lines = [_rec(f"r{i}", (i * 7919) % 613, session=f"s{i % 41}") for i in range(600)]
    src = _write(tmp_path / "f.jsonl", lines)
    cfg = BuildConfig(order=order, memory_limit="1GB", row_group_size=64)
    build_lenient(src, tmp_path / "whole", config=BuildConfig(order=order, row_group_size=64))
    monkeypatch.setattr(engine_duckdb, "rows_per_sort_chunk", lambda config: 50)
    m = build_lenient(src, tmp_path / "ranges", config=cfg)
    assert m["rows_out"] == 600
    for f in m["files"]:
        assert (tmp_path / "whole" / f["path"]).read_bytes() == (
            tmp_path / "ranges" / f["path"]
        ).read_bytes()
