"""Dispatch changes where a sample trains, not what the job computes: 2 ranks (gloo, CPU) whose
micro-batches ESD (alpha 1 and 0), LAIA-like or random dispatch chose train like one process on
the same global batches, losses to 1e-6 relative in float32; rank 0 dispatching once for both
gives each rank the micro-batches its own copy of the cut gives; and ``recpipe train``'s rank
loop (which dispatches once) gives the same losses with ``--dispatch esd`` as with the
contiguous cut."""

from __future__ import annotations

import json

import dispatch_cases
import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results(dist_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("dispatch")
    codes = run_ranks(dispatch_cases.dispatch_job, 2, str(dist_dataset), str(out), timeout_s=300)
    assert codes == [0, 0], f"the ranks exited with {codes}"
    return json.loads((out / "dispatch.json").read_text())


@pytest.mark.parametrize("case", range(len(dispatch_cases.POLICIES)))
def test_dispatched_ranks_train_like_one_process(results, case):
    r = results["policies"][case]
    assert (r["policy"], r["alpha"]) == dispatch_cases.POLICIES[case]
    assert (
        r["rows"] == [dispatch_cases.dist_cases.BATCH * dispatch_cases.dist_cases.STEPS] * 2
    )  # every rank exactly its share, every step
    assert r["loss_dev"] <= TOLERANCE, r


def test_the_dispatch_is_not_the_contiguous_cut(results):
    esd = results["policies"][0]
    assert sum(esd["steps_moved"]) > 0, esd


def test_dispatching_once_gives_each_rank_its_own_cuts_batches(results):
    """Rank 0 dispatches for both (the placement broadcast over gloo); rank 1 gets the rows its
    own copy of the cut would have chosen, step for step."""
    once = results["once"]
    assert sorted(once) == sorted(f"{p}_{a}" for p, a in dispatch_cases.POLICIES)
    for ranks in once.values():
        assert ranks == [[1, dispatch_cases.dist_cases.STEPS]] * 2, once


def test_the_rank_loop_with_esd_dispatch_gives_the_contiguous_losses(results):
    loop = results["loop"]
    assert len(loop["esd"]) == len(loop["contiguous"]) == 4
    for got, want in zip(loop["esd"], loop["contiguous"], strict=True):
        assert abs(got - want) <= TOLERANCE * abs(want)
