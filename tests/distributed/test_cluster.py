"""The cluster in a box (``recpipe.testing.cluster``): 2 namespace hosts on a shaped link train
like one process, and the shaping holds.

Skipped, with the reason, where network namespaces cannot be made (not root, no CAP_NET_ADMIN,
no iproute2 or tbf). Every process has a hard deadline; a hung rank is killed and fails the
test. No namespace of the run outlives it (checked at the end of the module).
``test_cluster_parity.py`` runs towers, ESD dispatch with caches and the hybrid store across
hosts on this module's ``cluster`` fixture (imported there).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import dist_cases
import pytest

from recpipe.testing import cluster as cluster_mod
from recpipe.testing.cluster import (
    Cluster,
    ClusterUnavailable,
    list_namespaces,
    sweep_stale,
    unavailable,
    wait_all,
)

RATE_MBIT = 40.0  # 5 MB/s: moving 4 MiB takes 0.84 s at least
JOB_TIMEOUT_S = 300.0  # imports, Numba and the one-process reference on a loaded 2-core box
RANK_SCRIPT = Path(__file__).with_name("cluster_rank.py")

_WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no cluster in a box: {_WHY_NOT}")


@pytest.fixture(scope="module")
def cluster():
    with Cluster([RATE_MBIT, RATE_MBIT]) as c:
        namespaces = [h.namespace for h in c.hosts]
        yield c
    left = set(list_namespaces()) & {*namespaces, f"{c.prefix}-br"}
    assert not left, f"namespaces left behind: {sorted(left)}"


def test_moving_bytes_over_a_shaped_link_takes_at_least_bytes_over_rate(cluster):
    nbytes = 4 << 20
    rate = RATE_MBIT * 1e6 / 8  # bytes/s
    floor = (nbytes - cluster.burst_for(RATE_MBIT)) / rate  # the bucket's depth goes at once
    for src, dst in ((0, 1), (1, 0)):
        seconds = cluster.transfer(src, dst, nbytes, timeout_s=60.0)
        assert seconds >= floor, (src, dst, seconds, floor)


def test_a_link_can_be_reshaped_and_unshaped():
    with Cluster([None, None]) as c:
        c.set_rate(1, 20.0)
        nbytes = 2 << 20
        floor = (nbytes - c.burst_for(20.0)) / (20e6 / 8)
        assert c.transfer(0, 1, nbytes) >= floor
        c.set_rate(1, None)
        assert c.rates_mbit == (None, None)
        c.transfer(0, 1, nbytes)  # still connected


def test_two_hosts_train_like_one_process(cluster, dist_dataset, tmp_path):
    """Rank k on host k, gloo over the shaped link (GLOO_SOCKET_IFNAME): losses, final tables
    and dense parameters equal one process's on the same global batches (float64: 1e-12)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "CLUSTER_RANK_DUMP_S": str(JOB_TIMEOUT_S - 15)}  # fmt: skip
    procs = cluster.launch(
        [sys.executable, str(RANK_SCRIPT), str(dist_dataset), str(tmp_path)], [0, 1],
        env=env, logs=tmp_path,
    )  # fmt: skip
    codes = wait_all(procs, timeout_s=JOB_TIMEOUT_S)
    logs = "\n".join(f"-- {p.name}\n" + p.read_text(errors="replace")[-4000:]
                     for p in sorted(tmp_path.glob("rank-*.log")))  # fmt: skip
    assert codes == [0, 0], f"the ranks exited with {codes} (None: killed at the deadline)\n{logs}"
    ranks = [json.loads((tmp_path / f"rank-{k}.json").read_text()) for k in (0, 1)]
    # each rank ran in its own host, not in the test's namespace, and talked over its link
    spaces = {r["netns"] for r in ranks}
    assert len(spaces) == 2 and os.stat("/proc/self/ns/net").st_ino not in spaces
    assert all(r["link_tx_bytes"] > 10_000 for r in ranks), ranks
    results = ranks[0]["results"]
    assert [tuple(r["case"]) for r in results] == [tuple(c) for c in dist_cases_cases()]
    for r in results:
        assert r["world"] == 2
        assert r["loss_dev"] <= r["tolerance"] == 1e-12, r
        assert r["table_dev"] <= 1e-12, r
        assert r["dense_dev"] <= 1e-12, r
        assert r["replicas_equal"], r
        assert 0 < r["hot_rows"][0] < r["all_rows"], r  # some rows hot, some cold: both paths
        assert r["dense_moved"] > 1e-3, r  # the dense part learned: the check is not vacuous


def dist_cases_cases():
    import cluster_rank

    assert all(c in dist_cases.CONFIGS for c in cluster_rank.CASES)
    return cluster_rank.CASES


def _ours(prefix: str) -> set[str]:
    return {n for n in list_namespaces() if n.startswith(prefix + "-")}


def test_a_hung_process_is_killed_at_the_deadline_and_the_namespaces_go():
    with Cluster([None, 10.0]) as c:
        prefix = c.prefix
        assert _ours(prefix) == {f"{prefix}-br", f"{prefix}-h0", f"{prefix}-h1"}
        hung = c.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        assert wait_all([hung], timeout_s=0.5) == [None]
        assert hung.poll() is not None
        c.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])  # left running
    assert not _ours(prefix)


def test_an_error_inside_the_cluster_removes_it():
    with pytest.raises(ZeroDivisionError), Cluster([None]) as c:
        prefix = c.prefix
        1 / 0  # noqa: B018
    assert not _ours(prefix)


def test_namespaces_of_a_killed_run_are_swept(tmp_path):
    """SIGKILL skips every clean-up of the run; the next run deletes what it left."""
    script = (
        "import sys, time\n"
        "from recpipe.testing.cluster import Cluster\n"
        "c = Cluster([None]).start()\n"
        "print(c.prefix, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                           env=env)  # fmt: skip
    try:
        ready, _, _ = select.select([run.stdout], [], [], 60.0)
        prefix = run.stdout.readline().strip() if ready else ""
        assert prefix and _ours(prefix), prefix
    finally:
        os.kill(run.pid, signal.SIGKILL)
        run.wait(30)
        run.stdout.close()
    assert _ours(prefix)  # left behind
    assert set(sweep_stale()) >= {f"{prefix}-br", f"{prefix}-h0"}
    assert not _ours(prefix)


def test_no_cluster_without_iproute2(monkeypatch):
    monkeypatch.setattr(cluster_mod.shutil, "which", lambda name: None)
    reason = unavailable()
    assert reason is not None and "`ip`" in reason
    with pytest.raises(ClusterUnavailable, match="no cluster in a box here"):
        Cluster([10.0]).start()
