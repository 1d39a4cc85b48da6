"""Smoke test of `benchmarks/distributed.py` at a tiny size: 2 ranks launched through torchrun's
API run every case (R sweep, TorchRec DMP, one rank) and the JSON has every figure."""

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

FIGURES = (
    "best_r_vs_r0",
    "chosen_vs_best_measured",
    "vs_torchrec_dmp",
    "scaling_2_ranks",
    "exact_dense_vs_default",
    "vs_torchrec_dmp_exact_dense",
)


def test_help(capsys):
    bench = load_benchmark("distributed")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in (*FIGURES, "cost_model_r2", "a2a_bytes_ratio", "samples_per_s"):
        assert word in out
    args = bench.parse_args([])
    assert (args.requests, args.batch_size, args.repeats) == (200_000, 2048, 5)


@pytest.mark.slow
@pytest.mark.torchrec
def test_tiny_run_writes_results(tmp_path):
    pytest.importorskip("torchrec")
    out = tmp_path / "distributed.json"
    argv = [
        sys.executable, "-m", "benchmarks.distributed", "--requests", "2000",
        "--batch-size", "32", "--batches", "2", "--steps", "1", "--repeats", "1", "--pairs", "2",
        "--num-embeddings", "1000", "--probe-rows", "1024", "--work", str(tmp_path / "work"),
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    for key in FIGURES:
        assert results[key]["median"] > 0, key
    assert math.isfinite(results["cost_model_r2"]) and results["cost_model_r2"] <= 1
    assert results["a2a_bytes_ratio"] > 0
    measured = results["hot_rows_measured"]
    assert measured[0] == 0 and measured[-1] == results["all_rows"]
    assert results["chosen_r"] in measured
    rows = results["a2a_bytes_per_step"]
    assert rows["0"] >= rows[str(results["all_rows"])]  # hot rows cross no all-to-all
    assert "vs_torchrec_dmp" in done.stdout
    sent = results["a2a_sent_bytes_per_step"]
    assert sent["ours"] > 0 and sent["torchrec_dmp"] > 0
    assert results["a2a_bytes_vs_torchrec"] == pytest.approx(sent["ours"] / sent["torchrec_dmp"])
    assert set(results["predicted_saving_se_s"]) == {str(r) for r in measured}
    paired = results["vs_torchrec_dmp_paired"]
    assert paired["repeats"] == 2 and paired["min"] <= paired["q1"] <= paired["q3"] <= paired["max"]
