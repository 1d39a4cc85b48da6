"""Smoke test of benchmarks/kernels.py at a tiny size (correctness of the script, not timing)."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


@pytest.mark.slow
def test_kernels_benchmark_writes_json(tmp_path, capsys):
    module = load_benchmark("kernels")
    out = tmp_path / "kernels.json"
    argv = ["--rows", "64", "--batches", "2", "--repeats", "1", "--dim", "4", "--out", str(out)]
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    for key in (
        "dedup_rows_per_s",
        "dedup_rows_per_s_3_features",
        "jagged_index_select_speedup",
        "peak_memory_ratio",
        "peak_memory_ratio_beyond_output",
        "vs_fbgemm_jagged_index_select",
    ):
        assert key in result
    assert result["dedup_rows_per_s"] > 0 and result["dedup_factor"] >= 1
    assert "dedup_rows_per_s" in capsys.readouterr().out
