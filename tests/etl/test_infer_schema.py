"""`recpipe etl infer-schema`: a schema guessed from hand-written logs builds and trains as is."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from etl.build import BuildConfig, build
from etl.infer_schema import infer_schema
from recpipe.errors import SchemaError
from schemas import load_schema
from tests.common.cli import one_error_line, run_cli

T0 = 1_700_000_000  # epoch seconds
DEVICES = ("ios", "android", "web")
MODEL = ["--embedding-dim", "4", "--num-embeddings", "200", "--bottom-mlp", "8", "--top-mlp", "8"]


def _logs(root: Path, *, flat: bool = False) -> tuple[Path, Path]:
    """Feature and event logs as a person would write them: string ids everywhere, epoch
    seconds, a segment per user, a history that shifts, an item per request, a device."""
    features, events = [], []
    for u in range(12):
        history = [f"sku-{u}-{k}" for k in range(3)]
        for n in range(10):
            rid = f"req-{u}-{n}"
            item = f"sku-{(u * 7 + n * 3) % 40}"
            dense = {"price": 1.0 + (u + n) % 5, "age": 20.0 + u}
            sparse = {
                "segment": [f"seg-{u % 3}"],
                "recent": list(history),
                "item": [item],
                "device": [DEVICES[n % 3]],
            }
            rec = {"request_id": rid, "user_id": f"u{u}", "ts": T0 + 3600 * u + 60 * n}
            rec.update({**dense, **sparse} if flat else {"dense": dense, "sparse": sparse})
            features.append(rec)
            history = [*history[1:], item]
            if (u + n) % 4 == 0:
                events.append({"request_id": rid, "ts": T0 + 3600 * u + 60 * n + 5, "label": 1})
    f, e = root / "feeds.jsonl", root / "clicks.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in features))
    e.write_text("".join(json.dumps(r) + "\n" for r in events))
    return f, e


@pytest.mark.parametrize(
    ("flat", "parquet"),
    [(False, False), (True, False), (True, True)],
    ids=["nested", "flat", "parquet"],
)
def test_infer_schema_guesses_keys_kinds_units_and_ids(tmp_path, flat, parquet):
    logs, _ = _logs(tmp_path, flat=flat)
    if parquet:
        rows = [json.loads(line) for line in logs.read_text().splitlines()]
        logs = tmp_path / "feeds.parquet"
        pq.write_table(pa.Table.from_pylist(rows), logs)
    schema, text = infer_schema(logs)
    assert schema.name == "feeds" and schema.layout == ("flat" if flat else "nested")
    assert schema.time_unit == "s" and schema.time_key == "ts" and schema.user_key == "user_id"
    assert schema.dense_names == ["price", "age"]
    got = {f.name: (f.kind, f.max_len, f.ids) for f in schema.sparse}
    assert got == {
        "segment": ("user", 1, "hash"),
        "recent": ("user", 3, "hash"),
        "item": ("item", 1, "hash"),
        "device": ("context", 1, "hash"),
    }
    assert text.startswith("# Inferred by `recpipe etl infer-schema`") and "recent: shared" in text
    manifest = build(logs, tmp_path / "ds", schema=schema, config=BuildConfig(engine="duckdb"))
    assert manifest["rows_out"] == 120 and manifest["rows_quarantined"] == 0


def test_infer_schema_max_len_is_a_quantile_and_int_ids_stay_int(tmp_path):
    lines = [
        {
            "request_id": i,
            "session_id": i // 5,
            "ts": 1_700_000_000_000 + i,
            "sparse": {"tags": list(range(i % 4 + 1))},
        }
        for i in range(200)
    ]
    lines[7]["sparse"]["tags"] = list(range(300))  # one outlier: not the length kept
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    schema, _ = infer_schema(path)
    (tags,) = schema.sparse
    assert (tags.max_len, tags.ids) == (4, "int") and schema.time_unit == "ms"
    assert schema.session_key == "session_id"


def test_infer_schema_refuses_nanoseconds_and_logs_without_request_ids(tmp_path):
    path = tmp_path / "ns.jsonl"
    path.write_text(
        json.dumps({"request_id": 1, "ts": 1_700_000_000_000_000_000, "sparse": {"a": [1]}}) + "\n"
    )
    with pytest.raises(SchemaError, match="nanoseconds"):
        infer_schema(path)
    path.write_text(json.dumps({"req": 1, "ts": 5}) + "\n")
    with pytest.raises(SchemaError, match="request_id"):
        infer_schema(path)


def test_infer_schema_cli_keeps_an_existing_out(tmp_path, capsys):
    logs, _ = _logs(tmp_path)
    out = tmp_path / "s.toml"
    out.write_text("mine")
    code, err = run_cli(["etl", "infer-schema", logs, "--out", out], capsys)
    assert code == 1 and out.read_text() == "mine"
    one_error_line(err, "`--out`")
    code, err = run_cli(["etl", "infer-schema", logs, "--out", logs, "--overwrite"], capsys)
    assert code == 1 and "one of the logs read" in err and logs.read_text().startswith("{")
    code, err = run_cli(["etl", "infer-schema", logs, "--out", tmp_path], capsys)
    assert code == 1 and "is a directory" in err
    code, err = run_cli(["etl", "infer-schema", logs, "--out", out, "--overwrite"], capsys)
    assert code == 0 and load_schema(out).time_unit == "s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clicks.jsonl", "feeds.jsonl", "s.toml"]


@pytest.mark.slow  # trains (imports torch)
def test_inferred_schema_builds_and_trains_with_no_hand_edits(tmp_path, capsys):
    logs, events = _logs(tmp_path)
    schema_path, ds = tmp_path / "feeds.toml", tmp_path / "ds"
    code, err = run_cli(["etl", "infer-schema", logs, "--out", schema_path], capsys)
    assert code == 0, err
    schema = load_schema(schema_path)
    assert schema.time_unit == "s" and all(f.ids == "hash" for f in schema.sparse)
    code, err = run_cli(
        ["etl", "build", logs, "--events", events, "--schema", schema_path, "--out", ds], capsys
    )
    assert code == 0, err
    manifest = json.loads((ds / "_manifest.json").read_text())
    assert manifest["rows_out"] == 120 and manifest["rows_quarantined"] == 0
    table = pq.ParquetDataset(sorted(ds.rglob("part-*.parquet"))).read()
    assert min(table.column("ts").to_pylist()) == T0 * 1000  # seconds stored as milliseconds
    assert sum(table.column("label").to_pylist()) == 30
    # users' requests an hour apart, a minute apart within a user: one session per user
    assert len(set(table.column("session_id").to_pylist())) == 12
    code, err = run_cli(
        ["train", ds, "--steps", "3", "--batch-size", "16", "--eval-batches", "1", *MODEL], capsys
    )
    assert code == 0, err
