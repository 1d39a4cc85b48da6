"""What the build reads of each record, said out loud: missing features, unknown keys, no labels.

Regression tests: records with their features at the top level (not under `dense`/`sparse`)
built a dataset of fills with 0 quarantined and nothing counted, a schema feature no record
carried was filled without a word, and a build without events made every label 0 silently.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
import pytest

from etl.build import BuildConfig, build, format_summary
from recpipe.errors import DataError
from schemas import default_schema, parse_schema

SCHEMA = parse_schema(
    """
[dataset]
name = "features"
[[dense]]
name = "user_age"
fill = -1.0
[[dense]]
name = "item_price"
[[sparse]]
name = "item_id"
kind = "item"
max_len = 8
"""
)


def _write(path, records) -> object:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _nested(i: int, **drop) -> dict:
    dense = {"user_age": 30.0 + i, "item_price": 1.5}
    sparse = {"item_id": [i]}
    for name in drop:
        dense.pop(name, None)
        sparse.pop(name, None)
    return {
        "request_id": f"r{i}",
        "ts": i,
        "session_id": f"s{i % 3}",
        "dense": dense,
        "sparse": sparse,
    }


def _flat(i: int) -> dict:
    """The features at the top level, where the build does not read them."""
    return {
        "request_id": f"r{i}",
        "ts": i,
        "session_id": "s",
        "user_age": 30.0,
        "item_price": 1.5,
        "item_id": [i],
    }


@pytest.mark.parametrize("engine", ["duckdb", "polars"])
def test_features_at_the_top_level_fail_the_build_naming_them(tmp_path, engine):
    src = _write(tmp_path / "f.jsonl", [_flat(i) for i in range(50)])
    cfg = BuildConfig(engine=engine)
    with pytest.raises(DataError) as err:
        build(src, tmp_path / "out", schema=SCHEMA, config=cfg)
    text = str(err.value)
    assert "3 schema feature(s) missing from every one of the 50 valid records" in text
    assert "`user_age` (50)" in text and "`item_id` (50)" in text
    assert "top-level keys the build does not read: `item_id`, `item_price`, `user_age`" in text
    assert "--allow-missing-features" in text
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("engine", ["duckdb", "polars"])
def test_allowed_missing_features_are_counted_in_the_manifest_and_summary(tmp_path, engine):
    records = [_flat(i) for i in range(4)] + [_nested(i, item_price=1) for i in range(4, 10)]
    src = _write(tmp_path / "f.jsonl", records)
    cfg = BuildConfig(engine=engine, allow_missing_features=True)
    m = build(src, tmp_path / "out", schema=SCHEMA, config=cfg)
    assert (m["rows_in"], m["rows_out"], m["rows_quarantined"]) == (10, 10, 0)
    assert m["features_missing"] == {"user_age": 4, "item_price": 10, "item_id": 4}
    assert m["unknown_keys"] == {"item_id": 4, "item_price": 4, "user_age": 4}
    assert any("missing from every valid record" in w and "item_price" in w for w in m["warnings"])
    assert any("top-level keys" in w for w in m["warnings"])
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.column("user_age").to_pylist()[:4] == [-1.0] * 4  # filled, and counted
    text = format_summary(m)
    assert "missing features item_price (10, 100%), item_id (4, 40%), user_age (4, 40%)" in text
    assert "unknown keys     item_id (4), item_price (4), user_age (4)" in text


def test_a_feature_no_record_carries_fails_unless_allowed(tmp_path):
    src = _write(tmp_path / "f.jsonl", [_nested(i, item_price=1) for i in range(6)])
    with pytest.raises(DataError, match=r"1 schema feature\(s\) missing .* `item_price` \(6\)"):
        build(src, tmp_path / "out", schema=SCHEMA)
    m = build(src, tmp_path / "out", schema=SCHEMA, config=BuildConfig(allow_missing_features=True))
    assert m["features_missing"] == {"item_price": 6} and m["rows_out"] == 6


def test_the_share_of_records_a_feature_may_miss_is_configurable(tmp_path):
    records = [_nested(i, user_age=1) if i < 6 else _nested(i) for i in range(10)]
    src = _write(tmp_path / "f.jsonl", records)
    m = build(src, tmp_path / "a", schema=SCHEMA, config=BuildConfig(fail_missing_share=0.7))
    assert m["features_missing"] == {"user_age": 6}
    with pytest.raises(DataError, match=r"missing from at least 60% of the 10 valid records"):
        build(src, tmp_path / "b", schema=SCHEMA, config=BuildConfig(fail_missing_share=0.6))
    with pytest.raises(DataError, match="`fail_missing_share` must be in"):
        BuildConfig(fail_missing_share=0)


def test_no_valid_record_is_not_a_missing_feature(tmp_path):
    src = _write(tmp_path / "f.jsonl", [{"ts": 1}, {"request_id": "a"}])
    m = build(src, tmp_path / "out", schema=SCHEMA)
    assert (m["rows_out"], m["rows_quarantined"], m["features_missing"]) == (0, 2, {})


def test_a_build_without_events_warns_that_every_label_is_0(tmp_path, capsys):
    from recpipe_cli import main

    src = _write(tmp_path / "f.jsonl", [_nested(i) for i in range(3)])
    m = build(src, tmp_path / "out", schema=SCHEMA)
    assert m["warnings"] == ["no event logs (--events): every label is 0"]
    assert "!! warning: no event logs (--events): every label is 0" in format_summary(m)
    events = _write(tmp_path / "e.jsonl", [{"request_id": "nobody", "label": 1}])
    m = build(src, tmp_path / "out", events=events, schema=SCHEMA, overwrite=True)
    assert m["warnings"] == ["no event matched a request kept: every label is 0"]
    events = _write(tmp_path / "e.jsonl", [{"request_id": "r1", "label": 1}])
    m = build(src, tmp_path / "out", events=events, schema=SCHEMA, overwrite=True)
    assert m["warnings"] == []
    args = ["etl", "build", str(src), "--out", str(tmp_path / "cli"), "--no-progress"]
    assert main([*args, "--allow-missing-features"]) == 0
    assert "warning: no event logs" in capsys.readouterr().out


def test_manifest_names_each_part_file_with_its_size_and_sha256(tmp_path):
    src = _write(tmp_path / "f.jsonl", [_nested(i) for i in range(40)])
    cfg = BuildConfig(max_file_bytes=1, row_group_size=4, partition_by="hour")
    m = build(src, tmp_path / "out", schema=SCHEMA, config=cfg)
    assert len(m["files"]) > 3
    for f in m["files"]:
        data = (tmp_path / "out" / f["path"]).read_bytes()
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
        assert {"path", "rows", "row_groups", "sessions"} <= set(f)
    assert m["parquet"]["page_checksums"] is True


def test_parquet_pages_carry_checksums_that_catch_flipped_bytes(tmp_path):
    """64 flipped bytes inside a part file raised nothing: pages now carry CRC checksums."""
    records = [_nested(i) for i in range(2000)]
    src = _write(tmp_path / "f.jsonl", records)
    m = build(src, tmp_path / "out", schema=SCHEMA, config=BuildConfig(dictionary="none"))
    path = tmp_path / "out" / m["files"][0]["path"]
    assert pq.read_table(path, page_checksum_verification=True).num_rows == 2000
    data = bytearray(path.read_bytes())
    meta = pq.read_metadata(path).row_group(0).column(3)  # user_age: one page of 2000 floats
    assert meta.total_compressed_size > 1000
    start = meta.data_page_offset + meta.total_compressed_size // 2
    data[start : start + 64] = bytes(b ^ 0xFF for b in data[start : start + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match=r"(?i)checksum|CRC"):
        pq.read_table(path, page_checksum_verification=True)


def test_default_schema_builds_of_complete_records_pass_the_feature_check(synth_logs, tmp_path):
    m = build(synth_logs.features, tmp_path / "out", schema=default_schema())
    valid = m["rows_in"] - m["rows_quarantined"]
    assert m["rows_out"] == valid and all(n < valid for n in m["features_missing"].values())
