"""What the ranks of the rank-cache tests run (spawned processes; results go to a JSON file):
ranks with per-rank embedding caches, their micro-batches chosen by ESD dispatch, train like one
process on the same global batches, and every step's pulls and pushes are those the
dispatcher's cache shadow predicted."""

from __future__ import annotations

import json
from pathlib import Path

import dist_cases
import torch
import torch.distributed as dist

from readers.dataset import dataset_schema
from readers.dispatch.cut import rank_cut
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from trainer.distributed.cache import RECORD_KINDS
from trainer.distributed.comm import Comm
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM

CACHE_ROWS = 512  # rows stay cached across steps (hits), and some are evicted every step
STEPS = 6
WORLDS = (2, 3)


def _cut(schema, world: int):
    return rank_cut("esd", schema=schema, alpha=1.0, cache_rows=(CACHE_ROWS,),
                    bandwidths=(1e9,) * (world - 1) + (1e10,),
                    id_modulus=dist_cases.SMALL_MODEL.num_embeddings)  # the tables' rows  # fmt: skip


def _stream(dataset: str, *, rank: int, world: int, cut) -> list:
    config = ReaderConfig(batch_size=dist_cases.BATCH, shuffle=True, seed=1)
    ds = RankBatchDataset(dataset, config=config, rank=rank, world_size=world, cut=cut)
    return [b for _, b in zip(range(STEPS), ds, strict=False)]


def build(dataset: str, comm: Comm, *, cache_rows: int | None, frozen: bool) -> DistributedTrainer:
    """The small model of the distributed tests, with per-rank caches (``cache_rows``)."""
    from dataclasses import replace

    schema = dataset_schema(dataset)
    factory = sharded_table_factory(optimizer="adagrad", dtype=torch.float32)
    config = replace(dist_cases.SMALL_MODEL, attention="none") if frozen else dist_cases.SMALL_MODEL
    model = DLRM.from_schema(schema, config, table_factory=factory)
    trainer = DistributedTrainer(model, comm=comm, optimizer="adagrad", cache_rows=cache_rows,
                                 table_order=list(schema.sparse_names))  # fmt: skip
    if frozen:
        for group in (g for o in trainer.optimizers for g in o.param_groups):
            group["lr"] = 0.0
    return trainer


def _case(comm: Comm, dataset: str, *, frozen: bool) -> dict | None:
    schema = dataset_schema(dataset)
    world = comm.world_size
    cut = _cut(schema, world)
    batches = _stream(dataset, rank=comm.rank, world=world, cut=cut)
    trainer = build(dataset, comm, cache_rows=CACHE_ROWS, frozen=frozen)
    trainer.sparse.keep_records = True
    losses = [float(trainer.train_step(b)[0]) for b in batches]
    tables = dist_cases.all_rows(comm, trainer)
    dispatches = {d.step: d for d in cut.recent()}
    steps = sorted(dispatches)[:STEPS]
    mismatches, totals = [], dict.fromkeys(RECORD_KINDS, 0)
    for k, (record, step) in enumerate(zip(trainer.sparse.records, steps, strict=True)):
        predicted = dispatches[step].transfers
        for kind in RECORD_KINDS:
            want = cut.row_pairs(getattr(predicted, kind)[comm.rank])
            got = getattr(record, kind)
            totals[kind] += int(got.shape[0])
            if not (got.shape == want.shape and (got == want).all()):
                mismatches.append([k, kind, int(got.shape[0]), int(want.shape[0])])
    every = [None] * world if comm.rank == 0 else None
    dist.gather_object({"mismatches": mismatches, "totals": totals}, every,
                       dst=dist.get_global_rank(comm.group, 0), group=comm.group)  # fmt: skip
    if comm.rank != 0:
        return None
    streams = [_stream(dataset, rank=r, world=world, cut=_cut(schema, world)) for r in range(world)]
    dense = "frozen" if frozen else "learning"
    ref = dist_cases.one_process(dataset, "adagrad", torch.float32, streams, dense=dense)
    return {
        "world": world,
        "frozen": frozen,
        "loss_dev": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)),
        "table_dev": dist_cases.compare_tables(tables, ref["tables"]),
        "ranks": every,
    }


def _loop_case(comm: Comm, dataset: str, out: str) -> dict | None:
    """``recpipe train``'s rank loop with ``--dispatch esd --cache-rows``, and without caches;
    and with caches stopped after 2 steps (a checkpoint, dirty rows still in the caches) and
    resumed to 4."""
    from dataclasses import replace

    from trainer.config import TrainConfig
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.run import train_rank

    config = TrainConfig(dataset=dataset, batch_size=dist_cases.BATCH, steps=4,
                         eval_fraction=0.25, model=dist_cases.SMALL_MODEL, seed=0)  # fmt: skip
    with_caches = DistributedConfig(dispatch="esd", hot_rows=0, count_steps=2, probe_rows=256,
                                    probe_repeats=1, bandwidths=(1e9, 1e10),
                                    cache_rows=CACHE_ROWS)  # fmt: skip
    # without caches esd is refused (it would price caches the ranks lack): the contiguous cut
    plain, _ = train_rank(config, replace(with_caches, dispatch="contiguous", cache_rows=0),
                          comm=comm, progress=False)  # fmt: skip
    cached, summary = train_rank(config, with_caches, comm=comm, progress=False)
    ckpt = str(Path(out, "checkpoint"))
    train_rank(replace(config, steps=2, checkpoint=ckpt), with_caches, comm=comm, progress=False)
    resumed, _ = train_rank(replace(config, checkpoint=ckpt, resume=True), with_caches, comm=comm,
                            progress=False)  # fmt: skip
    if comm.rank != 0:
        return None
    return {
        "plain": plain.losses,
        "cached": cached.losses,
        "resumed": resumed.losses,
        "plain_eval": plain.final_eval.loss,
        "cached_eval": cached.final_eval.loss,
        "summary": summary.cache,
        "shadow": [summary.shadow_steps, summary.shadow_matched],
        "per_rank": summary.cache_per_rank,
        "lines": dict(summary.lines()),
    }


def cache_job(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Every world of :data:`WORLDS`, with the dense part learning and frozen; the rank loop
    on 2 ranks."""
    results, loop = [], None
    for world in WORLDS:
        comm = dist_cases.subgroup_comm(world)
        for frozen in (False, True):
            if comm is not None:
                results.append(_case(comm, dataset, frozen=frozen))
        if comm is not None and world == 2:
            loop = _loop_case(comm, dataset, out)
    if rank == 0:
        Path(out, "cache.json").write_text(json.dumps({"cases": results, "loop": loop}))
    dist.barrier()


COLLECTIVES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_object",
               "all_gather_into_tensor", "broadcast", "gather", "scatter", "reduce_scatter_tensor",
               "barrier", "send", "recv")  # fmt: skip


class CollectiveCounter:
    """Counts the calls of ``torch.distributed``'s collectives while ``on`` (the exchange calls
    them through the module, so patching its attributes sees every one)."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, int] = {}
        self._real = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, real in self._real.items():
            setattr(dist, name, self._counted(name, real))

    def _counted(self, name, real):
        def counted(*args, **kwargs):
            if self.on:
                self.calls[name] = self.calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return counted

    def count(self, fn, *args, **kwargs) -> tuple[object, dict[str, int]]:
        """``fn(*args, **kwargs)`` and the collectives it called, by name."""
        self.calls, self.on = {}, True
        try:
            return fn(*args, **kwargs), self.calls
        finally:
            self.on = False

    def restore(self) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)


def _rounds(comm: Comm, batches: list, dataset: str, cache_rows: int) -> dict:
    trainer = build(dataset, comm, cache_rows=cache_rows, frozen=False)
    sparse, counter = trainer.sparse, CollectiveCounter()
    real_prepare, real_step = sparse.prepare, sparse.step
    per_step: list[dict[str, int]] = []

    def prepare(batch, *, train=True):
        planned, calls = counter.count(real_prepare, batch, train=train)
        per_step.append(dict(calls))
        return planned

    def step():
        _, calls = counter.count(real_step)
        for name, n in calls.items():
            per_step[-1][name] = per_step[-1].get(name, 0) + n

    sparse.prepare, sparse.step = prepare, step
    moved = []
    try:
        for batch in batches:
            trainer.train_step(batch, reduce_loss=False)
            moved.append(sparse.last_record.counts())
        sparse.prepare, sparse.step = real_prepare, real_step
        _, eval_calls = counter.count(sparse.prepare, batches[0], train=False)
        _, rows_calls = counter.count(sparse.owned_rows)
    finally:
        counter.restore()
    return {"steps": per_step, "moved": moved, "eval": eval_calls, "owned_rows": rows_calls}


def rounds_job(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Cached 2-rank jobs on their own micro-batches, with caches of :data:`CACHE_ROWS` rows
    (update pushes) and of none (every row evicted after its step, so no update pushes): the
    collectives of every training step's ``prepare`` and ``step`` (and of an evaluation's
    ``prepare`` and of ``owned_rows``), with what each step's records say it moved."""
    comm = dist_cases.subgroup_comm(world_size)
    batches = dist_cases.rank_batches(dataset, rank=rank, world=world_size, dedup=True, steps=STEPS)
    mine = {str(rows): _rounds(comm, batches, dataset, rows) for rows in (CACHE_ROWS, 0)}
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(out, "rounds.json").write_text(json.dumps(every))
    dist.barrier()
