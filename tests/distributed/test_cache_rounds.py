"""How many collectives the per-rank caches make (2 gloo ranks): a training step 4 all-to-alls,
5 when it has update pushes (the 2FP exchange makes 4), and no other collective; a step's evict
pushes and shared gradients add none (they travel with the next step's reads). An evaluation's
read makes at most 5, reading the rows for a checkpoint 2."""

from __future__ import annotations

import json

import cache_cases
import pytest
from dist_harness import run_ranks

CASES = (str(cache_cases.CACHE_ROWS), "0")  # caches with update pushes, and without


@pytest.fixture(scope="module")
def rounds(dist_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("rounds")
    codes = run_ranks(cache_cases.rounds_job, 2, str(dist_dataset), str(out), timeout_s=240)
    assert codes == [0, 0], f"the ranks exited with {codes}"
    every = json.loads((out / "rounds.json").read_text())
    return {case: [rank[case] for rank in every] for case in CASES}


def _moved(ranks, step: int, kind: str) -> bool:
    """Whether any rank's record of ``step`` lists a ``kind`` transfer."""
    return any(rank["moved"][step][kind] > 0 for rank in ranks)


@pytest.mark.parametrize("case", CASES)
def test_a_cached_step_makes_4_all_to_alls_5_with_update_pushes(rounds, case):
    ranks = rounds[case]
    assert len(ranks[0]["steps"]) == cache_cases.STEPS
    for k in range(cache_cases.STEPS):
        assert _moved(ranks, k, "pulls"), k  # a step without any pull would make 3
        want = 5 if _moved(ranks, k, "pushes") else 4
        for rank in ranks:
            assert rank["steps"][k] == {"all_to_all_single": want}, (case, k, rank["moved"][k])


def test_the_counted_steps_move_everything(rounds):
    """Steps with update pushes and steps without, each after a step with evict pushes and
    shared rows, whose rows and gradients they carry (else the counts above prove little)."""
    for case, pushes in zip(CASES, (True, False), strict=True):
        ranks = rounds[case]
        steps = [k for k in range(1, cache_cases.STEPS)
                 if _moved(ranks, k, "pushes") == pushes
                 and _moved(ranks, k - 1, "evict_pushes") and _moved(ranks, k - 1, "shared")]  # fmt: skip
        assert len(steps) >= 3, (case, [r["moved"] for r in ranks])


@pytest.mark.parametrize("case", CASES)
def test_evaluation_and_checkpoint_reads(rounds, case):
    for rank in rounds[case]:
        assert set(rank["eval"]) == {"all_to_all_single"}
        assert 3 <= rank["eval"]["all_to_all_single"] <= 5
        assert rank["owned_rows"] == {"all_to_all_single": 2}
