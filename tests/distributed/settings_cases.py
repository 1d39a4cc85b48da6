"""What the ranks of tests/distributed/test_settings.py run (in spawned processes): `train_rank`
started with other settings on each rank, and the settings check itself; every rank writes what
it saw to ``OUT/rank-R.json``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from dist_cases import BATCH, SMALL_MODEL

from trainer.config import TrainConfig
from trainer.distributed.comm import Comm, DistributedError
from trainer.distributed.config import DistributedConfig
from trainer.distributed.run import train_rank
from trainer.distributed.settings import check_same_settings, job_settings

OPTIONS = DistributedConfig(hot_rows=16, count_steps=2, probe_rows=256, probe_repeats=1)


def cases(rank: int, dataset: str, other: str) -> dict[str, tuple[TrainConfig, DistributedConfig]]:
    """This rank's settings in each case: rank 1 differs from rank 0 in what the name says."""
    base = TrainConfig(dataset=dataset, batch_size=BATCH, steps=2, eval_fraction=0.0,
                       model=SMALL_MODEL, seed=0)  # fmt: skip
    return {
        "lr": (replace(base, lr=0.05 if rank == 0 else 0.1), OPTIONS),
        "seed_hot_rows": (replace(base, seed=rank), replace(OPTIONS, hot_rows=16 + rank)),
        "steps": (replace(base, steps=2 + rank), OPTIONS),
        "dataset": (replace(base, dataset=dataset if rank == 0 else other), OPTIONS),
    }


def started_apart(rank: int, world_size: int, dataset: str, other: str, copy: str, out: str,
                  only: str | None = None) -> None:  # fmt: skip
    """Each case through ``train_rank`` (the error each rank raised, or ``None``); then the
    check alone on settings that agree: the same data under another path, and options each
    rank may set for itself."""
    comm = Comm.of(dist.new_group(), device="cpu", timeout_s=60.0, dense_group=dist.new_group())
    seen: dict[str, str | None] = {}
    for name, (config, options) in cases(rank, dataset, other).items():
        if only is not None and name != only:
            continue
        try:
            train_rank(config, options, comm=comm, progress=False)
            seen[name] = None
        except DistributedError as exc:
            seen[name] = str(exc)
    if only is None:
        base, _ = cases(rank, dataset, other)["lr"]
        mine = replace(base, lr=0.1, dataset=dataset if rank == 0 else copy, workers=rank,
                       metrics=f"{out}/metrics-{rank}.csv")  # fmt: skip
        check_same_settings(comm, job_settings(mine, OPTIONS))
        seen["agree"] = "ok"
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
