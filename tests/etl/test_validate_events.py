"""Feature and event logs side by side (issue 32, item 3): `etl validate --events`, event
records among the feature logs found by `validate` and refused by `shard`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from etl.shard import ShardConfig, shard
from etl.validate_logs import validate_logs
from recpipe.errors import DataError
from schemas import load_schema

T0 = 1_700_000_000_000
SCHEMA = """
[dataset]
name = "small"

[[dense]]
name = "user_age"

[[dense]]
name = "item_price"

[[sparse]]
name = "item_id"
kind = "item"
max_len = 1

[[sparse]]
name = "user_liked_items"
kind = "user"
max_len = 50
"""


def _feature(i: int) -> dict:
    return {
        "request_id": f"r-{i}",
        "session_id": f"s-{i // 5}",
        "user_id": i // 5,
        "ts": T0 + 1000 * i,
        "dense": {"user_age": 31.0, "item_price": 3.0},
        "sparse": {"item_id": [i], "user_liked_items": [1, 2]},
    }


def _event(i: int) -> dict:  # the contract's event line, a user key too (routable)
    return {"request_id": f"r-{i}", "user_id": i // 5, "ts": T0 + 1000 * i + 7, "label": i % 2}


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def schema(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(SCHEMA)
    return load_schema(path)


@pytest.fixture
def logs(tmp_path) -> Path:
    """A natural layout: logs/features/*.jsonl and logs/events/*.jsonl in one folder."""
    root = tmp_path / "logs"
    _write(root / "features" / "part-0.jsonl", [_feature(i) for i in range(40)])
    _write(root / "events" / "part-0.jsonl", [_event(i) for i in range(0, 40, 2)])
    return root


def test_event_shape(schema):
    from etl.shard import event_shaped

    assert event_shaped(_event(1), schema)
    assert event_shaped({"request_id": 1, "label": True}, schema)  # ts is optional
    assert not event_shaped(_feature(1), schema)
    assert not event_shaped({**_feature(1), "label": 1}, schema)  # features: a feature line
    assert not event_shaped({"request_id": 1, "ts": T0}, schema)  # no label
    assert not event_shaped({"label": 1, "ts": T0}, schema)  # no request id
    assert not event_shaped({"request_id": 1, "label": 1, "user_age": 3.0}, schema)  # flat


def test_validate_reports_event_lines_among_features_as_an_error(logs, schema):
    report = validate_logs(logs, schema=schema)
    assert not report.ok
    (err,) = [f for f in report.findings if f.severity == "error"]
    assert err.kind == "event_lines" and err.count == 20
    assert err.example == f"{logs / 'events' / 'part-0.jsonl'}:1"
    assert "--events" in err.fix
    # the event lines raise no false warnings (missing features, unknown `label`, quarantine)
    assert [f.kind for f in report.findings] == ["event_lines"]
    assert report.quarantined == {}


def test_validate_cli_exits_1_naming_the_event_file(logs, schema, capsys):
    from recpipe_cli import main

    assert main(["etl", "validate", str(logs), "--schema", str(logs.parent / "small.toml")]) == 1
    out = capsys.readouterr().out
    assert "[event_lines]" in out and f"{logs / 'events' / 'part-0.jsonl'}:1" in out
    assert "FAILED" in out


def test_validate_events_checks_each_kind_against_its_contract(logs, schema, capsys):
    from recpipe_cli import main

    events = logs / "events"
    report = validate_logs(
        logs, events=events, schema=schema
    )  # the folder holds both: events read as events
    assert report.ok, report.findings
    assert report.findings == []
    assert report.files == [str(logs / "features" / "part-0.jsonl")]
    assert report.event_files == [str(events / "part-0.jsonl")]
    assert report.event_lines == 20
    assert (
        main(
            [
                "etl",
                "validate",
                str(logs / "features"),
                "--events",
                str(events),
                "--schema",
                str(logs.parent / "small.toml"),
            ]
        )
        == 0
    )
    assert "20 event lines of 1 file(s)" in capsys.readouterr().out

    # an event line the build would quarantine is reported, against the event contract
    bad = _write(events / "part-1.jsonl", [{"request_id": "r-3", "label": "yes"}])
    report = validate_logs(logs / "features", events=events, schema=schema)
    (q,) = report.findings
    assert q.kind == "quarantine" and "wrong_type" in q.message and "event lines" in q.message
    assert q.example == f"{bad}:1"
    assert report.events_quarantined == {"wrong_type": 1}


def test_validate_events_flags_feature_logs_passed_as_events(logs, schema):
    with pytest.raises(DataError, match="also named by `--events`"):
        validate_logs(logs / "features", events=logs / "features" / "part-0.jsonl", schema=schema)
    report = validate_logs(logs / "events", events=logs / "features", schema=schema)
    assert not report.ok
    assert "feature_lines" in {f.kind for f in report.findings}


def test_shard_refuses_event_lines_naming_file_line_and_flag(logs, schema, tmp_path):
    out = tmp_path / "shards"
    with pytest.raises(DataError) as err:
        shard(logs, out, schema=schema, config=ShardConfig(num_shards=2, compare=False))
    msg = str(err.value)
    assert f"{logs / 'events' / 'part-0.jsonl'}: line 1: an event record" in msg
    assert "`etl build --events`" in msg
    assert not out.exists()  # nothing half-written
    # the feature logs alone shard as before
    report = shard(
        logs / "features", out, schema=schema, config=ShardConfig(num_shards=2, compare=False)
    )
    assert report["lines_in"] == 40 and report["lines_unroutable"] == 0


# -- the build's quarantine through shards names the original file and line ----------------


@pytest.fixture
def sharded(tmp_path, schema):
    """Features in two files, sessions interleaved (the shards regroup them); part-1 repeats
    two request ids of part-0 and holds a line that is not JSON."""
    feats = tmp_path / "feats"
    _write(feats / "part-0.jsonl", [_feature(i) for i in range(40)])
    again = [{**_feature(i), "ts": T0 + 99_000 + i} for i in (3, 10)]
    p1 = _write(feats / "part-1.jsonl", [_feature(40 + i) for i in range(9)] + again)
    with p1.open("a") as fh:
        fh.write("oops\n")
    out = tmp_path / "shards"
    shard(feats, out, schema=schema, config=ShardConfig(num_shards=2, compare=False))
    return feats, out


def test_shard_origins_replay_finds_every_line(sharded):
    from etl.rawio import iter_lines
    from etl.shard import shard_origins, shard_path

    _, out = sharded
    lines = {i: list(iter_lines(shard_path(out, i))) for i in range(2)}
    wanted = [(i, n) for i, got in lines.items() for n, _ in got]
    origins = shard_origins(out, wanted)
    assert len(origins) == len(wanted) == 51  # 40 + 11 routed; "oops" is unroutable
    for i, got in lines.items():
        for n, text in got:
            src, line = origins[(i, n)]
            assert dict(iter_lines(src))[line] == text
    assert any(
        origins[(i, n)][0] != origins[(i, n + 1)][0] for i, n in wanted if (i, n + 1) in origins
    )


def test_build_quarantine_through_shards_names_original_file_and_line(sharded, schema, tmp_path):
    import pyarrow.parquet as pq

    from etl.build import BuildConfig, build

    feats, shards = sharded
    out = tmp_path / "ds"
    build(shards, out, schema=schema, config=BuildConfig())
    rows = pq.read_table(out / "_quarantine" / "features.parquet").to_pylist()
    p0, p1 = str(feats / "part-0.jsonl"), str(feats / "part-1.jsonl")
    got = sorted((r["reason"], r["source"], r["line"], r["detail"]) for r in rows)
    assert got == [
        ("duplicate_request_id", p1, 10, f'field `request_id`: "r-3" already seen at {p0}:4'),
        ("duplicate_request_id", p1, 11, f'field `request_id`: "r-10" already seen at {p0}:11'),
        ("malformed_json", p1, 12, got[2][3]),
    ]


def test_build_through_changed_shard_inputs_keeps_the_shard_names(sharded, schema, tmp_path):
    import pyarrow.parquet as pq

    from etl.build import BuildConfig, build

    feats, shards = sharded
    with (feats / "part-1.jsonl").open("a") as fh:  # the shard's inputs are no longer its own
        fh.write("{}\n")
    out = tmp_path / "ds"
    build(shards, out, schema=schema, config=BuildConfig())
    rows = pq.read_table(out / "_quarantine" / "features.parquet").to_pylist()
    dups = [r for r in rows if r["reason"] == "duplicate_request_id"]
    assert len(dups) == 2 and all(r["source"].startswith(str(shards)) for r in dups)


def test_build_of_shards_holding_events_names_the_event_files(logs, schema, tmp_path, monkeypatch):
    """Shards made before `etl shard` refused event records (the issue's 55,375 lines): the
    build still quarantines the events as duplicates, now under their own file and line."""
    import pyarrow.parquet as pq

    import etl.shard
    from etl.build import BuildConfig, build

    monkeypatch.setattr(etl.shard, "event_shaped", lambda rec, schema: False, raising=False)
    shards = tmp_path / "shards"
    shard(logs, shards, schema=schema, config=ShardConfig(num_shards=2, compare=False))
    monkeypatch.undo()
    build(shards, tmp_path / "ds", schema=schema, config=BuildConfig(allow_missing_features=True))
    rows = pq.read_table(tmp_path / "ds" / "_quarantine" / "features.parquet").to_pylist()
    assert len(rows) == 20
    names = {str(logs / "features" / "part-0.jsonl"), str(logs / "events" / "part-0.jsonl")}
    for r in rows:
        assert r["reason"] == "duplicate_request_id" and r["source"] in names
        first = r["detail"].rsplit(" already seen at ", 1)[1].rsplit(":", 1)[0]
        assert first in names and first != r["source"]
