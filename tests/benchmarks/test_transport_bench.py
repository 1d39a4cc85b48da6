"""Smoke test of `benchmarks/transport.py` at a tiny size: both ways run, a packed batch arrives
as one storage, and the JSON has every figure with its spread."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


def test_help(capsys):
    bench = load_benchmark("transport")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("receive_ms", "packed_vs_tensors", "worker_samples_per_s"):
        assert word in out
    args = bench.parse_args([])
    assert (args.batch_size, args.workers, args.out) == (32_768, 2, None)


def test_a_missing_dataset_or_no_rounds_is_one_line(tmp_path, capsys):
    bench = load_benchmark("transport")
    assert bench.main(["--dataset", str(tmp_path / "absent")]) == 1
    assert "`--dataset`" in capsys.readouterr().err
    assert bench.main(["--rounds", "0"]) == 1
    assert "`--rounds`" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path):
    from benchmarks.trainer import build_dataset

    dataset, _ = build_dataset(tmp_path / "work", requests=600, seed=0)
    bench = load_benchmark("transport")
    out = tmp_path / "transport.json"
    argv = [
        "--dataset", str(dataset), "--batch-size", "64", "--workers", "2", "--prefetch", "2",
        "--rounds", "2", "--gap-rounds", "1", "--settle", "0", "--worker-batches", "2",
        "--out", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())
    batch = results["batch"]
    assert batch["packed"]["storages"] == 1 < batch["tensors"]["storages"]
    assert batch["packed"]["bytes"] == batch["tensors"]["bytes"] > 0
    for key in ("receive_ms", "receive_cpu_ms", "other_threads_cpu_ms"):
        assert set(results[key]) == {"packed", "tensors"}
        assert results[key]["packed"]["repeats"] == 2
    assert results["packed_vs_tensors"]["median"] > 0
    assert results["workers_for_target"] >= 1
    assert set(results["epoch_gap_ms"]) == {"ahead", "at_end"}
    assert results["epoch_gap_ms"]["ahead"]["repeats"] == 1
