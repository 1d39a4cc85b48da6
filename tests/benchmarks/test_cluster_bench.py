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

from recpipe.testing.cluster import stale_namespaces, unavailable

REPO = Path(__file__).resolve().parents[2]
FIGURES = (
    "hypereca_best_r_vs_r0",
    "hypereca_chosen_vs_best",
    "hypereca_best_nonzero_r_vs_r0",
    "service_ikjt_vs_kjt_samples_per_s",
    "vs_torchrec_dmp_shaped",
)
TRAIN_FIGURES = (
    "dmt_sptt_tm_vs_flat",
    "dmt_sptt_vs_flat",
    "esd_vs_laia_samples_per_s",
    "service_ikjt_vs_kjt_train_samples_per_s",
)


def test_help(capsys):
    bench = load_benchmark("cluster")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in (*FIGURES, *TRAIN_FIGURES, "dmt_auc_delta", "--rate-mbit", "--service-rate-mbit",
                 "link_measured_mbit", "--only", "--dmt-rate-mbit", "--esd-rate-mbit",
                 "--service-steps",
                 "--service-rank-rate-mbit"):  # fmt: skip
        assert word in out


def test_only_takes_known_parts(capsys):
    bench = load_benchmark("cluster")
    assert bench.parse_args(["--only", "esd,dmt"]).only == ("esd", "dmt")
    assert bench.parse_args([]).only == bench.PARTS
    assert bench.parse_args(["--only", "service-train"]).only == ("service-train",)
    # every figure the file can hold names the part that measures it (it runs alone)
    assert bench.FIGURE_PARTS["service_ikjt_vs_kjt_train_samples_per_s"] == "service-train"
    assert all(p in bench.PARTS for p in bench.FIGURE_PARTS.values() if p is not None)
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "dmt,towers"])
    assert "`--only` takes parts of" in capsys.readouterr().err


def test_merge_keeps_other_parts_and_names_what_is_missing():
    bench = load_benchmark("cluster")
    previous = {"hypereca_best_r_vs_r0": {"median": 1.0}, "hypereca": {"x": 1},
                "dmt_sptt_tm_vs_flat": {"median": 0.5}, "environment": {"cpus": 2},
                "not_measured": ["dmt_auc_delta"]}  # fmt: skip
    new = {"dmt_sptt_tm_vs_flat": {"median": 2.0}, "dmt_auc_delta": {"median": 0.0}}
    merged = bench.merge_results(previous, new)
    assert merged["hypereca"] == {"x": 1} and merged["hypereca_best_r_vs_r0"]["median"] == 1.0
    assert merged["dmt_sptt_tm_vs_flat"]["median"] == 2.0
    assert "environment" not in merged  # write_results adds today's
    assert "dmt_auc_delta" not in merged["not_measured"]
    assert "esd_vs_laia_samples_per_s" in merged["not_measured"]
    assert "hypereca_chosen_vs_best" in merged["not_measured"]
    # measured by another benchmark at this harness's rates: named with where it is
    assert "dispatch_vs_saved" not in merged["not_measured"]
    assert "dispatch.json" in merged["measured_elsewhere"]["dispatch_vs_saved"]
    assert bench.merge_results(None, new)["dmt_auc_delta"] == {"median": 0.0}


def test_steady_rate_leaves_out_the_first_steps():
    bench = load_benchmark("cluster")
    records = [{"kind": "train", "step": k, "samples": 100 * k, "wall_s": 5.0 + 0.5 * (k - 1)}
               for k in range(1, 7)]  # fmt: skip
    records[0]["wall_s"] = 5.0  # the first step: slow (it builds)
    records.append({"kind": "eval", "step": 6, "samples": 50, "wall_s": 99.0})
    rate = bench.steady_rate(records, warm=3)
    assert rate["step_s"] == pytest.approx(0.5)
    assert rate["samples_per_s"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="more than 3"):
        bench.steady_rate(records[:3], warm=3)


@pytest.fixture
def no_namespace_left():
    """Skips where namespaces cannot be made; checks the run left none of its own."""
    why = unavailable()
    if why is not None:
        pytest.skip(f"no cluster in a box: {why}")
    before = set(stale_namespaces())
    yield
    # the run's processes have exited: any namespace of theirs is stale (a benchmark running
    # beside the tests keeps its own, with a live creator)
    assert set(stale_namespaces()) <= before  # nothing of the run is left


def _run(out: Path, args: list[str], *, timeout: float) -> dict:
    """``python -m benchmarks.cluster ARGS --out OUT`` (one thread per rank); its results."""
    argv = [sys.executable, "-m", "benchmarks.cluster", *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path, no_namespace_left):
    args = [
        "--only", "hypereca", "--requests", "2000", "--batch-size", "64",
        "--batches", "2", "--steps", "1", "--repeats", "1", "--probe-rows", "256",
        "--num-embeddings", "1000", "--rate-mbit", "200", "--service-rate-mbit", "200",
        "--service-batch-size", "256", "--timeout-s", "300",
    ]  # fmt: skip
    results = _run(tmp_path / "cluster.json", args, timeout=400)
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


@pytest.mark.slow
def test_tiny_train_parts_update_only_their_figures(tmp_path, no_namespace_left):
    out = tmp_path / "cluster.json"
    out.write_text(json.dumps({"hypereca_best_r_vs_r0": {"median": 1.25}}))
    args = [
        "--only", "dmt,esd,service-train", "--requests", "4000",
        "--dmt-requests", "4000", "--dmt-steps", "5", "--esd-steps", "5", "--dmt-repeats", "1",
        "--esd-repeats", "1", "--dmt-batch-size", "64", "--esd-batch-size", "64",
        "--esd-cache-rows", "1024", "--dmt-rate-mbit", "200", "--esd-rate-mbit", "50",
        "--service-requests", "3000", "--service-steps", "5", "--service-repeats", "1",
        "--service-batch-size", "128", "--service-rate-mbit", "200", "--timeout-s", "300",
    ]  # fmt: skip
    results = _run(out, args, timeout=1200)
    assert results["hypereca_best_r_vs_r0"] == {"median": 1.25}  # kept
    for key in TRAIN_FIGURES:
        assert results[key]["median"] > 0 and results[key]["wall"]["repeats"] == 1, key
    assert (
        results["dmt"]["where_the_time_goes"]["sptt_tm"]["cross_host_bytes_per_sample"]
        < (results["dmt"]["where_the_time_goes"]["flat"]["cross_host_bytes_per_sample"])
    )
    assert len(results["dmt_auc_delta"]["by_seed"]["values"]) == 1
    assert results["esd"]["rates_mbit"] == [500.0, 500.0, 50.0, 50.0]
    assert results["esd"]["cost_model_homes"] == "ranks"  # the trainer's caches: owner homes
    assert "dmt_auc_delta" not in results["not_measured"]
    assert "hypereca_chosen_vs_best" in results["not_measured"]
    figure = results["service_ikjt_vs_kjt_train_samples_per_s"]
    assert figure["median"] > 0 and figure["wall"]["repeats"] == 1 and figure["unshaped"] > 0
    part = results["service_train"]
    assert part["rates_mbit"] == [None, None, 200.0]  # only the service's link is shaped
    assert part["bytes_per_sample"]["kjt"] > part["bytes_per_sample"]["ikjt"] > 0
    assert part["where_the_time_goes"]["ikjt"]["step_s"]["median"] > 0
    assert "service_ikjt_vs_kjt_train_samples_per_s" not in results["not_measured"]
