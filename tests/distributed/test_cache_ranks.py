"""Per-rank embedding caches (``trainer.distributed.cache``) under ESD dispatch, on 2 and 3 gloo
ranks: the same losses and final tables as one process on the same global batches, and every
step's reads, pulls, update pushes, shared rows, evictions and evict pushes on every rank equal
what the dispatcher's cache shadow predicted."""

from __future__ import annotations

import json

import cache_cases
import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def everything(dist_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    world = max(cache_cases.WORLDS)
    codes = run_ranks(cache_cases.cache_job, world, str(dist_dataset), str(out), timeout_s=300)
    assert codes == [0] * world, f"the ranks exited with {codes}"
    return json.loads((out / "cache.json").read_text())


@pytest.fixture(scope="module")
def results(everything):
    return [r for r in everything["cases"] if r is not None]


def test_every_world_ran(results):
    assert sorted((r["world"], r["frozen"]) for r in results) == sorted(
        (w, f) for w in cache_cases.WORLDS for f in (False, True)
    )


def test_the_caches_move_what_the_shadow_predicted(results):
    for r in results:
        for rank, got in enumerate(r["ranks"]):
            assert got["mismatches"] == [], (r["world"], rank, got)


def test_the_caches_pull_push_and_evict(results):
    """The run exercises every transfer (else the comparison above proves little)."""
    for r in results:
        totals = {k: sum(rank["totals"][k] for rank in r["ranks"]) for k in r["ranks"][0]["totals"]}
        for kind in ("pulls", "pushes", "shared", "evictions", "evict_pushes"):
            assert totals[kind] > 0, (r["world"], kind, totals)
        assert totals["reads"] > totals["pulls"], totals  # some reads hit the cache


def test_losses_match_one_process(results):
    for r in results:
        assert r["loss_dev"] <= 1e-6, r


def test_tables_match_one_process(results):
    # the dense part frozen: the tables depend on the exchange only, float32's 1e-6; learning,
    # float32 BLAS sums over micro-batches move the dense part by ~1e-7 and the tables by ~1e-5
    for r in results:
        assert r["table_dev"] <= (1e-6 if r["frozen"] else 1e-5), r


def test_the_rank_loop_with_caches_gives_the_losses_without(everything):
    loop = everything["loop"]
    assert len(loop["cached"]) == len(loop["plain"]) == 4
    for got, want in zip(loop["cached"], loop["plain"], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    assert abs(loop["cached_eval"] - loop["plain_eval"]) <= 1e-6 * abs(loop["plain_eval"])
    assert loop["summary"]["reads"] > loop["summary"]["pulls"] > 0, loop["summary"]
    per_rank = loop["per_rank"]
    assert len(per_rank) == 2
    assert {k: sum(r[k] for r in per_rank) for k in per_rank[0]} == loop["summary"]
    assert "miss pulls" in loop["lines"]["transfers"]
    # the rank loop compared every step's transfers with the dispatcher's shadow: all matched
    assert loop["shadow"] == [4, 4], loop["shadow"]
    assert "of 4 steps checked" in loop["lines"]["shadow"]


def test_a_job_with_caches_resumes_from_its_checkpoint(everything):
    """The checkpoint holds the rows dirty in the caches (read from them); the resumed job
    starts with empty caches, and its dispatcher too, and trains the same global batches."""
    loop = everything["loop"]
    assert len(loop["resumed"]) == 4
    for got, want in zip(loop["resumed"], loop["cached"], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
