"""Smoke test of `benchmarks/dispatch.py` at a tiny size: every policy replays, a 2-rank `recpipe
train` runs with esd and random dispatch, the JSON has every figure (costs per policy, the ratios
to LAIA, dispatch times with their spread, samples/s) and the README table renders them."""

from __future__ import annotations

import json
import math

import pytest
from _bench import load_benchmark

CASES = ("esd_alpha1", "esd_alpha0.5", "esd_alpha0", "esd_alpha0_second_regret", "laia",
         "round_robin", "random", "contiguous")  # fmt: skip


def test_help(capsys):
    bench = load_benchmark("dispatch")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("cost_vs_laia_alpha1", "dispatch_ms", "cost_order_holds"):
        assert word in out
    args = bench.parse_args([])  # the paper's setting
    assert (args.ranks, args.fast_ranks, args.fast_factor) == (8, 4, 10.0)
    assert (args.micro_batch, args.cache_share) == (128, 0.08)


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path):
    bench = load_benchmark("dispatch")
    out = tmp_path / "dispatch.json"
    argv = [
        "--requests", "1500", "--ranks", "4", "--fast-ranks", "2", "--micro-batch", "16",
        "--batches", "3", "--repeats", "2", "--sweep-piece-rows", "1", "--orders", "session",
        "--train-steps", "2", "--train-repeats", "1", "--read-steps", "2", "--read-repeats", "1",
        "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())
    assert results["setting"]["ranks"] == 4 and results["setting"]["headline_order"] == "session"
    res = results["orders"]["session"]
    assert res["dataset"]["global_batches"] == 3
    assert set(res["cost_s"]) == set(CASES)
    for name in CASES:
        cost = res["cost_s"][name]
        assert cost["cost"] == pytest.approx(cost["pulls"] + cost["pushes"])
        assert cost["cost"] > 0 and 0 <= cost["hit_rate"] <= 1
        assert res["dispatch_ms"][name]["wall"]["repeats"] == 2
        assert res["dispatch_ms"][name]["wall"]["median"] > 0
    assert math.isfinite(results["cost_vs_laia_alpha1"]) and results["cost_vs_laia_alpha1"] > 0
    assert res["cost_vs_laia_alpha1"] == results["cost_vs_laia_alpha1"]
    assert set(res["piece_rows_sweep"]["1"]) == {"esd_alpha1", "laia", "random"}
    assert results["cost"] == {name: res["cost_s"][name]["cost"] for name in CASES}
    assert results["dispatch_ms_alpha1_spread"]["repeats"] == 2
    for figure in ("dispatch_vs_saved", "dispatch_vs_saved_10gbit",
                   "dispatch_vs_saved_cluster_rates"):  # fmt: skip
        assert results[figure] == res[figure] and results[figure] > 0
    for rate in ("model", "10gbit", "cluster"):  # against the contiguous cut, at three rates
        vs = res["vs_contiguous"][rate]
        times = vs["step_transfer_s"]
        assert vs["saved_step_transfer_s"] == times["contiguous"] - times["esd_alpha1"]
    assert res["dispatch_vs_saved_10gbit"] > res["dispatch_vs_saved"]  # faster links save less
    assert res["dispatch_vs_saved_cluster_rates"] < res["dispatch_vs_saved"]  # slower: saves more
    for figure in ("dispatch_vs_saved", "dispatch_vs_saved_10gbit",
                   "dispatch_vs_saved_cluster_rates"):  # once: a rank's share  # fmt: skip
        every_rank = results[figure.replace("dispatch", "per_rank_cut")]
        assert every_rank == pytest.approx(results[figure] * 4)
    reading = results["reading"]
    for policy in ("contiguous", "esd", "random", "esd@source", "esd@other"):
        assert reading["current"]["samples_per_s"][policy]["median"] > 0
    assert set(reading["current"]["once_overhead_ms_per_step"]) == {"source", "other"}
    training = results["training"]
    assert (training["ranks"], training["steps"]) == (2, 2)
    assert all(training["samples_per_s"][p]["median"] > 0 for p in ("esd", "random"))
    assert results["train_esd_vs_random"] == training["esd_vs_random"] > 0
    # the real caches: their pulls and pushes over each rank's bandwidth
    assert training["cache_rows"] == res["dataset"]["cache_rows"]
    for policy in ("esd", "random"):
        link = training["cache_link_s"][policy]
        assert link["cost"] == pytest.approx(link["pulls"] + link["pushes"]) and link["pulls"] > 0
    assert results["train_cache_cost_esd_vs_random"] == training["cache_cost_esd_vs_random"] > 0
    # the README table renders every row from this JSON
    table = load_benchmark("report").render({"dispatch": results})
    for label in (
        "cost_vs_laia_alpha1",
        "cost_vs_laia_alpha0",
        "order holds",
        "dispatch_ms_alpha1",
        "dispatch_vs_saved",
    ):
        assert label in table, label
