"""Smoke test of `benchmarks/trainer.py` at a tiny size: it runs end to end and writes its JSON."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


def test_help(capsys):
    bench = load_benchmark("trainer")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    words = ("dedup_speedup", "activation_memory_ratio", "max_batch_ratio", "vs_torchrec_ebc",
             "torchrec_swap_dedup_speedup")  # fmt: skip
    for word in words:
        assert word in out
    args = bench.parse_args([])
    assert (args.requests, args.batch_size) == (200_000, 4096)
    assert bench.parse_args(["--workers", "0,4,8"]).workers == (0, 4, 8)
    with pytest.raises(SystemExit):
        bench.parse_args(["--workers", "two"])


@pytest.mark.slow
@pytest.mark.torchrec
def test_tiny_run_writes_results(tmp_path, capsys):
    pytest.importorskip("torchrec")
    bench = load_benchmark("trainer")
    out = tmp_path / "trainer.json"
    argv = [
        "--requests", "4000", "--batch-size", "256", "--steps", "1", "--ebc-batches", "2",
        "--num-embeddings", "1000", "--work", str(tmp_path / "work"), "--out", str(out),
        "--end-to-end", "--workers", "0,1", "--rounds", "1",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())
    for key in ("dedup_speedup", "activation_memory_ratio", "max_batch_ratio", "vs_torchrec_ebc"):
        assert results[key] > 0
    assert results["max_loss_rel_diff_on_vs_off"] < 1e-5
    assert results["losses_equal_bitwise"] is True  # recpipe train --dedup off == on, as floats
    assert results["ebc_max_abs_diff_vs_torchrec"] < 1e-5
    assert results["torchrec_swap_dedup_max_abs_diff"] < 1e-5
    assert results["torchrec_swap_dedup_speedup"] > 0 and results["torchrec_swap_plain"] > 0
    assert results["dedup_factor_sparse_values"] > 1.0
    assert "dedup_speedup" in capsys.readouterr().out
    for key in ("dedup_speedup", "vs_torchrec_ebc", "vs_torchrec_ebc_ours_sparse_grad"):
        spread = results[f"{key}_spread"]  # paired per-step ratios, CPU (headline) and wall
        assert spread["headline"] == "cpu" and results[key] == spread["cpu"]["median"], key
        assert spread["wall"]["repeats"] == spread["cpu"]["repeats"] >= 1, key
    assert [p["workers"] for p in results["end_to_end"]] == [0, 1]
    assert results["end_to_end_data"].endswith("clustered")  # --data's, no --end-to-end-data
    for point in results["end_to_end"]:  # fed by the readers / preloaded, one round each
        assert point["vs_model_only"] > 0 and point["vs_model_only_spread"]["values"]
    assert results["end_to_end_workers"] in (0, 1)
    assert results["end_to_end_vs_model_only"] == max(
        p["vs_model_only"] for p in results["end_to_end"]
    )
    assert "wall-time ratio" in load_benchmark("report").render({"trainer": results})
