"""The readers and trainer benchmarks report the partial-dedup factor and speed of the synth
schema's shifted-history feature (``user_recent_items``) at a tiny size."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


@pytest.mark.slow
def test_readers_bench_reports_partial_dedup(tmp_path, capsys):
    bench = load_benchmark("readers")
    out = tmp_path / "readers.json"
    argv = ["--requests", "3000", "--batch-size", "256", "--repeats", "1", "--vocab-size", "100"]
    assert bench.main([*argv, "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["partial_feature"] == ["user_recent_items"]
    # one id appended per request: clustered batches store about one id per row, not ~20
    assert results["partial_dedup_factor"] > 4 * results["partial_dedup_factor_time_ordered"]
    assert results["partial_dedup_factor_time_ordered"] >= 1.0
    spread = results["partial_convert_speed_spread"]
    assert spread["cpu"]["median"] == results["partial_convert_speed"] > 0
    assert "partial_dedup_factor" in capsys.readouterr().out


@pytest.mark.slow
def test_trainer_bench_reports_partial_dedup(tmp_path, capsys):
    bench = load_benchmark("trainer")
    out = tmp_path / "trainer.json"
    argv = ["--requests", "3000", "--batch-size", "256", "--steps", "2", "--warmup", "1",
            "--embedding-dim", "8", "--num-embeddings", "1000", "--ebc-batches", "2"]  # fmt: skip
    assert bench.main([*argv, "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["partial_feature"] == ["user_recent_items"]
    assert results["partial_dedup_factor"] > 4
    assert results["partial_speedup"] > 0 and results["partial_embedding_speedup"] > 0
    assert results["partial_speedup_spread"]["cpu"]["repeats"] == 2
    assert results["partial_embedding_same_bags"] is True
    assert results["partial_max_loss_rel_diff"] < 1e-5  # the same model, the same numbers
    assert "partial_speedup" in capsys.readouterr().out
