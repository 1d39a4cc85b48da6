"""Training on 2 ranks (gloo, CPU): the hot-set size R and its cost model, TorchRec's
DistributedModelParallel on the same job, and 2 ranks against 1.

Generates the default synthetic logs, builds the clustered dataset, and launches 2 worker
processes through torchrun's API (`torch.distributed.launcher.api.elastic_launch`). Each rank
reads its own equal share of every global batch (`readers.ranks`, ids hashed into
`--num-embeddings` rows so TorchRec's fixed-size tables can hold them) and trains a DLRM with
every sparse feature pooled (no attention: TorchRec's sharded `EmbeddingBagCollection` pools
only). Every case runs `--steps` steps per repeat, the cases alternated (`_common.alternate`),
rank 0's wall time kept; its CPU time is reported beside it.

Figures (written to benchmarks/results/distributed.json):
  samples_per_s            global samples/s at each R measured: 0, the cost model's choice, a few
                           between, and every row seen (all tables together)
  best_r_vs_r0             samples/s at the best R measured / at R = 0 (HypeReca: 1.6x-7.8x on
                           GPUs); report what 2 CPU ranks show
  cost_model_r2            the worst r² of the lines fitted at start-up to steps of a one-table
                           exchange timed on the job's own group (step time vs hot rows R, vs
                           cold ids, vs hot ids looked up). Target >= 0.9
  chosen_vs_best_measured  step time at the chosen R / at the best R measured. Target <= 1.05
                           (R is chosen among the sizes whose predicted saving over R = 0 is 2
                           standard errors wide: `predicted_saving_se_s`)
  a2a_bytes_ratio          all-to-all bytes per step at R = 0 / at the chosen R (counted)
  vs_torchrec_dmp          our samples/s (chosen R, dedup on) / TorchRec DMP's (table-wise
                           sharding, fused row-wise Adagrad, FBGEMM's CPU kernels) on the same
                           batches (TorchRec gets them without dedup: it has no grouped IKJT).
                           Target >= 1.0; `vs_torchrec_dmp_dedup_off` compares the same without
                           dedup on our side; `vs_torchrec_dmp_paired` the same from `--pairs`
                           single steps of each run back to back (quartiles `q1`, `q3`)
  exact_dense_vs_default   samples/s with the dense gradients summed in float64 and rounded
                           once (--exact-dense: bit for bit one process) / with DDP's float32
                           sums, both at the chosen R (report); `vs_torchrec_dmp_exact_dense`
                           compares the exact run with TorchRec DMP
  scaling_2_ranks          samples/s of 2 ranks / of 1 rank with the same batch per rank
                           (report; 2 cores)
  a2a_bytes_vs_torchrec    bytes a rank sends to the others by all_to_all_single per step, ours
                           (chosen R, dedup on) / TorchRec DMP's, both counted the same way
                           (every call intercepted for `--steps` untimed steps; per-step values in
                           `a2a_sent_bytes_per_step`). TorchRec's table-wise sharding sends each
                           bag's pooled vector, 2FP every distinct cold row: the ratio shows which
                           moves more on this job (report)

`--only store` measures just these and merges them into the results file (the other figures,
and the environment they were measured in, stay; these carry theirs under `store_bench`):
  vs_torchrec_dmp_store    samples/s of ours with `--store hybrid` (every owned row in the rank's
                           own EmbeddingStore per table: trainer/distributed/store_shard.py;
                           temporary stores) / TorchRec DMP's on the same batches, at the R the
                           cost model chooses (report); `vs_torchrec_dmp_module` the same run's
                           in-memory shards / TorchRec DMP
  store_vs_module          samples/s ours with the store / ours with in-memory shards (the
                           store's own cost; report)
  checkpoint_overhead_2ranks  wall time of the store job for `--ckpt-steps` steps (200) with a
                           checkpoint every `--ckpt-every` steps (100, benchmarks/store.py's
                           defaults) / without: benchmarks/store.py's checkpoint_overhead with 2
                           ranks (with / without time ratio). Target <= 1.05;
                           `checkpoint_overhead_2ranks_in_run` = wall / (wall - time in saves)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import alternate, environment, ratio_spread, spread, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "distributed.json"
WORLD = 2

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.distributed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200_000, help="synthetic requests")
    parser.add_argument("--batch-size", type=int, default=2048, help="rows per rank per step")
    parser.add_argument("--batches", type=int, default=8, help="distinct batches per rank")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per case and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="alternated repeats per case")
    parser.add_argument(
        "--pairs", type=int, default=64,
        help="single steps of ours and of TorchRec DMP, back to back, for vs_torchrec_dmp_paired",
    )  # fmt: skip
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="rows per table")
    parser.add_argument("--probe-rows", type=int, default=65536, help="largest cost probe")
    parser.add_argument("--data", type=Path, help="an existing clustered dataset (skip synth)")
    parser.add_argument("--work", type=Path, help="working directory (default: a temp dir)")
    parser.add_argument(
        "--only", choices=["store"],
        help="store: measure only the --store hybrid figures (vs_torchrec_dmp_store, "
             "store_vs_module, checkpoint_overhead_2ranks) and merge them into --out",
    )  # fmt: skip
    parser.add_argument("--ckpt-every", type=int, default=100,
                        help="checkpoint interval (steps) of checkpoint_overhead_2ranks")  # fmt: skip
    parser.add_argument("--ckpt-steps", type=int, default=200,
                        help="steps of a checkpoint_overhead_2ranks run")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    return parser.parse_args(argv)


def build_dataset(work: Path, *, requests: int, seed: int) -> Path:
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    logs = generate(work / "raw", SynthConfig(num_requests=requests, seed=seed), progress=True)
    out = work / "clustered"
    build(logs.features, out, events=logs.events, schema=default_schema(), config=BuildConfig(),
          overwrite=True, progress=True)  # fmt: skip
    return out


# -- one rank -----------------------------------------------------------------------------------
def _batches(dataset: str, args: dict, *, rank: int, world: int, dedup: bool) -> list[Any]:
    from readers.dataset import dataset_schema
    from readers.ranks import RankBatchDataset
    from readers.source import ReaderConfig

    schema = dataset_schema(dataset)
    hashing = [{"transform": "HashModulo", "features": list(schema.sparse_names),
                "params": {"modulus": args["num_embeddings"]}}]  # fmt: skip
    ds = RankBatchDataset(
        dataset, schema=schema, transforms=hashing, dedup=dedup, rank=rank, world_size=world,
        config=ReaderConfig(batch_size=args["batch_size"], shuffle=True, seed=1),
    )  # fmt: skip
    return [b for _, b in zip(range(args["batches"]), ds, strict=False)]


def _model_config(args: dict) -> Any:
    from trainer.models import ModelConfig

    return ModelConfig(embedding_dim=args["embedding_dim"],
                       num_embeddings=args["num_embeddings"], attention="none")  # fmt: skip


def _ours(
    dataset: str, args: dict, comm: Any, *, exact_dense: bool = False, factory: Any = None
) -> Any:
    """Our trainer (adagrad at its default lr) over in-memory shards, or over ``factory``'s."""
    from readers.dataset import dataset_schema
    from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
    from trainer.models import DLRM

    factory = factory or sharded_table_factory(optimizer="adagrad")
    model = DLRM.from_schema(dataset_schema(dataset), _model_config(args), table_factory=factory)
    return DistributedTrainer(model, comm=comm, optimizer="adagrad", hot_budget_rows=1 << 24,
                              exact_dense=exact_dense)  # fmt: skip


class _TorchRecDLRM:
    """The same DLRM with TorchRec's EmbeddingBagCollection (built lazily: torchrec imports)."""

    @staticmethod
    def build(dataset: str, args: dict) -> Any:
        import torch
        from torch import nn
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        from readers.dataset import dataset_schema
        from trainer.models import DLRM

        ours = DLRM.from_schema(dataset_schema(dataset), _model_config(args))
        features = list(ours.ebc.features)
        tables = [EmbeddingBagConfig(name=f, embedding_dim=args["embedding_dim"],
                                     num_embeddings=args["num_embeddings"], feature_names=[f])
                  for f in features]  # fmt: skip

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.dense_norm, self.bottom, self.top = ours.dense_norm, ours.bottom, ours.top
                self.register_buffer("tri", ours._tri.clone(), persistent=False)
                self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

            def forward(self, dense: Any, kjt: Any) -> Any:
                dense = torch.sign(dense) * torch.log1p(dense.abs())  # (B, F)
                x0 = self.bottom(self.dense_norm(torch.nan_to_num(dense, nan=0.0)))  # (B, D)
                pooled = self.ebc(kjt).to_dict()
                t = torch.stack([x0, *(pooled[f] for f in features)], dim=1)  # (B, n, D)
                dots = torch.bmm(t, t.transpose(1, 2)).flatten(1)  # (B, n * n)
                return self.top(torch.cat([x0, dots.index_select(1, self.tri)], 1)).squeeze(1)

        return Model()


def _torchrec_dmp(dataset: str, args: dict) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingType

    model = _TorchRecDLRM.build(dataset, args)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    table_wise = [ShardingType.TABLE_WISE.value]
    constraints = {c.name: ParameterConstraints(sharding_types=table_wise)
                   for c in model.ebc.embedding_bag_configs()}  # fmt: skip
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = [p for n, p in dmp.named_parameters() if ".ebc." not in n and p.requires_grad]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


@contextlib.contextmanager
def _a2a_sent_bytes() -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends to other ranks through ``all_to_all_single`` (ours and
    TorchRec's both call it as ``torch.distributed.all_to_all_single``), and the calls."""
    import torch.distributed as dist

    real = dist.all_to_all_single
    tally = {"bytes": 0, "calls": 0}

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):  # fmt: skip
        world, me = dist.get_world_size(group), dist.get_rank(group)
        total = input.numel() * input.element_size()
        if input_split_sizes is None:  # equal splits
            to_self = total // world
        else:
            row = total // max(input.shape[0], 1) if input.dim() else input.element_size()
            to_self = int(input_split_sizes[me]) * row
        tally["bytes"] += total - to_self
        tally["calls"] += 1
        return real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)  # fmt: skip

    dist.all_to_all_single = counted
    try:
        yield tally
    finally:
        dist.all_to_all_single = real


def _paired_steps(ours, theirs, *, pairs: int, barrier) -> list[list[float]]:
    """``pairs`` single steps of each, back to back (the order swapped every pair): the
    seconds ``[ours, theirs]`` of each pair. A pair's two steps see the same state of the
    machine, so their ratio cancels the drift that runs of many steps keep."""
    out = []
    for k in range(pairs):
        times = {}
        for name, step in (
            (("o", ours), ("t", theirs)) if k % 2 == 0 else (("t", theirs), ("o", ours))
        ):
            barrier()
            start = time.perf_counter()
            step(k)
            times[name] = time.perf_counter() - start
        out.append([times["o"], times["t"]])
    return out


def _dmp_step(dmp: Any, optimizer: Any, plain: list[Any]) -> Any:
    """One TorchRec DMP step on ``plain[k % len(plain)]`` (dense, KJT, labels): ``step(k)``."""
    import torch.nn.functional as F

    def step(k: int) -> None:
        dense, kjt, labels = plain[k % len(plain)]
        optimizer.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(dmp(dense, kjt), labels)
        loss.backward()
        optimizer.step()

    return step


def _hot_plan(comm: Any, args: dict, base: Any, on: list[Any]) -> tuple[Any, Any, Any]:
    """The cost model fitted on ``comm`` (probes up to ``probe_rows``), the hot-row
    candidates counted by ``base`` on the batches ``on``, and the hot-set size it chooses."""
    from trainer.distributed.costs import choose_num_hot, fit_costs

    top = args["probe_rows"]
    fit = fit_costs(comm, dim=args["embedding_dim"],
                    ar_rows=[max(top // k, 1) for k in (64, 16, 4, 1)],
                    a2a_rows=[max(top // k, 1) for k in (64, 16, 4, 1)])  # fmt: skip
    for batch in on:
        base.sparse.count(batch)
    candidates = base.sparse.gather_counts(budget=1 << 24)
    return fit, candidates, choose_num_hot(candidates, fit)


def _worker(dataset: str, args: dict) -> dict[str, Any] | None:
    """One rank of the benchmark job (started by elastic_launch)."""
    import numpy as np
    import torch

    from recpipe.torchrec_interop import to_torchrec
    from trainer.distributed.comm import Comm, init_from_env

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=600.0)
    rank, world = comm.rank, comm.world_size
    on = _batches(dataset, args, rank=rank, world=world, dedup=True)
    off = _batches(dataset, args, rank=rank, world=world, dedup=False)
    base = _ours(dataset, args, comm)
    fit, candidates, plan = _hot_plan(comm, args, base, on)
    everything = int(candidates.counts.size)
    sizes = sorted({0, plan.num_hot, everything // 64, everything // 16, everything // 4,
                    everything})  # fmt: skip
    trainers = {}
    for r in sizes:
        trainer = base if r == sizes[0] else _ours(dataset, args, comm)
        trainer.sparse.candidates = candidates
        trainer.sparse.count_left = 0
        trainer.sparse.reshard(r)
        trainers[r] = trainer
    dedup_off = _ours(dataset, args, comm)
    exact = _ours(dataset, args, comm, exact_dense=True)
    for trainer in (dedup_off, exact):
        trainer.sparse.candidates, trainer.sparse.count_left = candidates, 0
        trainer.sparse.reshard(plan.num_hot)
    single = _ours(dataset, args, Comm.single()) if rank == 0 else None
    if single is not None:
        single.sparse.count_left = 0
    dmp, dmp_opt = _torchrec_dmp(dataset, args)
    plain = [(b.dense, to_torchrec(b.to_plain().kjt), b.labels) for b in off]
    steps = args["steps"]

    def ours(trainer: Any, batches: list[Any]) -> Any:
        def case() -> None:
            comm.barrier(what="benchmark")
            for k in range(steps):
                trainer.train_step(batches[k % len(batches)], reduce_loss=False)
            trainer.pending_losses()  # one all-reduce for the case's losses

        return case

    their_step = _dmp_step(dmp, dmp_opt, plain)

    def theirs() -> None:
        comm.barrier(what="benchmark")
        for k in range(steps):
            their_step(k)

    def one_rank() -> None:
        comm.barrier(what="benchmark")
        if single is not None:
            for k in range(steps):
                single.train_step(on[k % len(on)], reduce_loss=False)
            single.pending_losses()
        comm.barrier(what="benchmark")

    cases = {f"R={r}": ours(t, on) for r, t in trainers.items()}
    cases["dedup_off"] = ours(dedup_off, off)
    cases["exact_dense"] = ours(exact, on)
    cases["torchrec_dmp"] = theirs
    cases["one_rank"] = one_rank
    for trainer in [*trainers.values(), dedup_off, exact]:
        trainer.sparse.stats = type(trainer.sparse.stats)()
    runs = alternate(cases, repeats=args["repeats"])
    chosen = trainers[plan.num_hot]
    paired = _paired_steps(
        lambda k: chosen.train_step(on[k % len(on)], reduce_loss=False), their_step,
        pairs=args["pairs"], barrier=lambda: comm.barrier(what="benchmark"),
    )  # fmt: skip
    chosen.pending_losses()
    sent = {}
    for name, case in (("ours", cases[f"R={plan.num_hot}"]), ("torchrec_dmp", theirs)):
        with _a2a_sent_bytes() as tally:  # untimed: the wrapper costs a little
            case()
        sent[name] = {"bytes": tally["bytes"] / steps, "calls": tally["calls"] / steps}
    totals = {}
    for r, trainer in trainers.items():
        stats = trainer.sparse.stats.as_tensor()
        comm.all_reduce(stats, what="benchmark")
        totals[r] = stats.tolist()
    if rank != 0:
        return None
    fields = list(type(base.sparse.stats).__dataclass_fields__)
    rho = candidates.rho()
    return {
        "runs": {name: [[t.wall_s, t.cpu_s] for t in ts] for name, ts in runs.items()},
        "sizes": sizes,
        "chosen": plan.num_hot,
        "all_rows": everything,
        "rho": {str(r): float(rho[min(r, rho.size - 1)]) for r in sizes},
        "accesses_per_step": float(candidates.accesses_per_step),
        "predicted_cost_s": {
            str(r): float(fit.cost(r, rho[min(r, rho.size - 1)], candidates.accesses_per_step))
            for r in sizes
        },
        "predicted_saving_se_s": {
            str(r): float(fit.saving_se(r, rho[min(r, rho.size - 1)], candidates.accesses_per_step))
            for r in sizes
        },
        "exchange": {str(r): dict(zip(fields, v, strict=True)) for r, v in totals.items()},
        "fit": {
            **{
                name: _line(getattr(fit, name))
                for name in ("all_reduce", "all_to_all", "hot_lookup")
            },
            "c_ar": fit.c_ar,
            "c_a2a": fit.c_a2a,
            "a_ar": fit.a_ar,
            "r2": fit.r2,
        },
        "dedup_factor": float(np.mean([_dedup_factor(b) for b in on])),
        "a2a_sent": sent,
        "paired": paired,
        "steps": steps,
        "world": world,
    }


def _store_trainer(dataset: str, args: dict, comm: Any, *, root: str | None,
                   stores: list[Any]) -> Any:  # fmt: skip
    """Our trainer with every owned row in this rank's hybrid stores (``recpipe train --nproc N
    --store hybrid``): under ``root`` as a checkpointing job keeps them, or temporary ones."""
    from trainer.config import DEFAULT_LR
    from trainer.distributed.store_shard import store_table_factory

    factory = store_table_factory(optimizer="adagrad", lr=DEFAULT_LR["adagrad"], root=root,
                                  rank=comm.rank, world_size=comm.world_size, open_step=None,
                                  stores=stores)  # fmt: skip
    return _ours(dataset, args, comm, factory=factory)


def _store_worker(dataset: str, args: dict) -> dict[str, Any] | None:
    """One rank of ``--only store``: ours over in-memory shards, ours over the rank's hybrid
    stores, TorchRec DMP (``steps`` steps each), and the store job for ``ckpt_steps`` steps
    without and with a checkpoint every ``ckpt_every`` steps, alternated."""
    import torch

    from recpipe.torchrec_interop import to_torchrec
    from trainer.distributed.comm import init_from_env
    from trainer.distributed.store_shard import save_store_checkpoint

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=600.0)
    on = _batches(dataset, args, rank=comm.rank, world=comm.world_size, dedup=True)
    off = _batches(dataset, args, rank=comm.rank, world=comm.world_size, dedup=False)
    module = _ours(dataset, args, comm)
    _, candidates, plan = _hot_plan(comm, args, module, on)
    stores: list[Any] = []
    root = args["ckpt_root"]
    store = _store_trainer(dataset, args, comm, root=None, stores=stores)
    ckpt = _store_trainer(dataset, args, comm, root=root, stores=stores)
    for trainer in (module, store, ckpt):
        trainer.sparse.candidates, trainer.sparse.count_left = candidates, 0
        trainer.sparse.reshard(plan.num_hot)
    dmp, dmp_opt = _torchrec_dmp(dataset, args)
    their_step = _dmp_step(dmp, dmp_opt, [(b.dense, to_torchrec(b.to_plain().kjt), b.labels)
                                          for b in off])  # fmt: skip
    steps, every = args["steps"], args["ckpt_every"]
    saves: list[float] = []  # seconds of each checkpoint (rank 0's)

    def ours(trainer: Any, count: int, *, checkpoints: bool = False) -> Any:
        def case() -> None:
            comm.barrier(what="benchmark")
            seconds = 0.0
            for k in range(count):
                trainer.train_step(on[k % len(on)], reduce_loss=False)
                if checkpoints and trainer.step % every == 0:  # as the loop's save()
                    start = time.perf_counter()
                    trainer.pending_losses()
                    save_store_checkpoint(root, comm=comm, sparse=trainer.sparse,
                                          step=trainer.step,
                                          state={"trainer": trainer.state_dict(),
                                                 "hot_chosen": True})  # fmt: skip
                    seconds += time.perf_counter() - start
            trainer.pending_losses()
            if checkpoints:
                saves.append(seconds)

        return case

    def theirs() -> None:
        comm.barrier(what="benchmark")
        for k in range(steps):
            their_step(k)

    cases = {
        "module": ours(module, steps),
        "store": ours(store, steps),
        "torchrec_dmp": theirs,
        "store_without_ckpt": ours(store, args["ckpt_steps"]),
        "store_with_ckpt": ours(ckpt, args["ckpt_steps"], checkpoints=True),
    }
    try:
        runs = alternate(cases, repeats=args["repeats"])
        rows = [s.num_rows for s in stores]
    finally:
        for s in stores:
            s.close()
    if comm.rank != 0:
        return None
    return {
        "runs": {name: [[t.wall_s, t.cpu_s] for t in ts] for name, ts in runs.items()},
        "checkpoint_seconds": saves[1:],  # each timed run's (the first: the warm-up's)
        "chosen": plan.num_hot,
        "store_rows_rank0": rows,
        "steps": steps,
        "world": comm.world_size,
    }


def _line(line: Any) -> dict[str, Any]:
    return {"slope": line.slope, "intercept": line.intercept, "r2": line.r2,
            "sizes": list(line.sizes), "seconds": list(line.seconds)}  # fmt: skip


def _dedup_factor(batch: Any) -> float:
    from trainer.runlog import batch_dedup_factor

    return batch_dedup_factor(batch)


# -- the job ------------------------------------------------------------------------------------
def _launch(dataset: Path, args: argparse.Namespace, worker: Any = None,
            **extra: Any) -> dict[str, Any]:  # fmt: skip
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=WORLD, run_id=f"bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
    )  # fmt: skip
    options = {k: getattr(args, k) for k in ("batch_size", "batches", "steps", "repeats", "pairs",
                                               "embedding_dim", "num_embeddings", "probe_rows")}  # fmt: skip
    results = elastic_launch(config, worker or _worker)(str(dataset), {**options, **extra})
    return results[0]


def _summarise(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    steps, world, batch = raw["steps"], raw["world"], args.batch_size
    walls = {name: [w for w, _ in ts] for name, ts in raw["runs"].items()}
    cpus = {name: [c for _, c in ts] for name, ts in raw["runs"].items()}
    samples = {name: (batch if name == "one_rank" else world * batch) * steps for name in walls}
    sps = {name: samples[name] / spread(ws)["median"] for name, ws in walls.items()}
    ours_r = {int(name[2:]): v for name, v in sps.items() if name.startswith("R=")}
    best = max(ours_r, key=ours_r.get)
    chosen = raw["chosen"]
    ex = raw["exchange"]
    bytes_per_step = {r: ex[str(r)]["a2a_bytes"] / max(ex[str(r)]["steps"] / world, 1)
                      for r in ours_r}  # fmt: skip

    def rate_ratio(a: str, b: str) -> dict[str, Any]:
        return _rate_ratio(walls, cpus, samples, a, b)

    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "world_size": world,
        "samples_per_s": {str(r): v for r, v in sorted(ours_r.items())},
        "samples_per_s_spread": {
            name: spread([samples[name] / t for t in ws]) for name, ws in walls.items()
        },
        "hot_rows_measured": sorted(ours_r),
        "chosen_r": chosen,
        "best_measured_r": best,
        "all_rows": raw["all_rows"],
        "rho": raw["rho"],
        "accesses_per_step": raw["accesses_per_step"],
        "best_r_vs_r0": rate_ratio(f"R={best}", "R=0"),
        "cost_model_r2": raw["fit"]["r2"],
        "cost_model": raw["fit"],
        "predicted_cost_s": raw["predicted_cost_s"],
        "predicted_saving_se_s": raw["predicted_saving_se_s"],
        "chosen_vs_best_measured": rate_ratio(f"R={best}", f"R={chosen}"),
        "a2a_bytes_per_step": {str(r): v for r, v in sorted(bytes_per_step.items())},
        "a2a_bytes_ratio": bytes_per_step[0] / bytes_per_step[chosen]
        if bytes_per_step[chosen]
        else float("inf"),
        "vs_torchrec_dmp": rate_ratio(f"R={chosen}", "torchrec_dmp"),
        "vs_torchrec_dmp_dedup_off": rate_ratio("dedup_off", "torchrec_dmp"),
        "vs_torchrec_dmp_paired": _paired_spread(raw["paired"]),
        "exact_dense_vs_default": rate_ratio("exact_dense", f"R={chosen}"),
        "vs_torchrec_dmp_exact_dense": rate_ratio("exact_dense", "torchrec_dmp"),
        "scaling_2_ranks": rate_ratio(f"R={chosen}", "one_rank"),
        "a2a_sent_bytes_per_step": {k: v["bytes"] for k, v in raw["a2a_sent"].items()},
        "a2a_calls_per_step": {k: v["calls"] for k, v in raw["a2a_sent"].items()},
        "a2a_bytes_vs_torchrec": raw["a2a_sent"]["ours"]["bytes"]
        / max(raw["a2a_sent"]["torchrec_dmp"]["bytes"], 1.0),
        "exchange": ex,
        "dedup_factor": raw["dedup_factor"],
    }


def _rate_ratio(walls: dict, cpus: dict, samples: dict, a: str, b: str) -> dict[str, Any]:
    """Samples/s of case ``a`` / of case ``b``, repeat by repeat: wall and CPU spreads."""
    wall = ratio_spread([samples[a] / t for t in walls[a]], [samples[b] / t for t in walls[b]])
    cpu = ratio_spread([samples[a] / t for t in cpus[a]], [samples[b] / t for t in cpus[b]])
    return {"median": wall["median"], "wall": wall, "cpu": cpu}


STORE_MEANS = (
    "--only store: one 2-rank job (gloo, CPU, one torch thread a rank) holding three trainers "
    "on the same batches, the hot-set size R chosen by the cost model as the job does: ours over "
    "in-memory shards (RowShard), ours with --store hybrid (every owned row in the rank's own "
    "EmbeddingStore per table, trainer/distributed/store_shard.py; temporary stores), TorchRec "
    "DMP as vs_torchrec_dmp. vs_torchrec_dmp_store = samples/s ours with the store / TorchRec "
    "DMP's; store_vs_module = ours with the store / ours in memory; vs_torchrec_dmp_module = "
    "ours in memory / TorchRec DMP's in the same run (`steps` steps per case and repeat). "
    "checkpoint_overhead_2ranks = wall time of the store job for `ckpt_steps` steps with a "
    "checkpoint every `ckpt_every` steps / the same steps without checkpoints (benchmarks/store.py's "
    "checkpoint_overhead: with / without time ratio = samples/s without / with; K and the steps "
    "as its defaults, 100 and 200). A checkpoint = what `recpipe train --nproc 2 --store hybrid "
    "--checkpoint-every K` does (trainer/loop.py save): the pending losses reduced, then "
    "save_store_checkpoint: each rank writes its owned hot rows into its stores and its stores "
    "commit together (each one's writer thread at once: "
    "trainer.store.checkpoints.checkpoint_stores), "
    "incrementally (rows changed since its last commit; sync='full': fsync + atomic "
    "commit record), rank headers and rank 0's checkpoint.pt (dense model, optimizers) last. "
    "Unlike store.py's runs the batches are read before timing (no loader time on either side: "
    "the ratio is the stricter) and the stores persist across repeats (every checkpoint after "
    "the warm-up's first is incremental; with the batches cycling, each still rewrites every row "
    "the batches touch). All five cases alternated (the order rotates each repeat) after one "
    "untimed call of each; medians of the per-repeat ratios with their spread and CPU twins. "
    "checkpoint_overhead_2ranks_in_run: wall / (wall - rank 0's seconds inside the saves), "
    "per run with checkpoints."
)


STORE_CONFIG = ("requests", "batch_size", "batches", "steps", "repeats", "ckpt_steps", "ckpt_every",
                "embedding_dim", "num_embeddings")  # fmt: skip


def _summarise_store(raw: dict[str, Any], args: argparse.Namespace,
                     load: list[float]) -> dict[str, Any]:  # fmt: skip
    """The ``--only store`` figures (see STORE_MEANS)."""
    world, batch = raw["world"], args.batch_size
    walls = {name: [w for w, _ in ts] for name, ts in raw["runs"].items()}
    cpus = {name: [c for _, c in ts] for name, ts in raw["runs"].items()}
    long = ("store_without_ckpt", "store_with_ckpt")
    samples = {n: world * batch * (args.ckpt_steps if n in long else raw["steps"]) for n in walls}
    with_, without = walls["store_with_ckpt"], walls["store_without_ckpt"]
    overhead = ratio_spread(with_, without)
    cpu = ratio_spread(cpus["store_with_ckpt"], cpus["store_without_ckpt"])
    saves = raw["checkpoint_seconds"]
    in_run = spread([w / (w - s) for w, s in zip(with_, saves, strict=True)])
    return {
        "vs_torchrec_dmp_store": _rate_ratio(walls, cpus, samples, "store", "torchrec_dmp"),
        "store_vs_module": _rate_ratio(walls, cpus, samples, "store", "module"),
        "vs_torchrec_dmp_module": _rate_ratio(walls, cpus, samples, "module", "torchrec_dmp"),
        "checkpoint_overhead_2ranks": overhead["median"],
        "checkpoint_overhead_2ranks_spread": {"wall": overhead, "cpu": cpu},
        "checkpoint_overhead_2ranks_in_run": in_run["median"],
        "checkpoint_overhead_2ranks_in_run_spread": in_run,
        "store_bench": {
            "measures": STORE_MEANS,
            "samples_per_s_spread": {
                name: spread([samples[name] / t for t in ws]) for name, ws in walls.items()
            },
            "checkpoint_seconds_per_run": saves,
            "train_seconds_with": with_,
            "train_seconds_without": without,
            "chosen_r": raw["chosen"],
            "store_rows_rank0": raw["store_rows_rank0"],
            "load_average_before_after": load,
            "config": {k: getattr(args, k) for k in STORE_CONFIG},
            "environment": environment(),
        },
    }


def run_store_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--only store``: the store figures, merged into the results already in ``args.out``
    (whose other figures, and the ``environment`` they were measured in, stay as they are)."""
    with tempfile.TemporaryDirectory(prefix="recpipe-bench-dist-store-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        dataset = args.data or build_dataset(work, requests=args.requests, seed=args.seed)
        before = list(os.getloadavg())
        raw = _launch(dataset, args, _store_worker, ckpt_root=str(work / "checkpoint"),
                      ckpt_every=args.ckpt_every, ckpt_steps=args.ckpt_steps)  # fmt: skip
        got = _summarise_store(raw, args, [*before, *os.getloadavg()])
        got["store_bench"]["wall_s"] = time.perf_counter() - t0
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**merged, **got}, indent=1, default=float) + "\n")
    return got


def _store_table(got: dict[str, Any]) -> str:
    def ratio(key: str) -> str:
        w = got[key]["wall"] if "wall" in got[key] else got[key]
        return f"{w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f})"

    rows = [
        ("vs_torchrec_dmp_store", ratio("vs_torchrec_dmp_store")),
        ("store_vs_module", ratio("store_vs_module")),
        ("vs_torchrec_dmp_module", ratio("vs_torchrec_dmp_module")),
        ("checkpoint_overhead_2ranks", ratio("checkpoint_overhead_2ranks_spread")),
        ("checkpoint_overhead_2ranks_in_run", ratio("checkpoint_overhead_2ranks_in_run_spread")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _paired_spread(pairs: list[list[float]]) -> dict[str, Any]:
    """Samples/s ours / TorchRec's from single steps run back to back: the spread of the
    per-pair ratios (their seconds / ours), with quartiles."""
    ratios = [t / o for o, t in pairs]
    q1, _, q3 = (
        statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    )
    return {**spread(ratios), "q1": q1, "q3": q3}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="recpipe-bench-dist-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        dataset = args.data or build_dataset(work, requests=args.requests, seed=args.seed)
        raw = _launch(dataset, args)
        results = _summarise(raw, args)
        results["wall_s"] = time.perf_counter() - t0
        return results


def _table(results: dict[str, Any]) -> str:
    rows = [
        ("samples/s by R", ", ".join(f"{r}: {v:,.0f}" for r, v in results["samples_per_s"].items())),
        ("chosen R / best measured", f"{results['chosen_r']} / {results['best_measured_r']} "
                                     f"(of {results['all_rows']:,} rows)"),
        ("best_r_vs_r0", f"{results['best_r_vs_r0']['median']:.3f}"),
        ("cost_model_r2", f"{results['cost_model_r2']:.3f}"),
        ("chosen_vs_best_measured", f"{results['chosen_vs_best_measured']['median']:.3f}"),
        ("a2a_bytes_ratio", f"{results['a2a_bytes_ratio']:.3f}"),
        ("vs_torchrec_dmp", f"{results['vs_torchrec_dmp']['median']:.3f} (dedup off: "
                            f"{results['vs_torchrec_dmp_dedup_off']['median']:.3f}; paired steps: "
                            f"{results['vs_torchrec_dmp_paired']['median']:.3f}; exact dense: "
                            f"{results['vs_torchrec_dmp_exact_dense']['median']:.3f})"),
        ("exact_dense_vs_default", f"{results['exact_dense_vs_default']['median']:.3f}"),
        ("scaling_2_ranks", f"{results['scaling_2_ranks']['median']:.3f}"),
        ("a2a_bytes_vs_torchrec", f"{results['a2a_bytes_vs_torchrec']:.3f} ("
                                  + " / ".join(f"{v / 1e6:.2f} MB"
                                               for v in results["a2a_sent_bytes_per_step"].values())
                                  + " per step and rank)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.only == "store":
        got = run_store_only(args)
        print(f"benchmarks/distributed.py --only store: {WORLD} ranks (gloo, CPU) -> {args.out}")
        print(_store_table(got))
        print(json.dumps({"wall_s": round(got["store_bench"]["wall_s"], 1)}))
        return 0
    results = run(args)
    path = write_results(results, args.out)
    print(f"benchmarks/distributed.py: {WORLD} ranks (gloo, CPU) -> {path}")
    print(_table(results))
    print(json.dumps({"wall_s": round(results["wall_s"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
