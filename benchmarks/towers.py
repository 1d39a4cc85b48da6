"""Disaggregated multi-tower (DMT) on synthetic data with planted feature interactions: the
flat model vs SPTT vs SPTT + tower modules, the learned partition vs a strided one.

Generates synthetic logs with `recpipe synth --planted-groups G --planted-features M` (G groups
of M one-id features; per request each group draws a latent value its features show, with
noise, and the hidden label model adds the pairwise interactions of the groups' codes; its AUC is
in `_synth.json`), builds the clustered dataset, and trains DLRMs on the G x M planted features:

  flat         the DLRM (TowerDLRM with pass-through towers: the same model, the same numbers)
  sptt         the same model trained by the SPTT schedule on `--towers` x `--ranks-per-host`
               processes launched through torchrun's API (`elastic_launch`), tower t on host t
  dlrm_r<R>    SPTT + DLRM tower modules at compression R (every tower emits n_t / R vectors),
               with the learned partition and with a strided one (feature i in tower i mod T)

The learned partition comes from `recpipe towers partition` (coherent, balance 1, centred
affinities, MDS in `--partition-dims` dimensions, a short run at `--partition-lr`) on the
training part. Every model trains on the same global batches (the SPTT job's ranks' batches,
concatenated) for `--steps` steps per seed, and is evaluated on the same held-out rows; the
single-process runs of the towered models compute what SPTT computes (tests/towers checks it:
bitwise outputs, losses within 1e-6).

Figures (written to benchmarks/results/towers.json):
  auc                         held-out AUC per model: mean, sd and the values over `--seeds` seeds
  sptt_minus_flat             mean AUC of SPTT - of flat; target: within one sd of flat
  compression4_minus_flat     mean AUC of dlrm_r4 (learned) - of flat; target >= -0.002
  learned_vs_strided          per compression: mean AUC difference, Mann-Whitney U and its exact
                              one-sided p (learned > strided); target: learned >= strided
  cross_host_bytes_per_sample every collective's bytes that crossed hosts per training sample,
                              counted in the SPTT job (and the flat table-wise path's)
  compression_measured        cross-host embedding bytes of pass-through SPTT / with tower modules
  flops_per_sample            forward FLOPs per sample of each model's dense part
  towers_dedup_bytes_ratio    cross-host bytes of SPTT's sparse all-to-all with --dedup on / off
                              (every rank's, `--traffic-steps` steps) on session-clustered data:
                              the bundled schema's synth (`--dedup-requests` requests, its user
                              dedup groups), pass-through towers, a strided plan; bytes are
                              deterministic, so one run; `dedup_traffic` holds the parts (ids,
                              all collectives, the readers' dedup factor) and whether the two
                              runs' losses agree bit for bit

`--dedup-only` measures towers_dedup_bytes_ratio alone (about a minute) and puts it into an
existing `--out` file, leaving the other figures as they are.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import environment, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "towers.json"

__all__ = ["main", "mann_whitney", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.towers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--requests", type=int, default=40_000, help="synthetic requests")
    add("--groups", type=int, default=4, help="planted feature groups G")
    add("--features-per-group", type=int, default=16, help="planted features per group M")
    add("--strength", type=float, default=1.5, help="weight of the planted interactions")
    add("--noise", type=float, default=0.1, help="chance a planted feature shows noise")
    add("--towers", type=int, default=4, help="towers T (= hosts of the SPTT job)")
    add("--ranks-per-host", type=int, default=1, help="ranks per host of the SPTT job")
    add("--compressions", default="2,4,8,16", help="tower-module compressions (comma-separated)")
    add("--seeds", type=int, default=5, help="seeds per model (>= 5 for the U test)")
    add("--steps", type=int, default=250, help="training steps per run")
    add("--batch-size", type=int, default=64, help="rows per rank per step")
    add("--embedding-dim", type=int, default=16)
    add("--num-embeddings", type=int, default=1000, help="rows per table (ids hashed)")
    add("--partition-steps", type=int, default=300, help="steps of the partitioner's short run")
    add("--partition-dims", type=int, default=8, help="dimensions of the partitioner's MDS")
    add("--partition-lr", type=float, default=1.0,
        help="Adagrad learning rate of the partitioner's short run (only the embeddings' "
             "alignment matters there; at the default 0.05, 300 steps barely move them)")  # fmt: skip
    add("--traffic-steps", type=int, default=2, help="SPTT steps per config counting bytes")
    add(
        "--dedup-requests",
        type=int,
        default=4000,
        help="synthetic requests of the session-clustered data for towers_dedup_bytes_ratio",
    )
    add("--dedup-only", action="store_true",
        help="measure towers_dedup_bytes_ratio only and update it in an existing --out file")  # fmt: skip
    add("--row-group-size", type=int, default=2048, help="rows per row group of the dataset")
    add("--data", type=Path, help="an existing planted dataset (skip synth)")
    add("--work", type=Path, help="working directory (default: a temp dir)")
    add("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    return parser.parse_args(argv)


# -------------------------------------------------------------------------------------------
# statistics


def mann_whitney(x: list[float], y: list[float]) -> dict[str, float]:
    """Mann-Whitney U of ``x`` against ``y`` and its exact one-sided p-value for "x tends to be
    larger" (the null distribution of U counted exactly; a tie counts half in U and is
    rounded down for the p-value, which keeps it conservative).

    >>> mann_whitney([3.0, 4.0, 5.0], [0.0, 1.0, 2.0])["p_greater"]
    0.05
    """
    m, n = len(x), len(y)
    u = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)
    # ways[k][u]: orderings of k x-values among the y-values with statistic u (DP over m, n)
    counts = _u_counts(m, n)
    total = sum(counts)
    at_least = sum(counts[math.floor(u) :])
    return {"u": u, "p_greater": at_least / total, "m": m, "n": n}


def _u_counts(m: int, n: int) -> list[int]:
    """How many of the C(m+n, m) orderings give each U = 0..m·n (no ties)."""
    # f[i][j] = counts for i x-values and j y-values; f[i][j][u] = f[i-1][j][u-j] + f[i][j-1][u]
    table = [[[1] for _ in range(n + 1)] for _ in range(m + 1)]
    for i in range(1, m + 1):
        for j in range(1, n + 1):
            size = i * j + 1
            row = [0] * size
            for u, c in enumerate(table[i - 1][j]):
                row[u + j] += c
            for u, c in enumerate(table[i][j - 1]):
                row[u] += c
            table[i][j] = row
    return table[m][n]


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


# -------------------------------------------------------------------------------------------
# data and models


def build_dataset(work: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate, planted_schema

    config = SynthConfig(num_requests=args.requests, seed=0, planted_groups=args.groups,
                         planted_features=args.features_per_group,
                         planted_strength=args.strength, planted_noise=args.noise)  # fmt: skip
    logs = generate(work / "raw", config, progress=True)
    out = work / "dataset"
    build(logs.features, out, events=logs.events, schema=planted_schema(config),
          config=BuildConfig(row_group_size=args.row_group_size), overwrite=True, progress=True)  # fmt: skip
    return out, logs.summary


def _features(args: dict[str, Any]) -> list[str]:
    return [f"planted_{g}_{j}" for g in range(args["groups"])
            for j in range(args["features_per_group"])]  # fmt: skip


def _model_config(args: dict[str, Any], seed: int) -> Any:
    from trainer.config import ModelConfig, TableConfig

    dim, rows = args["embedding_dim"], args["num_embeddings"]
    tables = tuple(TableConfig(f, rows, dim, (f,), hash_ids=True) for f in _features(args))
    return ModelConfig(embedding_dim=dim, num_embeddings=rows, tables=tables, attention="none",
                       bottom_mlp=(32,), top_mlp=(64,), seed=seed)  # fmt: skip


def _world(args: dict[str, Any]) -> int:
    return args["towers"] * args["ranks_per_host"]


def _rank_datasets(dataset: str, args: dict[str, Any], seed: int, *, rank: int, world: int):
    from readers.dataset import dataset_schema
    from readers.holdout import holdout_splits
    from readers.ranks import RankBatchDataset
    from readers.source import DatasetSource, ReaderConfig

    schema = dataset_schema(dataset)
    train, held = holdout_splits(DatasetSource(dataset, schema=schema).splits,
                                 session_key=schema.session_key, fraction=0.1, seed=0)  # fmt: skip
    common = {"schema": schema, "rank": rank, "world_size": world, "dedup": False}
    reader = ReaderConfig(batch_size=args["batch_size"], shuffle=True, seed=seed)
    held_reader = ReaderConfig(batch_size=args["batch_size"])
    return (RankBatchDataset(dataset, config=reader, splits=train, **common),
            RankBatchDataset(dataset, config=held_reader, splits=held, **common))  # fmt: skip


def _take(ds: Any, steps: int) -> list[Any]:
    """``steps`` batches of a rank's stream, epoch after epoch."""
    out: list[Any] = []
    while len(out) < steps:
        before = len(out)
        out.extend(b for _, b in zip(range(steps - len(out)), ds, strict=False))
        if len(out) == before:
            msg = "the training part yields no batch: use more --requests or a smaller --batch-size"
            raise SystemExit(msg)
    return out


def _global_data(dataset: str, args: dict[str, Any], seed: int) -> tuple[list[Any], list[Any]]:
    """The SPTT job's global batches (training, held out), concatenated in one process."""
    from trainer.distributed.batches import global_batches

    world = _world(args)
    parts = [_rank_datasets(dataset, args, seed, rank=r, world=world) for r in range(world)]
    train = list(global_batches([_take(t, args["steps"]) for t, _ in parts]))
    held = list(global_batches([list(h) for _, h in parts]))
    return train, held


def _tower_model(dataset: str, args: dict[str, Any], seed: int, plan: Any, module: Any) -> Any:
    from readers.dataset import dataset_schema
    from trainer.distributed.trainer import sharded_table_factory
    from trainer.towers.model import TowerDLRM

    return TowerDLRM.from_schema(dataset_schema(dataset), _model_config(args, seed), plan=plan,
                                 towers=module, table_factory=sharded_table_factory(optimizer="adagrad"))  # fmt: skip


def _modules(args: dict[str, Any]) -> dict[str, Any]:
    from trainer.towers.config import TowerModuleConfig

    out = {"flat": TowerModuleConfig()}
    for r in args["compressions"]:
        out[f"dlrm_r{r}"] = TowerModuleConfig("dlrm", compression=r)
    return out


def train_local(dataset: str, args: dict[str, Any], seed: int, plan: Any, module: Any,
                data: tuple[list[Any], list[Any]]) -> dict[str, Any]:  # fmt: skip
    """One process on the global batches (the single-process form of the SPTT job)."""
    import torch

    from trainer.distributed.comm import Comm
    from trainer.distributed.trainer import DistributedTrainer

    torch.manual_seed(seed)
    model = _tower_model(dataset, args, seed, plan, module)
    trainer = DistributedTrainer(model, comm=Comm.single(), optimizer="adagrad", lr=args.get("lr"))
    train, held = data
    for batch in train:
        trainer.train_step(batch, reduce_loss=False)
    losses = trainer.pending_losses()
    ev = trainer.evaluate(held)
    return {"auc": ev.auc, "loss": ev.loss, "final_train_loss": losses[-1],
            "flops_per_sample": model.flops().total}  # fmt: skip


# -------------------------------------------------------------------------------------------
# the SPTT job


def _sptt_worker(
    dataset: str, args: dict[str, Any], plans: dict[str, str]
) -> dict[str, Any] | None:
    """One rank of the SPTT job (started by elastic_launch): training per seed, then a few
    counted steps per configuration."""
    import torch

    from readers.dataset import dataset_schema
    from trainer.distributed.comm import destroy, init_from_env
    from trainer.towers.config import TowerModuleConfig, load_plan
    from trainer.towers.layout import SPTTLayout
    from trainer.towers.model import model_tables
    from trainer.towers.sptt import SPTTGroups, SPTTTrainer

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=600.0)
    learned = load_plan(plans["learned"])
    config = _model_config(args, 0)
    tables = model_tables(dataset_schema(dataset), config)
    layout = SPTTLayout(learned, tables, comm.world_size, args["ranks_per_host"])
    groups = SPTTGroups.create(layout, world=comm, timeout_s=600.0)
    out: dict[str, Any] = {"sptt": [], "traffic": {}, "samples": {}}

    def trainer(seed: int, module: Any, schedule: str = "sptt") -> SPTTTrainer:
        torch.manual_seed(seed)
        model = _tower_model(dataset, args, seed, learned, module)
        return SPTTTrainer(model, layout=layout, groups=groups, schedule=schedule)

    for seed in range(args["seeds"]):
        train_ds, held_ds = _rank_datasets(
            dataset, args, seed, rank=comm.rank, world=comm.world_size
        )
        run = trainer(seed, TowerModuleConfig())
        for batch in _take(train_ds, args["steps"]):
            run.train_step(batch, reduce_loss=False)
        run.pending_losses()
        out["sptt"].append(run.evaluate(list(held_ds)).auc)
    train_ds, _ = _rank_datasets(dataset, args, 0, rank=comm.rank, world=comm.world_size)
    batches = _take(train_ds, args["traffic_steps"])
    configs = {
        "sptt": (TowerModuleConfig(), "sptt"),
        "flat_tablewise": (TowerModuleConfig(), "flat"),
    }
    configs.update({f"dlrm_r{r}": (TowerModuleConfig("dlrm", compression=r), "sptt")
                    for r in args["compressions"]})  # fmt: skip
    for name, (module, schedule) in configs.items():
        run = trainer(0, module, schedule)
        for batch in batches:
            run.train_step(batch, reduce_loss=False)
        run.pending_losses()
        out["traffic"][name] = {k: vars(v) for k, v in run.traffic.merged(groups.world).items()}
        out["samples"][name] = len(batches) * args["batch_size"] * comm.world_size
    rank = comm.rank
    destroy()
    return out if rank == 0 else None


def _launch(dataset: Path, args: dict[str, Any], plans: dict[str, str]) -> dict[str, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=_world(args), run_id=f"towers-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
    )  # fmt: skip
    return elastic_launch(config, _sptt_worker)(str(dataset), args, plans)[0]


# -------------------------------------------------------------------------------------------
# dedup through SPTT's sparse all-to-all


def build_clustered(work: Path, requests: int) -> Path:
    """The bundled schema's synthetic sessions, built clustered (its user dedup groups)."""
    from etl.build import build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    logs = generate(work / "raw-clustered", SynthConfig(num_requests=requests, seed=0))
    out = work / "clustered"
    build(logs.features, out, events=logs.events, schema=default_schema(), overwrite=True)
    return out


def _dedup_worker(dataset: str, args: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of the dedup job: the same `traffic_steps` SPTT steps with the readers'
    deduplicated batches and with plain ones; every collective's bytes, the ids sent, the
    losses."""
    import torch

    from readers.dataset import dataset_schema
    from readers.ranks import RankBatchDataset
    from readers.source import ReaderConfig
    from trainer.config import ModelConfig
    from trainer.distributed.comm import destroy, init_from_env
    from trainer.distributed.trainer import sharded_table_factory
    from trainer.towers.config import TowerPlan
    from trainer.towers.layout import SPTTLayout
    from trainer.towers.model import TowerDLRM, model_tables
    from trainer.towers.sptt import SPTTGroups, SPTTTrainer

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=600.0)
    schema = dataset_schema(dataset)
    config = ModelConfig(embedding_dim=args["embedding_dim"], num_embeddings=args["num_embeddings"],
                         attention="none", bottom_mlp=(32,), top_mlp=(64,), seed=0)  # fmt: skip
    plan = TowerPlan.strided(schema.sparse_names, args["towers"])
    layout = SPTTLayout(plan, model_tables(schema, config), comm.world_size, args["ranks_per_host"])
    groups = SPTTGroups.create(layout, world=comm, timeout_s=600.0)
    out: dict[str, Any] = {}
    for name, dedup in (("on", True), ("off", False)):
        data = RankBatchDataset(dataset, schema=schema, rank=comm.rank, world_size=comm.world_size,
                                config=ReaderConfig(batch_size=args["batch_size"], shuffle=True,
                                                    seed=0), dedup=dedup)  # fmt: skip
        batches = _take(data, args["traffic_steps"])
        torch.manual_seed(0)
        model = TowerDLRM.from_schema(schema, config, plan=plan,
                                      table_factory=sharded_table_factory(optimizer="adagrad"))  # fmt: skip
        run = SPTTTrainer(model, layout=layout, groups=groups)
        for batch in batches:
            run.train_step(batch, reduce_loss=False)
        losses = run.pending_losses()
        routed = torch.tensor([run.routed.rows, run.routed.ids, run.routed.inverse])
        routed = comm.all_reduce(routed, what="the ids sent")
        stored = sum(g.num_values for b in batches for g in b.ikjts.values())
        expanded = sum(g.num_expanded_values for b in batches for g in b.ikjts.values())
        factors = comm.all_reduce(torch.tensor([stored, expanded]), what="the dedup factors")
        out[name] = {
            "traffic": {k: vars(v) for k, v in run.traffic.merged(groups.world).items()},
            "routed": dict(zip(("rows", "ids", "inverse"), map(int, routed.tolist()))),
            "losses": losses,
            "group_values": dict(zip(("stored", "expanded"), map(int, factors.tolist()))),
        }
    rank = comm.rank
    destroy()
    return out if rank == 0 else None


def dedup_traffic(work: Path, opts: dict[str, Any], requests: int) -> dict[str, Any]:
    """``towers_dedup_bytes_ratio`` and its parts (see the module docstring)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    dataset = build_clustered(work, requests)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=_world(opts), run_id=f"towers-dedup-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
    )  # fmt: skip
    job = elastic_launch(config, _dedup_worker)(str(dataset), opts)[0]
    return summarise_dedup(job, requests=requests, opts=opts)


def summarise_dedup(job: dict[str, Any], *, requests: int, opts: dict[str, Any]) -> dict[str, Any]:
    sparse = ("sparse_counts", "sparse_ids")

    def cross(side: str, names: Any = None) -> int:
        traffic = job[side]["traffic"]
        return sum(t["cross_host"] for k, t in traffic.items() if names is None or k in names)

    on, off = job["on"], job["off"]
    values = on["group_values"]
    samples = opts["traffic_steps"] * opts["batch_size"] * _world(opts)
    return {
        "towers_dedup_bytes_ratio": cross("on", sparse) / cross("off", sparse),
        "dedup_traffic": {
            "requests": requests,
            "layout": f"{opts['towers']} hosts x {opts['ranks_per_host']} ranks",
            "steps": opts["traffic_steps"],
            "batch_size": opts["batch_size"],
            "samples": samples,
            "sparse_cross_host_bytes": {"on": cross("on", sparse), "off": cross("off", sparse)},
            "all_cross_host_bytes": {"on": cross("on"), "off": cross("off")},
            "all_bytes_ratio": cross("on") / cross("off"),
            "ids_sent": {"on": on["routed"]["ids"], "off": off["routed"]["ids"]},
            "ids_ratio": on["routed"]["ids"] / off["routed"]["ids"],
            "routed": {"on": on["routed"], "off": off["routed"]},
            "readers_dedup_factor": values["expanded"] / values["stored"] if values["stored"] else 1.0,
            "losses_bitwise": on["losses"] == off["losses"],
            "losses": {"on": on["losses"], "off": off["losses"]},
            "by_collective": {"on": on["traffic"], "off": off["traffic"]},
        },
    }  # fmt: skip


def run_dedup_only(args: argparse.Namespace) -> Path:
    """``towers_dedup_bytes_ratio`` alone, put into the results already in ``args.out`` (whose
    other figures, and the ``environment`` they were measured in, stay as they are; the dedup
    figures carry their own)."""
    import torch

    torch.set_num_threads(1)
    opts = _options(args)
    with tempfile.TemporaryDirectory(prefix="recpipe-towers-dedup-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        got = dedup_traffic(work, opts, args.dedup_requests)
    got["dedup_traffic"]["environment"] = environment()
    if not args.out.exists():
        return write_results(got, args.out)
    before = json.loads(args.out.read_text())
    args.out.write_text(json.dumps({**before, **got}, indent=1, default=float) + "\n")
    return args.out


# -------------------------------------------------------------------------------------------
# the run


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {k: getattr(args, k) for k in ("groups", "features_per_group", "towers", "ranks_per_host",
                                          "seeds", "steps", "batch_size", "embedding_dim",
                                          "num_embeddings", "traffic_steps")}  # fmt: skip
    opts["compressions"] = [int(c) for c in str(args.compressions).split(",") if c]
    return opts


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer.config import ModelConfig
    from trainer.towers.config import PartitionConfig, TowerPlan
    from trainer.towers.partition import plot_partition
    from trainer.towers.run import partition

    torch.set_num_threads(1)
    opts = _options(args)
    with tempfile.TemporaryDirectory(prefix="recpipe-towers-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if args.data is not None:
            dataset, synth = (
                args.data,
                json.loads((args.data.parent / "raw" / "_synth.json").read_text()),
            )
        else:
            dataset, synth = build_dataset(work, args)
        features = _features(opts)
        base = _model_config(opts, 0)
        part = partition(PartitionConfig(
            str(dataset), towers=args.towers, strategy="coherent", balance=1.0, seed=0,
            steps=args.partition_steps, batch_size=args.batch_size * _world(opts),
            lr=args.partition_lr, center=True, dims=args.partition_dims,
            features=tuple(features), model=ModelConfig(**{**vars(base), "tables": None}),
        ))  # fmt: skip
        plans = {"learned": part.plan, "strided": TowerPlan.strided(features, args.towers)}
        paths = {name: str(plan.save(work / f"{name}.toml")) for name, plan in plans.items()}
        plot = plot_partition(part, work / "learned.png")
        print(f"learned towers: {part.plan.towers}", file=sys.stderr)
        job = _launch(dataset, opts, paths)
        aucs: dict[str, list[float]] = {}
        flops: dict[str, int] = {}
        for seed in range(args.seeds):
            data = _global_data(str(dataset), opts, seed)
            for plan_name, plan in plans.items():
                for name, module in _modules(opts).items():
                    if plan_name == "strided" and name == "flat":
                        continue  # pass-through towers: the same model whatever the plan
                    key = name if plan_name == "learned" else f"{name}_strided"
                    got = train_local(str(dataset), opts, seed, plan, module, data)
                    aucs.setdefault(key, []).append(got["auc"])
                    flops[key] = got["flops_per_sample"]
                    print(f"seed {seed} {key}: AUC {got['auc']:.4f}", file=sys.stderr)
        aucs["sptt"] = job["sptt"]
        flops["sptt"] = flops["flat"]
        dedup = dedup_traffic(work, opts, args.dedup_requests)
        wall = time.perf_counter() - t0
    return {**summarise(args, opts, synth, part, aucs, flops, job, wall, plot), **dedup}


def summarise(args: argparse.Namespace, opts: dict[str, Any], synth: dict[str, Any], part: Any,
              aucs: dict[str, list[float]], flops: dict[str, int], job: dict[str, Any],
              wall: float, plot: Path) -> dict[str, Any]:  # fmt: skip
    auc = {k: _stats(v) for k, v in aucs.items()}
    flat = auc["flat"]
    learned_vs_strided = {}
    for r in opts["compressions"]:
        a, b = aucs[f"dlrm_r{r}"], aucs[f"dlrm_r{r}_strided"]
        test = mann_whitney(a, b)
        learned_vs_strided[str(r)] = {
            "learned_minus_strided": statistics.fmean(a) - statistics.fmean(b), **test,
        }  # fmt: skip
    embedding = ("peer_a2a", "peer_a2a_grad", "flat_a2a", "flat_a2a_grad")
    per_sample, measured = {}, {}
    for name, traffic in job["traffic"].items():
        samples = job["samples"][name]
        per_sample[name] = {
            "total": sum(t["cross_host"] for t in traffic.values()) / samples,
            "embeddings": sum(traffic[k]["cross_host"] for k in embedding) / samples,
            "by_collective": {k: t["cross_host"] / samples for k, t in traffic.items() if t["calls"]},
        }  # fmt: skip
    passthrough = per_sample["sptt"]["embeddings"]
    for r in opts["compressions"]:
        measured[str(r)] = passthrough / per_sample[f"dlrm_r{r}"]["embeddings"]
    r4 = "dlrm_r4" if "dlrm_r4" in auc else f"dlrm_r{opts['compressions'][0]}"
    sptt_gap = auc["sptt"]["mean"] - flat["mean"]
    return {
        "config": {
            **opts,
            "requests": args.requests,
            "strength": args.strength,
            "noise": args.noise,
            "partition_steps": args.partition_steps,
            "partition_lr": args.partition_lr,
            "partition_dims": args.partition_dims,
            "partition_center": True,
        },
        "environment": environment(),
        "hidden_model_auc": synth.get("hidden_model_auc"),
        "learned_towers": [list(t) for t in part.plan.towers],
        "partition_plot": str(plot),
        "auc": auc,
        "sptt_minus_flat": sptt_gap,
        "sptt_within_one_sd_of_flat": abs(sptt_gap) <= flat["sd"],
        "compression4_minus_flat": auc[r4]["mean"] - flat["mean"],
        "compression4_within_0_002": auc[r4]["mean"] - flat["mean"] >= -0.002,
        "learned_vs_strided": learned_vs_strided,
        "learned_ge_strided": all(
            v["learned_minus_strided"] >= 0 for v in learned_vs_strided.values()
        ),
        "cross_host_bytes_per_sample": per_sample,
        "compression_measured": measured,
        "flops_per_sample": flops,
        "wall_s": wall,
    }


def _table(results: dict[str, Any]) -> str:
    rows = ["model                    AUC mean ± sd        FLOPs/sample  cross-host B/sample"]
    traffic = results["cross_host_bytes_per_sample"]
    for name, s in sorted(results["auc"].items()):
        base = name.removesuffix("_strided")
        t = traffic.get(base, {}).get("total")
        shown = f"{t:,.0f}" if t is not None and base != "flat" else "-"
        rows.append(f"{name:<24} {s['mean']:.4f} ± {s['sd']:.4f}    "
                    f"{results['flops_per_sample'][name]:>12,}  {shown:>19}")  # fmt: skip
    return "\n".join(rows)


def _print_dedup(results: dict[str, Any]) -> None:
    d = results["dedup_traffic"]
    sparse = d["sparse_cross_host_bytes"]
    print(f"towers_dedup_bytes_ratio {results['towers_dedup_bytes_ratio']:.3f}: sparse all-to-all "
          f"{sparse['on']:,} cross-host bytes with --dedup on, {sparse['off']:,} off "
          f"({d['samples']:,} samples; ids {d['ids_ratio']:.3f}, all collectives "
          f"{d['all_bytes_ratio']:.3f}, readers' dedup factor {d['readers_dedup_factor']:.2f}; "
          f"losses bitwise: {d['losses_bitwise']})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dedup_only:
        path = run_dedup_only(args)
        _print_dedup(json.loads(path.read_text()))
        print(f"wrote {path}")
        return 0
    if args.seeds < 2:
        raise SystemExit("--seeds must be >= 2 (a standard deviation and a U test)")
    results = run(args)
    path = write_results(results, args.out)
    print(_table(results))
    print(f"sptt - flat: {results['sptt_minus_flat']:+.5f}; compression 4 - flat: "
          f"{results['compression4_minus_flat']:+.5f}")  # fmt: skip
    for r, v in results["learned_vs_strided"].items():
        print(
            f"learned - strided at {r}: {v['learned_minus_strided']:+.4f} (p = {v['p_greater']:.3g})"
        )
    _print_dedup(results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
