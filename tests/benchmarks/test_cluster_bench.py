"""Smoke test of `benchmarks/cluster.py`: its help names every figure, and a tiny run over 2
namespace hosts (skipped where namespaces cannot be made) writes them with the rates used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import load_benchmark

from recpipe.testing.cluster import list_namespaces, unavailable

REPO = Path(__file__).resolve().parents[2]
FIGURES = (
    "hypereca_best_r_vs_r0",
    "hypereca_chosen_vs_best",
    "hypereca_best_nonzero_r_vs_r0",
    "service_ikjt_vs_kjt_samples_per_s",
)


def test_help(capsys):
    bench = load_benchmark("cluster")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in (*FIGURES, "--rate-mbit", "--service-rate-mbit", "link_measured_mbit"):
        assert word in out


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path):
    why = unavailable()
    if why is not None:
        pytest.skip(f"no cluster in a box: {why}")
    before = set(list_namespaces())
    out = tmp_path / "cluster.json"
    argv = [
        sys.executable, "-m", "benchmarks.cluster", "--requests", "2000", "--batch-size", "64",
        "--batches", "2", "--steps", "1", "--repeats", "1", "--probe-rows", "256",
        "--num-embeddings", "1000", "--rate-mbit", "200", "--service-rate-mbit", "200",
        "--service-batch-size", "256", "--timeout-s", "300", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    for key in FIGURES:
        assert results[key]["median"] > 0 and results[key]["wall"]["repeats"] == 1, key
    assert results["topology"]["rates_mbit"] == [200.0, 200.0]
    assert all(v > 0 for v in results["link_measured_mbit"])
    where = results["hypereca"]["where_the_time_goes"]
    assert where["0"]["a2a_bytes_per_rank_step"] > 0 and where["0"]["step_s"]["median"] > 0
    assert (
        results["service"]["bytes_per_sample"]["kjt"]
        > results["service"]["bytes_per_sample"]["ikjt"]
    )
    assert results["unshaped"]["samples_per_s"]["0"] > 0
    assert set(list_namespaces()) <= before  # nothing of the run is left
