"""Ranks started with different settings or datasets are refused at start-up, on every rank,
in one line naming the setting and each rank's value.

Regressions: `--lr`, `--seed` and `--hot-rows` that differed between ranks trained silently;
another dataset or `--steps` on one rank hung the job until `--dist-timeout`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import settings_cases
from dist_harness import JOIN_TIMEOUT_S, free_port, run_ranks

from tests.common.data import synthetic_dataset

pytestmark = pytest.mark.slow  # two spawned ranks, as every multi-rank test

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = JOIN_TIMEOUT_S  # spawn and import on a loaded machine; the checks take no time


@pytest.fixture(scope="module")
def outcome(dist_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("settings")
    other = synthetic_dataset(root / "other", requests=300, seed=9, files=1)
    copy = root / "copy"
    shutil.copytree(dist_dataset, copy)
    out = root / "out"
    out.mkdir()
    codes = run_ranks(settings_cases.started_apart, 2, str(dist_dataset), str(other), str(copy),
                      str(out), timeout_s=TIMEOUT_S)  # fmt: skip
    assert codes == [0, 0], codes
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]  # every rank refuses, with the same message
    return seen[0], dist_dataset, other


def check_message(message: str | None, *needles: str) -> None:
    assert message is not None, "the ranks trained with different settings"
    first, *rest = message.splitlines()
    assert first.startswith("the 2 ranks were started with different settings: "), message
    assert rest == ["hint: start every rank with the same options and the same dataset"]
    for needle in needles:
        assert needle in first, message


def test_another_lr_is_refused(outcome):
    seen, _, _ = outcome
    check_message(seen["lr"], "`--lr` 0.05 (rank 0), 0.1 (rank 1)")
    assert "`--steps`" not in seen["lr"]


def test_every_differing_setting_is_named(outcome):
    seen, _, _ = outcome
    check_message(seen["seed_hot_rows"], "`--hot-rows` 16 (rank 0), 17 (rank 1)",
                  "`--seed` 0 (rank 0), 1 (rank 1)")  # fmt: skip


def test_another_steps_or_dataset_fails_at_once_instead_of_hanging(outcome):
    seen, dataset, other = outcome
    check_message(seen["steps"], "`--steps` 2 (rank 0), 3 (rank 1)")
    check_message(seen["dataset"], f"`DATASET` '{dataset}' (files ", f"(rank 0), '{other}' (files ")


def test_the_same_data_elsewhere_and_local_options_agree(outcome):
    seen, _, _ = outcome
    assert seen["agree"] == "ok"


def _two_nodes(dataset, per_node: list[list[str]], *, timeout_s: float = TIMEOUT_S) -> list:
    """`recpipe train --nproc 1 --nnodes 2 --node-rank K` twice on this machine (two "nodes",
    static rendezvous), node K with ``per_node[K]`` added: each node's (stderr, exit code)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    recpipe = str(Path(sys.executable).with_name("recpipe"))
    port = str(free_port())
    small = ["--batch-size", "32", "--embedding-dim", "8", "--num-embeddings", "1000",
             "--eval-fraction", "0", "--count-steps", "2", "--dist-timeout", "60",
             "--no-progress"]  # fmt: skip
    procs = []
    for k, extra in enumerate(per_node):
        argv = [recpipe, "train", str(dataset), *small, "--nproc", "1", "--nnodes", "2",
                "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", port,
                *extra]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=REPO, start_new_session=True))  # fmt: skip
    try:
        return [(p.communicate(timeout=timeout_s)[1], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # the node's launcher and its worker: its own session
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)


def test_two_nodes_started_apart_both_fail_at_once(dist_dataset):
    """The multi-machine case end to end: each node's own command line, one `--lr` and one
    `--steps` apart; before, the first trained silently apart, the second hung."""
    done = _two_nodes(dist_dataset, [["--lr", "0.05", "--steps", "2"],
                                     ["--lr", "0.1", "--steps", "3"]])  # fmt: skip
    for k, (err, code) in enumerate(done):
        assert code == 1, err[-3000:]
        line = next(x for x in err.splitlines() if "started with different settings" in x)
        assert line.startswith(f"recpipe train (rank {k}): error: the 2 ranks were started"), line
        assert "`--lr` 0.05 (rank 0), 0.1 (rank 1)" in line
        assert "`--steps` 2 (rank 0), 3 (rank 1)" in line
        assert "Traceback" not in err, err[-3000:]
