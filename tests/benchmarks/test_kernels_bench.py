"""Smoke test of benchmarks/kernels.py at a tiny size (correctness of the script, not timing)."""

from __future__ import annotations

import json

import pytest
import torch
from _bench import load_benchmark

TINY = ["--rows", "64", "--batches", "2", "--repeats", "1", "--dim", "4"]


@pytest.mark.slow
def test_kernels_benchmark_writes_json(tmp_path, capsys):
    module = load_benchmark("kernels")
    out = tmp_path / "kernels.json"
    assert module.main([*TINY, "--out", str(out)]) == 0
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
    # ours allocates little beyond what any implementation must: the output and the gradient
    assert 1.0 <= result["peak_ours_over_lower_bound"] < 1.25
    assert result["peak_memory_ratio"] <= result["peak_memory_ratio_reachable"] * 1.01
    if not torch.cuda.is_available():
        assert "no CUDA device" in result["gpu"]["skipped"]
    # ratios are medians of alternated, paired repeats, with their wall and CPU spreads
    for key in ("jagged_index_select_speedup", "dedup_speedup_vs_numpy"):
        spread = result[f"{key}_spread"]
        assert result[key] == spread["median"] == spread["wall"]["median"], key
        assert spread["wall"]["min"] <= spread["wall"]["max"] and spread["cpu"]["repeats"] >= 1
    assert result["dedup_rows_per_s_spread"]["repeats"] == 1
    assert "dedup_rows_per_s" in capsys.readouterr().out
    assert "over 1 repeats" in load_benchmark("report").render({"kernels": result})


@pytest.mark.slow
@pytest.mark.cuda
def test_kernels_benchmark_gpu_section_in_simulator(tmp_path, capsys):
    from numba import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set by `make test`)")
    module = load_benchmark("kernels")
    out = tmp_path / "kernels.json"
    assert module.main([*TINY, "--gpu", "simulate", "--gpu-rows", "32,48", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    gpu = result["gpu"]
    # the sweep repeats the section at each size asked for
    assert [point["rows"] for point in result["gpu_sweep"]] == [32, 48]
    assert all(point["jagged_index_select_ms"] > 0 for point in result["gpu_sweep"])
    for name in ("dispatcher_launch", "direct_launch"):  # the host cost of an empty launch
        assert gpu[f"{name}_ms"] > 0
    assert gpu["simulated"] and gpu["rows"] == 64 and 0 < gpu["unique_rows"] < 64
    for name in ("jagged_index_select", "jagged_index_add", "segment_reduce_sum", "dedup_rows"):
        assert gpu[f"{name}_ms"] > 0 and gpu[f"{name}_gbps"] > 0
        assert gpu[f"{name}_share_of_peak"] is None  # the simulator reports no peak
        assert gpu[f"{name}_vs_torch_copy"] > 0
    # the select moves what a copy of its output moves, plus its index arrays
    assert gpu["jagged_index_select_bytes"] > gpu["torch_copy_bytes"]
    # the select as callers make it (nothing known, the size known, the layout known) and each
    # kernel alone in both thread layouts, the JSON saying which is which
    for name in (
        "jagged_index_select_known_size", "jagged_index_select_known_layout",
        "select_kernel_word", "select_kernel_row", "add_kernel_word", "add_kernel_row",
    ):  # fmt: skip
        assert gpu[f"{name}_ms"] > 0 and gpu[f"{name}_vs_torch_copy"] > 0, name
    assert "_known_layout" in gpu["known_layout_note"] and gpu["select_layout"] == "row"
    printed = capsys.readouterr().out
    assert "jagged_index_select" in printed and "by batch rows" in printed


@pytest.mark.parametrize("bad", ["", "0,16", "a,b", "16,-4"])
def test_kernels_benchmark_refuses_bad_gpu_rows(bad, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("kernels").main(["--gpu-rows", bad])
    assert "expected integers >= 1 separated by commas" in capsys.readouterr().err
