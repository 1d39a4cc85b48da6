"""What the ranks of the distributed tests run (in spawned processes; results go to JSON files
that the tests read). Every case compares W ranks with one process on the same global batches:
the reference is a :class:`DistributedTrainer` with a world of one on the concatenated batches
(checked against the single-process store trainer in ``test_exchange.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from readers.dataset import dataset_schema
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from trainer.distributed.batches import global_batches
from trainer.distributed.comm import Comm
from trainer.distributed.costs import CostFit, LineFit, choose_num_hot
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM, ModelConfig

SMALL_MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=1000, bottom_mlp=(16,), top_mlp=(16,), attention_heads=2
)
BATCH = 32  # rows per rank
STEPS = 3
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}
# a cost model under which some, not all, rows are worth replicating (deterministic, unlike a
# fit on a loaded machine): a row pays for its all-reduce when accessed in more than 2 of the
# 3 steps (C_ar / C_a2a = 2 / 3 steps), so 0 < chosen R < all rows
FIXED_FIT = CostFit(
    all_reduce=LineFit(2e-6, 1e-6, 1.0, (), ()),
    all_to_all=LineFit(2 * 3e-6 + 1e-7, 1e-5, 1.0, (), ()),
    hot_lookup=LineFit(1e-7 + 2 * 2e-6, 1e-5, 1.0, (), ()),  # W·C_ar in the hot sweep's slope
    world_size=2,
)
CONFIGS = [
    *((opt, r, dedup, "float32") for opt in ("sgd", "adagrad") for r in ("zero", "chosen", "all")
      for dedup in (True, False)),
    ("sgd", "chosen", True, "float64"),
    ("adagrad", "chosen", True, "float64"),
    ("adagrad", "reshard", True, "float32"),
]  # fmt: skip
# cases where the tables depend on nothing but the exchange, which must meet float32's 1e-6: the
# dense part frozen (its learning rate 0: its float32 gradients are BLAS sums over the batch, in
# another order for every split of it) and no attention pooling (it pads a batch to its longest
# row, so a micro-batch and the global batch sum its softmax and products over other lengths)
EXCHANGE_ONLY = [("adagrad", "chosen", dedup, "float32") for dedup in (True, False)]
# the dense part learning, its gradients summed in float64 (--exact-dense) and no attention
# pooling: every float32 case must meet 1e-6
EXACT_DENSE = [c for c in CONFIGS if c[3] == "float32" and c[1] != "reshard"]


def subgroup_comm(world: int) -> Comm | None:
    """A :class:`Comm` over global ranks ``[0, world)`` (every process must call this)."""
    ranks = list(range(world))
    group, dense = dist.new_group(ranks), dist.new_group(ranks)
    if dist.get_rank() >= world:
        return None
    return Comm.of(group, device="cpu", timeout_s=60.0, dense_group=dense)


_BATCHES: dict = {}


def rank_batches(dataset: str, *, rank: int, world: int, dedup: bool, steps: int) -> list:
    key = (dataset, rank, world, dedup, steps)
    if key in _BATCHES:
        return _BATCHES[key]
    ds = RankBatchDataset(
        dataset, config=ReaderConfig(batch_size=BATCH, shuffle=True, seed=1), dedup=dedup,
        rank=rank, world_size=world,
    )  # fmt: skip
    _BATCHES[key] = [b for _, b in zip(range(steps), ds, strict=False)]
    return _BATCHES[key]


DENSE_MODES = ("learning", "frozen", "exact", "default")


def build(
    dataset: str, opt: str, comm: Comm, dtype: torch.dtype, *, dense: str = "learning"
) -> DistributedTrainer:
    """A trainer of the small model. ``dense``: ``"learning"`` (attention pooling, DDP's
    float32 sums: ``--fast-dense``); ``"frozen"`` (no attention pooling, the dense part does not
    learn: lr 0); ``"exact"`` (no attention pooling, the dense gradients summed in float64:
    ``exact_dense``); ``"default"`` (attention pooling and exact dense gradients: what
    ``recpipe train --nproc N`` runs)."""
    assert dense in DENSE_MODES, dense
    schema = dataset_schema(dataset)
    factory = sharded_table_factory(optimizer=opt, dtype=dtype)
    attention = dense in ("learning", "default")
    config = SMALL_MODEL if attention else replace(SMALL_MODEL, attention="none")
    model = DLRM.from_schema(schema, config, table_factory=factory).to(dtype)
    trainer = DistributedTrainer(
        model, comm=comm, optimizer=opt, hot_budget_rows=1 << 20,
        exact_dense=dense in ("exact", "default"),
    )  # fmt: skip
    if dense == "frozen":
        for group in (g for o in trainer.optimizers for g in o.param_groups):
            group["lr"] = 0.0
    return trainer


def all_rows(comm: Comm, trainer: DistributedTrainer) -> dict | None:
    """Every rank's owned rows, merged on rank 0 (``None`` elsewhere)."""
    parts = [None] * comm.world_size if comm.rank == 0 else None
    global_zero = dist.get_global_rank(comm.group, 0)
    dist.gather_object(trainer.sparse.owned_rows(), parts, dst=global_zero, group=comm.group)
    if comm.rank != 0:
        return None
    out = {}
    for name in parts[0]:
        ids = torch.cat([p[name]["ids"] for p in parts])
        order = torch.argsort(ids)
        entry = {"ids": ids[order], "values": torch.cat([p[name]["values"] for p in parts])[order]}
        if parts[0][name]["state"] is not None:
            entry["state"] = torch.cat([p[name]["state"] for p in parts])[order]
        out[name] = entry
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are all zero)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else diff


def compare_tables(got: dict, want: dict) -> float:
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        if not torch.equal(g["ids"], w["ids"]):
            return float("inf")
        worst = max(worst, relative(g["values"], w["values"]))
        if "state" in w:
            worst = max(worst, relative(g["state"], w["state"]))
    return worst


def compare_dense(got: dict, want: dict) -> float:
    return max(relative(got[k], want[k]) for k in want if want[k].is_floating_point())


def replicas_equal(comm: Comm, trainer: DistributedTrainer) -> bool:
    """Every table's hot replica is bitwise the same on every rank."""
    same = True
    for table in trainer.tables:
        every = comm.all_gather(table.hot_values, what="test")
        same &= all(torch.equal(every[0], v) for v in every)
        if table.hot_state is not None:
            every = comm.all_gather(table.hot_state, what="test")
            same &= all(torch.equal(every[0], v) for v in every)
    return bool(same)


def one_process(
    dataset: str, opt: str, dtype: torch.dtype, streams: list, *, dense: str = "learning"
) -> dict:
    """One process on the global batches made of ``streams`` (one per rank)."""
    trainer = build(dataset, opt, Comm.single(), dtype, dense=dense)
    losses = [float(trainer.train_step(b)[0]) for b in global_batches(streams)]
    return {
        "losses": losses,
        "tables": _single_rows(trainer),
        "dense": {k: v.clone() for k, v in trainer.module.state_dict().items()},
    }


def reference(
    dataset: str, opt: str, dedup: bool, dtype: torch.dtype, world: int, *, dense: str = "learning"
) -> dict:
    """One process on the global batches of a ``world``-rank job; and how far one process
    drifts from itself in float32 when the same global batches hold their rows in another order
    (the micro-batches concatenated in reverse): the floor of any comparison in float32."""
    streams = [rank_batches(dataset, rank=r, world=world, dedup=dedup, steps=STEPS)
               for r in range(world)]  # fmt: skip
    ref = one_process(dataset, opt, dtype, streams, dense=dense)
    if dtype == torch.float32:
        again = one_process(dataset, opt, dtype, streams[::-1], dense=dense)
        ref["table_noise"] = compare_tables(again["tables"], ref["tables"])
        ref["dense_noise"] = compare_dense(again["dense"], ref["dense"])
    return ref


def digest(tables: dict) -> str:
    """A hash of every table's ids, values and state (bitwise comparisons between cases)."""
    h = hashlib.sha256()
    for name in sorted(tables):
        for key in ("ids", "values", "state"):
            if key in tables[name]:
                h.update(tables[name][key].numpy().tobytes())
    return h.hexdigest()


def _single_rows(trainer: DistributedTrainer) -> dict:
    rows = trainer.sparse.owned_rows()
    return {name: {k: v for k, v in entry.items() if v is not None} for name, entry in rows.items()}


def run_case(
    comm: Comm, dataset: str, case: tuple, refs: dict, *, dense: str = "learning"
) -> dict | None:
    opt, hot, dedup, dtype_name = case
    dtype = getattr(torch, dtype_name)
    world = comm.world_size
    batches = rank_batches(dataset, rank=comm.rank, world=world, dedup=dedup, steps=STEPS)
    trainer = build(dataset, opt, comm, dtype, dense=dense)
    initial = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    for batch in batches:  # count this job's accesses first: the hot set is chosen from them
        trainer.sparse.count(batch)
    cand = trainer.sparse.gather_counts()
    everything = int(cand.counts.size)
    chosen = choose_num_hot(cand, FIXED_FIT).num_hot
    schedule = {
        "zero": [0],
        "chosen": [chosen],
        "all": [everything],
        "reshard": [0, chosen, everything, chosen // 2],
    }[hot]
    losses, replicas_same, sizes = [], True, []
    for step, batch in enumerate(batches):
        if step < len(schedule):
            trainer.sparse.reshard(schedule[step])
            replicas_same &= replicas_equal(comm, trainer)
        sizes.append(trainer.sparse.num_hot)
        losses.append(float(trainer.train_step(batch)[0]))
        replicas_same &= replicas_equal(comm, trainer)
    cold = torch.tensor([trainer.sparse.stats.cold_rows])
    comm.all_reduce(cold, what="test")
    tables = all_rows(comm, trainer)
    if comm.rank != 0:
        return None
    key = (opt, dedup, dtype_name, dense)
    if key not in refs:
        refs[key] = reference(dataset, opt, dedup, dtype, world, dense=dense)
    ref = refs[key]
    loss_dev = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True))
    return {
        "case": list(case),
        "exchange_only": dense == "frozen",
        "exact_dense": dense == "exact",
        "world": world,
        "hot_rows": sizes,
        "all_rows": everything,
        "losses": losses,
        "tables_digest": digest(tables),
        "loss_dev": loss_dev,
        "table_dev": compare_tables(tables, ref["tables"]),
        "dense_dev": compare_dense(trainer.module.state_dict(), ref["dense"]),
        "dense_moved": compare_dense(trainer.module.state_dict(), initial),
        "tolerance": TOLERANCE[dtype],
        "table_noise": ref.get("table_noise", 0.0),
        "dense_noise": ref.get("dense_noise", 0.0),
        "replicas_equal": replicas_same,
        "cold_rows": int(cold.item()),
        # N (1 - rho(R)) over the steps, from the counts: every access minus the hot ones
        "expected_cold_rows": int(cand.total - cand.counts[: sizes[0]].sum())
        if hot != "reshard" else None,
    }  # fmt: skip


def matrix(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Every case at 2, 3 and 4 ranks, in one job of ``world_size`` = 4 processes; and at 2
    ranks, ``recpipe train``'s rank loop in-process and through the reader service."""
    for world in (2, 3, 4):
        comm = subgroup_comm(world)
        if comm is not None:
            refs: dict = {}
            results = [run_case(comm, dataset, case, refs) for case in CONFIGS]
            results += [run_case(comm, dataset, c, refs, dense="frozen") for c in EXCHANGE_ONLY]
            results += [run_case(comm, dataset, c, refs, dense="exact") for c in EXACT_DENSE]
            if comm.rank == 0:
                Path(out, f"matrix-{world}.json").write_text(json.dumps(results))
            if world == 2:
                served = service_and_in_process(comm, dataset)
                if comm.rank == 0:
                    Path(out, "service.json").write_text(json.dumps(served))
        dist.barrier()


# the default dense mode with attention pooling on, over more steps: (optimizer, dedup)
ATTENTION_CASES = [("adagrad", True), ("adagrad", False), ("sgd", True)]
ATTENTION_STEPS = 20


def exact_with_attention(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Every case of :data:`ATTENTION_CASES` at 2 .. ``world_size`` ranks (subgroups of one job)
    with the default dense mode (attention pooling, exact dense gradients), and one process on
    the same global batches: ``attention-{world}.json`` (rank 0 of each world)."""
    for world in range(2, world_size + 1):
        comm = subgroup_comm(world)
        if comm is not None:
            results = [_attention_case(comm, dataset, opt, dedup) for opt, dedup in ATTENTION_CASES]
            if comm.rank == 0:
                Path(out, f"attention-{world}.json").write_text(json.dumps(results))
        dist.barrier()


def _attention_case(comm: Comm, dataset: str, opt: str, dedup: bool) -> dict | None:
    world = comm.world_size
    batches = rank_batches(dataset, rank=comm.rank, world=world, dedup=dedup,
                           steps=ATTENTION_STEPS)  # fmt: skip
    trainer = build(dataset, opt, comm, torch.float32, dense="default")
    initial = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    losses = [float(trainer.train_step(b)[0]) for b in batches]
    tables = all_rows(comm, trainer)
    if comm.rank != 0:
        return None
    streams = [rank_batches(dataset, rank=r, world=world, dedup=dedup, steps=ATTENTION_STEPS)
               for r in range(world)]  # fmt: skip
    ref = one_process(dataset, opt, torch.float32, streams, dense="default")
    dense, want = trainer.module.state_dict(), ref["dense"]
    return {
        "case": [opt, dedup],
        "world": world,
        "steps": len(losses),
        "losses": losses,
        "reference": ref["losses"],
        "loss_dev": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)),
        "dense_dev": compare_dense(dense, want),
        "table_dev": compare_tables(tables, ref["tables"]),
        "dense_bitwise": all(torch.equal(dense[k], want[k]) for k in want),
        "tables_bitwise": digest(tables) == digest(ref["tables"]),
        "attention_moved": max(
            relative(dense[k], initial[k]) for k in want if k.startswith("attention.")
        ),
        "outside": trainer.exact.outside if trainer.exact is not None else None,
    }


def die_at_step(rank: int, world_size: int, dataset: str, out: str, victim: int, step: int):
    """Train; rank ``victim`` kills itself (SIGKILL) before step ``step``; the others must fail
    with an error, not hang."""
    comm = Comm.of(dist.new_group(), device="cpu", timeout_s=60.0, dense_group=dist.new_group())
    batches = rank_batches(dataset, rank=rank, world=world_size, dedup=True, steps=step + 3)
    trainer = build(dataset, "adagrad", comm, torch.float32)
    try:
        for t, batch in enumerate(batches):
            if t == step and rank == victim:
                Path(out, "killed").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            trainer.train_step(batch)
    except Exception as exc:
        Path(out, f"error-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    Path(out, f"finished-{rank}").write_text("no error")


def resume_reference(
    dataset: str, model: ModelConfig, reader_at_resume: dict, *, steps: tuple,
    optimizer: str = "adagrad",
):  # fmt: skip
    """One process on the global batches of a job that ran ``steps[0]`` steps at 2 ranks and
    ``steps[1]`` more at 3 (the rows no rank had delivered, dealt again): losses and tables.
    The job is ``recpipe train`` with ``--seed 0 --eval-fraction 0``."""
    reader = ReaderConfig(batch_size=BATCH, shuffle=True, seed=0)
    batches = []
    for world, state, count in ((2, None, steps[0]), (3, reader_at_resume, steps[1])):
        parts = []
        for r in range(world):
            ds = RankBatchDataset(dataset, config=reader, rank=r, world_size=world)
            if state is not None:
                ds.load_state_dict(state)
            parts.append([b for _, b in zip(range(count), ds, strict=False)])
        batches.extend(global_batches(parts))
    factory = sharded_table_factory(optimizer=optimizer)
    net = DLRM.from_schema(dataset_schema(dataset), model, table_factory=factory)
    trainer = DistributedTrainer(net, comm=Comm.single(), optimizer=optimizer, exact_dense=True)
    losses = [float(trainer.train_step(b)[0]) for b in batches]
    return {"losses": losses, "tables": _single_rows(trainer)}


def checkpoint_tables(root: str) -> dict:
    """Every row of a multi-rank checkpoint, merged over its rank files, sorted by id."""
    from trainer.distributed.checkpoint import read_checkpoint, read_part

    state = read_checkpoint(root)
    world = state["world_size"]
    parts = [read_part(root, state, "sparse", rank=r, world_size=world)["rows"]
             for r in range(world)]  # fmt: skip
    out = {}
    for name in parts[0]:
        ids = torch.cat([p[name]["ids"] for p in parts])
        order = torch.argsort(ids)
        out[name] = {"ids": ids[order],
                     "values": torch.cat([p[name]["values"] for p in parts])[order],
                     "state": torch.cat([p[name]["state"] for p in parts])[order]}  # fmt: skip
    return out


def service_and_in_process(comm: Comm, dataset: str) -> dict | None:
    """``train_rank`` on this group twice, reading in-process and through the reader service
    (one client per rank, rank 0's process hosts the server): the training losses and the
    remainders (rank 0's record; ``None`` elsewhere)."""
    import io

    from readers.service import DatasetProducer, ReaderServer, ServiceConfig
    from trainer.config import TrainConfig
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.run import train_rank

    config = TrainConfig(dataset=dataset, batch_size=BATCH, steps=4, eval_fraction=0.25,
                         model=SMALL_MODEL, seed=0)  # fmt: skip
    options = DistributedConfig(hot_rows=16, count_steps=2, probe_rows=256, probe_repeats=1)
    server = None
    if comm.rank == 0:
        producer = DatasetProducer(dataset, batch_size=BATCH, shuffle=True, seed=0,
                                   warmup_batches=0)  # fmt: skip
        server = ReaderServer(producer, config=ServiceConfig(readers=0, report_every_s=0),
                              log=io.StringIO()).start()  # fmt: skip
    address = [None if server is None else "{}:{}".format(*server.address)]
    dist.broadcast_object_list(address, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    try:
        here, _ = train_rank(config, options, comm=comm, progress=False)
        served, summary = train_rank(
            replace(config, service=address[0]), options, comm=comm, progress=False
        )
    finally:
        if server is not None:
            server.close()
    if comm.rank != 0:
        return None
    return {
        "in_process": here.losses,
        "service": served.losses,
        "evals": [here.final_eval.samples, served.final_eval.samples],
        "remainder_rows": summary.remainder_rows,
    }
