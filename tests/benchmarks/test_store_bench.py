"""Smoke test of benchmarks/store.py at a tiny size (correctness of the script, not timing)."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


@pytest.mark.slow
def test_store_benchmark_writes_json(tmp_path, capsys):
    module = load_benchmark("store")
    out = tmp_path / "store.json"
    argv = [
        "--batch",
        "64",
        "--pooling",
        "4",
        "--vocab",
        "2000",
        "--dim",
        "8",
        "--steps",
        "2",
        "--ckpt-steps",
        "6",
        "--ckpt-every",
        "3",
        "--ckpt-warmup",
        "3",
        "--ckpt-repeats",
        "2",
        "--storage-checkpoints",
        "2",
        "--index-rows",
        "1000",
        "--model-requests",
        "3000",
        "--model-steps",
        "4",
        "--model-repeats",
        "1",
        "--miss-steps",
        "6",
        "--repeats",
        "1",
        "--recovery-repeats",
        "1",
        "--out",
        str(out),
    ]
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    for key in (
        "index_ids_per_s_per_core",
        "index_ids_per_s_per_core_10pct_new",
        "pull_push_rows_per_s",
        "pull_push_rows_per_s_hot",
        "step_vs_fbgemm_tbe",
        "rho",
        "chosen_hot_rows",
        "checkpoint_overhead",
        "checkpoint_overhead_embedding_only",
        "checkpoint_overhead_first_interval",
        "checkpoint_overhead_sync_process",
        "storage_choice",
        "recovery_speedup",
        "recovery_speedup_cold_cache",
        "miss_rate",
    ):
        assert key in result
    assert set(result["rho"]) == {"1000", "10000", "65536"}
    assert {"1%", "10%", "50%"} <= set(result["miss_rate"])
    assert 0.0 <= result["miss_rate"]["10%"]["miss_rate"] <= 1.0
    choice = result["storage_choice"]
    assert choice["chosen"] in choice and choice["in_place_undo_log"]["steady_seconds"] > 0
    model = result["checkpoint_model"]
    assert model["stores"] > 0 and model["checkpoints"][0]["step"] == 3
    assert model["checkpoints"][0]["rows_written"] > 0
    assert all(t["min"] > 0 for t in result["recovery_seconds"].values())
    assert set(result["recovery_seconds"]) == {
        f"{what}_{cache}" for what in ("dump", "open", "verify") for cache in ("warm", "cold")
    }
    for key in ("recovery_speedup_spread", "step_vs_fbgemm_tbe_spread"):
        spread = result[key]
        assert spread["wall"]["repeats"] == 1 and spread["cpu"]["repeats"] == 1
        assert spread["wall"]["min"] <= spread["median"] <= spread["wall"]["max"]
    assert result["checkpoint_overhead_spread"]["wall"]["repeats"] == 1
    assert result["checkpoint_overhead_in_run"] >= 1.0
    assert result["environment"]["cpus"] >= 1
    assert "checkpoint overhead" in capsys.readouterr().out
