"""The cost probe stays small and robust (issue 30, item 4), and `--dispatch esd`/`laia` need real
caches (item 3): the probe moves at most 5% of the run's planned exchange (its bytes counted as
the exchange counts its own), a poor fit falls back to R = 0, and both are reported."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from recpipe.errors import RecpipeError
from trainer.distributed.comm import Comm
from trainer.distributed.config import DistributedConfig
from trainer.distributed.costs import (
    POOR_FIT_R2,
    PROBE_SHARE,
    CostFit,
    LineFit,
    ProbePlan,
    fallback_reason,
    fit_costs,
    probe_plan,
)

EPOCH_BYTES = 27.9 * 2**20  # a whole epoch of the real logs, every rank together


def test_the_default_probe_moved_over_a_gigabyte_on_two_ranks():
    """What the issue measured: the old probe (65,536 rows, 7 repeats) dwarfs a whole epoch."""
    assert ProbePlan().bytes(dim=16, world=2) > 1e9 > 30 * EPOCH_BYTES
    assert probe_plan(float("inf"), dim=16, world=2) == ProbePlan()  # never larger than it was


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_probe_counts_what_the_exchange_counts(world):
    """The probe's bytes, measured on its own exchange, are what the plan predicts (exactly on
    a world of one; the other ranks' share of cold ids is an expectation there)."""
    plan = ProbePlan(top=256, repeats=1, hot_lookups=16)
    if world == 1:
        fit = fit_costs(Comm.single(), dim=4, ar_rows=plan.sizes, a2a_rows=plan.sizes,
                        repeats=plan.repeats, hot_lookups=plan.hot_lookups)  # fmt: skip
        assert fit.probe_bytes == plan.bytes(dim=4, world=1) > 0
        assert fit.probe_s > 0
    # more ranks move more: every rank all-reduces every hot set, W times larger in one sweep
    assert plan.bytes(dim=4, world=world + 1) > plan.bytes(dim=4, world=world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [16, 64])
def test_the_plan_stays_within_its_bound(world, dim):
    budgets = [PROBE_SHARE * EPOCH_BYTES * k for k in (0.01, 1, 10, 100, 1000)]
    plans = [probe_plan(b, dim=dim, world=world) for b in budgets]
    for budget, plan in zip(budgets, plans, strict=True):
        assert plan is None or plan.bytes(dim=dim, world=world) <= budget
    moved = [0 if p is None else p.bytes(dim=dim, world=world) for p in plans]
    assert moved == sorted(moved)  # a larger budget never buys a smaller probe
    assert plans[0] is None  # under the smallest probe: none (the fit falls back)
    assert plans[-1] is not None
    for plan in filter(None, plans):  # the all-reduce sweep's sizes stay distinct enough
        sizes = {max(r, plan.hot_lookups) for r in plan.sizes}
        assert len(sizes) >= 3


def test_the_real_logs_get_a_probe_of_under_5_percent_of_an_epoch():
    plan = probe_plan(PROBE_SHARE * EPOCH_BYTES, dim=16, world=2)
    assert plan is not None
    assert plan.bytes(dim=16, world=2) <= 0.05 * EPOCH_BYTES


def _fit(r2_like: bool) -> CostFit:
    sizes = (16, 64, 256, 1024)
    good = tuple(1e-4 + 1e-7 * s for s in sizes)
    noisy = (3e-4, 1e-4, 2.5e-4, 1.5e-4)  # r² 0.02: no line
    line = LineFit.of(sizes, good if r2_like else noisy)
    return CostFit(all_reduce=line, all_to_all=LineFit.of(sizes, good),
                   hot_lookup=LineFit.of(sizes, good), world_size=2)  # fmt: skip


def test_a_poor_fit_is_not_used():
    assert fallback_reason(_fit(True)) is None
    poor = _fit(False)
    assert poor.r2 < POOR_FIT_R2
    assert fallback_reason(poor) == f"poor fit (r² {poor.r2:.3f} < 0.5)"
    nan = replace(poor, all_reduce=replace(poor.all_reduce, r2=math.nan))
    assert fallback_reason(nan) is not None  # not a number: not a fit


# -- esd and laia price caches: refused without them ---------------------------------------------
@pytest.mark.parametrize("policy", ["esd", "laia"])
def test_cache_pricing_dispatch_without_caches_is_refused(policy):
    with pytest.raises(RecpipeError, match=rf"`--dispatch {policy}` without `--cache-rows`") as exc:
        DistributedConfig(dispatch=policy)
    assert "\n" not in str(exc.value) and "hint: " in str(exc.value)
    assert DistributedConfig(dispatch=policy, cache_rows=64).cache_rows == 64


@pytest.mark.parametrize("policy", ["contiguous", "random", "round-robin"])
def test_dispatch_that_prices_no_cache_needs_none(policy):
    assert DistributedConfig(dispatch=policy).cache_rows == 0


def test_the_command_line_refuses_esd_without_caches_before_any_worker(capsys):
    from recpipe_cli import build_parser
    from trainer.distributed.launch import distributed_config

    args = build_parser("train").parse_args(["train", "data", "--nproc", "2", "--dispatch", "esd"])
    with pytest.raises(SystemExit) as exc:
        distributed_config(args)
    assert exc.value.code == 2
    assert "`--cache-rows`" in capsys.readouterr().err


def test_the_probe_options_reach_the_config():
    from recpipe_cli import build_parser
    from trainer.distributed.launch import distributed_config

    parser = build_parser("train")
    plain = distributed_config(parser.parse_args(["train", "data", "--nproc", "2"]))
    assert (plain.probe_rows, plain.probe_repeats) == (None, None)  # bounded
    given = parser.parse_args(
        ["train", "data", "--nproc", "2", "--probe-rows", "65536", "--probe-repeats", "7"]
    )
    assert (distributed_config(given).probe_rows, distributed_config(given).probe_repeats) == (
        65536,
        7,
    )


# -- through the rank loop (a world of one) ------------------------------------------------------
@pytest.fixture(scope="module")
def small_run(dist_dataset):
    import dist_cases

    from trainer.config import TrainConfig

    return TrainConfig(dataset=str(dist_dataset), batch_size=32, steps=4, eval_fraction=0.25,
                       model=dist_cases.SMALL_MODEL, seed=0)  # fmt: skip


def _train(config, options):
    from trainer.distributed.run import dump, train_rank

    _, summary = train_rank(config, options, comm=Comm.single(), progress=False)
    return summary, dict(summary.lines()), dump(summary)


def test_the_summary_reports_the_bound_and_the_fallback(small_run):
    """A world of one exchanges nothing: the bound is 0 bytes, no probe runs, R = 0."""
    summary, lines, doc = _train(small_run, DistributedConfig(count_steps=2))
    assert (summary.planned_exchange_bytes, summary.probe_bound_bytes) == (0, 0)
    assert (summary.probe_bytes, summary.probe_rows, summary.hot_rows) == (0, 0, 0)
    assert summary.cost_model_fallback == "R = 0"
    assert lines["cost model"].startswith("not fitted: the smallest probe would move")
    assert lines["cost model"].endswith(", fell back to R = 0 (no hot set)")
    assert lines["cost probe"] == "not run; bound 0.00 MiB (5% of the planned exchange, 0.00 MiB)"
    assert doc["probe_bound_bytes"] == 0 and doc["cost_model_fallback"] == "R = 0"


def test_explicit_probe_options_win_over_the_bound(small_run):
    options = DistributedConfig(hot_rows=0, count_steps=2, probe_rows=256, probe_repeats=1)
    summary, lines, doc = _train(small_run, options)
    assert (summary.probe_rows, summary.probe_repeats) == (256, 1)
    plan = ProbePlan(top=256, repeats=1)
    assert summary.probe_bytes == plan.bytes(dim=small_run.model.embedding_dim, world=1)
    assert summary.probe_bytes > summary.probe_bound_bytes == 0
    assert lines["cost probe"].endswith("exceeded: --probe-rows/--probe-repeats given")
    assert summary.hot_rows == 0 and summary.cost_model_fallback == ""  # R given: no fallback
    assert doc["probe_bytes"] == summary.probe_bytes


@pytest.mark.parametrize("good", [True, False])
def test_the_fit_chooses_r_only_when_it_is_good(small_run, monkeypatch, good):
    import trainer.distributed.run as run

    fit = replace(_fit(good), world_size=1, probe_bytes=123)
    monkeypatch.setattr(run, "fit_costs", lambda *a, **k: fit)
    options = DistributedConfig(count_steps=2, probe_rows=256, probe_repeats=1)
    summary, lines, doc = _train(small_run, options)
    if good:
        assert summary.cost_model_fallback == ""
        assert lines["cost model"].startswith("C_ar ")
    else:
        assert summary.hot_rows == 0 and doc["cost_model_fallback"] == "R = 0"
        assert lines["cost model"].startswith(
            f"poor fit (r² {fit.r2:.3f} < 0.5), fell back to R = 0 (no hot set); C_ar "
        )
    assert summary.cost_model_r2 == fit.r2 and summary.probe_bytes == 123
