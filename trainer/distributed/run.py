"""``recpipe train`` on one rank of a multi-rank job: :class:`RankEngine`, driven by the one loop
of :mod:`trainer.loop`.

::

    sessions -> train | held out (by session hash, as in one process)
    train -> the run's stream (trainer.streams): step t's global batch cut across the ranks,
             in process or from `recpipe serve` (one client per rank) -> DistributedTrainer
    start-up: every rank's settings and dataset compared (one digest each: refused, naming the
    setting, where they differ)
    first --count-steps steps: count accesses; then fit the cost model on the job's group
    (collectives timed at several sizes, within 5% of the run's exchange the counted steps
    measure), choose R (cost model, R = 0 where its fit is poor, or --hot-rows) and reshard; every --checkpoint-every steps and at the end: a collective checkpoint
    at the end (and every --eval-every steps): every rank scores all held-out rows

Rank 0 shows progress and writes the checkpoint's dense part, the summary and the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.checkpoint import check_resume, checkpoint_file, global_batch_change
from trainer.config import DEFAULT_LR, TrainConfig
from trainer.distributed.cache import RECORD_KINDS
from trainer.distributed.checkpoint import load_sparse, read_checkpoint, save_checkpoint
from trainer.distributed.comm import Comm
from trainer.distributed.config import DistributedConfig
from trainer.distributed.costs import (
    PROBE_ROWS,
    PROBE_SHARE,
    CostFit,
    ProbePlan,
    choose_num_hot,
    fallback_reason,
    fit_costs,
    probe_plan,
)
from trainer.distributed.exchange import ExchangeStats
from trainer.distributed.settings import check_same_settings, job_settings
from trainer.distributed.store_shard import (
    check_store_options,
    load_store_sparse,
    save_store_checkpoint,
    store_table_factory,
)
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.runlog import EvalResult, TrainResult
from trainer.train import evaluate_batches, model_config, read_schema

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = [
    "DistributedConfig",
    "DistributedSummary",
    "RankEngine",
    "check_config",
    "placement_broadcast",
    "train_rank",
]

_log = logging.getLogger(__name__)


@dataclass
class DistributedSummary:
    """What the exchange did over the whole job (every rank summed).

    Attributes:
        world_size: ranks.
        hot_rows: R after the hot set was chosen.
        rho: share of the counted accesses the hot set serves.
        cost_model_r2: the worst r² of the fitted lines.
        c_ar, c_a2a: the fitted coefficients (seconds per hot row, per cold access).
        cost_model: what became of the cost model, as the summary line says it (``""``: not
            fitted, e.g. resumed after R was chosen, or a job with caches).
        cost_model_fallback: what R was taken instead of the model's choice (``""``: none):
            ``"R = 0"`` when the fit was poor (``costs.POOR_FIT_R2``) or the probe not run.
        planned_exchange_bytes: the run's exchange without a hot set, every rank together:
            the counted steps' bytes (sent to other ranks, and all-reduced) per step times the
            run's steps (``--steps``, or the epochs' steps where the reader knows them; else
            the counted steps). ``None``: not measured (no probe was planned).
        probe_bound_bytes: the most the probe may move (``costs.PROBE_SHARE`` of the planned
            exchange; explicit ``--probe-rows``/``--probe-repeats`` are not held to it).
        probe_bytes: bytes the probe moved, every rank together (0: not run).
        probe_rows, probe_repeats: the probe's largest size and its repeats (0: not run).
        probe_s: seconds the probe took (rank 0).
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
        exact_dense: the dense gradients were summed in float64 (the default; ``--fast-dense``:
            DDP's float32 all-reduce).
    """

    world_size: int
    hot_rows: int = 0
    rho: float = 0.0
    cost_model_r2: float = float("nan")
    c_ar: float = float("nan")
    c_a2a: float = float("nan")
    cost_model: str = ""
    cost_model_fallback: str = ""
    planned_exchange_bytes: int | None = None
    probe_bound_bytes: int | None = None
    probe_bytes: int = 0
    probe_rows: int = 0
    probe_repeats: int = 0
    probe_s: float = 0.0
    exchange: ExchangeStats = field(default_factory=ExchangeStats)
    remainder_rows: int = 0
    cache_rows: int = 0
    cache: dict[str, int] = field(default_factory=dict)
    cache_per_rank: list[dict[str, int]] = field(default_factory=list)
    shadow_steps: int = 0
    shadow_matched: int = 0
    exact_dense: bool = False

    def lines(self) -> list[tuple[str, str]]:
        return [*self._exchange_lines(), ("dense grads", "float64 sums, rounded once (exact)"
                if self.exact_dense else "DDP, float32 sums (--fast-dense)")]  # fmt: skip

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
            ("cost model", self.cost_model or "not fitted"),
            ("cost probe", self._probe_line()),
            ("all-to-all", f"{ex.cold_rows:,} rows ({ex.remote_rows:,} remote), "
                           f"{ex.a2a_bytes / 2**20:.1f} MiB"),
            ("remainder", f"{self.remainder_rows:,} rows of the last epoch not dealt"),
        ]  # fmt: skip

    def _probe_line(self) -> str:
        if self.probe_bound_bytes is None or self.planned_exchange_bytes is None:
            return "not run"
        bound = (f"bound {_mib(self.probe_bound_bytes)} ({PROBE_SHARE:.0%} of the planned "
                 f"exchange, {_mib(self.planned_exchange_bytes)})")  # fmt: skip
        if not self.probe_rows:
            return f"not run; {bound}"
        over = ", exceeded: --probe-rows/--probe-repeats given"
        return (f"{_mib(self.probe_bytes)} moved in {self.probe_s:.2f} s (sizes up to "
                f"{self.probe_rows:,} rows, {self.probe_repeats} repeat"
            f"{'' if self.probe_repeats == 1 else 's'}); {bound}"
                f"{over if self.probe_bytes > self.probe_bound_bytes else ''}")  # fmt: skip


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def check_config(config: TrainConfig, options: DistributedConfig | None = None) -> None:
    """Refuse what a multi-rank run does not support (before any process is started).

    Raises:
        RecpipeError: naming the option and why.
    """
    if config.store == "hybrid":
        cache_rows = 0 if options is None else options.cache_rows
        check_store_options(optimizer=config.optimizer, cache_rows=cache_rows)
    if config.batch_size < 2:
        msg = (
            f"`batch_size` (per rank) must be >= 2 with several processes, got {config.batch_size}"
        )
        raise RecpipeError(msg)


class RankEngine:
    """One rank's step engine (:class:`trainer.loop.StepEngine`): a
    :class:`DistributedTrainer` (sharded tables, the 2FP exchange or caches), its cost model,
    hot set and collective checkpoints. With ``--store hybrid`` the rows it owns live in its
    own embedding stores (:mod:`trainer.distributed.store_shard`).

    Args:
        config: the run (``batch_size`` per rank).
        options: the exchange's options.
        comm: the job's group (a world of one: this process alone).
        schema: the schema it reads and builds the model with.
        resume_state: the checkpoint the job resumes.
    """

    def __init__(
        self, config: TrainConfig, options: DistributedConfig, comm: Comm, *,
        schema: Any, resume_state: dict[str, Any] | None,
    ) -> None:  # fmt: skip
        self.config, self.options, self.comm, self.schema = config, options, comm, schema
        self.world_size, self.writer = comm.world_size, comm.rank == 0
        # on CUDA each rank trains on the device its group was set up on (cuda:LOCAL_RANK)
        self.device = comm.device if comm.device.type == "cuda" else torch.device(config.device)
        self.resume_state = resume_state
        self.stores: list[Any] = []  # with --store hybrid: this rank's stores, one per table
        try:
            self.trainer = self._make_trainer()  # exact dense warns of what it cannot cover
        except BaseException:
            for store in self.stores:  # a temporary store's directory goes with it
                store.close()
            raise
        self.dispatch_cut: Any = None  # the dispatch-once cut, when the readers run here
        self.shadow_cut: Any = None  # the same, when the caches are checked against it
        self._shadow_missed: list[int] = []  # per step checked: 1 where this rank differed
        self.hot_chosen = bool(options.cache_rows)  # a job with caches has no hot set
        self.fit: CostFit | None = None
        self.summary = DistributedSummary(world_size=comm.world_size, cache_rows=options.cache_rows,
                                          exact_dense=options.exact_dense)  # fmt: skip
        self.count_until = options.count_steps
        self.stream: Any = None  # set by train_rank (the remainder, at the end)

    @property
    def step(self) -> int:
        return self.trainer.step

    def _make_trainer(self) -> DistributedTrainer:
        from trainer.models import DLRM

        cfg = self.config
        if cfg.store == "hybrid":
            factory = self._store_factory()
        else:
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

    def _store_factory(self) -> Any:
        """Tables whose owned rows live in this rank's stores: reopened at the checkpoint's
        step when the job resumes at the world size it was saved at, else created."""
        cfg, comm = self.config, self.comm
        check_store_options(optimizer=cfg.optimizer, cache_rows=self.options.cache_rows)
        if self.device.type != "cpu":
            msg = f"`--store` 'hybrid' with several processes on {self.device.type}: not supported yet (CPU only)"
            raise RecpipeError(msg)
        state = self.resume_state
        same = state is not None and state.get("store_world_size") == comm.world_size
        return store_table_factory(
            optimizer=cfg.optimizer,
            lr=DEFAULT_LR[cfg.optimizer] if cfg.lr is None else float(cfg.lr),
            root=cfg.checkpoint,
            rank=comm.rank,
            world_size=comm.world_size,
            open_step=int(state["step"]) if same and state is not None else None,
            stores=self.stores,
        )

    def _table_order(self, model: Any) -> list[str] | None:
        """The tables in the dispatcher's order (the schema's sparse features), when there is
        one table per sparse feature; else the model's order."""
        from trainer.distributed.exchange import ShardedTable

        names = [m.config.name for m in model.modules() if isinstance(m, ShardedTable)]
        sparse = list(self.schema.sparse_names)
        return sparse if sorted(names) == sorted(sparse) else None

    def cut(self) -> Any:
        """The dispatch cut of the training stream (``None`` through the service, which
        dispatches itself)."""
        from readers.dispatch.cut import DispatchOnceCut, rank_cut

        opts = self.options
        if self.config.service is not None:
            if opts.dispatch != "contiguous":
                msg = (
                    f"`dispatch` {opts.dispatch!r} with --service: the reader service "
                    "dispatches (`recpipe serve --dispatch`)"
                )
                raise RecpipeError(msg)
            return None
        extra: dict[str, Any] = {"cache_rows": (opts.cache_rows,)} if opts.cache_rows else {}
        model = model_config(self.config)
        if opts.dispatch != "contiguous" and model.hash_ids:  # the rows the tables hold
            extra["id_modulus"] = model.num_embeddings
        if opts.dispatch != "contiguous":  # a row's home is its owner rank (owner_of)
            extra["homes"] = "ranks"
        cut = rank_cut(opts.dispatch, schema=self.schema, alpha=opts.alpha,
                       bandwidths=opts.bandwidths, **extra)  # fmt: skip
        if opts.dispatch == "contiguous" or self.config.workers:
            return cut  # DataLoader workers: every rank's workers dispatch for it
        # readers in this process: rank 0 dispatches each global batch once, for every rank;
        # with caches each rank checks its transfers against the shadow's (digests travel)
        once = DispatchOnceCut(cut, rank=self.comm.rank, world_size=self.world_size,
                               share=placement_broadcast(self.comm),
                               check_kinds=RECORD_KINDS if opts.cache_rows else ())  # fmt: skip
        self.dispatch_cut = once
        self.shadow_cut = once if opts.cache_rows else None
        return once

    # -- the step ----------------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> torch.Tensor:
        _, logits = self.trainer.train_step(batch, reduce_loss=False)
        self._check_shadow()
        return logits

    def pending_losses(self) -> list[float]:
        return self.trainer.pending_losses()  # all-reduced: every rank sees the same values

    def after_step(self) -> float:
        """Once the accesses are counted: probe the links, choose R, reshard; the seconds."""
        if self.hot_chosen or self.trainer.step < self.count_until:
            return 0.0
        start = time.perf_counter()
        self._choose_hot_set()
        return time.perf_counter() - start

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None) -> EvalResult:
        """Every rank scores the same held-out batches (one process's): the lookups are
        collective, the loss and AUC need no gather."""
        trainer = self.trainer
        trainer.module.eval()

        def logits_of(batch: Batch) -> torch.Tensor:
            return trainer.module(trainer.sparse.prepare(batch, train=False))

        return evaluate_batches(logits_of, batches, device=self.device, max_batches=max_batches)

    # -- hot set ---------------------------------------------------------------------------------
    def fit_costs(self) -> None:
        """Fit the cost model on the job's group (collective; when R is chosen, after the
        counted steps, whose exchange gives the planned run's): the largest probe within
        ``costs.PROBE_SHARE`` of the run's planned exchange (:func:`costs.probe_plan`; none
        fits: no fit), or the one ``--probe-rows``/``--probe-repeats`` ask for. Nothing with
        caches (no hot set) or with ``--hot-rows R`` and no probe option (nothing to choose)."""
        opts, summary, comm = self.options, self.summary, self.comm
        explicit = opts.probe_rows is not None or opts.probe_repeats is not None
        if opts.cache_rows:
            return
        if opts.hot_rows != "auto" and not explicit:
            summary.cost_model = f"not fitted (`--hot-rows` {opts.hot_rows} given)"
            return
        totals = self.trainer.sparse.stats.as_tensor()
        comm.all_reduce(totals, what="the counted steps' exchange")
        counted = ExchangeStats.from_tensor(totals)
        steps = max(counted.steps // comm.world_size, 1)
        planned = (counted.a2a_bytes + counted.allreduce_bytes) * self._planned_steps(steps)
        summary.planned_exchange_bytes = planned // steps
        bound = summary.probe_bound_bytes = int(PROBE_SHARE * planned // steps)
        dim = self.config.model.embedding_dim
        plan: ProbePlan | None
        if explicit:
            plan = ProbePlan(top=opts.probe_rows or PROBE_ROWS[-1], repeats=opts.probe_repeats or 7)
        else:
            plan = probe_plan(bound, dim=dim, world=comm.world_size)
        if plan is None:
            least = ProbePlan(top=256, repeats=1, hot_lookups=16)
            summary.cost_model = (
                f"not fitted: the smallest probe would move "
                f"{_mib(least.bytes(dim=dim, world=comm.world_size))}, over its bound"
            )
            return
        self.fit = fit = fit_costs(comm, dim=dim, ar_rows=plan.sizes, a2a_rows=plan.sizes,
                                   repeats=plan.repeats, hot_lookups=plan.hot_lookups)  # fmt: skip
        summary.probe_rows, summary.probe_repeats = plan.top, plan.repeats
        summary.probe_bytes, summary.probe_s = fit.probe_bytes, fit.probe_s
        summary.cost_model_r2, summary.c_ar, summary.c_a2a = fit.r2, fit.c_ar, fit.c_a2a
        summary.cost_model = (f"C_ar {fit.c_ar:.3g} s/row, C_a2a {fit.c_a2a:.3g} s/access, "
                              f"r² {fit.r2:.3f}")  # fmt: skip
        poor = fallback_reason(fit)
        if poor is not None:
            summary.cost_model = f"{poor}; {summary.cost_model}"

    def _planned_steps(self, counted: int) -> int:
        """The run's steps (``--steps``, else its epochs' where the reader knows them, else
        ``counted``)."""
        from trainer.runlog import run_targets

        steps, epochs = run_targets(self.config)
        if steps is None and epochs is not None and self.stream is not None:
            steps = self.stream.planned_steps(epochs)
        return max(steps or counted, counted)

    def _choose_hot_set(self) -> None:
        sparse, opts = self.trainer.sparse, self.options
        candidates = sparse.gather_counts()
        self.fit_costs()
        if opts.hot_rows != "auto":
            num_hot = int(opts.hot_rows)
        elif self.fit is not None and fallback_reason(self.fit) is None:
            num_hot = choose_num_hot(candidates, self.fit).num_hot
        else:  # no fit, or a poor one: no hot set (the 2FP exchange alone)
            num_hot = 0
            why, _, fitted = self.summary.cost_model.partition("; ")
            self.summary.cost_model_fallback = "R = 0"
            self.summary.cost_model = (f"{why}, fell back to R = 0 (no hot set)"
                                       + (f"; {fitted}" if fitted else ""))  # fmt: skip
        sparse.reshard(num_hot)
        self.hot_chosen = True
        rho = candidates.rho()
        self.summary.hot_rows = sparse.num_hot
        self.summary.rho = float(rho[min(sparse.num_hot, rho.size - 1)])

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self, state: dict[str, Any]) -> Path:
        cfg = self.config
        assert cfg.checkpoint is not None
        full = {
            **state,
            "trainer": self.trainer.state_dict(),
            "hot_chosen": self.hot_chosen,
            "options": asdict(self.options),
            "layout": {"kind": "ranks", "world_size": self.comm.world_size, "store": cfg.store},
        }
        save = save_store_checkpoint if self.stores else save_checkpoint
        return save(cfg.checkpoint, comm=self.comm, sparse=self.trainer.sparse,  # type: ignore[arg-type]
                    step=self.trainer.step, state=full)  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state["trainer"])
        if self.stores:
            load_store_sparse(self.config.checkpoint, state, sparse=self.trainer.sparse)  # type: ignore[arg-type]
        else:
            load_sparse(self.config.checkpoint, state, sparse=self.trainer.sparse)
        self.hot_chosen = bool(state["hot_chosen"]) or bool(self.options.cache_rows)
        if self.hot_chosen:
            self.trainer.sparse.count_left = 0
            self.summary.hot_rows = self.trainer.sparse.num_hot
        self.count_until = self.trainer.step + self.options.count_steps

    def close(self, *, failing: bool) -> None:
        """The job's counters, summed over ranks (collective; skipped when failing); the
        stores are closed (changes after their last checkpoint are not kept)."""
        try:
            if not failing:
                self._sum_counters()
        finally:
            if self.dispatch_cut is not None:
                self.dispatch_cut.close()
            for store in self.stores:
                store.close()

    def _sum_counters(self) -> None:
        comm = self.comm
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
        if self.stream is not None:
            self.summary.remainder_rows = self.stream.remainder_rows

    def _check_shadow(self) -> None:
        """Compare this rank's cache transfers of the step with the dispatcher's prediction
        (digests that came with the step's placement: the readers run in this process, one
        batch at a time)."""
        if self.shadow_cut is None:
            return
        from readers.dispatch.cut import pairs_digest

        record = self.trainer.sparse.last_record
        predicted = self.shadow_cut.last_digests[self.comm.rank]
        same = all(pairs_digest(getattr(record, kind)) == int(predicted[k])
                   for k, kind in enumerate(RECORD_KINDS))  # fmt: skip
        self._shadow_missed.append(0 if same else 1)


def placement_broadcast(comm: Comm) -> Callable[[np.ndarray], np.ndarray]:
    """The ``share`` of a :class:`readers.dispatch.cut.DispatchOnceCut`: an int64 payload
    broadcast from rank 0 of ``comm``'s ranks over a gloo group of its own (CPU, ``comm``'s
    timeout), so it never interleaves with the exchange's or DDP's collectives. Made by every
    rank of ``comm`` (only those: the group is formed among them)."""
    if comm.world_size == 1:
        return lambda payload: payload
    import torch.distributed as dist

    ranks = None if comm.group is None else dist.get_process_group_ranks(comm.group)
    group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True,
                           timeout=timedelta(seconds=comm.timeout_s))  # fmt: skip
    side = Comm.of(group, device="cpu", timeout_s=comm.timeout_s)

    def share(payload: np.ndarray) -> np.ndarray:
        with side.guard("the dispatch broadcast (rank 0's placement of the global batch)"):
            dist.broadcast(torch.from_numpy(payload), group=group, group_src=0)
        return payload

    return share


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
    from trainer.loop import run_loop
    from trainer.streams import open_stream

    check_same_settings(comm, job_settings(config, options))  # before any other collective
    check_config(config)
    schema = read_schema(config)
    state = None
    if config.resume and config.checkpoint is not None:
        state = read_checkpoint(config.checkpoint)
        if state is not None:
            path = checkpoint_file(config.checkpoint)
            check_resume(state, config, path=path, world_size=comm.world_size)
            note = global_batch_change(state, config, path=path, world_size=comm.world_size)
            if note is not None and comm.rank == 0:
                _log.warning("%s", note)
    engine = RankEngine(config, options, comm, schema=schema, resume_state=state)
    stream = open_stream(config, schema, rank=comm.rank, world_size=comm.world_size,
                         device=engine.device, cut=engine.cut())  # fmt: skip
    engine.stream = stream
    _log.info(
        "rank %d of %d on %s: %d row groups with training rows, %d with held-out rows",
        comm.rank, comm.world_size, engine.device, *stream.splits,
    )  # fmt: skip
    result = run_loop(config, engine, stream, resume_state=state, progress=progress)
    return result, engine.summary


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
