"""benchmarks/service.py runs end to end at a tiny size and writes its figures."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


@pytest.mark.slow
def test_service_benchmark_writes_its_figures(tmp_path, monkeypatch, capsys) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    out = tmp_path / "service.json"
    argv = ["--requests", "3000", "--batch-size", "256", "--readers", "0", "--repeats", "2"]
    assert (
        load_benchmark("service").main([*argv, "--work", str(tmp_path / "work"), "--out", str(out)])
        == 0
    )
    results = json.loads(out.read_text())
    sent = results["sent_bytes_per_sample"]
    assert 0 < sent["ikjt"] < sent["kjt"]
    ratio = results["service_vs_inprocess"]  # median, and its wall and CPU spreads
    assert ratio["median"] == ratio["wall"]["median"] > 0 and ratio["cpu"]["median"] > 0
    assert ratio["wall"]["min"] <= ratio["wall"]["median"] <= ratio["wall"]["max"]
    assert ratio["wall"]["repeats"] == 2
    assert set(results["samples_per_s"]) == {
        "inprocess_ikjt",
        "service_ikjt",
        "service_kjt",
        "inprocess_ikjt_no_read_ahead",  # the default read-ahead is measured against none
        "service_ikjt_no_read_ahead",
    }
    assert all(v["median"] > 0 for v in results["read_ahead_speedup"].values())
    assert all(r["median"] > 0 for r in results["samples_per_s"].values())
    assert results["environment"]["cpus"] >= 1
    for kept in results["kept_reader"].values():
        assert kept["reader_processes_started"] == 1  # the next client got the first one's reader
        nxt = kept["next_client"]
        assert nxt["samples_per_s"] > 0 and nxt["startup_s"] > 0
        assert nxt["reader_cpu_s_per_batch"] > 0 and kept["reader_rss_mb"] > 0
    assert "service_vs_inprocess" in capsys.readouterr().out


def test_service_benchmark_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("service").parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "sent_bytes_per_sample" in capsys.readouterr().out
