"""What the ranks of the dispatch tests run (spawned processes; results go to a JSON file): ranks
whose micro-batches a dispatch policy chose train like one process on the same global batches."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import dist_cases
import torch
import torch.distributed as dist

from readers.dataset import dataset_schema
from readers.dispatch.cut import rank_cut
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from trainer.distributed.comm import Comm

POLICIES = [("esd", 1.0), ("esd", 0.0), ("laia", 1.0), ("random", 1.0)]


def _stream(dataset: str, *, rank: int, world: int, cut) -> list:
    """The first steps of this rank, cut by ``cut``: the reader config of
    :func:`dist_cases.rank_batches`, so the global batches are the reference's."""
    config = ReaderConfig(batch_size=dist_cases.BATCH, shuffle=True, seed=1)
    ds = RankBatchDataset(dataset, config=config, rank=rank, world_size=world, cut=cut)
    return [b for _, b in zip(range(dist_cases.STEPS), ds, strict=False)]


def _sessions(batches: list) -> list[list[int]]:
    return [b.session_ids.tolist() for b in batches]


def _policy_case(comm: Comm, dataset: str, policy: str, alpha: float, ref: dict) -> dict | None:
    schema = dataset_schema(dataset)
    # a small cache and one fast rank, so that the placement differs from the contiguous one
    cut = rank_cut(policy, schema=schema, alpha=alpha, cache_rows=(64,),
                   bandwidths=(1e9,) * (comm.world_size - 1) + (1e10,))  # fmt: skip
    batches = _stream(dataset, rank=comm.rank, world=comm.world_size, cut=cut)
    plain = dist_cases.rank_batches(dataset, rank=comm.rank, world=comm.world_size, dedup=True,
                                    steps=dist_cases.STEPS)  # fmt: skip
    moved = sum(a != b for a, b in zip(_sessions(batches), _sessions(plain), strict=True))
    trainer = dist_cases.build(dataset, "adagrad", comm, torch.float32)
    losses = [float(trainer.train_step(b)[0]) for b in batches]
    counts = torch.tensor([moved, sum(len(b.labels) for b in batches)])
    every = comm.all_gather(counts, what="test")
    if comm.rank != 0:
        return None
    return {
        "policy": policy,
        "alpha": alpha,
        "losses": losses,
        "reference": ref["losses"],
        "loss_dev": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)),
        "steps_moved": [int(c[0]) for c in every],
        "rows": [int(c[1]) for c in every],
    }


def _once_case(comm: Comm, dataset: str) -> dict | None:
    """Rank 0 dispatching for both ranks over the placement broadcast gives each rank the
    micro-batches of its own copy of the cut, row for row."""
    from readers.dispatch.cut import DispatchOnceCut
    from trainer.distributed.run import placement_broadcast

    schema = dataset_schema(dataset)
    out = {}
    options = {"schema": schema, "cache_rows": (64,),
               "bandwidths": (1e9,) * (comm.world_size - 1) + (1e10,)}  # fmt: skip
    for policy, alpha in POLICIES:
        once = DispatchOnceCut(rank_cut(policy, alpha=alpha, **options), rank=comm.rank,
                               world_size=comm.world_size, share=placement_broadcast(comm))  # fmt: skip
        got = _stream(dataset, rank=comm.rank, world=comm.world_size, cut=once)
        once.close()
        want = _stream(dataset, rank=comm.rank, world=comm.world_size,
                       cut=rank_cut(policy, alpha=alpha, **options))  # fmt: skip
        same = all(
            a.session_ids.tolist() == b.session_ids.tolist() and torch.equal(a.labels, b.labels)
            for a, b in zip(got, want, strict=True)
        )
        every = comm.all_gather(torch.tensor([int(same), len(got)]), what="test")
        out[f"{policy}_{alpha}"] = [[int(v) for v in e] for e in every]
    return out if comm.rank == 0 else None


def _train_rank_case(comm: Comm, dataset: str) -> dict | None:
    """``recpipe train``'s rank loop with ``--dispatch contiguous`` and ``--dispatch esd``."""
    from trainer.config import TrainConfig
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.run import train_rank

    config = TrainConfig(dataset=dataset, batch_size=dist_cases.BATCH, steps=4,
                         eval_fraction=0.25, model=dist_cases.SMALL_MODEL, seed=0)  # fmt: skip
    options = DistributedConfig(hot_rows=16, count_steps=2, probe_rows=256, probe_repeats=1)
    plain, _ = train_rank(config, options, comm=comm, progress=False)
    # esd prices per-rank caches: it runs with real ones (refused without)
    esd_options = replace(options, dispatch="esd", alpha=0.5, hot_rows=0, cache_rows=64)
    esd, _ = train_rank(config, esd_options, comm=comm, progress=False)
    if comm.rank != 0:
        return None
    return {"contiguous": plain.losses, "esd": esd.losses}


def dispatch_job(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Every policy of :data:`POLICIES` against one process, and the rank loop (2 ranks)."""
    comm = dist_cases.subgroup_comm(world_size)
    ref = {}
    if rank == 0:
        ref = dist_cases.reference(dataset, "adagrad", True, torch.float32, world_size)
    results = [_policy_case(comm, dataset, p, a, ref) for p, a in POLICIES]
    once = _once_case(comm, dataset)
    loop = _train_rank_case(comm, dataset)
    if rank == 0:
        Path(out, "dispatch.json").write_text(
            json.dumps({"policies": results, "once": once, "loop": loop})
        )
    dist.barrier()
