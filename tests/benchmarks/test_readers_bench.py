"""Smoke test of `benchmarks/readers.py` at a tiny size: it runs end to end and writes its JSON."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


def test_help(capsys):
    bench = load_benchmark("readers")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--requests" in out and "--batch-size" in out and "reader_speedup_vs_baseline" in out
    args = bench.parse_args([])
    assert (args.requests, args.batch_size) == (200_000, 4096)


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path, capsys):
    for module in ("etl.synth", "etl.build"):
        pytest.importorskip(module)
    bench = load_benchmark("readers")
    out = tmp_path / "readers.json"
    argv = ["--requests", "3000", "--batch-size", "256", "--repeats", "1", "--vocab-size", "100"]
    assert bench.main([*argv, "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    keys = (
        "reader_speedup_vs_baseline",
        "ikjt_vs_kjt_samples_per_s",
        "convert_overhead",
        "reader_speedup_fitted",
    )
    for key in keys:
        assert results[key] > 0, key
    check = results["len_matches_delivered"]
    assert check["equal"] and check["len"] == check["delivered"] == 12  # 3000 rows, B=256
    assert (tmp_path / "work" / "clustered" / "_preprocess_fitted.json").is_file()
    rb = results["read_bytes_per_sample"]
    assert rb["time_ordered"] > rb["clustered"] > 0
    assert results["settings"]["rows"] == 3000
    clustered = results["dedup_factor_per_group"]["clustered"]
    assert all(f >= 1.0 for f in clustered.values())
    for key in keys:
        spread = results[f"{key}_spread"]  # paired repeats: CPU-time (headline) and wall-time
        assert spread["headline"] == "cpu" and spread["cpu"]["median"] == results[key], key
        assert spread["wall"]["repeats"] == spread["cpu"]["repeats"] == 1, key
    table = capsys.readouterr().out
    assert "reader_speedup_vs_baseline" in table and "convert_overhead" in table
    rendered = load_benchmark("report").render({"readers": results})  # the README's new shape
    assert "over 1 repeats; wall-time ratio" in rendered

    measured = bench.measure_inprocess(tmp_path / "work" / "clustered", batch_size=512)
    assert measured["samples"] == 3000 and measured["batches"] == 6
