"""``recpipe train`` on one rank of a multi-rank job.

::

    row groups -> train | held out (whole sessions, as in one process)
    train -> RankBatchDataset (one global stream, an equal range per rank) -> DistributedTrainer
    start-up: fit the cost model on the job's group (collectives timed at several sizes)
    first --count-steps steps: count accesses; then choose R (cost model or --hot-rows) and
    reshard; every --checkpoint-every steps and at the end: a collective checkpoint
    at the end (and every --eval-every steps): loss and AUC on the held-out rows of all ranks

Rank 0 shows progress and writes the checkpoint's dense part, the summary and the metrics.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.config import TrainConfig
from trainer.distributed.checkpoint import load_sparse, read_checkpoint, save_checkpoint
from trainer.distributed.comm import Comm
from trainer.distributed.config import DistributedConfig
from trainer.distributed.costs import CostFit, choose_num_hot, fit_costs
from trainer.distributed.exchange import ExchangeStats
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.metrics import PredictionWindow
from trainer.train import EvalResult, TrainResult, batch_dedup_factor

__all__ = ["DistributedConfig", "DistributedSummary", "check_config", "train_rank"]


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
    """

    world_size: int
    hot_rows: int = 0
    rho: float = 0.0
    cost_model_r2: float = float("nan")
    c_ar: float = float("nan")
    c_a2a: float = float("nan")
    exchange: ExchangeStats = field(default_factory=ExchangeStats)
    remainder_rows: int = 0

    def lines(self) -> list[tuple[str, str]]:
        ex = self.exchange
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
    if config.service is not None:
        msg = "`service` with several processes: not supported yet (one client per rank)"
        raise RecpipeError(msg)
    if config.batch_size < 2:
        msg = (
            f"`batch_size` (per rank) must be >= 2 with several processes, got {config.batch_size}"
        )
        raise RecpipeError(msg)


class _RankRun:
    """The state of one rank's ``train_rank`` call."""

    def __init__(
        self, config: TrainConfig, options: DistributedConfig, comm: Comm, *, progress: bool
    ) -> None:
        from readers.dataset import dataset_schema

        self.config, self.options, self.comm = config, options, comm
        self.progress = progress and comm.rank == 0
        self.schema = dataset_schema(config.dataset)
        # on CUDA each rank trains on the device its group was set up on (cuda:LOCAL_RANK)
        self.device = comm.device if comm.device.type == "cuda" else torch.device(config.device)
        check_config(config)
        self.resume_state = None
        if config.resume and config.checkpoint is not None:
            self.resume_state = read_checkpoint(config.checkpoint)
        self.trainer = self._make_trainer()
        self._make_loaders()
        self.losses: list[float] = []
        self.samples = 0
        self.evals: list[tuple[int, EvalResult]] = []
        self.window = PredictionWindow(config.log_window)
        self.resumed_from: int | None = None
        self.saved_step: int | None = None
        self.hot_chosen = False
        self.fit: CostFit | None = None
        self.summary = DistributedSummary(world_size=comm.world_size)

    def _make_trainer(self) -> DistributedTrainer:
        from trainer.models import DLRM

        cfg = self.config
        factory = sharded_table_factory(optimizer=cfg.optimizer, device=self.device)
        model = DLRM.from_schema(self.schema, replace(cfg.model, seed=cfg.seed),
                                 table_factory=factory)  # fmt: skip
        return DistributedTrainer(
            model,
            comm=self.comm,
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            device=self.device,
            hot_budget_rows=self.options.hot_budget_rows,
            count_steps=self.options.count_steps,
        )

    def _make_loaders(self) -> None:
        from readers.holdout import holdout_splits
        from readers.ranks import RankBatchDataset, RankLoader
        from readers.source import DatasetSource, ReaderConfig

        cfg, comm = self.config, self.comm
        splits = DatasetSource(cfg.dataset, schema=self.schema).splits
        train, held = holdout_splits(
            splits, session_key=self.schema.session_key, fraction=cfg.eval_fraction, seed=cfg.seed
        )
        common = {"schema": self.schema, "transforms": cfg.preprocess, "dedup": cfg.dedup,
                  "rank": comm.rank, "world_size": comm.world_size}  # fmt: skip
        reader = ReaderConfig(batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed)
        self.train_ds = RankBatchDataset(cfg.dataset, config=reader, splits=train, **common)
        self.eval_ds = RankBatchDataset(
            cfg.dataset, config=ReaderConfig(batch_size=cfg.batch_size), splits=held, **common
        )
        self.train_splits, self.eval_splits = len(train), len(held)
        self.loader = RankLoader(self.train_ds, num_workers=cfg.workers)

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

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path | None:
        cfg = self.config
        self.losses += self.trainer.pending_losses()
        if cfg.checkpoint is None or self.saved_step == self.trainer.step:
            return None if cfg.checkpoint is None else Path(cfg.checkpoint) / "checkpoint.pt"
        state = {
            "trainer": self.trainer.state_dict(),
            "reader": self.loader.state_dict(),
            "losses": self.losses,
            "samples": self.samples,
            "evals": [(s, asdict(e)) for s, e in self.evals],
            "hot_chosen": self.hot_chosen,
            "config": {k: v for k, v in asdict(cfg).items() if k != "model"},
            "model_config": asdict(cfg.model),
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
        self.losses = list(state["losses"])
        self.samples = int(state["samples"])
        self.evals = [(s, EvalResult(**e)) for s, e in state["evals"]]
        self.hot_chosen = bool(state["hot_chosen"])
        if self.hot_chosen:
            self.trainer.sparse.count_left = 0
            self.summary.hot_rows = self.trainer.sparse.num_hot
        self.resumed_from = self.saved_step = self.trainer.step

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg, comm = self.config, self.comm
        self.restore()
        top = self.options.probe_rows
        self.fit = fit_costs(
            comm,
            dim=cfg.model.embedding_dim,
            ar_rows=[max(top // k, 1) for k in (64, 16, 4, 1)],
            a2a_rows=[max(top // k, 1) for k in (64, 16, 4, 1)],
            repeats=self.options.probe_repeats,
        )
        self.summary.cost_model_r2 = self.fit.r2
        self.summary.c_ar, self.summary.c_a2a = self.fit.c_ar, self.fit.c_a2a
        target_steps = cfg.steps
        target_epochs = cfg.epochs if cfg.steps is None else None
        if target_steps is None and target_epochs is None:
            target_epochs = 1
        count_until = self.trainer.step + self.options.count_steps
        bar = tqdm(total=target_steps, initial=self.trainer.step, unit="step", desc="train",
                   file=sys.stderr, disable=not self.progress, dynamic_ncols=True)  # fmt: skip
        t0, samples0 = time.perf_counter(), self.samples
        factors: list[float] = []
        done = self._finished(target_steps, target_epochs)
        empty = 0
        while not done:
            empty += 1
            for batch in self.loader:
                empty = 0
                factors.append(batch_dedup_factor(batch))
                _, logits = self.trainer.train_step(batch, reduce_loss=False)
                self.samples += batch.batch_size * comm.world_size
                self.window.add(logits, batch.labels)
                step = self.trainer.step
                bar.update(1)
                if step % 10 == 0:
                    self.losses += self.trainer.pending_losses()
                    rate = (self.samples - samples0) / max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(loss=f"{np.mean(self.losses[-20:]):.4f}",
                                    sps=f"{rate:,.0f}", refresh=False)  # fmt: skip
                if not self.hot_chosen and step >= count_until:
                    self._choose_hot_set()
                if cfg.eval_every and step % cfg.eval_every == 0:
                    self._evaluate(step)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self.save()
                if target_steps is not None and step >= target_steps:
                    break
            done = self._finished(target_steps, target_epochs)
            if empty >= 2 and not done:
                msg = (
                    f"{cfg.dataset}: the training split yields no batch of {cfg.batch_size} rows "
                    f"per rank for {comm.world_size} ranks"
                )
                raise RecpipeError(msg)
        self.losses += self.trainer.pending_losses()
        wall = time.perf_counter() - t0
        bar.close()
        if not self.evals or self.evals[-1][0] != self.trainer.step:
            self._evaluate(self.trainer.step)
        path = self.save()
        totals = self.trainer.sparse.stats.as_tensor()
        comm.all_reduce(totals, what="the final counters")
        self.summary.exchange = ExchangeStats.from_tensor(totals)
        self.summary.remainder_rows = self.train_ds.layout.remainder_rows
        return TrainResult(
            steps=self.trainer.step,
            samples=self.samples,
            losses=self.losses,
            train_auc=self.window.auc(),
            evals=self.evals,
            samples_per_s=(self.samples - samples0) / wall if wall > 0 else float("nan"),
            peak_memory_bytes=_peak_memory(self.device),
            dedup_factor=float(np.mean(factors)) if factors else 1.0,
            wall_s=wall,
            checkpoint=None if path is None else str(path),
            resumed_from=self.resumed_from,
            train_splits=self.train_splits,
            eval_splits=self.eval_splits,
        )

    def _finished(self, target_steps: int | None, target_epochs: int | None) -> bool:
        if target_steps is not None:
            return self.trainer.step >= target_steps
        return self.loader.epoch >= target_epochs

    def _evaluate(self, step: int) -> None:
        self.eval_ds.set_epoch(0)
        result = self.trainer.evaluate(iter(self.eval_ds), max_batches=self.config.eval_batches)
        if result.samples:
            self.evals.append((step, result))


def _peak_memory(device: torch.device) -> int:
    from trainer.metrics import peak_memory_bytes

    return peak_memory_bytes(device)


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
    """
    del log
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
