"""`recpipe towers partition` and `recpipe towers train` (one process, and `--nproc 2`: two
"hosts" of one rank, each a torchrun worker) end to end on a small dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.towers.config import load_plan

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--embedding-dim", "4", "--num-embeddings", "200", "--bottom-mlp", "8", "--top-mlp", "8"]


def _recpipe(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    recpipe = str(Path(sys.executable).with_name("recpipe"))
    return subprocess.run([recpipe, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)  # fmt: skip


@pytest.fixture(scope="module")
def plan_file(towers_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    done = _recpipe("towers", "partition", str(towers_dataset), "--towers", "2", "--balance", "1",
                    "--steps", "4", "--batch-size", "64", "--affinity-batches", "2", "--out",
                    str(out / "towers.toml"), "--plot", str(out / "towers.png"), "--quiet",
                    *MODEL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 towers ->" in done.stdout
    assert (out / "towers.png").stat().st_size > 0
    return out / "towers.toml"


@pytest.mark.slow
def test_partition_writes_a_balanced_plan_deterministically(towers_dataset, plan_file, tmp_path):
    plan = load_plan(plan_file)
    assert plan.sizes == (6, 6)  # the 12 sparse features of the synth schema, balance 1
    assert plan.strategy == "coherent" and plan.seed == 0
    again = _recpipe("towers", "partition", str(towers_dataset), "--towers", "2", "--balance", "1",
                     "--steps", "4", "--batch-size", "64", "--affinity-batches", "2", "--out",
                     str(tmp_path / "again.toml"), "--quiet", *MODEL)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again.toml").read_text() == plan_file.read_text()


@pytest.mark.slow
def test_partition_refuses_an_impossible_balance(towers_dataset, tmp_path):
    done = _recpipe("towers", "partition", str(towers_dataset), "--towers", "5", "--balance", "1",
                    "--steps", "1", "--out", str(tmp_path / "t.toml"), "--quiet")  # fmt: skip
    assert done.returncode != 0
    assert "`--balance` 1 cannot split 12 features into 5 towers" in done.stderr
    assert not (tmp_path / "t.toml").exists()


@pytest.mark.slow
def test_train_one_process_and_two_hosts(towers_dataset, plan_file, tmp_path):
    common = ["towers", "train", str(towers_dataset), "--towers", str(plan_file), "--steps", "3",
              "--batch-size", "32", "--eval-batches", "1", "--quiet", *MODEL]  # fmt: skip
    one = _recpipe(*common, "--json", str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stderr[-3000:]
    single = json.loads((tmp_path / "one.json").read_text())
    assert single["steps"] == 3 and single["towers"]["schedule"] == "local"
    two = _recpipe(*common, "--nproc", "2", "--ranks-per-host", "1", "--tower-module", "dlrm",
                   "--compression", "2", "--json", str(tmp_path / "two.json"))  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    got = json.loads((tmp_path / "two.json").read_text())
    towers = got["towers"]
    assert got["steps"] == 3 and towers["schedule"] == "sptt" and towers["world_size"] == 2
    assert towers["vectors"] == [3, 3] and towers["compression"] == 2.0
    assert towers["traffic"]["peer_a2a"]["cross_host"] > 0
    assert towers["traffic"]["host_a2a"]["calls"] > 0
    assert towers["traffic"]["host_a2a"]["cross_host"] == 0
    assert towers["cross_host_bytes_per_sample"] > 0
