"""One hot-set cost model for every engine: the store in one process and the ranks' exchange
choose R with the same curve (``rho_curve``) and the same choice (``choose_on_curve``) of
``f(R) = [R > 0]·A_ar + R·C_ar + N·(1 − ρ(R))·C_a2a``."""

from __future__ import annotations

import numpy as np
import pytest

from recpipe.errors import StoreError
from trainer.distributed.costs import CostFit, LineFit, choose_num_hot
from trainer.distributed.exchange import HotCandidates
from trainer.store.hotset import CostCoefficients, choose_hot_rows, choose_on_curve, rho_curve


def _counts(n: int = 400, seed: int = 0) -> np.ndarray:
    return np.minimum(np.random.default_rng(seed).zipf(1.3, n), 10_000).astype(np.int64)


def test_the_ranks_candidates_and_the_stores_counts_have_one_curve():
    """The top K of the counts with the total of all of them: the first K + 1 points of the
    curve of every count (the ranks see only their candidates, the store every row)."""
    counts = _counts()
    top = np.sort(counts)[::-1][:50]
    whole = rho_curve(counts)
    assert np.array_equal(rho_curve(top, total=int(counts.sum())), whole[:51])
    cand = HotCandidates(top, np.zeros(50, np.int64), np.arange(50), int(counts.sum()), 3)
    np.testing.assert_array_equal(cand.rho(), whole[:51])
    assert rho_curve(np.zeros(3, np.int64)).tolist() == [0.0] * 4


def test_the_store_and_the_ranks_choose_the_same_r():
    """The same counts and coefficients (no per-call cost, exact): the store's
    ``choose_hot_rows`` and the ranks' ``choose_num_hot`` (a fit of those slopes) choose the
    same R at the same cost; both are the brute-force minimum."""
    counts = np.sort(_counts(500, 1))[::-1]
    n = float(counts.sum()) / 4
    fit = CostFit(
        all_reduce=LineFit(3e-7, 0.0, 1.0, (), ()),
        all_to_all=LineFit(9e-7, 0.0, 1.0, (), ()),
        hot_lookup=LineFit(1e-7 + 2 * 3e-7, 0.0, 1.0, (), ()),
        world_size=2,
    )
    coefficients = fit.coefficients()
    assert coefficients.a_ar == 0.0 and coefficients.c_a2a == pytest.approx(4e-7)
    store = choose_hot_rows(counts, accesses_per_batch=n, coefficients=coefficients,
                            max_rows=10_000)  # fmt: skip
    ranks = choose_num_hot(HotCandidates(counts, np.zeros(500, np.int64), np.arange(500),
                                         int(counts.sum()), 4), fit, confidence=0.0)  # fmt: skip
    curve = rho_curve(counts)
    brute = min((float(coefficients.cost(r, curve[r], n)), r) for r in range(curve.size))
    assert 0 < store.num_hot == ranks.num_hot == brute[1]
    assert store.cost == ranks.cost == brute[0]


def test_a_per_call_cost_can_make_no_hot_set_the_best():
    """``A_ar`` (paid once a step when R > 0) makes f non-convex at 0: the exhaustive choice
    takes R = 0 once A_ar exceeds the best saving, and a hot set (its cost A_ar more) below
    it."""
    counts = _counts()
    curve = rho_curve(counts)
    n = float(counts.sum()) / 10
    plain = choose_on_curve(curve, accesses_per_batch=n, coefficients=CostCoefficients(1e-7, 1e-6))
    saving = plain.cost_no_hot - plain.cost
    assert plain.num_hot > 0 and saving > 0
    cheap = CostCoefficients(1e-7, 1e-6, a_ar=0.5 * saving)
    chosen = choose_on_curve(curve, accesses_per_batch=n, coefficients=cheap)
    assert chosen.num_hot > 0 and chosen.cost == pytest.approx(plain.cost + cheap.a_ar)
    dear = CostCoefficients(1e-7, 1e-6, a_ar=1.01 * saving)
    assert choose_on_curve(curve, accesses_per_batch=n, coefficients=dear).num_hot == 0
    capped = choose_on_curve(curve, accesses_per_batch=n, coefficients=cheap, max_rows=3)
    assert capped.num_hot <= 3


def test_what_the_choice_refuses():
    curve = rho_curve(_counts(20))
    coefficients = CostCoefficients(1e-7, 1e-6)
    with pytest.raises(StoreError, match="`max_rows` must be >= 0"):
        choose_on_curve(curve, accesses_per_batch=1.0, coefficients=coefficients, max_rows=-1)
    for bad in (-1.0, float("nan"), float("inf"), "2"):
        with pytest.raises(StoreError, match="confidence"):
            choose_on_curve(curve, accesses_per_batch=1.0, coefficients=coefficients,
                            confidence=bad)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(StoreError, match="must be >= 0"):
        CostCoefficients(1e-7, 1e-6, a_ar=-1.0)
