"""``recpipe towers partition`` and towered training (``recpipe train --towers``): the work
behind the commands.

* :func:`partition`: a short training run (or a checkpoint) -> mean ``R Rᵀ`` -> affinities ->
  the partitioner (:mod:`trainer.towers.partition`).
* :func:`train_towers`: train a :class:`~trainer.towers.model.TowerDLRM` through the one loop
  (:mod:`trainer.loop`) as :class:`TowersEngine`: checkpoints, resume, periodic evaluation,
  metrics and the reader service as any run. In one process the towers are model structure
  only; on several ranks (torchrun) the tables sit on their tower's host and SPTT moves the
  data (:mod:`trainer.towers.sptt`).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.config import ModelConfig, TrainConfig
from trainer.distributed.comm import Comm
from trainer.distributed.settings import check_same_settings, job_settings
from trainer.runlog import EvalResult, TrainResult
from trainer.towers.config import PartitionConfig, TowerPlan, TowersConfig, load_plan
from trainer.towers.model import FlopCount, TowerDLRM, model_tables
from trainer.towers.partition import Partition, affinity_from_gram, partition_features
from trainer.towers.sptt import CollectiveTraffic

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = [
    "TowersEngine",
    "TowersSummary",
    "checked_plan",
    "describe_partition",
    "model_config",
    "partition",
    "train_towers",
]

_log = logging.getLogger(__name__)


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


class TowersEngine:
    """One rank's step engine for a towered DLRM (:class:`trainer.loop.StepEngine`). In one
    process the towers are model structure only (a :class:`DistributedTrainer` on a world of
    one); on several ranks the tables sit on their tower's host and SPTT moves the data.

    Checkpoints: every rank writes its own part (its tables' rows, its tower, the head, the
    optimizers) under ``CK/towers/step-N/``; rank 0 writes ``checkpoint.pt`` last, naming the
    folder. A towers checkpoint resumes with the same plan on the same number of ranks. With
    ``--store hybrid`` the rows of the tables a rank holds live in its own embedding stores
    (``CK/store/rank-R-of-W/<table>/``), which commit the step before the headers are written.
    """

    def __init__(self, config: TrainConfig, options: TowersConfig, comm: Comm, *,
                 schema: Any, resume_state: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.config, self.options, self.comm, self.schema = config, options, comm, schema
        self.world_size, self.writer = comm.world_size, comm.rank == 0
        self.device = comm.device if comm.device.type == "cuda" else torch.device(config.device)
        plan = checked_plan(config, options, schema=schema)
        self.plan = plan
        self.per_host = _ranks_per_host(options, comm.world_size)
        if resume_state is not None:
            self._check_layout(resume_state)  # before any store is reopened (or replaced)
        self.stores: list[Any] = []  # with --store hybrid: this rank's stores, one per table
        try:
            self._build(resume_state)
        except BaseException:
            for store in self.stores:  # a temporary store's directory goes with it
                store.close()
            raise
        self.samples = 0  # training samples of this process (the traffic's denominator)
        self.summary: TowersSummary | None = None

    def _table_factory(self, tables: Any, resume_state: dict[str, Any] | None) -> Any:
        """Sharded tables; with ``--store hybrid`` the tables this rank holds keep their rows
        in its own stores (``CK/store/rank-R-of-W/<table>/``, reopened at the checkpoint's
        step on a resume), the others stay empty in-memory shards this rank never touches."""
        from trainer.config import DEFAULT_LR
        from trainer.distributed.trainer import sharded_table_factory

        cfg, comm = self.config, self.comm
        plain = sharded_table_factory(optimizer=cfg.optimizer, device=self.device)
        if cfg.store == "module":
            return plain
        from trainer.distributed.store_shard import check_store_options, store_table_factory
        from trainer.towers.layout import SPTTLayout

        check_store_options(optimizer=cfg.optimizer, cache_rows=0)
        if self.device.type != "cpu":
            msg = f"`--store` 'hybrid' with towers on {self.device.type}: not supported yet (CPU only)"
            raise RecpipeError(msg)
        if comm.world_size == 1:  # one process: every table (the towers are structure only)
            held = {t.name for t in tables}
        else:
            layout = SPTTLayout(self.plan, tables, comm.world_size, self.per_host)
            held = {t.name for t in layout.tables_of(comm.rank)}
        stored = store_table_factory(
            optimizer=cfg.optimizer,
            lr=DEFAULT_LR[cfg.optimizer] if cfg.lr is None else float(cfg.lr),
            root=cfg.checkpoint,
            rank=comm.rank,
            world_size=comm.world_size,
            open_step=None if resume_state is None else int(resume_state["step"]),
            stores=self.stores,
        )

        def factory(table: Any, seed: int) -> Any:
            return (stored if table.name in held else plain)(table, seed)

        return factory

    def _build(self, resume_state: dict[str, Any] | None) -> None:
        from trainer.distributed.trainer import DistributedTrainer

        config, options, comm, schema, plan = (
            self.config, self.options, self.comm, self.schema, self.plan)  # fmt: skip
        mcfg = model_config(config)
        tables = model_tables(schema, mcfg, plan.features)
        mcfg = replace(mcfg, tables=tables)
        factory = self._table_factory(tables, resume_state)
        model = TowerDLRM.from_schema(schema, mcfg, plan=plan,
                                      towers=options.module_config(), table_factory=factory)  # fmt: skip
        self.model = model
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

    @property
    def step(self) -> int:
        return int(self.trainer.step)

    # -- the step ----------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> torch.Tensor:
        _, logits = self.trainer.train_step(batch, reduce_loss=False)
        self.samples += batch.batch_size * self.world_size
        return logits

    def pending_losses(self) -> list[float]:
        return self.trainer.pending_losses()

    def after_step(self) -> float:
        return 0.0

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None) -> EvalResult:
        """Every rank scores the same held-out batches; what the evaluation moves is not
        counted as training traffic."""
        from trainer.train import evaluate_batches

        trainer = self.trainer
        if self.schedule == "local":
            trainer.module.eval()

            def logits_of(batch: Batch) -> torch.Tensor:
                return trainer.module(trainer.sparse.prepare(batch, train=False))
        else:
            trainer.model.eval()

            def logits_of(batch: Batch) -> torch.Tensor:
                return trainer.forward(batch, train=False)

        traffic = copy.deepcopy(trainer.traffic.by_name) if self.schedule != "local" else None
        try:
            return evaluate_batches(logits_of, batches, device=self.device,
                                    max_batches=max_batches)  # fmt: skip
        finally:
            if traffic is not None:
                trainer.traffic.by_name = traffic

    # -- checkpoints ---------------------------------------------------------------------------
    def _own_state(self) -> dict[str, Any]:
        trainer = self.trainer
        sparse = trainer.sparse
        return {
            "step": self.step,
            "model": (trainer.module if self.schedule == "local" else trainer.model).state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            # with --store hybrid the rows are in the rank's stores (committed at this step)
            "rows": None if sparse is None or self.stores else sparse.owned_rows(),
            "optimizer_step": None if sparse is None else sparse.optimizer_step,
            "hot": None
            if sparse is None
            else dict(zip(sparse.names, sparse.hot_sets(), strict=True)),
        }

    def save(self, state: dict[str, Any]) -> Path:
        from trainer.distributed.checkpoint import save_parts

        cfg, comm = self.config, self.comm
        assert cfg.checkpoint is not None
        sparse = self.trainer.sparse
        if self.stores and sparse is not None:  # the stores commit before any header is written
            from trainer.distributed.store_shard import commit_stores

            commit_stores(sparse, self.step)
        layout = {"kind": "towers", "world_size": comm.world_size,
                  "ranks_per_host": self.per_host, "towers": [list(t) for t in self.plan.towers],
                  "schedule": self.schedule, "store": cfg.store,
                  "tower_module": asdict(self.options.module_config())}  # fmt: skip
        return save_parts(cfg.checkpoint, comm=comm, area="towers", step=self.step,
                          part=self._own_state(),
                          doc={**state, "layout": layout, "step": self.step})  # fmt: skip

    def _check_layout(self, state: Mapping[str, Any]) -> None:
        """Refuse a checkpoint written by another layout (``check_resume`` refuses another
        ``--store``)."""
        from trainer.checkpoint import checkpoint_file

        comm, cfg = self.comm, self.config
        path = checkpoint_file(cfg.checkpoint or ".")
        layout = state.get("layout") or {}
        towers = [list(t) for t in self.plan.towers]
        if (
            layout.get("kind") != "towers"
            or layout.get("world_size") != comm.world_size
            or (layout.get("towers") != towers or layout.get("ranks_per_host") != self.per_host)
        ):
            msg = (
                f"{path}: written by {_written_by(layout)}; this run trains towers {towers} on "
                f"{comm.world_size} ranks ({self.per_host} per host): resume it as it was "
                "written, or start afresh with --overwrite"
            )
            raise RecpipeError(msg)

    def restore(self, state: dict[str, Any]) -> None:
        from trainer.distributed.checkpoint import read_part

        comm, cfg = self.comm, self.config
        self._check_layout(state)
        part = read_part(cfg.checkpoint or ".", state, "towers", rank=comm.rank,
                         world_size=comm.world_size)  # fmt: skip
        trainer = self.trainer
        (trainer.module if self.schedule == "local" else trainer.model).load_state_dict(
            part["model"]
        )
        for opt, saved in zip(trainer.optimizers, part["optimizers"], strict=True):
            opt.load_state_dict(saved)
        if trainer.sparse is not None and self.stores:  # reopened at the step when built
            from trainer.distributed.store_shard import reopened_stores

            reopened_stores(trainer.sparse, optimizer_step=int(part["optimizer_step"]),
                            hot=part["hot"])  # fmt: skip
        elif trainer.sparse is not None and part["rows"] is not None:
            trainer.sparse.load_owned_rows([part["rows"]])
        trainer.step = int(part["step"])

    def close(self, *, failing: bool) -> None:
        """The summary (the traffic summed over ranks: collective; skipped when failing); the
        stores are closed (changes after their last checkpoint are not kept)."""
        try:
            if not failing:
                self._summarise()
        finally:
            for store in self.stores:
                store.close()

    def _summarise(self) -> None:
        traffic = {}
        if self.schedule != "local":
            traffic = self.trainer.traffic.merged(self.comm)
        model = self.model
        self.summary = TowersSummary(
            world_size=self.comm.world_size,
            ranks_per_host=self.per_host,
            schedule=self.schedule,
            tower_sizes=model.plan.sizes,
            vectors=model.vectors,
            compression=sum(model.plan.sizes) / sum(model.vectors),
            flops=model.flops(),
            traffic=traffic,
            samples=self.samples,
        )


def _written_by(layout: Mapping[str, Any]) -> str:
    kind = layout.get("kind", "local")
    if kind == "towers":
        return (
            f"a towers run (towers {layout.get('towers')} on {layout.get('world_size')} ranks, "
            f"{layout.get('ranks_per_host')} per host)"
        )
    if kind == "ranks":
        return f"a {layout.get('world_size')}-rank run without towers"
    return "a one-process run without towers"


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
    from readers.dataset import dataset_schema
    from trainer.checkpoint import (
        check_resume,
        checkpoint_file,
        global_batch_change,
        load_checkpoint,
    )
    from trainer.loop import run_loop
    from trainer.streams import open_stream

    comm = comm or Comm.single(config.device)
    if comm.world_size > 1:  # before any other collective
        check_same_settings(comm, job_settings(config, options, towers=options.towers))
    schema = dataset_schema(config.dataset)
    state = None
    if config.resume and config.checkpoint is not None:
        path = checkpoint_file(config.checkpoint)
        state = load_checkpoint(path)
        if state is not None:
            check_resume(state, config, path=path, world_size=comm.world_size)
            note = global_batch_change(state, config, path=path, world_size=comm.world_size)
            if note is not None and comm.rank == 0:
                _log.warning("%s", note)
    engine = TowersEngine(config, options, comm, schema=schema, resume_state=state)
    stream = open_stream(config, schema, rank=comm.rank, world_size=comm.world_size,
                         device=engine.device)  # fmt: skip
    result = run_loop(config, engine, stream, resume_state=state, progress=progress,
                      desc="towers")  # fmt: skip
    assert engine.summary is not None
    return result, engine.summary
