"""The ranks-equal-one-process checks with the ranks on different namespace hosts
(``recpipe.testing.cluster``): each job is ``recpipe train``'s own worker (``python -m trainer``,
the flags of ``--nproc``) started inside its host with torchrun's variables, gloo on the host's
shaped link (intra-host pairs over the host's loopback), and compared with one process on the
same global batches, or with the same job on one host:

* towers (SPTT, tower modules compressing 2x) on 2 hosts x 2 ranks: one process's per-step
  losses within 1e-6 relative (the tolerance of ``tests/towers/test_sptt.py``);
* ``--dispatch esd --cache-rows`` on 2 hosts: the same job with both ranks on one host gives the
  same per-step losses bit for bit and the same cache transfers on every rank (dispatch does
  not depend on where ranks run), and the dispatcher's shadow predicted every step's transfers;
* ``--store hybrid`` on 2 hosts: one process's per-step losses within 1e-6 (as
  ``test_store_ranks.py``), the first step's bit for bit.

Every job has a hard deadline (a hung rank is killed and fails the test), every collective a
60 s timeout; skipped, with the reason, where namespaces cannot be made; the module's cluster is
removed in every exit path (``test_cluster.cluster``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cluster import _WHY_NOT, JOB_TIMEOUT_S, cluster  # noqa: F401  (cluster: a fixture)

from recpipe.testing.cluster import wait_all
from tests.trainer.test_one_loop import BATCH, MODEL, _train, data  # noqa: F401  (data: a fixture)

pytestmark = [
    pytest.mark.skipif(_WHY_NOT is not None, reason=f"no cluster in a box: {_WHY_NOT}"),
    pytest.mark.slow,  # each test: one or two jobs of fresh interpreters, 10-30 s on 2 cores
]

STEPS = 6
TOWERS_TOLERANCE = 1e-6  # relative, per step: tests/towers/test_sptt.py's LOSS_TOLERANCE
STORE_TOLERANCE = 1e-6  # absolute, per step: tests/distributed/test_store_ranks.py's
CROSSED = 20_000  # bytes a host's link sends at least when its ranks train with another host's
QUIET = 10_000  # at most, when no rank of the job is on another host (ARP, neighbour discovery)


def _link_tx_bytes(cluster, host: int) -> int:  # noqa: F811
    """Bytes host ``host``'s link (``eth0`` in its namespace) has sent so far."""
    out = subprocess.run(
        ["ip", "-n", cluster.hosts[host].namespace, "-s", "-j", "link", "show", "eth0"],
        capture_output=True, text=True, timeout=20, check=True,
    )  # fmt: skip
    return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def _on_hosts(cluster, data, placement, tmp: Path, *extra) -> dict:  # noqa: F811
    """``recpipe train``'s flags of ``_train`` run by ``len(placement)`` workers, rank k on host
    ``placement[k]``: rank 0's ``--json`` summary, its per-step ``losses`` and the bytes each
    host's link sent (``tx_bytes``). One thread per rank: by default a rank's threads are its
    host's cores divided among the host's ranks, and another count may sum in another order."""
    tmp.mkdir()
    args = [data[0], "--batch-size", BATCH, "--eval-batches", 1, "--seed", 0, "--quiet",
            "--checkpoint", tmp / "ck", *MODEL, "--steps", STEPS, "--threads", 1,
            "--dist-timeout", 60, "--json", tmp / "summary.json",
            "--metrics", tmp / "metrics.jsonl", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    before = [_link_tx_bytes(cluster, h) for h in range(len(cluster.hosts))]
    procs = cluster.launch([sys.executable, "-m", "trainer", *map(str, args)], placement,
                           env=env, logs=tmp)  # fmt: skip
    codes = wait_all(procs, timeout_s=JOB_TIMEOUT_S)
    logs = "\n".join(f"-- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                     for p in sorted(tmp.glob("rank-*.log")))  # fmt: skip
    assert codes == [0] * len(placement), f"the ranks exited with {codes} (None: killed)\n{logs}"
    summary = json.loads((tmp / "summary.json").read_text())
    records = [json.loads(r) for r in (tmp / "metrics.jsonl").read_text().splitlines()]
    summary["losses"] = [r["loss"] for r in records if r["kind"] == "train"]
    summary["tx_bytes"] = [_link_tx_bytes(cluster, h) - b for h, b in enumerate(before)]
    assert len(summary["losses"]) == STEPS, logs
    return summary


def _worst_relative(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def test_towers_on_two_hosts_of_two_ranks_train_like_one_process(cluster, data, tmp_path):  # noqa: F811
    """SPTT with DLRM tower modules (compression 2): ranks 0, 1 on host 0 and 2, 3 on host 1
    (the host all-to-all and the tower gradients over loopback, the peer all-to-all over the
    link); one process with the same plan and modules on the global batch of 4 x BATCH / 2."""
    towers = ["--towers", data[1], "--tower-module", "dlrm", "--compression", 2,
              "--attention", "none"]  # fmt: skip
    job = _on_hosts(cluster, data, [0, 0, 1, 1], tmp_path / "hosts", *towers,
                    "--ranks-per-host", 2, "--batch-size", BATCH // 2)  # fmt: skip
    assert job["towers"]["schedule"] == "sptt" and job["towers"]["world_size"] == 4, job["towers"]
    assert all(b >= CROSSED for b in job["tx_bytes"]), job["tx_bytes"]
    one = _train(data, "one process", tmp_path / "one", *towers, "--steps", STEPS,
                 "--batch-size", 2 * BATCH)  # fmt: skip
    worst = _worst_relative(job["losses"], one["losses"])
    assert worst <= TOWERS_TOLERANCE, (worst, job["losses"], one["losses"])


def test_esd_dispatch_with_caches_does_not_depend_on_where_ranks_run(cluster, data, tmp_path):  # noqa: F811
    """`--dispatch esd --cache-rows 64`, rank k on host k and both ranks on host 0: the same
    per-step losses (bit for bit), held-out loss and cache transfers (every kind, every rank),
    and the shadow predicted every step on both."""
    esd = ["--dispatch", "esd", "--cache-rows", 64, "--bandwidths", "1e9,1e10"]
    apart = _on_hosts(cluster, data, [0, 1], tmp_path / "apart", *esd)
    together = _on_hosts(cluster, data, [0, 0], tmp_path / "together", *esd)
    assert all(b >= CROSSED for b in apart["tx_bytes"]), apart["tx_bytes"]
    assert max(together["tx_bytes"]) <= QUIET, together["tx_bytes"]  # loopback only
    assert apart["losses"] == together["losses"]
    assert apart["eval_loss"] == together["eval_loss"]
    got, want = apart["distributed"], together["distributed"]
    assert got["cache"]["pulls"] > 0 and got["cache"]["evict_pushes"] > 0, got["cache"]
    assert got["cache_per_rank"] == want["cache_per_rank"]
    assert got["exchange"] == want["exchange"]
    assert got["shadow_matched"] == got["shadow_steps"] == STEPS, got
    assert want["shadow_matched"] == want["shadow_steps"] == STEPS, want


def test_hybrid_stores_on_two_hosts_train_like_one_process(cluster, data, tmp_path):  # noqa: F811
    """`--store hybrid` with a hot set of 64 rows after 2 counted steps, rank k on host k (each
    rank's rows in its own stores): one process `--store hybrid` on the global batch."""
    store = ["--store", "hybrid"]
    job = _on_hosts(cluster, data, [0, 1], tmp_path / "hosts", *store,
                    "--count-steps", 2, "--hot-rows", 64)  # fmt: skip
    assert job["distributed"]["hot_rows"] == 64, job["distributed"]
    assert all(b >= CROSSED for b in job["tx_bytes"]), job["tx_bytes"]
    for rank in range(2):
        assert any((tmp_path / "hosts" / "ck" / "store" / f"rank-{rank:05d}-of-00002").iterdir())
    one = _train(data, "one process", tmp_path / "one", *store, "--steps", STEPS,
                 "--batch-size", 2 * BATCH)  # fmt: skip
    assert job["losses"][0] == one["losses"][0]
    worst = max(abs(a - b) for a, b in zip(job["losses"], one["losses"], strict=True))
    assert worst <= STORE_TOLERANCE, (worst, job["losses"], one["losses"])
