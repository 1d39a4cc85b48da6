"""`etl.stats` on real builds of the synthetic logs (shared session-scoped fixtures)."""

from __future__ import annotations

import json

import pytest

from etl.stats import compute_stats

pytest.importorskip("etl.build")


@pytest.mark.slow
def test_clustered_synth_dataset(clustered_dataset, tmp_path):
    report = compute_stats(clustered_dataset)  # schema and order from the manifest
    manifest = json.loads((clustered_dataset / "_manifest.json").read_text())

    assert report.order == "session"
    assert report.rows == manifest["rows_out"]
    assert report.sessions.sessions == manifest["sessions"]
    assert report.samples_per_batch_session > 8  # clustered: batches hold whole sessions
    liked = report.feature("user_liked_items")
    assert liked.d > 0.5 and liked.partial_duplicates > 0
    assert report.feature("item_id").d < 0.1
    # model and measured agree where duplicates come from sessions, not from low cardinality
    assert liked.measured_factor == pytest.approx(liked.model_factor, rel=0.1)
    assert liked.measured_factor > 1.5
    # the liked lists shift together: one group
    group = next(g for g in report.proposed_groups if "user_liked_items" in g)
    assert "user_liked_sellers" in group
    assert "item_id" not in report.proposed_features
    users = sum(f.byte_share for f in report.features if f.kind == "user")
    assert users > 0.5

    data = json.loads(report.write_json(tmp_path / "stats.json").read_text())
    assert data["dedup_toml"].startswith("[dedup]\ngroups = [")


@pytest.mark.slow
def test_time_ordered_synth_dataset_loses_the_factor(clean_synth_logs, clustered_dataset, tmp_path):
    from etl.build import BuildConfig, build

    timed_dir = tmp_path / "time_ordered"
    build(
        clean_synth_logs.features,
        timed_dir,
        events=clean_synth_logs.events,
        config=BuildConfig(order="time"),
    )
    clustered = compute_stats(clustered_dataset)
    timed = compute_stats(timed_dir)

    assert timed.order == "time"
    assert timed.samples_per_batch_session < clustered.samples_per_batch_session / 3
    for name in ("user_follows", "user_liked_items", "user_recent_queries"):
        # same data, same d(f); only the file order differs
        assert timed.feature(name).d == pytest.approx(clustered.feature(name).d)
        assert timed.feature(name).measured_factor < clustered.feature(name).measured_factor
