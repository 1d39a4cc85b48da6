"""Smoke test of `benchmarks/towers.py` at a tiny size: synth with planted groups, the
partitioner, a 2-rank SPTT job through torchrun's API, the one-process runs, and the JSON in
the shape the README and the lead's full run expect."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import load_benchmark

REPO = Path(__file__).resolve().parents[2]


def test_help_and_mann_whitney(capsys):
    bench = load_benchmark("towers")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("sptt_minus_flat", "learned_vs_strided", "cross_host_bytes_per_sample"):
        assert word in out
    args = bench.parse_args([])
    assert (args.seeds, args.compressions, args.towers) == (5, "2,4,8,16", 4)
    # 5 vs 5 fully separated: p = 1 / C(10, 5); identical samples: p = 1 (conservative)
    sep = bench.mann_whitney([5.0, 6, 7, 8, 9], [0.0, 1, 2, 3, 4])
    assert sep["u"] == 25 and math.isclose(sep["p_greater"], 1 / 252)
    assert bench.mann_whitney([1.0] * 5, [1.0] * 5)["p_greater"] > 0.5


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path):
    out = tmp_path / "towers.json"
    argv = [
        sys.executable, "-m", "benchmarks.towers", "--requests", "1500", "--groups", "2",
        "--features-per-group", "4", "--towers", "2", "--ranks-per-host", "1",
        "--compressions", "2,4", "--seeds", "2", "--steps", "3", "--batch-size", "16",
        "--embedding-dim", "4", "--num-embeddings", "64", "--partition-steps", "4",
        "--traffic-steps", "1", "--row-group-size", "256", "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=500, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    models = {"flat", "sptt", "dlrm_r2", "dlrm_r4", "dlrm_r2_strided", "dlrm_r4_strided"}
    assert set(results["auc"]) == models
    for name, stats in results["auc"].items():
        assert len(stats["values"]) == 2, name
        assert 0.0 <= stats["mean"] <= 1.0 and stats["sd"] >= 0.0, name
    assert set(results["learned_vs_strided"]) == {"2", "4"}
    for v in results["learned_vs_strided"].values():
        assert 0.0 < v["p_greater"] <= 1.0
    traffic = results["cross_host_bytes_per_sample"]
    assert set(traffic) >= {"sptt", "flat_tablewise", "dlrm_r2", "dlrm_r4"}
    assert results["compression_measured"] == {"2": 2.0, "4": 4.0}
    assert traffic["dlrm_r4"]["total"] < traffic["dlrm_r2"]["total"] < traffic["sptt"]["total"]
    flops = results["flops_per_sample"]
    assert flops["flat"] == flops["sptt"] > 0
    table = load_benchmark("report").render({"towers": results})
    assert "**Towers (DMT)**" in table and "| compression 4 − flat (mean AUC) |" in table
    assert "flat_tablewise:" in table
    assert sorted(t for tower in results["learned_towers"] for t in tower) == sorted(
        f"planted_{g}_{j}" for g in range(2) for j in range(4)
    )
