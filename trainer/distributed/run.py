"""``recpipe train`` on one rank of a multi-rank job.

::

    sessions -> train | held out (by session hash, as in one process)
    train -> RankBatchDataset, or ServiceRankDataset (one client of `recpipe serve` per rank):
             one global stream, an equal range per rank -> DistributedTrainer
    start-up: every rank's settings and dataset compared (one digest each: refused, naming the
    setting, where they differ); fit the cost model on the job's group (collectives timed at
    several sizes)
    first --count-steps steps: count accesses; then choose R (cost model or --hot-rows) and
    reshard; every --checkpoint-every steps and at the end: a collective checkpoint
    at the end (and every --eval-every steps): loss and AUC on the held-out rows of all ranks

Rank 0 shows progress and writes the checkpoint's dense part, the summary and the metrics.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.checkpoint import checkpoint_file
from trainer.config import TrainConfig
from trainer.distributed.cache import RECORD_KINDS
from trainer.distributed.checkpoint import load_sparse, read_checkpoint, save_checkpoint
from trainer.distributed.comm import Comm
from trainer.distributed.config import DistributedConfig
from trainer.distributed.costs import CostFit, choose_num_hot, fit_costs
from trainer.distributed.exchange import ExchangeStats
from trainer.distributed.settings import check_same_settings, job_settings
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.metrics import peak_memory_bytes
from trainer.runlog import RunLog, TrainResult, divergence_hint, run_targets
from trainer.train import model_config, read_schema, reader_options

__all__ = ["DistributedConfig", "DistributedSummary", "check_config", "train_rank"]

_log = logging.getLogger(__name__)


@dataclass
class DistributedSummary:
    """What the exchange did over the whole job (every rank summed).

    Attributes:
        world_size: ranks.
        hot_rows: R after the hot set was chosen.
        rho: share of the counted accesses the hot set serves.
        cost_model_r2: the worse r² of the two fitted lines.
        c_ar, c_a2a: the fitted coefficients (seconds per hot row, per cold access).
        exchange: the exchange counters summed over ranks.
        remainder_rows: rows of the last epoch no rank was given (counted, not lost).
        cache_rows: rows of each rank's cache (0: no caches, the 2FP exchange).
        cache: with caches, each transfer kind's rows over the job, every rank summed
            (``reads``, ``pulls``, ``pushes``, ``shared``, ``evictions``, ``evict_pushes``).
        cache_per_rank: the same, one dict per rank.
        shadow_steps: with caches and an in-process dispatcher, the steps whose transfers were
            compared with what the dispatcher's shadow predicted, and ``shadow_matched`` those
            where every rank's matched row for row (the shadow restarts from empty caches at
            every epoch, the caches keep their rows, so later epochs differ).
        exact_dense: the dense gradients were summed in float64 (``--exact-dense``).
    """

    world_size: int
    hot_rows: int = 0
    rho: float = 0.0
    cost_model_r2: float = float("nan")
    c_ar: float = float("nan")
    c_a2a: float = float("nan")
    exchange: ExchangeStats = field(default_factory=ExchangeStats)
    remainder_rows: int = 0
    cache_rows: int = 0
    cache: dict[str, int] = field(default_factory=dict)
    cache_per_rank: list[dict[str, int]] = field(default_factory=list)
    shadow_steps: int = 0
    shadow_matched: int = 0
    exact_dense: bool = False

    def lines(self) -> list[tuple[str, str]]:
        return [*self._exchange_lines(), ("dense grads", "float64 sums, rounded once (--exact-dense)"
                if self.exact_dense else "DDP, float32 sums")]  # fmt: skip

    def _exchange_lines(self) -> list[tuple[str, str]]:
        ex = self.exchange
        if self.cache_rows:
            c = self.cache
            reads = max(c.get("reads", 0), 1)
            return [
                ("ranks", f"{self.world_size}"),
                ("caches", f"{self.cache_rows:,} rows per rank; {1 - c.get('pulls', 0) / reads:.1%}"
                           " of the reads hit the latest version"),
                ("transfers", f"{c.get('pulls', 0):,} miss pulls, {c.get('pushes', 0):,} update "
                              f"pushes, {c.get('evict_pushes', 0):,} evict pushes, "
                              f"{c.get('shared', 0):,} shared reads (gradients sent home)"),
                *(
                    [("shadow", f"the dispatcher predicted every transfer of {self.shadow_matched:,}"
                                f" of {self.shadow_steps:,} steps checked")]
                    if self.shadow_steps else []
                ),
                ("remainder", f"{self.remainder_rows:,} rows of the last epoch not dealt"),
            ]  # fmt: skip
        return [
            ("ranks", f"{self.world_size}"),
            ("hot rows", f"{self.hot_rows:,} (serving {self.rho:.1%} of counted accesses)"),
            ("cost model", f"C_ar {self.c_ar:.3g} s/row, C_a2a {self.c_a2a:.3g} s/access, "
                           f"r² {self.cost_model_r2:.3f}"),
            ("all-to-all", f"{ex.cold_rows:,} rows ({ex.remote_rows:,} remote), "
                           f"{ex.a2a_bytes / 2**20:.1f} MiB"),
            ("remainder", f"{self.remainder_rows:,} rows of the last epoch not dealt"),
        ]  # fmt: skip


def check_config(config: TrainConfig) -> None:
    """Refuse what a multi-rank run does not support (before any process is started).

    Raises:
        RecpipeError: naming the option and why.
    """
    if config.store != "module":
        msg = (
            f"`store` {config.store!r} with several processes: not supported yet; the tables of "
            "a multi-rank job are sharded over the ranks (row-wise Adagrad or SGD, as the store)"
        )
        raise RecpipeError(msg)
    if config.optimizer == "adam":
        msg = "`optimizer` 'adam' with several processes: the sharded tables train with sgd or adagrad"
        raise RecpipeError(msg)
    if config.batch_size < 2:
        msg = (
            f"`batch_size` (per rank) must be >= 2 with several processes, got {config.batch_size}"
        )
        raise RecpipeError(msg)


class _RankRun:
    """The state of one rank's ``train_rank`` call (its history is a :class:`RunLog`, as in
    the single-process loop; rank 0 writes the metrics)."""

    def __init__(
        self, config: TrainConfig, options: DistributedConfig, comm: Comm, *, progress: bool
    ) -> None:

        self.config, self.options, self.comm = config, options, comm
        self.progress = progress and comm.rank == 0
        self.schema = read_schema(config)
        # on CUDA each rank trains on the device its group was set up on (cuda:LOCAL_RANK)
        self.device = comm.device if comm.device.type == "cuda" else torch.device(config.device)
        check_config(config)
        self.resume_state = None
        if config.resume and config.checkpoint is not None:
            self.resume_state = read_checkpoint(config.checkpoint)
        self.trainer = self._make_trainer()
        outside = self.trainer.exact.outside if self.trainer.exact is not None else []
        if outside and comm.rank == 0:
            _log.warning(
                "--exact-dense: %d parameters are not nn.Linear layers' (%s%s): their gradients "
                "are float32 sums, the same on every rank but not bit for bit one process's",
                len(outside), ", ".join(outside[:3]), ", ..." if len(outside) > 3 else "",
            )  # fmt: skip
        self.shadow_cut: Any = None  # the dispatch cut, when it runs in this process
        self._shadow_missed: list[int] = []  # per step checked: 1 where this rank differed
        self._make_loaders()
        self.log = RunLog(config, device=self.device, write=comm.rank == 0)
        self.unreduced: list[dict[str, Any]] = []  # metrics records waiting for their loss
        self.saved_step: int | None = None
        self.hot_chosen = bool(options.cache_rows)  # a job with caches has no hot set
        self.fit: CostFit | None = None
        self.summary = DistributedSummary(world_size=comm.world_size, cache_rows=options.cache_rows,
                                          exact_dense=options.exact_dense)  # fmt: skip
        _log.info(
            "rank %d of %d on %s: %d row groups with training rows, %d with held-out rows",
            comm.rank, comm.world_size, self.device, self.train_splits, self.eval_splits,
        )  # fmt: skip

    def _make_trainer(self) -> DistributedTrainer:
        from trainer.models import DLRM

        cfg = self.config
        factory = sharded_table_factory(optimizer=cfg.optimizer, device=self.device)
        model = DLRM.from_schema(self.schema, model_config(cfg), table_factory=factory)
        return DistributedTrainer(
            model,
            comm=self.comm,
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            device=self.device,
            hot_budget_rows=self.options.hot_budget_rows,
            count_steps=self.options.count_steps,
            cache_rows=self.options.cache_rows or None,
            table_order=self._table_order(model),
            exact_dense=self.options.exact_dense,
        )

    def _table_order(self, model: Any) -> list[str] | None:
        """The tables in the dispatcher's order (the schema's sparse features), when there is
        one table per sparse feature; else the model's order."""
        from trainer.distributed.exchange import ShardedTable

        names = [m.config.name for m in model.modules() if isinstance(m, ShardedTable)]
        sparse = list(self.schema.sparse_names)
        return sparse if sorted(names) == sorted(sparse) else None

    def _make_loaders(self) -> None:
        """Training and held-out batches of this rank, in-process or through the service (the
        sessions divided by :func:`holdout_splits` either way)."""
        from readers.holdout import holdout_splits
        from readers.source import DatasetSource

        cfg = self.config
        splits = DatasetSource(cfg.dataset, schema=self.schema).splits
        train, held = holdout_splits(
            splits, session_key=self.schema.session_key, fraction=cfg.eval_fraction, seed=cfg.seed
        )
        self.train_splits, self.eval_splits = len(train), len(held)
        if cfg.service is not None:
            if self.options.dispatch != "contiguous":
                msg = (
                    f"`dispatch` {self.options.dispatch!r} with --service: the reader service "
                    "dispatches (`recpipe serve --dispatch`)"
                )
                raise RecpipeError(msg)
            self._make_service_loaders(train, held)
            return
        from readers.dataset import make_pipeline
        from readers.dispatch.cut import rank_cut
        from readers.ranks import RankBatchDataset, RankLoader
        from readers.source import ReaderConfig

        transforms = make_pipeline(
            cfg.preprocess, self.schema, dataset=cfg.dataset, fitted=cfg.fitted
        )
        common = {"schema": self.schema, "transforms": transforms, "dedup": cfg.dedup,
                  "rank": self.comm.rank, "world_size": self.comm.world_size}  # fmt: skip
        reader = ReaderConfig(**reader_options(cfg), shuffle=cfg.shuffle, seed=cfg.seed)
        opts = self.options
        caches = {"cache_rows": (opts.cache_rows,)} if opts.cache_rows else {}
        cut = rank_cut(opts.dispatch, schema=self.schema, alpha=opts.alpha,
                       bandwidths=opts.bandwidths, **caches)  # fmt: skip
        self.train_ds = RankBatchDataset(cfg.dataset, config=reader, splits=train, cut=cut,
                                         **common)  # fmt: skip
        # the caches' transfers can be checked against the dispatcher's shadow when the cut runs
        # in this process (no DataLoader workers)
        in_process = opts.cache_rows and cfg.workers == 0 and hasattr(cut, "recent")
        self.shadow_cut = cut if in_process else None
        self.eval_ds = RankBatchDataset(
            cfg.dataset, config=ReaderConfig(**reader_options(cfg)), splits=held, **common
        )
        self.loader = RankLoader(self.train_ds, num_workers=cfg.workers)

    def _make_service_loaders(self, train: list[Any], held: list[Any]) -> None:
        """One client of ``recpipe serve`` per rank: the server's training part and held-out
        part, checked to hold as many row groups as this dataset's."""
        from readers.holdout import Holdout
        from readers.service.client import ServiceRankDataset

        cfg, comm = self.config, self.comm
        holdout = Holdout(cfg.eval_fraction, seed=cfg.seed) if held else None
        common = {"rank": comm.rank, "world_size": comm.world_size, "batch_size": cfg.batch_size}
        self.train_ds = ServiceRankDataset(
            cfg.service, holdout=holdout, splits=len(train), **common
        )
        self.eval_ds = None
        if holdout is not None:
            part = holdout.other()
            self.eval_ds = ServiceRankDataset(cfg.service, holdout=part, splits=len(held), **common)
        self.loader = self.train_ds

    # -- hot set ---------------------------------------------------------------------------------
    def _choose_hot_set(self) -> None:
        sparse, opts = self.trainer.sparse, self.options
        candidates = sparse.gather_counts()
        if opts.hot_rows == "auto":
            plan = choose_num_hot(candidates, self.fit)
            num_hot = plan.num_hot
        else:
            num_hot = int(opts.hot_rows)
        sparse.reshard(num_hot)
        self.hot_chosen = True
        rho = candidates.rho()
        self.summary.hot_rows = sparse.num_hot
        self.summary.rho = float(rho[min(sparse.num_hot, rho.size - 1)])

    # -- losses and metrics ------------------------------------------------------------------------
    def _reduce_losses(self) -> None:
        """The pending steps' losses (one all-reduce for all of them), and their records."""
        losses = self.trainer.pending_losses()  # all-reduced: every rank sees the same values
        for record, loss in zip(self.unreduced, losses, strict=True):
            if not math.isfinite(loss):
                msg = (
                    f"step {record['step']}: the training loss is {loss}; training stopped"
                    f"{divergence_hint(self.config, self.saved_step)}"
                )
                raise RecpipeError(msg)
        self.log.losses += losses
        for record, loss in zip(self.unreduced, losses, strict=True):
            self.log.record({**record, "loss": loss})
        self.unreduced = []

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path | None:
        cfg = self.config
        self._reduce_losses()
        if cfg.checkpoint is None or self.saved_step == self.trainer.step:
            return None if cfg.checkpoint is None else checkpoint_file(cfg.checkpoint)
        state = {
            "trainer": self.trainer.state_dict(),
            "reader": self.loader.state_dict(),
            **self.log.state_dict(),
            "hot_chosen": self.hot_chosen,
            "options": asdict(self.options),
        }
        path = save_checkpoint(cfg.checkpoint, comm=self.comm, sparse=self.trainer.sparse,
                               step=self.trainer.step, state=state)  # fmt: skip
        self.saved_step = self.trainer.step
        return path

    def restore(self) -> None:
        state = self.resume_state
        if state is None:
            return
        self.trainer.load_state_dict(state["trainer"])
        self.loader.load_state_dict(state["reader"])
        load_sparse(self.config.checkpoint, state, sparse=self.trainer.sparse)
        self.log.load_state_dict(state, step=self.trainer.step)
        self.hot_chosen = bool(state["hot_chosen"]) or bool(self.options.cache_rows)
        if self.hot_chosen:
            self.trainer.sparse.count_left = 0
            self.summary.hot_rows = self.trainer.sparse.num_hot
        self.saved_step = self.trainer.step

    # -- the loop --------------------------------------------------------------------------------
    def _fit_costs(self) -> None:
        top = self.options.probe_rows
        sizes = [max(top // k, 1) for k in (64, 16, 4, 1)]
        self.fit = fit_costs(self.comm, dim=self.config.model.embedding_dim, ar_rows=sizes,
                             a2a_rows=sizes, repeats=self.options.probe_repeats)  # fmt: skip
        self.summary.cost_model_r2 = self.fit.r2
        self.summary.c_ar, self.summary.c_a2a = self.fit.c_ar, self.fit.c_a2a

    def run(self) -> TrainResult:
        from recpipe.progress import progress_bar

        cfg, comm, log = self.config, self.comm, self.log
        self.restore()
        if not self.options.cache_rows:
            self._fit_costs()
        target_steps, target_epochs = run_targets(cfg)
        count_until = self.trainer.step + self.options.count_steps
        bar = progress_bar(total=target_steps, initial=self.trainer.step, unit="step", desc="train",
                   file=sys.stderr, disable=not self.progress, dynamic_ncols=True)  # fmt: skip
        t0 = last = time.perf_counter()
        samples0 = log.samples
        done = self._finished(target_steps, target_epochs)
        empty = 0
        try:
            log.open_sinks()
            while not done:
                empty += 1
                for batch in self.loader:
                    empty = 0
                    _, logits = self.trainer.train_step(batch, reduce_loss=False)
                    self._check_shadow()
                    log.add_batch(batch, logits, samples=batch.batch_size * comm.world_size)
                    step = self.trainer.step
                    bar.update(1)
                    now = time.perf_counter()
                    train_s = now - t0 - log.eval_s  # evaluations are not training time
                    rate = (log.samples - samples0) / max(train_s, 1e-9)
                    window_auc = log.window.auc() if step % cfg.log_every == 0 else None
                    self.unreduced.append(log.train_record(
                        step=step, epoch=self.loader.epoch, auc=window_auc, samples_per_s=rate,
                        step_s=now - last, memory=peak_memory_bytes(self.device), wall_s=train_s,
                    ))  # fmt: skip
                    last = now
                    if step % cfg.log_every == 0:
                        self._reduce_losses()
                        bar.set_postfix(loss=f"{np.mean(log.losses[-20:]):.4f}",
                                        sps=f"{rate:,.0f}", refresh=False)  # fmt: skip
                    if not self.hot_chosen and step >= count_until:
                        self._choose_hot_set()
                    if cfg.eval_every and step % cfg.eval_every == 0:
                        last += self._evaluate(step)  # the next step_s leaves it out
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        self.save()
                    if target_steps is not None and step >= target_steps:
                        break
                done = self._finished(target_steps, target_epochs)
                if empty >= 2 and not done:
                    msg = (
                        f"{cfg.dataset}: the training split yields no batch of {cfg.batch_size} "
                        f"rows per rank for {comm.world_size} ranks"
                    )
                    raise RecpipeError(msg)
            self._reduce_losses()
            wall = time.perf_counter() - t0 - log.eval_s  # train_wall_s
            if not log.evaluated_at(self.trainer.step):
                self._evaluate(self.trainer.step)
            path = self.save()
        finally:
            bar.close()
            log.close()
        totals = self.trainer.sparse.stats.as_tensor()
        comm.all_reduce(totals, what="the final counters")
        self.summary.exchange = ExchangeStats.from_tensor(totals)
        if self.shadow_cut is not None:  # a step matched when it matched on every rank
            missed = torch.tensor(self._shadow_missed, dtype=torch.int64)
            comm.all_reduce(missed, what="the shadow check", op="max")
            self.summary.shadow_steps = int(missed.numel())
            self.summary.shadow_matched = int((missed == 0).sum())
        if self.options.cache_rows:
            per_rank = self.trainer.sparse.totals()
            self.summary.cache_per_rank = per_rank
            self.summary.cache = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
        self.summary.remainder_rows = self.train_ds.remainder_rows
        return log.result(
            steps=self.trainer.step, samples0=samples0, wall=wall, checkpoint=path,
            train_splits=self.train_splits, eval_splits=self.eval_splits,
        )  # fmt: skip

    def _check_shadow(self) -> None:
        """Compare this rank's cache transfers of the step with the dispatcher's prediction
        (the step just dispatched: the readers run in this process, one batch at a time)."""
        if self.shadow_cut is None:
            return
        record = self.trainer.sparse.last_record
        predicted = self.shadow_cut.recent()[-1].transfers
        rank = self.comm.rank
        same = all(
            np.array_equal(getattr(record, kind),
                           self.shadow_cut.row_pairs(getattr(predicted, kind)[rank]))
            for kind in RECORD_KINDS
        )  # fmt: skip
        self._shadow_missed.append(0 if same else 1)

    def _finished(self, target_steps: int | None, target_epochs: int | None) -> bool:
        if target_steps is not None:
            return self.trainer.step >= target_steps
        return self.loader.epoch >= target_epochs

    def _evaluate(self, step: int) -> float:
        """Evaluate on the held-out data of all ranks; the seconds it took."""
        if self.eval_ds is None:
            return 0.0
        t0 = time.perf_counter()
        self.eval_ds.set_epoch(0)
        result = self.trainer.evaluate(iter(self.eval_ds), max_batches=self.config.eval_batches)
        seconds = time.perf_counter() - t0
        self.log.add_eval(step, result, epoch=self.loader.epoch, seconds=seconds)
        return seconds


def train_rank(
    config: TrainConfig,
    options: DistributedConfig,
    *,
    comm: Comm,
    progress: bool = True,
    log: TextIO | None = None,
) -> tuple[TrainResult, DistributedSummary]:
    """Train this rank's part of a multi-rank job (collective: every rank calls it).

    Args:
        config: the run, as for one process; ``batch_size`` is per rank (the global batch is
            ``world_size`` times it).
        options: the exchange's options.
        comm: the job's exchange group (:func:`trainer.distributed.comm.init_from_env`).
        progress: show a progress bar (rank 0 only).
        log: where messages go (default stderr).

    Returns:
        The run (losses of the global batches, the same on every rank) and the exchange's
        summary (every rank's counters summed).

    Raises:
        DistributedError: the ranks were started with different settings or datasets
            (:mod:`trainer.distributed.settings`, checked first), or a peer failed.
    """
    del log
    check_same_settings(comm, job_settings(config, options))  # before any other collective
    run = _RankRun(config, options, comm, progress=progress)
    result = run.run()
    return result, run.summary


def describe(summary: DistributedSummary) -> str:
    """The summary's lines, as ``format_summary`` shows its own."""
    rows = summary.lines()
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def dump(summary: DistributedSummary) -> dict[str, Any]:
    """The summary as JSON-ready values."""
    out = asdict(summary)
    out["exchange"] = asdict(summary.exchange)
    return out
