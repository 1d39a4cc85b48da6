"""`benchmarks/distributed.py --only store`: the `--store hybrid` figures (against TorchRec DMP,
against in-memory shards, the 2-rank checkpoint overhead), merged into an existing results file
whose other figures stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import load_benchmark

REPO = Path(__file__).resolve().parents[2]

FIGURES = ("vs_torchrec_dmp_store", "store_vs_module", "vs_torchrec_dmp_module")


def test_docstring_names_the_store_figures():
    bench = load_benchmark("distributed")  # its docstring is its --help
    for word in (*FIGURES, "checkpoint_overhead_2ranks", "--only store", "--ckpt-every"):
        assert word in bench.__doc__
    args = bench.parse_args(["--only", "store"])
    assert (args.only, args.ckpt_every, args.ckpt_steps) == ("store", 100, 200)


@pytest.mark.slow
@pytest.mark.torchrec
def test_store_only_merges_its_figures(tmp_path):
    pytest.importorskip("torchrec")
    out = tmp_path / "distributed.json"
    out.write_text(json.dumps({"vs_torchrec_dmp": {"median": 1.5}, "world_size": 2}))
    argv = [
        sys.executable, "-m", "benchmarks.distributed", "--only", "store", "--requests", "2000",
        "--batch-size", "32", "--batches", "2", "--steps", "2", "--repeats", "1",
        "--ckpt-steps", "4", "--ckpt-every", "2", "--num-embeddings", "1000",
        "--probe-rows", "1024", "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["vs_torchrec_dmp"] == {"median": 1.5}  # the other figures stay
    for key in FIGURES:
        assert results[key]["median"] > 0, key
    assert results["checkpoint_overhead_2ranks"] > 0
    assert results["checkpoint_overhead_2ranks_in_run"] >= 1
    bench = results["store_bench"]
    assert len(bench["checkpoint_seconds_per_run"]) == 1  # one timed run with checkpoints
    assert bench["checkpoint_seconds_per_run"][0] > 0  # it saved (2 of 4 steps)
    assert (work := tmp_path / "work" / "checkpoint" / "checkpoint.pt").exists(), work
    assert "checkpoint_overhead_2ranks" in done.stdout
