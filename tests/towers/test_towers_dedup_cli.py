"""`recpipe train --towers` with `--dedup on` and `--dedup off`: the same per-step losses, bit for
bit, in one process and on 2 "hosts" x 1 rank (torchrun workers), and with dedup on the sparse
all-to-all moves fewer bytes across hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--embedding-dim", "4", "--num-embeddings", "200", "--bottom-mlp", "8", "--top-mlp", "8"]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def plan(towers_dataset, tmp_path_factory):
    from readers.dataset import dataset_schema
    from trainer.towers.config import TowerPlan

    names = dataset_schema(towers_dataset).sparse_names
    return TowerPlan.strided(names, 2).save(tmp_path_factory.mktemp("plan") / "towers.toml")


def _train(dataset, plan, out: Path, dedup: str, *extra: str) -> dict:
    args = ["train", str(dataset), "--towers", str(plan), "--steps", "3", "--batch-size", "32",
            "--eval-batches", "1", "--seed", "0", "--quiet", "--dedup", dedup, *MODEL, *extra,
            "--json", str(out.with_suffix(".json")), "--metrics", str(out.with_suffix(".jsonl"))]  # fmt: skip
    if "--nproc" in extra:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
        recpipe = str(Path(sys.executable).with_name("recpipe"))
        done = subprocess.run([recpipe, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                              env=env, cwd=REPO)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        from recpipe_cli import main

        assert main(args) == 0
    summary = json.loads(out.with_suffix(".json").read_text())
    lines = out.with_suffix(".jsonl").read_text().splitlines()
    summary["losses"] = [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
    return summary


def test_one_process_dedup_on_and_off_train_bitwise_alike(towers_dataset, plan, tmp_path):
    on = _train(towers_dataset, plan, tmp_path / "on", "on")
    off = _train(towers_dataset, plan, tmp_path / "off", "off")
    assert len(on["losses"]) == 3
    assert on["losses"] == off["losses"]


@pytest.mark.slow
def test_two_hosts_dedup_on_and_off_train_bitwise_alike(towers_dataset, plan, tmp_path):
    hosts = ["--nproc", "2", "--ranks-per-host", "1"]
    on = _train(towers_dataset, plan, tmp_path / "on", "on", *hosts)
    off = _train(towers_dataset, plan, tmp_path / "off", "off", *hosts)
    assert on["towers"]["schedule"] == "sptt" and on["towers"]["world_size"] == 2
    assert len(on["losses"]) == 3
    assert on["losses"] == off["losses"]
    sparse_on = on["towers"]["traffic"]["sparse_ids"]["cross_host"]
    sparse_off = off["towers"]["traffic"]["sparse_ids"]["cross_host"]
    assert 0 < sparse_on < sparse_off
    peer = [s["towers"]["traffic"]["peer_a2a"]["cross_host"] for s in (on, off)]
    assert peer[0] == peer[1] > 0  # the pooled embeddings move as before
