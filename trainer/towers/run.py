"""``recpipe towers partition`` and ``recpipe towers train``: the work behind the commands.

* :func:`partition`: a short training run (or a checkpoint) -> mean ``R Rᵀ`` -> affinities ->
  the partitioner (:mod:`trainer.towers.partition`).
* :func:`train_towers`: train a :class:`~trainer.towers.model.TowerDLRM`. In one process the
  towers are model structure only; on several ranks (torchrun) the tables sit on their tower's
  host and SPTT moves the data (:mod:`trainer.towers.sptt`). Readers: one global stream cut
  into equal ranges per rank (:class:`readers.ranks.RankBatchDataset`), as in
  ``recpipe train --nproc``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.config import ModelConfig, TrainConfig
from trainer.distributed.comm import Comm
from trainer.distributed.settings import check_same_settings, job_settings
from trainer.metrics import PredictionWindow, peak_memory_bytes
from trainer.runlog import TrainResult, batch_dedup_factor
from trainer.towers.config import PartitionConfig, TowerPlan, TowersConfig, load_plan
from trainer.towers.model import FlopCount, TowerDLRM, model_tables
from trainer.towers.partition import Partition, affinity_from_gram, partition_features
from trainer.towers.sptt import CollectiveTraffic

__all__ = [
    "TowersSummary",
    "checked_plan",
    "describe_partition",
    "model_config",
    "partition",
    "train_towers",
]


def model_config(config: TrainConfig) -> ModelConfig:
    """``config.model`` with the run's seed and no attention pooling (towers pool only)."""
    return replace(config.model, seed=config.seed, attention="none")


# -------------------------------------------------------------------------------------------
# partition


def partition(config: PartitionConfig, *, progress: bool = False) -> Partition:
    """Towers for ``config.dataset`` (see :class:`~trainer.towers.config.PartitionConfig`)."""
    from readers.dataset import dataset_schema
    from trainer.towers.affinity import gram_matrix, load_trained, train_briefly, training_batches

    if config.checkpoint is not None:
        model, run = load_trained(config.checkpoint)
        run = replace(run, dataset=config.dataset, batch_size=config.batch_size)
        source = f"checkpoint {config.checkpoint}"
    else:
        schema = dataset_schema(config.dataset)
        base = replace(config.model, attention="none", seed=config.seed)
        model_cfg = replace(base, tables=model_tables(schema, base, config.features))
        run = TrainConfig(config.dataset, steps=config.steps, batch_size=config.batch_size,
                          seed=config.seed, eval_fraction=config.eval_fraction, lr=config.lr,
                          model=model_cfg)  # fmt: skip
        model = train_briefly(run, progress=progress)
        source = f"{config.steps} training steps on {config.dataset}"
    features, gram, samples = gram_matrix(
        model, training_batches(run), max_batches=config.affinity_batches, center=config.center
    )
    if config.features is not None:
        missing = [f for f in config.features if f not in features]
        if missing:
            msg = (
                f"`features` {missing!r} are not pooled features of the model ({list(features)!r})"
            )
            raise RecpipeError(msg)
        pick = [features.index(f) for f in config.features]
        features, gram = tuple(config.features), gram[np.ix_(pick, pick)]
    what = "centred R Rᵀ" if config.center else "R Rᵀ"
    source += f"; mean {what} over {samples:,} samples"
    return partition_features(features, affinity_from_gram(gram), towers=config.towers,
                              strategy=config.strategy, balance=config.balance,
                              seed=config.seed, dims=config.dims, source=source)  # fmt: skip


def describe_partition(part: Partition) -> str:
    """The towers, their sizes, and the mean affinity inside towers and between them."""
    aff, assign = part.affinity, part.assignment
    same = assign[:, None] == assign[None, :]
    off = ~np.eye(len(assign), dtype=bool)
    inside = float(aff[same & off].mean()) if (same & off).any() else float("nan")
    between = float(aff[~same].mean()) if (~same).any() else float("nan")
    rows = [(f"tower {t} ({len(f)})", ", ".join(f)) for t, f in enumerate(part.plan.towers)]
    rows += [
        ("strategy", f"{part.plan.strategy}, balance {part.plan.balance:g}, seed {part.plan.seed}"),
        ("affinity", f"mean |cos| {inside:.3f} inside towers, {between:.3f} between them"),
        ("MDS stress", f"{part.stress:.4g}"),
        ("source", part.plan.source),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# -------------------------------------------------------------------------------------------
# training


@dataclass
class TowersSummary:
    """What a towers run moved and computed.

    Attributes:
        world_size: ranks G.
        ranks_per_host: L.
        schedule: ``sptt``, ``flat``, or ``local`` (one process).
        tower_sizes: features per tower.
        vectors: vectors each tower emits.
        compression: features in / vectors out over all towers.
        flops: forward FLOPs per sample of the dense parts.
        traffic: bytes per collective over the job (every rank summed).
        samples: training samples the traffic was counted over.
    """

    world_size: int
    ranks_per_host: int
    schedule: str
    tower_sizes: tuple[int, ...]
    vectors: tuple[int, ...]
    compression: float
    flops: FlopCount
    traffic: dict[str, CollectiveTraffic] = field(default_factory=dict)
    samples: int = 0

    @property
    def cross_host_bytes_per_sample(self) -> float:
        """Bytes that crossed hosts per training sample (every collective counted)."""
        total = sum(t.cross_host for t in self.traffic.values())
        return total / self.samples if self.samples else 0.0

    def lines(self) -> list[tuple[str, str]]:
        rows = [
            ("ranks", f"{self.world_size} ({self.world_size // self.ranks_per_host} hosts x "
                      f"{self.ranks_per_host}), schedule {self.schedule}"),
            ("towers", f"{len(self.tower_sizes)}: features {list(self.tower_sizes)} -> vectors "
                       f"{list(self.vectors)} (compression {self.compression:g})"),
            ("FLOPs/sample", f"{self.flops.total:,} forward (towers {self.flops.towers:,})"),
            ("cross-host", f"{self.cross_host_bytes_per_sample:,.0f} bytes/sample"),
        ]  # fmt: skip
        for name, t in self.traffic.items():
            if t.calls:
                rows.append((f"  {name}", f"{t.bytes:,} bytes ({t.cross_host:,} across hosts), "
                                          f"{t.calls:,} calls"))  # fmt: skip
        return rows

    def dump(self) -> dict[str, Any]:
        out = asdict(self)
        out["flops"]["total"] = self.flops.total
        out["cross_host_bytes_per_sample"] = self.cross_host_bytes_per_sample
        return out


def checked_plan(config: TrainConfig, options: TowersConfig, *, schema: Any = None) -> TowerPlan:
    """The tower plan of ``options``, checked to hold the features the model trains on, each
    once: ``options.features`` when given, else every sparse feature of the dataset.

    Raises:
        TowerError: naming the plan and the features missing from it or unknown.
    """
    from readers.dataset import dataset_schema

    plan = load_plan(options.towers)
    if options.features is not None:
        plan.check_features(options.features, owner="`--features`")
        return plan
    schema = schema if schema is not None else dataset_schema(config.dataset)
    plan.check_features(
        schema.sparse_names,
        owner=f"the dataset {config.dataset!r}",
        hint=(
            "`recpipe towers partition DATASET --towers T --out FILE` writes a plan of every "
            "sparse feature; to train on the plan's features only, name them in --features"
        ),
    )
    return plan


def _ranks_per_host(options: TowersConfig, world: int) -> int:
    if options.ranks_per_host is not None:
        return options.ranks_per_host
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else world


class _Run:
    """One rank's ``train_towers`` call."""

    def __init__(self, config: TrainConfig, options: TowersConfig, comm: Comm, *,
                 progress: bool) -> None:  # fmt: skip
        from readers.dataset import dataset_schema
        from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory

        if config.optimizer not in ("sgd", "adagrad"):
            msg = f"`optimizer` must be 'sgd' or 'adagrad' with towers (row-wise for the tables), got {config.optimizer!r}"
            raise RecpipeError(msg)
        if config.service is not None or config.store != "module" or config.resume:
            msg = "`service`, `store` 'hybrid' and `resume` are not supported by `recpipe towers train` yet"
            raise RecpipeError(msg)
        self.config, self.options, self.comm = config, options, comm
        self.progress = progress and comm.rank == 0
        self.schema = dataset_schema(config.dataset)
        self.device = comm.device if comm.device.type == "cuda" else torch.device(config.device)
        plan = checked_plan(config, options, schema=self.schema)
        mcfg = model_config(config)
        tables = model_tables(self.schema, mcfg, plan.features)
        mcfg = replace(mcfg, tables=tables)
        factory = sharded_table_factory(optimizer=config.optimizer, device=self.device)
        model = TowerDLRM.from_schema(self.schema, mcfg, plan=plan,
                                      towers=options.module_config(), table_factory=factory)  # fmt: skip
        self.model = model
        self.per_host = _ranks_per_host(options, comm.world_size)
        if comm.world_size == 1:
            self.schedule = "local"
            self.trainer: Any = DistributedTrainer(model, comm=comm, optimizer=config.optimizer,
                                                   lr=config.lr, device=self.device)  # fmt: skip
        else:
            from trainer.towers.layout import SPTTLayout
            from trainer.towers.sptt import SPTTGroups, SPTTTrainer

            self.schedule = options.schedule
            layout = SPTTLayout(plan, tables, comm.world_size, self.per_host)
            groups = SPTTGroups.create(layout, world=comm, device=comm.device,
                                       timeout_s=comm.timeout_s)  # fmt: skip
            self.trainer = SPTTTrainer(model, layout=layout, groups=groups,
                                       optimizer=config.optimizer, lr=config.lr,
                                       device=self.device, schedule=options.schedule)  # fmt: skip
        self._make_loaders()

    def _make_loaders(self) -> None:
        from readers.holdout import holdout_splits
        from readers.ranks import RankBatchDataset, RankLoader
        from readers.source import DatasetSource, ReaderConfig

        cfg, comm = self.config, self.comm
        splits = DatasetSource(cfg.dataset, schema=self.schema).splits
        train, held = holdout_splits(splits, session_key=self.schema.session_key,
                                     fraction=cfg.eval_fraction, seed=cfg.seed)  # fmt: skip
        common = {"schema": self.schema, "transforms": cfg.preprocess, "dedup": cfg.dedup,
                  "rank": comm.rank, "world_size": comm.world_size}  # fmt: skip
        reader = ReaderConfig(batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed)
        self.train_ds = RankBatchDataset(cfg.dataset, config=reader, splits=train, **common)
        self.eval_ds = RankBatchDataset(cfg.dataset, config=ReaderConfig(batch_size=cfg.batch_size),
                                        splits=held, **common)  # fmt: skip
        self.splits = (len(train), len(held))
        self.loader = RankLoader(self.train_ds, num_workers=cfg.workers)

    def run(self) -> tuple[TrainResult, TowersSummary]:
        from recpipe.progress import progress_bar

        cfg, comm, trainer = self.config, self.comm, self.trainer
        steps = cfg.steps
        epochs = cfg.epochs if cfg.steps is None else None
        if steps is None and epochs is None:
            epochs = 1
        bar = progress_bar(total=steps, unit="step", desc="towers", file=sys.stderr,
                   disable=not self.progress, dynamic_ncols=True)  # fmt: skip
        window = PredictionWindow(cfg.log_window)
        losses: list[float] = []
        factors: list[float] = []
        samples, t0 = 0, time.perf_counter()
        while not self._done(steps, epochs):
            got = 0
            for batch in self.loader:
                got += 1
                factors.append(batch_dedup_factor(batch))
                _, logits = trainer.train_step(batch, reduce_loss=False)
                window.add(logits, batch.labels)
                samples += batch.batch_size * comm.world_size
                bar.update(1)
                if trainer.step % 10 == 0:
                    losses += trainer.pending_losses()
                    bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}", refresh=False)
                if steps is not None and trainer.step >= steps:
                    break
            if not got:
                msg = (
                    f"{cfg.dataset}: the training split yields no batch of {cfg.batch_size} rows "
                    f"per rank for {comm.world_size} ranks"
                )
                raise RecpipeError(msg)
        losses += trainer.pending_losses()
        wall = time.perf_counter() - t0
        bar.close()
        summary = self._summary(samples)  # before the evaluation's collectives
        t_eval = time.perf_counter()
        self.eval_ds.set_epoch(0)
        ev = trainer.evaluate(iter(self.eval_ds), max_batches=cfg.eval_batches)
        eval_wall = time.perf_counter() - t_eval
        result = TrainResult(
            steps=trainer.step, samples=samples, losses=losses, train_auc=window.auc(),
            evals=[(trainer.step, ev)] if ev.samples else [],
            samples_per_s=samples / wall if wall > 0 else float("nan"),
            peak_memory_bytes=peak_memory_bytes(self.device),
            dedup_factor=float(np.mean(factors)) if factors else 1.0, train_wall_s=wall,
            train_splits=self.splits[0], eval_splits=self.splits[1], eval_wall_s=eval_wall,
            eval_runs=1,
        )  # fmt: skip
        return result, summary

    def _done(self, steps: int | None, epochs: int | None) -> bool:
        if steps is not None:
            return self.trainer.step >= steps
        return self.loader.epoch >= epochs

    def _summary(self, samples: int) -> TowersSummary:
        traffic = {}
        if self.schedule != "local":
            traffic = self.trainer.traffic.merged(self.comm)
        model = self.model
        return TowersSummary(
            world_size=self.comm.world_size,
            ranks_per_host=self.per_host,
            schedule=self.schedule,
            tower_sizes=model.plan.sizes,
            vectors=model.vectors,
            compression=sum(model.plan.sizes) / sum(model.vectors),
            flops=model.flops(),
            traffic=traffic,
            samples=samples,
        )


def train_towers(
    config: TrainConfig,
    options: TowersConfig,
    *,
    comm: Comm | None = None,
    progress: bool = True,
) -> tuple[TrainResult, TowersSummary]:
    """Train a towered DLRM (collective when ``comm`` spans several ranks).

    Args:
        config: the run (``batch_size`` per rank, as with ``recpipe train --nproc``; the model's
            ``attention`` is ignored: towers pool only).
        options: the towers, their modules, the job's hosts.
        comm: the job's group (:func:`trainer.distributed.comm.init_from_env`); ``None``: one
            process, the towers as model structure only.
        progress: show a progress bar (rank 0).

    Returns:
        The run (the losses of the global batches) and what the towers moved and computed.
    """
    comm = comm or Comm.single(config.device)
    if comm.world_size > 1:  # before any other collective
        check_same_settings(comm, job_settings(config, options, towers=options.towers))
    run = _Run(config, options, comm, progress=progress)
    return run.run()
