"""`benchmarks/store.py --only checkpoint` at a tiny size: only the DLRM checkpoint runs,
merged into the results file (the script's correctness, not timing)."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


def test_only_checkpoint_is_an_option():
    module = load_benchmark("store")
    assert module.parse_args(["--only", "checkpoint"]).only == "checkpoint"
    assert module.parse_args([]).only is None
    assert "--only checkpoint" in module.__doc__


@pytest.mark.slow
def test_only_checkpoint_merges_its_figures(tmp_path, capsys):
    module = load_benchmark("store")
    out = tmp_path / "store.json"
    kept = {"recovery_speedup": 4.5, "environment": {"cpus": 99}}
    out.write_text(json.dumps(kept))
    argv = ["--only", "checkpoint", "--batch", "64", "--ckpt-every", "3", "--model-requests",
            "3000", "--model-steps", "4", "--model-repeats", "2", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["recovery_speedup"] == 4.5 and result["environment"] == {"cpus": 99}
    spread = result["checkpoint_overhead_spread"]
    assert spread["wall"]["repeats"] == 2 and spread["cpu"]["repeats"] == 2
    assert result["checkpoint_overhead"] == spread["wall"]["median"]
    assert result["checkpoint_overhead_in_run"] >= 1.0
    model = result["checkpoint_model"]
    assert model["stores"] > 0 and model["checkpoints"][0]["step"] == 3
    assert model["checkpoints"][0]["seconds"] > 0 and len(model["load_average_before_after"]) == 6
    assert model["environment"]["cpus"] >= 1
    assert "checkpoint_overhead" in capsys.readouterr().out
