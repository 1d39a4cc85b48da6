"""The exact placement, the greedy pass and HybridDis against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch.assign import exact_flow, flow_cost, greedy_flow, hybrid_flow, regret
from readers.dispatch.dispatcher import DispatchConfig
from recpipe.errors import DataError
from tests.readers.dispatch.brute import brute_force


def split(flow: np.ndarray) -> int:
    return int(((flow > 0).sum(1) > 1).sum())


@st.composite
def problems(
    draw, *, exact_share: bool, max_pieces: int = 5, max_size: int = 3, max_ranks: int = 3
):
    """Integer costs (exact sums: costs are multiples of every size), piece sizes and room;
    with ``exact_share`` the room is exactly the rows."""
    w = draw(st.integers(1, max_ranks))
    n = draw(st.integers(0, max_pieces))
    sizes = np.array(
        draw(st.lists(st.integers(1, max_size), min_size=n, max_size=n)), dtype=np.int64
    )
    costs = 6 * np.array(
        draw(st.lists(st.integers(0, 20), min_size=n * w, max_size=n * w)), dtype=np.float64
    )
    costs = costs.reshape(n, w)
    total = int(sizes.sum())
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=w - 1, max_size=w - 1)))
    capacity = np.diff([0, *cuts, total]).astype(np.int64)
    if not exact_share:
        capacity = capacity + np.array(draw(st.lists(st.integers(0, 2), min_size=w, max_size=w)))
    return costs, sizes, capacity


@settings(max_examples=200, deadline=None)
@given(problems(exact_share=False))
def test_exact_placement_is_the_brute_force_optimum(problem):
    costs, sizes, capacity = problem
    flow = exact_flow(costs, sizes, capacity=capacity)
    assert flow.sum(1).tolist() == sizes.tolist()
    assert (flow.sum(0) <= capacity).all()
    assert flow_cost(costs, sizes, flow) == pytest.approx(
        brute_force(costs, sizes, capacity), abs=1e-9
    )
    assert split(flow) <= costs.shape[1] - 1


@settings(max_examples=200, deadline=None)
@given(problems(exact_share=False, max_pieces=7, max_size=1, max_ranks=4))
def test_exact_assignment_of_single_rows_is_the_brute_force_optimum(problem):
    costs, sizes, capacity = problem
    flow = exact_flow(costs, sizes, capacity=capacity)
    assert flow_cost(costs, sizes, flow) == brute_force(costs, sizes, capacity)


@settings(max_examples=200, deadline=None)
@given(problems(exact_share=True), st.sampled_from([0.0, 0.3, 0.5, 1.0]))
def test_every_rank_gets_exactly_its_share(problem, alpha):
    costs, sizes, capacity = problem
    flow = hybrid_flow(costs, sizes, capacity=capacity, alpha=alpha)
    assert flow.sum(0).tolist() == capacity.tolist()
    assert flow.sum(1).tolist() == sizes.tolist()
    assert split(flow) <= 2 * (costs.shape[1] - 1)
    if alpha == 1.0:  # alpha = 1: the optimum
        assert flow_cost(costs, sizes, flow) == pytest.approx(
            brute_force(costs, sizes, capacity), abs=1e-9
        )
    if alpha == 0.0:
        assert split(flow) <= costs.shape[1] - 1


@settings(max_examples=200, deadline=None)
@given(problems(exact_share=True), st.sampled_from([0.0, 0.25, 0.5, 0.75]))
def test_hybrid_stays_within_theorem_1(problem, alpha):
    """Theorem 1 (HybridDis), as stated and proved in docs/dispatch.md. Let S be the pieces of
    largest regret per row holding an ``alpha`` share of the rows, G the rest, grouped by their
    cheapest rank into G_1, G_2, ... (the bulk pieces that reserve their room in the exact
    pass), ``C_k[j]`` what the pieces of G_k cost together on rank j, and OPT the optimum. Then

        cost(HybridDis) <= OPT + sum_{i in G} (max_j c[i, j] - min_j c[i, j]) + R,
        R = sum_k (max_j C_k[j] - min_j C_k[j]) <= sum_{i in G} (max_j c[i, j] - min_j c[i, j]),

    and HybridDis never costs more than the pure greedy pass (alpha = 0), which stays within
    OPT + sum_i (paid(i) - min_j c[i, j]) (``paid(i)``: what piece i costs as placed).
    """
    costs, sizes, capacity = problem
    flow = hybrid_flow(costs, sizes, capacity=capacity, alpha=alpha)
    n, w = costs.shape
    order = np.argsort(-regret(costs) / np.maximum(sizes, 1), kind="stable")
    rows = np.cumsum(sizes[order])
    k = int(np.searchsorted(rows, np.ceil(alpha * sizes.sum()))) + 1 if alpha > 0 else 0
    rest = order[k:]
    cheapest = costs.min(1) if n else np.zeros(0)
    dearest = costs.max(1) if n else np.zeros(0)
    opt = brute_force(costs, sizes, capacity)
    cost = flow_cost(costs, sizes, flow)
    reserve = 0.0
    if 0 < k < n:
        group = (costs[rest] / sizes[rest, None]).argmin(1)
        together = np.zeros((w, w))
        np.add.at(together, group, costs[rest])
        reserve = float((together.max(1) - together.min(1)).sum())
    gap = float((dearest[rest] - cheapest[rest]).sum())
    assert reserve <= gap + 1e-9
    assert cost <= opt + gap + reserve + 1e-9
    greedy = hybrid_flow(costs, sizes, capacity=capacity, alpha=0.0)
    assert cost <= flow_cost(costs, sizes, greedy) + 1e-9
    paid = (costs * greedy / np.maximum(sizes, 1)[:, None]).sum(1) if n else np.zeros(0)
    assert flow_cost(costs, sizes, greedy) <= opt + (paid - cheapest).sum() + 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_half_the_batch_exact_costs_between_the_optimum_and_greedy(seed):
    """4 ranks with links 10x faster than the other 4, pieces that hit the caches here and
    there: the greedy pass fills the fast ranks with the pieces of largest regret, so placing
    them exactly in the room the rest needs (alpha = 0.5) saves against alpha = 0 (with the full
    room, the exact share took each piece's cheapest rank: the greedy placement again)."""
    rng = np.random.default_rng(seed)
    n, w = 256, 8
    seconds = np.array([1.0] * 4 + [10.0] * 4)
    reads = rng.integers(1, 30, n)
    hits = (rng.random((n, w)) * reads[:, None] * (rng.random((n, w)) < 0.3)).astype(np.int64)
    costs = (reads[:, None] - hits) * seconds[None, :]
    one, capacity = np.ones(n, dtype=np.int64), np.full(w, n // w)
    cost = {
        a: flow_cost(costs, one, hybrid_flow(costs, one, capacity=capacity, alpha=a))
        for a in (1.0, 0.5, 0.0)
    }
    assert cost[1.0] < cost[0.5] < 0.95 * cost[0.0]


@settings(max_examples=200, deadline=None)
@given(problems(exact_share=True, max_pieces=6, max_ranks=2))
def test_greedy_in_regret_order_is_optimal_on_two_ranks(problem):
    """Two ranks: the rows most eager for one rank take it first (a fractional knapsack), so
    the greedy pass in order of regret per row ends where the optimum does."""
    costs, sizes, capacity = problem
    if costs.shape[1] != 2:
        costs = np.repeat(costs[:, :1], 2, axis=1)
        capacity = np.array([capacity.sum(), 0])
    greedy = hybrid_flow(costs, sizes, capacity=capacity, alpha=0.0)
    assert flow_cost(costs, sizes, greedy) == pytest.approx(
        brute_force(costs, sizes, capacity), abs=1e-9
    )


def test_greedy_is_not_always_optimal_on_three_ranks():
    costs = np.array([[0.0, 0.0, 4.0], [3.0, 0.0, 4.0], [4.0, 0.0, 5.0]])
    one = np.ones(3, dtype=np.int64)
    assert flow_cost(costs, one, hybrid_flow(costs, one, capacity=one, alpha=0.0)) == 7.0
    assert flow_cost(costs, one, hybrid_flow(costs, one, capacity=one, alpha=1.0)) == 4.0


def test_exact_on_a_paper_sized_batch():
    """1024 rows over 8 ranks of 128 (the paper's batch), single rows and sessions: the optimum
    does not depend on the order the pieces come in, beats the greedy pass, and splits at most
    W - 1 pieces."""
    rng = np.random.default_rng(3)
    for sizes in (np.ones(1024, dtype=np.int64), np.full(64, 16, dtype=np.int64)):
        costs = rng.integers(0, 1000, (sizes.size, 8)).astype(np.float64) * 16
        capacity = np.full(8, 128)
        flow = exact_flow(costs, sizes, capacity=capacity)
        best = flow_cost(costs, sizes, flow)
        perm = rng.permutation(sizes.size)
        again = exact_flow(costs[perm], sizes[perm], capacity=capacity)
        assert flow_cost(costs[perm], sizes[perm], again) == pytest.approx(best, rel=1e-12)
        assert best <= flow_cost(
            costs, sizes, hybrid_flow(costs, sizes, capacity=capacity, alpha=0.0)
        )
        assert split(flow) <= 7


def test_regret():
    assert regret(np.array([[3.0, 1.0, 2.0], [5.0, 5.0, 2.0]])).tolist() == [1.0, 2.0]
    assert regret(np.array([[3.0], [1.0]])).tolist() == [0.0, 0.0]


def test_greedy_gives_a_piece_no_rank_holds_a_fast_rank():
    """Ranks 0 and 1 equally fast, rank 2 ten times slower. Piece 2's rows are on no rank: it
    costs the same on both fast ranks (second-smallest minus smallest: 0), so in that order it
    came last and took the slow rank after pieces 0 and 1 (one row held on a fast rank each)
    took the fast ones."""
    costs = np.array([[0.0, 1.0, 10.0], [1.0, 0.0, 10.0], [2.0, 2.0, 20.0]])
    one = np.ones(3, dtype=np.int64)
    flow = hybrid_flow(costs, one, capacity=one, alpha=0.0)
    assert flow.argmax(1)[2] in (0, 1)
    assert flow_cost(costs, one, flow) == 13.0  # not 20
    esd_order = hybrid_flow(costs, one, capacity=one, alpha=0.0, regret_kind="second")
    assert flow_cost(costs, one, esd_order) == 20.0  # ESD's regret: piece 2 on the slow rank


def test_esds_regret_and_bad_kinds():
    costs = np.array([[3.0, 1.0, 2.0], [5.0, 5.0, 2.0], [2.0, 2.0, 20.0]])
    assert regret(costs, kind="second").tolist() == [1.0, 3.0, 0.0]
    with pytest.raises(DataError, match="`regret` must be one of"):
        regret(costs, kind="median")
    with pytest.raises(DataError, match="`regret` must be one of"):
        DispatchConfig(regret="median")


def test_greedy_follows_the_order_spills_and_breaks_ties_to_the_lowest_rank():
    costs = np.array([[1.0, 1.0], [0.0, 5.0]])
    one = np.array([1, 1])
    assert greedy_flow(costs, one, capacity=one).argmax(1).tolist() == [0, 1]
    assert greedy_flow(costs, one, capacity=one, order=np.array([1, 0])).argmax(1).tolist() == [
        1,
        0,
    ]
    spilled = greedy_flow(np.array([[0.0, 1.0, 2.0]]), np.array([5]), capacity=np.array([2, 2, 2]))
    assert spilled.tolist() == [[2, 2, 1]]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: hybrid_flow(np.zeros((2, 2)), np.ones(2), capacity=np.array([1, 1]), alpha=1.5),
            "`alpha`",
        ),
        (
            lambda: hybrid_flow(np.zeros((2, 2)), np.ones(2), capacity=np.array([2, 1]), alpha=1),
            "sum to the 2",
        ),
        (lambda: exact_flow(np.zeros((3, 2)), np.ones(3), capacity=np.array([1, 1])), "do not fit"),
        (
            lambda: greedy_flow(np.zeros((3, 2)), np.ones(3), capacity=np.array([1, 1])),
            "do not fit",
        ),
        (
            lambda: exact_flow(np.zeros((2, 2)), np.ones(2), capacity=np.array([1, 1, 1])),
            "`capacity`",
        ),
        (
            lambda: exact_flow(np.array([[np.nan, 0.0]]), np.ones(1), capacity=np.array([1, 1])),
            "finite",
        ),
        (lambda: exact_flow(np.zeros(3), np.ones(3), capacity=np.array([3])), "`costs`"),
        (lambda: exact_flow(np.zeros((2, 1)), np.array([1, 0]), capacity=np.array([3])), "`sizes`"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(DataError, match=match):
        call()


def test_ties_leave_at_most_w_minus_1_split_pieces():
    """Costs full of ties give optimal flows with cycles of split pieces; cancelling them keeps
    the cost and leaves at most W - 1 pieces split."""
    from readers.dispatch import _kernels as K

    rng = np.random.default_rng(0)
    had_more = 0
    for _ in range(100):
        n, w = int(rng.integers(5, 60)), int(rng.integers(2, 9))
        sizes = rng.integers(1, 20, n)
        costs = rng.integers(0, 5, (n, w)).astype(np.float64) * sizes[:, None]
        capacity = np.full(w, -(-int(sizes.sum()) // w))
        raw = np.zeros((n, w), dtype=np.int64)
        K.transport(costs / sizes[:, None], sizes, capacity.copy(), 1e-9, raw)
        had_more += split(raw) > w - 1
        flow = exact_flow(costs, sizes, capacity=capacity)
        assert flow_cost(costs, sizes, flow) == pytest.approx(flow_cost(costs, sizes, raw))
        assert flow.sum(1).tolist() == sizes.tolist() and (flow.sum(0) <= capacity).all()
        assert split(flow) <= w - 1
    assert had_more > 10  # the solver alone leaves more: the cancelling is what bounds it
