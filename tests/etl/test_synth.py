"""Synthetic logs: determinism, RecD-like statistics, labels, and injected bad records."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import orjson
import pytest

from etl.rawio import iter_lines
from etl.synth import BAD_KINDS, SynthConfig, SynthResult, generate
from etl.synth_cli import register_cli
from recpipe.errors import RecpipeError
from schemas import default_schema

SCHEMA = default_schema()
USER_SPARSE = [f.name for f in SCHEMA.sparse if f.kind == "user"]


def _records(paths):
    out = []
    for path in paths:
        for _, line in iter_lines(path):
            out.append(orjson.loads(line))
    return out


def _profile(result: SynthResult, batch: int) -> dict:
    """Measure what `recpipe stats` will measure, straight from the raw logs."""
    recs = _records(result.features)
    recs.sort(key=lambda r: (r["ts"], r["request_id"]))
    sess = np.array([int(r["session_id"][2:]) for r in recs])
    per_session = np.bincount(sess)
    per_session = per_session[per_session > 0]
    in_batch = [
        batch / len(np.unique(sess[i : i + batch])) for i in range(0, len(sess) - batch + 1, batch)
    ]
    last: dict[int, dict] = {}
    dup, pairs = Counter(), 0
    user_bytes = total_bytes = 0
    for r in recs:
        prev = last.get(sess_id := int(r["session_id"][2:]))
        if prev is not None:
            pairs += 1
            for name in USER_SPARSE:
                dup[name] += r["sparse"][name] == prev["sparse"][name]
        last[sess_id] = r
        for name, value in r["sparse"].items():
            size = len(orjson.dumps(value))
            total_bytes += size
            user_bytes += size if name.startswith("user_") else 0
        for name, value in r["dense"].items():
            size = len(orjson.dumps(value))
            total_bytes += size
            user_bytes += size if name.startswith("user_") else 0
    labels: dict[str, int] = defaultdict(int)
    for ev in _records(result.events):
        labels[ev["request_id"]] = max(labels[ev["request_id"]], ev["label"])
    return {
        "mean_len": per_session.mean(),
        "p99_len": np.percentile(per_session, 99),
        "max_len": per_session.max(),
        "per_batch": float(np.mean(in_batch)),
        "dup": {name: dup[name] / pairs for name in USER_SPARSE},
        "user_byte_share": user_bytes / total_bytes,
        "label_rate": sum(labels.values()) / len(recs),
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> SynthResult:
    return generate(tmp_path_factory.mktemp("s"), SynthConfig(num_requests=3_000, seed=3, files=2))


def test_layout_and_counts(small):
    root = small.root
    assert [p.name for p in small.features] == ["part-00000.jsonl.zst", "part-00001.jsonl.zst"]
    assert all(p.parent == root / "features" for p in small.features)
    assert all(p.parent == root / "events" for p in small.events)
    assert sum(1 for p in small.features for _ in iter_lines(p)) == 3_000
    summary = json.loads((root / "_synth.json").read_text())
    assert summary["num_requests"] == 3_000
    assert summary["num_bad"] == dict.fromkeys(BAD_KINDS, 0)
    assert summary["num_events"] == sum(1 for p in small.events for _ in iter_lines(p))
    assert 0.5 < summary["hidden_model_auc"] < 1.0


def test_records_follow_the_schema(small):
    recs = _records(small.features)
    assert len({r["request_id"] for r in recs}) == len(recs)
    for r in recs[:200]:
        assert set(r) == {"request_id", "session_id", "user_id", "ts", "dense", "sparse"}
        assert list(r["dense"]) == SCHEMA.dense_names
        assert list(r["sparse"]) == SCHEMA.sparse_names
        for f in SCHEMA.sparse:
            ids = r["sparse"][f.name]
            assert 1 <= len(ids) <= f.max_len and all(isinstance(i, int) for i in ids)


def test_same_seed_same_bytes(tmp_path, small):
    again = generate(tmp_path / "again", SynthConfig(num_requests=3_000, seed=3, files=2))
    for a, b in zip(small.features + small.events, again.features + again.events):
        assert a.read_bytes() == b.read_bytes()
    other = generate(tmp_path / "other", SynthConfig(num_requests=3_000, seed=4, files=2))
    assert other.features[0].read_bytes() != small.features[0].read_bytes()


@pytest.mark.slow
def test_recd_like_statistics(tmp_path):
    # 50k requests with batches of 1024 hold the same share of the data per batch as the
    # default 200k requests with batches of 4096.
    result = generate(tmp_path, SynthConfig(num_requests=50_000, seed=1, concurrent_sessions=4000))
    prof = _profile(result, batch=1024)
    assert 15.0 < prof["mean_len"] < 18.0
    assert prof["p99_len"] > 4 * prof["mean_len"]  # long tail
    assert 1.05 < prof["per_batch"] < 1.2
    dup = prof["dup"]
    for static in ("user_segment", "user_country", "user_follows"):
        assert dup[static] == 1.0
    for shifting in ("user_liked_items", "user_liked_sellers", "user_recent_queries"):
        assert 0.6 < dup[shifting] < 0.8
    assert dup.pop("user_recent_items") == 0.0  # shifts on every request: partial duplicates only
    assert 0.75 < np.mean(list(dup.values())) < 0.9
    assert prof["user_byte_share"] > 0.6
    assert 0.05 < prof["label_rate"] < 0.4


def test_user_lists_shift_by_one_id(small):
    recs = sorted(_records(small.features), key=lambda r: r["ts"])
    last: dict[str, list[int]] = {}
    changes = 0
    for r in recs:
        cur = r["sparse"]["user_liked_items"]
        prev = last.get(r["session_id"])
        if prev is not None and prev != cur:
            changes += 1
            assert cur[-2] == prev[-1]  # one new id appended ...
            assert cur[:-1] == (prev[1:] if len(prev) == 50 else prev)  # ... oldest dropped at 50
        last[r["session_id"]] = cur
    assert changes > 0


def test_without_session_id_sessions_follow_from_gaps(tmp_path):
    cfg = SynthConfig(num_requests=8_000, seed=2, with_session_id=False, concurrent_sessions=150)
    result = generate(tmp_path, cfg)
    recs = _records(result.features)
    assert all("session_id" not in r for r in recs)
    by_user = defaultdict(list)
    for r in recs:
        by_user[r["user_id"]].append(r["ts"])
    gaps = np.concatenate([np.diff(sorted(t)) for t in by_user.values() if len(t) > 1])
    limit = 30 * 60 * 1000
    # Gaps are either inside a session (< 30 min) or between sessions (> 30 min, none equal).
    assert (gaps != limit).all()
    n_sessions = sum(int((np.diff(sorted(t)) > limit).sum()) + 1 for t in by_user.values())
    assert n_sessions == result.summary["num_sessions"]
    assert len(by_user) < n_sessions  # users come back for new sessions


def test_bad_records_of_every_kind(synth_logs):
    result = synth_logs
    n_bad = sum(result.num_bad.values())
    assert n_bad == round(0.02 * result.num_requests)
    assert set(result.num_bad) == set(BAD_KINDS)
    assert min(result.num_bad.values()) >= n_bad // len(BAD_KINDS)
    lines = [line for p in result.features for _, line in iter_lines(p)]
    assert len(lines) == result.num_requests
    found = Counter()
    seen_ids = set()
    for line in lines:
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            try:
                rec = json.loads(line)  # NaN / Infinity are not strict JSON
            except json.JSONDecodeError:
                found["malformed_json"] += 1
                continue
            found["non_finite"] += 1
            continue
        if "request_id" not in rec:
            found["missing_request_id"] += 1
        elif "ts" not in rec:
            found["missing_ts"] += 1
        elif rec["request_id"] in seen_ids:
            found["duplicate_request_id"] += 1
        elif (
            not isinstance(rec["ts"], int)
            or any(not isinstance(v, int | float) for v in rec["dense"].values())
            or any(
                not isinstance(v, list) or not all(isinstance(i, int) for i in v)
                for v in rec["sparse"].values()
            )
        ):
            # orjson reads ids beyond int64 (but within uint64) as ints: check their range.
            found["wrong_type"] += 1
        elif any(i >= 2**63 for v in rec["sparse"].values() for i in v):
            found["id_out_of_range"] += 1
        elif len(rec["sparse"]["item_tags"]) > SCHEMA.feature("item_tags").max_len:
            found["list_too_long"] += 1
        seen_ids.add(rec.get("request_id"))
    assert dict(found) == result.num_bad
    bad_events = result.num_bad_events
    assert bad_events["malformed_json"] > 0 and bad_events["wrong_type"] > 0


def test_config_validation():
    with pytest.raises(RecpipeError, match="`num_requests` must be >= 1"):
        SynthConfig(num_requests=0)
    with pytest.raises(RecpipeError, match="`bad_fraction`"):
        SynthConfig(bad_fraction=1.5)
    with pytest.raises(RecpipeError, match="`files`"):
        SynthConfig(files=0)


def test_cli_help_and_run(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="recpipe")
    register_cli(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["synth", "--help"])
    assert exc.value.code == 0
    assert "--bad-fraction" in capsys.readouterr().out
    args = parser.parse_args(
        ["synth", "--out", str(tmp_path), "--requests", "500", "--files", "1", "--quiet"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "hidden-model AUC" in out and "samples/session" in out
    assert (tmp_path / "features" / "part-00000.jsonl.zst").exists()
