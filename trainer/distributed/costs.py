"""The hot-set cost model, fitted on the job's own process group at start-up.

A step costs (HypeReca)::

    f(R) = [R > 0]·A_ar + R·C_ar + N·(1 − ρ(R))·C_a2a

``R`` hot rows cost an all-reduce of their gradients and touched-rows mask every step (``C_ar``
per row, ``A_ar`` per call); every other access of the step's ``N`` unique-id accesses (all
ranks) moves an id, a row and a gradient by all-to-all, ``C_a2a`` per access more than a hot
access costs (the hot accesses' own cost, ``N·C_hot``, does not depend on R and is left out).
``ρ(R)`` is the share of accesses the R most accessed rows serve, measured
(:class:`HotCandidates`).

:func:`fit_costs` times steps of a one-table exchange on the job's own group (its collectives
and the work around them) at several sizes of three kinds: every size is visited a few times in
rotated orders, with untimed steps after every change of size; a visit keeps the slowest rank's
fastest step, a size its fastest visit (every rank fits the same numbers, so every rank chooses
the same R). A line is fitted to each kind; its r² says how well a line explains the
times. :func:`choose_num_hot` evaluates ``f`` at every R up to the candidates and takes the
smallest minimum (exact: no convexity assumed) among the R whose saving over no hot set,
``f(0) − f(R)``, the fit is confident of: the saving less ``confidence`` standard errors (from
the lines' slope errors) must stay positive. A gain the probe's own noise could explain buys a
hot set's all-reduce on every step for nothing, and the probe (one table, synthetic ids)
misses costs of the real job, so doubt falls on the side of no hot set.

**The probe's size.** A probe at the largest sizes moves far more than a short job exchanges
(``PROBE_ROWS`` with 7 repeats on 2 ranks: about 1.2 GB, a third of it the hot-lookup sweep's
all-reduce, which grows with W²). :func:`probe_plan` therefore picks the largest
:class:`ProbePlan` whose bytes (:meth:`ProbePlan.bytes`, counted as the exchange counts its own:
bytes sent to other ranks plus bytes all-reduced, and the hot sets' rows gathered) stay within
``PROBE_SHARE`` (5%) of the run's planned exchange, or none. :func:`fallback_reason` says when
a fit is too poor to choose R with (``POOR_FIT_R2``); the trainer then takes R = 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np
import torch

from trainer.distributed.comm import Comm
from trainer.distributed.exchange import HotCandidates, ShardedEmbeddings, ShardedTable
from trainer.distributed.shard import RowShard, SparseOptimizer
from trainer.store import CostCoefficients, HotPlan
from trainer.store.hotset import choose_on_curve

__all__ = [
    "CostFit",
    "LineFit",
    "ProbePlan",
    "choose_num_hot",
    "fallback_reason",
    "fit_costs",
    "probe_plan",
]

PROBE_ROWS: tuple[int, ...] = (1024, 4096, 16384, 65536)
#: standard errors a hot set's predicted saving must exceed (:func:`choose_num_hot`)
CONFIDENCE = 2.0
#: most of the planned run's exchange (bytes) the probe may move (:func:`probe_plan`)
PROBE_SHARE = 0.05
#: below this r² (the worst line's), the fit is not used to choose R (:func:`fallback_reason`):
#: with four sizes, r² < 0.5 puts a slope within 1.41 standard errors of zero
#: (t = r·√(n−2)/√(1−r²)), so not even its sign is sure, let alone a saving of 2 errors
POOR_FIT_R2 = 0.5
_GRAD_BYTES = 8  # gradients travel in float64 (exchange.GRAD_DTYPE)


@dataclass(frozen=True)
class LineFit:
    """``seconds = intercept + slope · size``, fitted by least squares.

    Attributes:
        slope: seconds per unit of size.
        intercept: seconds per call.
        r2: coefficient of determination of the fit.
        sizes: the sizes timed.
        seconds: the time at each size (over its visits, the fastest of the slowest rank's
            fastest steps).
        slope_se: the slope's standard error, from the residuals (0 with two sizes or fewer:
            nothing to estimate it from).
    """

    slope: float
    intercept: float
    r2: float
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    slope_se: float = 0.0

    @classmethod
    def of(cls, sizes: Sequence[int], seconds: Sequence[float]) -> LineFit:
        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        slope, intercept = np.polyfit(x, y, 1)
        resid = y - (intercept + slope * x)
        total = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
        spread = float(((x - x.mean()) ** 2).sum())
        se = 0.0
        if x.size > 2 and spread > 0:
            se = float(np.sqrt((resid**2).sum() / (x.size - 2) / spread))
        return cls(float(slope), float(intercept), r2, tuple(int(s) for s in sizes),
                   tuple(float(v) for v in seconds), se)  # fmt: skip


@dataclass(frozen=True)
class CostFit:
    """The fitted coefficients of the cost model.

    Attributes:
        all_reduce: time of an exchange step against hot rows R (a few of them looked up).
        all_to_all: time of an exchange step against the cold ids one rank looks up.
        hot_lookup: time of an exchange step against the hot ids one rank looks up, the hot set
            being every rank's ids of that size (its all-reduce grows with the size).
        world_size: ranks of the group measured.
        backend: its backend.
        baseline_s: a step of the all-reduce probe's lookups without a hot set (what the
            all-reduce probe costs besides the all-reduce).
        probe_bytes: bytes the probe moved, every rank together, counted as
            :meth:`ProbePlan.bytes` counts them (the exchange's own counters, and the hot
            sets' rows gathered).
        probe_s: seconds the probe took (this rank).
    """

    all_reduce: LineFit
    all_to_all: LineFit
    hot_lookup: LineFit
    world_size: int
    backend: str = "gloo"
    baseline_s: float = 0.0
    probe_bytes: int = 0
    probe_s: float = 0.0

    @property
    def c_ar(self) -> float:
        """Seconds per hot row per step."""
        return max(self.all_reduce.slope, 1e-12)

    @property
    def a_ar(self) -> float:
        """Seconds per all-reduce call (paid when R > 0)."""
        return max(self.all_reduce.intercept - self.baseline_s, 0.0)

    @property
    def hot_lookup_slope(self) -> float:
        """Seconds per hot id a rank looks up, its share of the all-reduce taken off (the
        sweep's hot set holds W rows per id looked up)."""
        return self.hot_lookup.slope - self.world_size * self.all_reduce.slope

    @property
    def c_a2a(self) -> float:
        """Seconds a cold access of the job costs more than a hot one (each rank looks up 1/W
        of the accesses)."""
        return max((self.all_to_all.slope - self.hot_lookup_slope) / self.world_size, 1e-12)

    @property
    def c_ar_se(self) -> float:
        """Standard error of :attr:`c_ar`."""
        return self.all_reduce.slope_se

    @property
    def c_a2a_se(self) -> float:
        """Standard error of :attr:`c_a2a` (the three slopes' errors, taken as independent)."""
        w = self.world_size
        var = (self.all_to_all.slope_se**2 + self.hot_lookup.slope_se**2
               + (w * self.all_reduce.slope_se) ** 2)  # fmt: skip
        return float(np.sqrt(var)) / w

    @property
    def r2(self) -> float:
        """The worst of the fits' r²."""
        return min(self.all_reduce.r2, self.all_to_all.r2, self.hot_lookup.r2)

    def coefficients(self) -> CostCoefficients:
        """The store's cost model with these coefficients (``A_ar`` and the standard errors
        included): what :func:`choose_num_hot` chooses R with."""
        return CostCoefficients(
            c_ar=self.c_ar,
            c_a2a=self.c_a2a,
            source=f"fitted on the job's process group ({self.world_size} ranks, {self.backend})",
            a_ar=self.a_ar,
            c_ar_se=self.c_ar_se,
            c_a2a_se=self.c_a2a_se,
        )

    def cost(self, num_hot: np.ndarray | int, rho: np.ndarray | float, accesses: float) -> Any:
        """``f(R)`` (:meth:`trainer.store.CostCoefficients.cost`)."""
        return self.coefficients().cost(num_hot, rho, accesses)

    def saving_se(self, num_hot: np.ndarray | int, rho: np.ndarray | float, accesses: float) -> Any:
        """Standard error of the saving ``f(0) − f(R)``
        (:meth:`trainer.store.CostCoefficients.saving_se`)."""
        return self.coefficients().saving_se(num_hot, rho, accesses)


@dataclass(frozen=True)
class ProbePlan:
    """The sizes and repeats of a cost probe (:func:`fit_costs`).

    Attributes:
        top: the largest size: hot rows of the all-reduce sweep, ids per rank of the lookup
            sweeps; each sweep times 1/64, 1/16, 1/4 and all of it.
        repeats: timed steps per size, over all visits.
        hot_lookups: ids looked up per step of the all-reduce sweep.
        rounds: visits of every size (at most ``repeats``).
        warm: untimed steps after every change of size.
    """

    top: int = PROBE_ROWS[-1]
    repeats: int = 7
    hot_lookups: int = 64
    rounds: int = 3
    warm: int = 2

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(max(self.top // k, 1) for k in (64, 16, 4, 1))

    @property
    def visits(self) -> int:
        return max(min(self.rounds, self.repeats), 1)

    @property
    def calls(self) -> int:
        """Timed steps per visit (at least ``repeats`` per size over the visits)."""
        return max(-(-self.repeats // self.visits), 1)

    def bytes(self, *, dim: int, world: int, itemsize: int = 4) -> int:
        """Bytes the probe moves, every rank together, counted as the exchange counts its own
        (:class:`~trainer.distributed.exchange.ExchangeStats`: bytes sent to other ranks,
        bytes all-reduced): a cold id's request, gradient and row when another rank owns it
        (chance (W−1)/W: an expectation), every rank's all-reduced hot gradients and masks,
        the counts messages; and, at most, every hot set's rows (with their optimizer state)
        and keys gathered by the other ranks at each visit."""
        w, steps = world, self.visits * (self.warm + self.calls)
        cold_id = (w - 1) * (8 + (_GRAD_BYTES + itemsize) * dim)  # all ranks, per id per rank
        hot_row = w * (dim + 1) * _GRAD_BYTES  # all-reduced by every rank
        gathered = (w - 1) * ((dim + 1) * itemsize + 16)
        sizes = self.sizes
        ar = [max(r, self.hot_lookups) for r in sizes]
        hot_sets = sum(w * s for s in sizes) + sum(ar)
        per_visit_steps = (
            sum(sizes) * cold_id  # the cold sweep
            + hot_sets * hot_row  # the hot-lookup sweep (W·s rows) and the all-reduce sweep
            + self.hot_lookups * cold_id  # the all-reduce sweep's baseline: no hot set
            + (3 * len(sizes) + 1) * w * (w - 1) * 8  # counts
        )
        return int(steps * per_visit_steps + self.visits * hot_sets * gathered)


def probe_plan(budget_bytes: float, *, dim: int, world: int, itemsize: int = 4) -> ProbePlan | None:
    """The largest probe within ``budget_bytes`` (:meth:`ProbePlan.bytes`), or ``None`` when
    even the smallest exceeds it.

    The largest size is halved from ``PROBE_ROWS[-1]`` (65,536) to 1,024 at 7 repeats, then to
    256 at 3 repeats (one timed step per visit), then 256 at 1 repeat (one visit): the sizes
    shrink before the repeats do, since a line over small sizes is still a line, and the
    fastest of several visits is what keeps other load out of it. ``hot_lookups`` is
    ``top // 16`` up to 64, so the all-reduce sweep's sizes stay distinct.
    """
    ladder = [(PROBE_ROWS[-1] >> k, 7) for k in range(7)]  # 65,536 .. 1,024
    ladder += [(1024, 3), (512, 3), (256, 3), (256, 1)]
    for top, repeats in ladder:
        plan = ProbePlan(top=top, repeats=repeats, hot_lookups=min(64, top // 16))
        if plan.bytes(dim=dim, world=world, itemsize=itemsize) <= budget_bytes:
            return plan
    return None


def fallback_reason(fit: CostFit, *, min_r2: float = POOR_FIT_R2) -> str | None:
    """Why ``fit`` should not choose R (``None``: it may): its worst line's r² below
    ``min_r2`` (or not a number)."""
    r2 = fit.r2
    if r2 >= min_r2:
        return None
    return f"poor fit (r² {r2:.3f} < {min_r2:g})"


_Step = Callable[[], float]
"""A probe step: runs one exchange step and returns the seconds of the part that is timed."""


def _slowest_rank_fastest(
    comm: Comm, setups: Sequence[Callable[[], _Step]], *, rounds: int, warm: int, calls: int
) -> list[float]:
    """The time of each case's step (collective: every rank gets the same times).

    ``rounds`` rounds visit every case, each round in an order rotated by one (no size always
    follows the same other one, and a slow phase of other load spoils one visit, not a size).
    A visit sets its case up (``setups[i]()``, which may call collectives: every rank visits
    in the same order), runs ``warm`` untimed steps (the first steps after a change of size
    run slower than the job's steady steps) and times ``calls`` steps. A visit's time is its slowest rank's fastest step, and a
    case's time its fastest visit (other load only slows steps down).
    """
    n = len(setups)
    fastest = np.full((rounds, n), np.inf)
    for r in range(rounds):
        for i in np.roll(np.arange(n), -r):
            step = setups[i]()
            for _ in range(warm):
                step()
            fastest[r, i] = min(step() for _ in range(calls))
    slowest = torch.from_numpy(fastest)
    comm.all_reduce(slowest, what="the cost probe", op="max")
    return slowest.numpy().min(axis=0).tolist()


class _Probe:
    """A one-table exchange on the job's group, driven with synthetic ids: what a step of the
    real exchange costs (its collectives and the work around them: indexing, placing rows,
    summing gradients, the optimizer)."""

    def __init__(self, comm: Comm, *, dim: int, dtype: torch.dtype) -> None:
        from torch import nn

        from trainer.modules import TableConfig

        table = ShardedTable(
            TableConfig("probe", 1, dim, ("probe",)),
            RowShard(dim=dim, dtype=dtype, device=comm.device, seed=1, with_state=True),
        )
        holder = nn.Module()
        holder.add_module("probe", table)
        self.comm = comm
        self.sparse = ShardedEmbeddings(
            holder, comm=comm, optimizer=SparseOptimizer("rowwise_adagrad", 1e-3), count_steps=0
        )

    def step(self, ids: np.ndarray, *, timed: str = "prepare+step") -> _Step:
        """One exchange step of a batch looking ``ids`` up; ``timed`` is ``"prepare+step"``
        (the whole step) or ``"step"`` (the backward exchange only: the hot all-reduce, the
        cold gradients' all-to-all and the updates)."""
        from recpipe.batch import Batch
        from recpipe.jagged import KeyedJaggedTensor

        n = ids.size
        kjt = KeyedJaggedTensor.from_lengths(
            ["probe"], torch.from_numpy(ids), torch.ones(n, dtype=torch.int64)
        )
        batch = Batch(dense=torch.zeros(n, 0), labels=torch.zeros(n), kjt=kjt)
        device = self.comm.device
        whole = timed == "prepare+step"

        def run() -> float:
            t0 = perf_counter()
            self.sparse.prepare(batch)
            if not whole:
                t0 = perf_counter()
            self.sparse.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return perf_counter() - t0

        return run


def fit_costs(
    comm: Comm,
    *,
    dim: int,
    dtype: torch.dtype = torch.float32,
    ar_rows: Sequence[int] = PROBE_ROWS,
    a2a_rows: Sequence[int] = PROBE_ROWS,
    repeats: int = 7,
    hot_lookups: int = 64,
    rounds: int = 3,
    warm: int = 2,
) -> CostFit:
    """Time the exchange on ``comm`` at several sizes and fit the cost model (collective:
    every rank calls it with the same arguments).

    A one-table exchange runs real steps, three sweeps of them:

    * ``a2a_rows`` distinct ids per rank, all cold (no hot set): the time per cold lookup;
    * the same ids, hot: the time per hot lookup (a hot row is not free: it is found,
      gathered and updated on every rank). The hot set is every rank's ids of the size timed
      (W per size unit), so this line's slope holds ``W·C_ar`` too, taken off again
      (:attr:`CostFit.hot_lookup_slope`); one hot set as large as the largest size would put
      its all-reduce, a large constant, into every size and drown the slope in its noise.
      ``C_a2a`` is what a cold lookup costs more;
    * hot sets of ``ar_rows`` rows with ``hot_lookups`` of them looked up: ``C_ar`` per hot
      row; the same lookups with no hot set are the baseline of the all-reduce's per-call
      cost. Only the backward exchange is timed here (the hot set changes nothing before it
      but a binary search among the hot ids): ``prepare``'s three all-to-alls would add
      their noise and no signal.

    Each sweep visits its sizes ``rounds`` times in rotated orders, with ``warm`` untimed
    steps after every change of size (:func:`_slowest_rank_fastest`).

    Args:
        comm: the job's exchange group.
        dim: embedding dimension D.
        dtype: the rows' dtype (gradients travel in float64).
        ar_rows: hot-set sizes R to time.
        a2a_rows: ids per rank to time (spread over all owners).
        repeats: timed steps per size, over all rounds.
        hot_lookups: ids looked up per step in the hot-set sweep.
        rounds: visits of every size (at most ``repeats``).
        warm: untimed steps after every change of size.
    """
    started = perf_counter()
    world = comm.world_size
    probe = _Probe(comm, dim=dim, dtype=dtype)
    gathered = [0]  # rows entering a hot set (the same on every rank)

    def set_hot(ids: np.ndarray) -> None:
        gathered[0] += int(ids.size - np.isin(ids, probe.sparse.tables[0].hot_ids).sum())
        probe.sparse.set_hot([ids])

    rounds = max(min(rounds, repeats), 1)
    calls = max(-(-repeats // rounds), 1)  # at least `repeats` timed steps per size

    def timed(setups: Sequence[Callable[[], _Step]]) -> list[float]:
        return _slowest_rank_fastest(comm, setups, rounds=rounds, warm=warm, calls=calls)

    steps = [probe.step(np.arange(rows, dtype=np.int64) + (comm.rank << 40)) for rows in a2a_rows]
    cold = timed([lambda s=s: s for s in steps])

    def all_hot(rows: int, step: _Step) -> Callable[[], _Step]:
        def setup() -> _Step:  # every rank's lookups of this size, and nothing more, hot
            every = [np.arange(rows, dtype=np.int64) + (r << 40) for r in range(world)]
            set_hot(np.concatenate(every))
            return step

        return setup

    hot = timed([all_hot(rows, s) for rows, s in zip(a2a_rows, steps, strict=True)])
    looked_up = probe.step(np.arange(hot_lookups, dtype=np.int64), timed="step")

    def hot_set(rows: int) -> Callable[[], _Step]:
        def setup() -> _Step:
            set_hot(np.arange(rows, dtype=np.int64))
            return looked_up

        return setup

    sizes = [max(r, hot_lookups) for r in ar_rows]
    base, *ar = timed([hot_set(0), *(hot_set(r) for r in sizes)])  # base: no hot set
    backend = "local" if world == 1 else ("nccl" if comm.device.type == "cuda" else "gloo")
    stats = probe.sparse.stats
    moved = torch.tensor([stats.a2a_bytes + stats.allreduce_bytes], dtype=torch.int64)
    comm.all_reduce(moved, what="the cost probe's bytes")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    gather_bytes = (world - 1) * gathered[0] * ((dim + 1) * itemsize + 16)
    return CostFit(
        all_reduce=LineFit.of(sizes, ar),
        all_to_all=LineFit.of(a2a_rows, cold),
        hot_lookup=LineFit.of(a2a_rows, hot),
        world_size=world,
        backend=backend,
        baseline_s=base,
        probe_bytes=int(moved.item()) + gather_bytes,
        probe_s=perf_counter() - started,
    )


def choose_num_hot(
    candidates: HotCandidates, fit: CostFit, *, confidence: float = CONFIDENCE
) -> HotPlan:
    """The R in ``[0, len(candidates)]`` minimising ``f(R)`` (the smallest on ties), among R = 0
    and the R whose saving ``f(0) − f(R)`` exceeds ``confidence`` standard errors of it
    (``confidence=0``: the plain minimum): the store's choice
    (:func:`trainer.store.hotset.choose_on_curve`) on the candidates' curve."""
    return choose_on_curve(
        candidates.rho(),
        accesses_per_batch=candidates.accesses_per_step,
        coefficients=fit.coefficients(),
        confidence=confidence,
    )
