"""Smoke test of `benchmarks/integrity.py` at a tiny size: it runs end to end and writes its JSON."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


def test_help(capsys):
    bench = load_benchmark("integrity")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "read_pages_vs_off" in out and "stats_digest_share" in out and "--repeats" in out
    args = bench.parse_args([])
    assert (args.requests, args.repeats, args.batch_size) == (200_000, 7, 4096)


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path, capsys):
    bench = load_benchmark("integrity")
    out = tmp_path / "integrity.json"
    argv = ["--requests", "800", "--repeats", "1", "--batch-size", "128"]
    assert bench.main([*argv, "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    for key in ("read_pages_vs_off", "loader_pages_vs_off", "stats_digest_share"):
        assert results[key]["median"] > 0, key
        assert results[key]["cpu"]["repeats"] == 1, key
    assert results["verify_mb_per_s"]["median"] > 0
    assert results["settings"]["verified_ok"] is True
    assert results["settings"]["rows"] == 800 and "environment" in results
    assert "read_pages_vs_off" in capsys.readouterr().out
