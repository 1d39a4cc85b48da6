"""Smoke test of `benchmarks/etl.py` at a tiny size: it runs end to end and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _bench import load_benchmark


def test_help(capsys):
    bench = load_benchmark("etl")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--requests" in out and "--memory-limit" in out and "--quick" in out
    assert bench.parse_args([]).requests == 1_000_000
    assert bench.parse_args(["--quick"]).requests == 50_000


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path, capsys):
    for module in ("etl.synth", "etl.shard", "etl.build"):
        pytest.importorskip(module)
    bench = load_benchmark("etl")
    out = tmp_path / "etl.json"
    argv = ["--requests", "3000", "--shards", "2", "--batch-size", "256"]
    argv += ["--repeat", "1"]
    assert bench.main([*argv, "--work", str(tmp_path / "work"), "--out", str(out)]) == 0

    results = json.loads(out.read_text())
    for key in (
        "parquet_ratio_time_vs_clustered",
        "shard_ratio_session_vs_request",
        "build_rows_per_s",
        "build_vs_duckdb_oneliner",
        "build_peak_rss_mb",
    ):
        assert results[key] > 0, key
    assert results["rows_out"] == results["rows_in"] == 3000
    # the ratios are medians of alternated rounds, with their spread and CPU-time twin
    for key in ("build_vs_duckdb_oneliner", "polars_vs_duckdb_build"):
        spread = results[f"{key}_spread"]
        assert spread["median"] == results[key] == spread["wall"]["median"]
        assert spread["wall"]["repeats"] == spread["cpu"]["repeats"] == 1
        assert spread["cpu"]["median"] > 0
    assert results["build_s"] == results["build_s_runs"][0] and results["environment"]["cpus"]
    # where the build's wall and CPU seconds went, phase by phase
    assert set(results["build_phase_cpu_s"]) == set(results["build_phase_s"]) >= {"parse", "write"}
    # the Polars engine builds the same part files, byte for byte
    assert results["polars_same_parquet"] is True and results["polars_vs_duckdb_build"] > 0
    clustered, timed = results["dedup_factor_clustered"], results["dedup_factor_time_ordered"]
    assert set(clustered) == set(timed) and "user_liked_items" in clustered
    assert clustered["user_liked_items"] > timed["user_liked_items"]
    assert (
        results["samples_per_batch_session_clustered"]
        > results["samples_per_batch_session_time_ordered"]
    )
    table = capsys.readouterr().out
    assert "parquet_ratio_time_vs_clustered" in table and "user_liked_items" in table

    # out-of-core mode adds its entry and keeps the default run's figures
    argv = ["--requests", "2000", "--memory-limit", "256MB", "--threads", "1"]
    assert bench.main([*argv, "--work", str(tmp_path / "ooc"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["parquet_ratio_time_vs_clustered"] > 0
    ooc = results["out_of_core"]
    assert ooc["ok"] and ooc["rows_out"] == 2000 and ooc["peak_rss_mb"] > 0
    assert ooc["raw_bytes_uncompressed"] > ooc["raw_bytes_compressed"] > 0


def test_failed_child_step_is_reported(tmp_path):
    pytest.importorskip("etl.build")
    bench = load_benchmark("etl")
    spec = {
        "kind": "build",
        "features": [str(tmp_path / "missing.jsonl")],
        "events": None,
        "out": str(tmp_path / "out"),
        "config": {},
    }
    result = bench._run_child(spec, tmp_path)
    assert not result["ok"] and "missing.jsonl" in result["error"]
    assert result["peak_rss_mb"] > 0
    with pytest.raises(RuntimeError, match=r"step 'build' failed: .*missing.jsonl"):
        bench._require(result, "build")


@pytest.mark.slow
def test_scale_mode_reports_seconds_per_million_rows(tmp_path, capsys):
    bench = load_benchmark("etl")
    out = tmp_path / "etl.json"
    out.write_text(json.dumps({"requests": 7, "rows_in": 7}))  # a default run's figures
    argv = ["--scale", "1000,2000", "--no-polars", "--repeat", "1", "--out", str(out)]
    assert bench.main([*argv, "--work", str(tmp_path / "work")]) == 0
    results = json.loads(out.read_text())
    scale = results["scale"]
    assert scale["sizes"] == [1000, 2000] and list(scale["engines"]) == ["duckdb"]
    for size, rows in (("1000", 1000), ("2000", 2000)):
        got = scale["engines"]["duckdb"][size]
        assert got["rows_in"] == rows
        assert got["s_per_million_rows"] == pytest.approx(got["s"] / (rows / 1e6))
    assert scale["growth"]["duckdb"] > 0
    assert results["requests"] == results["rows_in"] == 7  # the other runs' figures are kept
    assert "seconds per million input rows" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--scale", "1M"])


def test_spark_scaleout_flags_and_the_rows_compared_in_manifest_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bench = load_benchmark("etl")
    args = bench.parse_args(["--spark-scaleout", "--spark-rss-sizes", "250000,1000000"])
    assert args.spark_scaleout and args.spark_rss_sizes == [250000, 1000000]
    assert args.spark_workers == [1, 2] and bench.parse_args([]).spark_rss_sizes == [
        10**6,
        4 * 10**6,
    ]
    with pytest.raises(SystemExit):
        bench.parse_args(["--spark-workers", "two"])

    def dataset(name: str, cuts: list[list[int]]) -> Path:
        root = tmp_path / name
        root.mkdir()
        files = []
        for i, rows in enumerate(cuts):
            pq.write_table(pa.table({"x": rows}), root / f"part-{i:05d}.parquet")
            files.append({"path": f"part-{i:05d}.parquet"})
        files.reverse() if name == "reversed" else None
        (root / "_manifest.json").write_text(json.dumps({"files": files}))
        return root

    one = dataset("one", [[1, 2, 3, 4]])
    assert bench._same_rows(one, dataset("two", [[1], [2, 3, 4]]))
    assert bench._same_rows(one, dataset("reversed", [[3, 4], [1, 2]]))  # listed 1, 0
    assert not bench._same_rows(one, dataset("swapped", [[2, 1], [3, 4]]))
