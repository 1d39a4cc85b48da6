"""The exact assignment, the greedy pass and HybridDis against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch.assign import (
    assignment_cost,
    exact_assign,
    greedy_assign,
    hybrid_assign,
    regret,
)
from recpipe.errors import DataError


def brute_force(costs: np.ndarray, capacity: np.ndarray) -> float:
    """The least cost over every assignment that respects ``capacity`` (small cases only)."""
    n, w = costs.shape
    best = np.inf
    for assign in itertools.product(range(w), repeat=n):
        if (np.bincount(assign, minlength=w) <= capacity).all():
            best = min(best, costs[np.arange(n), list(assign)].sum())
    return best


@st.composite
def problems(draw, *, exact_share: bool, max_rows: int = 7, max_ranks: int = 4):
    """An integer cost matrix (exact sums) and capacities; with ``exact_share`` they sum to the
    rows, else to at least the rows."""
    w = draw(st.integers(1, max_ranks))
    n = draw(st.integers(0, max_rows))
    costs = np.array(
        draw(st.lists(st.integers(0, 20), min_size=n * w, max_size=n * w)), dtype=np.float64
    ).reshape(n, w)
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=w - 1, max_size=w - 1)))
    capacity = np.diff([0, *cuts, n])
    if not exact_share:
        capacity = capacity + np.array(draw(st.lists(st.integers(0, 2), min_size=w, max_size=w)))
    return costs, capacity.astype(np.int64)


@settings(max_examples=300, deadline=None)
@given(problems(exact_share=False))
def test_exact_assignment_is_the_brute_force_optimum(problem):
    costs, capacity = problem
    assign = exact_assign(costs, capacity)
    assert (np.bincount(assign, minlength=capacity.size) <= capacity).all()
    assert assignment_cost(costs, assign) == brute_force(costs, capacity)


@settings(max_examples=300, deadline=None)
@given(problems(exact_share=True), st.sampled_from([0.0, 0.3, 0.5, 1.0]))
def test_every_rank_gets_exactly_its_share(problem, alpha):
    costs, capacity = problem
    assign = hybrid_assign(costs, capacity, alpha=alpha)
    assert np.bincount(assign, minlength=capacity.size).tolist() == capacity.tolist()
    if alpha == 1.0:  # alpha = 1: the optimum
        assert assignment_cost(costs, assign) == brute_force(costs, capacity)


@settings(max_examples=300, deadline=None)
@given(problems(exact_share=True), st.sampled_from([0.0, 0.25, 0.5, 0.75]))
def test_hybrid_stays_within_theorem_1(problem, alpha):
    """Theorem 1 (HybridDis), as stated and proved in docs/dispatch.md. Let S be the
    ``ceil(alpha * n)`` packs of largest regret (assigned exactly), G the rest (assigned
    greedily in regret order), ``a(i)`` the rank chosen and OPT the optimum. Then

        cost(HybridDis) <= OPT + sum_{i in G} (c[i, a(i)] - min_j c[i, j])
                        <= OPT + sum_{i in G} (max_j c[i, j] - min_j c[i, j]),

    because the exact part costs at most what OPT spends on S (OPT restricted to S fits the
    same room) and OPT spends at least ``min_j c[i, j]`` on every pack of G. For alpha = 0 it
    reads cost(greedy) <= OPT + the excess the greedy pass paid over each pack's cheapest rank.
    """
    costs, capacity = problem
    assign = hybrid_assign(costs, capacity, alpha=alpha)
    n = costs.shape[0]
    greedy_part = np.argsort(-regret(costs), kind="stable")[int(np.ceil(alpha * n)) :]
    cheapest = costs.min(1) if n else np.zeros(0)
    paid = costs[greedy_part, assign[greedy_part]] - cheapest[greedy_part]
    spread = costs[greedy_part].max(1) - cheapest[greedy_part] if n else np.zeros(0)
    opt = brute_force(costs, capacity)
    assert assignment_cost(costs, assign) <= opt + paid.sum() <= opt + spread.sum()


@settings(max_examples=300, deadline=None)
@given(problems(exact_share=True, max_rows=8, max_ranks=2))
def test_greedy_in_regret_order_is_optimal_on_two_ranks(problem):
    """With two ranks the packs most eager for one rank take it first, so the greedy pass in
    regret order ends where the optimum does."""
    costs, capacity = problem
    if costs.shape[1] != 2:
        costs = np.repeat(costs[:, :1], 2, axis=1)
        capacity = np.array([capacity.sum(), 0])
    greedy = hybrid_assign(costs, capacity, alpha=0.0)
    assert assignment_cost(costs, greedy) == brute_force(costs, capacity)


def test_greedy_is_not_always_optimal_on_three_ranks():
    costs = np.array([[4.0, 3.0, 3.0], [1.0, 3.0, 4.0], [2.0, 2.0, 5.0]])
    one = np.ones(3, dtype=np.int64)
    assert assignment_cost(costs, hybrid_assign(costs, one, alpha=0.0)) == 9.0
    assert assignment_cost(costs, hybrid_assign(costs, one, alpha=1.0)) == 6.0


def test_exact_on_a_paper_sized_batch_matches_a_shuffled_order():
    """1024 packs over 8 ranks of 128 (the paper's batch): the optimum does not depend on the
    order the rows are added in, and it beats the greedy pass."""
    rng = np.random.default_rng(3)
    costs = rng.integers(0, 1000, (1024, 8)).astype(np.float64)
    capacity = np.full(8, 128)
    best = assignment_cost(costs, exact_assign(costs, capacity))
    perm = rng.permutation(1024)
    again = exact_assign(costs[perm], capacity)
    assert assignment_cost(costs[perm], again) == best
    assert best <= assignment_cost(costs, hybrid_assign(costs, capacity, alpha=0.0))


def test_regret():
    assert regret(np.array([[3.0, 1.0, 2.0], [5.0, 5.0, 0.0]])).tolist() == [1.0, 5.0]
    assert regret(np.array([[3.0], [1.0]])).tolist() == [0.0, 0.0]


def test_greedy_follows_the_order_and_breaks_ties_to_the_lowest_rank():
    costs = np.array([[1.0, 1.0], [0.0, 5.0]])
    assert greedy_assign(costs, np.array([1, 1])).tolist() == [0, 1]
    assert greedy_assign(costs, np.array([1, 1]), order=np.array([1, 0])).tolist() == [1, 0]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: hybrid_assign(np.zeros((2, 2)), np.array([1, 1]), alpha=1.5), "`alpha`"),
        (lambda: hybrid_assign(np.zeros((2, 2)), np.array([2, 1]), alpha=1.0), "sum to the 2"),
        (lambda: exact_assign(np.zeros((3, 2)), np.array([1, 1])), "do not fit"),
        (lambda: greedy_assign(np.zeros((3, 2)), np.array([1, 1])), "do not fit"),
        (lambda: exact_assign(np.zeros((2, 2)), np.array([1, 1, 1])), "`capacity`"),
        (lambda: exact_assign(np.array([[np.nan, 0.0]]), np.array([1, 1])), "finite"),
        (lambda: exact_assign(np.zeros(3), np.array([3])), "`costs`"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(DataError, match=match):
        call()
