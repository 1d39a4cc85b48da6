"""One rank of the cluster-in-a-box test job (run as a script inside a namespace host by
``recpipe.testing.cluster``): joins the job from torchrun's variables as ``recpipe train``'s
ranks do (``init_from_env``), trains the cases of :mod:`dist_cases` in ``CASES``, and writes
``rank-<k>.json``: rank 0's comparisons with one process, and every rank's network namespace
and the bytes its host's link sent. Progress goes to stderr; a rank still running after
``CLUSTER_RANK_DUMP_S`` seconds prints every thread's stack (where it hangs).

Usage: ``cluster_rank.py DATASET OUT``
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import dist_cases
from dist_harness import GROUP_TIMEOUT_S

# float64: losses, tables and dense parameters to 1e-12 of one process, the dense part learning
CASES = [("adagrad", "chosen", True, "float64")]
_T0 = time.monotonic()


def _say(what: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def _tx_bytes() -> int:
    link = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{link}/statistics/tx_bytes").read_text())


def main(dataset: str, out: str) -> None:
    faulthandler.enable()
    if "CLUSTER_RANK_DUMP_S" in os.environ:
        faulthandler.dump_traceback_later(float(os.environ["CLUSTER_RANK_DUMP_S"]), exit=False)
    import torch

    from trainer.distributed.comm import destroy, init_from_env

    torch.set_num_threads(1)
    sent = _tx_bytes()
    _say("imported")
    comm = init_from_env(device="cpu", timeout_s=GROUP_TIMEOUT_S)
    _say(f"rank {comm.rank} of {comm.world_size} joined")
    refs: dict = {}
    results = []
    for case in CASES:
        results.append(dist_cases.run_case(comm, dataset, case, refs))
        _say(f"case {case} done")
    comm.barrier(what="test")
    record = {
        "rank": comm.rank,
        "world": comm.world_size,
        "netns": os.stat("/proc/self/ns/net").st_ino,
        "link_tx_bytes": _tx_bytes() - sent,
        "results": results if comm.rank == 0 else None,
    }
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    destroy()
    _say("left the group")
    sys.stderr.flush()
    # gloo's threads can abort the interpreter's exit ("terminate called without an active
    # exception") once the group is gone; the rank's record is written: leave now
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
