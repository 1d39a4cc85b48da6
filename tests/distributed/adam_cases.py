"""What the ranks of ``test_adam_ranks.py`` run (spawned processes; results go to JSON files the
tests read): ``--optimizer adam`` at 2 and 3 ranks against one process on the same global
batches, and a job saved at 2 ranks and resumed at 3."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from dist_cases import (
    BATCH,
    FIXED_FIT,
    SMALL_MODEL,
    all_rows,
    build,
    compare_dense,
    compare_tables,
    replicas_equal,
    subgroup_comm,
)

from readers.dataset import dataset_schema
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from trainer.distributed.batches import global_batches
from trainer.distributed.checkpoint import load_sparse, read_checkpoint, save_checkpoint
from trainer.distributed.comm import Comm
from trainer.distributed.costs import choose_num_hot
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM
from trainer.train import Trainer

STEPS = 20
RESUME_STEPS = (8, 8)  # at 2 ranks, then at 3
# (name, dtype, dense mode of dist_cases.build, rows): "reshard": the hot set the cost model
# chooses, then every row (step 7), then half the chosen (step 14): Adam's moments move with
# the rows each time; "cache": per-rank caches of 64 rows (evictions, shared rows, pulls)
CASES = [
    ("hot, float32", "float32", "default", "reshard"),
    ("caches, float32", "float32", "default", "cache"),
    ("hot, float64", "float64", "exact", "reshard"),
]
CACHE_ROWS = 64


def batches_of(dataset: str, *, rank: int, world: int, steps: int) -> list:
    ds = RankBatchDataset(dataset, config=ReaderConfig(batch_size=BATCH, shuffle=True, seed=1),
                          rank=rank, world_size=world)  # fmt: skip
    return [b for _, b in zip(range(steps), ds, strict=False)]


def adam_trainer(dataset: str, comm: Comm, dtype: torch.dtype, dense: str, rows: str):
    """:func:`dist_cases.build`'s small model under ``adam``; ``rows``: ``"cache"`` gives every
    rank a cache of :data:`CACHE_ROWS` rows in place of the 2FP exchange."""
    if rows != "cache":
        return build(dataset, "adam", comm, dtype, dense=dense)
    factory = sharded_table_factory(optimizer="adam", dtype=dtype)
    model = DLRM.from_schema(dataset_schema(dataset), SMALL_MODEL, table_factory=factory)
    assert dense == "default"  # attention pooling, exact dense gradients
    return DistributedTrainer(model.to(dtype), comm=comm, optimizer="adam",
                              cache_rows=CACHE_ROWS, exact_dense=True)  # fmt: skip


def step_loss(trainer: DistributedTrainer, batch) -> float:
    """A training step's global mean loss as computed (float64; ``train_step`` hands it back
    as a float32 tensor)."""
    trainer.train_step(batch, reduce_loss=False)
    return trainer.pending_losses()[-1]


def _reshard(trainer: DistributedTrainer, step: int, chosen: int, everything: int) -> None:
    plan = {0: chosen, 7: everything, 14: chosen // 2}
    if step in plan:
        trainer.sparse.reshard(plan[step])


def sharded_one_process(dataset, dtype, dense, batches) -> dict:
    """The sharded engine on a world of one (no hot set, no caches) on the global batches."""
    trainer = build(dataset, "adam", Comm.single(), dtype, dense=dense)
    losses = [step_loss(trainer, b) for b in batches]
    rows = trainer.sparse.owned_rows()
    return {"losses": losses, "tables": rows,
            "dense": {k: v.clone() for k, v in trainer.module.state_dict().items()}}  # fmt: skip


def parameter_tables(dataset, dtype, dense, batches, *, exact: bool) -> list[float]:
    """One process's own engine: parameter tables under ``SparseAdam``, the dense part under
    ``Adam`` (what ``recpipe train --optimizer adam`` runs in one process); ``exact``: dense
    gradients and batch norm statistics summed in float64 (its default), else torch's float32
    sums and ``BatchNorm1d`` (``--fast-dense``)."""
    config = (
        SMALL_MODEL if dense in ("learning", "default") else replace(SMALL_MODEL, attention="none")
    )
    model = DLRM.from_schema(dataset_schema(dataset), config).to(dtype)
    trainer = Trainer(model, optimizer="adam", exact_dense=exact)
    return [float(trainer.train_step(b)[0]) for b in batches]


def _worst(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


def _case(comm: Comm, dataset: str, case: tuple) -> dict | None:
    name, dtype_name, dense, rows = case
    dtype, world = getattr(torch, dtype_name), comm.world_size
    batches = batches_of(dataset, rank=comm.rank, world=world, steps=STEPS)
    trainer = adam_trainer(dataset, comm, dtype, dense, rows)
    chosen = everything = 0
    if rows != "cache":
        for batch in batches:
            trainer.sparse.count(batch)
        cand = trainer.sparse.gather_counts()
        chosen, everything = choose_num_hot(cand, FIXED_FIT).num_hot, int(cand.counts.size)
    losses, hot_sizes, same = [], [], True
    for step, batch in enumerate(batches):
        if rows != "cache":
            _reshard(trainer, step, chosen, everything)
            hot_sizes.append(trainer.sparse.num_hot)
        losses.append(step_loss(trainer, batch))
        if rows != "cache":
            same &= replicas_equal(comm, trainer)
    steps = torch.tensor([trainer.sparse.base.optimizer_step if rows == "cache"
                          else trainer.sparse.optimizer_step])  # fmt: skip
    every_step = [int(s) for s in comm.all_gather(steps, what="test")]
    shard_steps = sorted({t.shard.step for t in trainer.tables})
    tables = all_rows(comm, trainer)
    if comm.rank != 0:
        return None
    streams = [batches_of(dataset, rank=r, world=world, steps=STEPS) for r in range(world)]
    global_b = list(global_batches(streams))
    ref = sharded_one_process(dataset, dtype, dense, global_b)
    param = parameter_tables(dataset, dtype, dense, global_b, exact=True)
    fast = parameter_tables(dataset, dtype, dense, global_b, exact=False)
    return {
        "case": name,
        "dtype": dtype_name,
        "world": world,
        "losses": losses,
        "reference": ref["losses"],
        "parameter_tables": param,
        "loss_dev": _worst(losses, ref["losses"]),
        "param_dev": _worst(losses, param),
        "fast_dense_dev": _worst(losses, fast),
        "table_dev": compare_tables(tables, ref["tables"]),
        "dense_dev": compare_dense(trainer.module.state_dict(), ref["dense"]),
        "adam_state_cols": int(tables[next(iter(tables))]["state"].shape[1]),
        "hot_sizes": hot_sizes,
        "replicas_equal": bool(same),
        "optimizer_steps": every_step,
        "shard_steps": shard_steps,
    }


def ranks_vs_one_process(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Every case of :data:`CASES` at 2 and 3 ranks (subgroups of one job of 3 processes),
    then a job saved at 2 ranks and resumed at 3: ``adam-{world}.json``, ``resume.json``."""
    for world in (2, 3):
        comm = subgroup_comm(world)
        if comm is not None:
            results = [_case(comm, dataset, case) for case in CASES]
            if comm.rank == 0:
                Path(out, f"adam-{world}.json").write_text(json.dumps(results))
        dist.barrier()
    resumes = [_resume(dataset, out, dtype, dense)
               for dtype, dense in (("float32", "default"), ("float64", "exact"))]  # fmt: skip
    if rank == 0:
        Path(out, "resume.json").write_text(json.dumps(resumes))
    dist.barrier()


def _resume(dataset: str, out: str, dtype_name: str, dense: str) -> dict | None:
    """Train RESUME_STEPS[0] steps at 2 ranks with a hot set, checkpoint (rows with their
    moments and step count, the dense Adam), resume at 3 ranks and train RESUME_STEPS[1]
    more; rank 0 also runs one process straight through the same global batches."""
    dtype = getattr(torch, dtype_name)
    first, second = RESUME_STEPS
    root = Path(out, f"ckpt-{dtype_name}")
    losses: list[float] = []
    comm = subgroup_comm(2)
    if comm is not None:
        batches = batches_of(dataset, rank=comm.rank, world=2, steps=first)
        trainer = adam_trainer(dataset, comm, dtype, dense, "hot")
        for batch in batches:
            trainer.sparse.count(batch)
        trainer.sparse.reshard(choose_num_hot(trainer.sparse.gather_counts(), FIXED_FIT).num_hot)
        losses = [step_loss(trainer, b) for b in batches]
        save_checkpoint(root, comm=comm, sparse=trainer.sparse, step=trainer.step,
                        state={"trainer": trainer.state_dict()})  # fmt: skip
    dist.barrier()
    comm = subgroup_comm(3)
    assert comm is not None
    state = read_checkpoint(root)
    trainer = adam_trainer(dataset, comm, dtype, dense, "hot")
    trainer.load_state_dict(state["trainer"])
    load_sparse(root, state, sparse=trainer.sparse)
    hot_after_load = trainer.sparse.num_hot
    batches = batches_of(dataset, rank=comm.rank, world=3, steps=second)
    losses += [step_loss(trainer, b) for b in batches]
    tables = all_rows(comm, trainer)
    if comm.rank != 0:
        return None
    straight = [b for world, n in ((2, first), (3, second)) for b in global_batches(
        [batches_of(dataset, rank=r, world=world, steps=n) for r in range(world)])]  # fmt: skip
    ref = sharded_one_process(dataset, dtype, dense, straight)
    return {
        "dtype": dtype_name,
        "losses": losses,
        "reference": ref["losses"],
        "loss_dev": _worst(losses, ref["losses"]),
        "table_dev": compare_tables(tables, ref["tables"]),
        "dense_dev": compare_dense(trainer.module.state_dict(), ref["dense"]),
        "saved_step": int(state["step"]),
        "hot_after_load": hot_after_load,
        "optimizer_step": trainer.sparse.optimizer_step,
    }
