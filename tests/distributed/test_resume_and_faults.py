"""Save at 2 ranks, resume at 3 (rows move to their new owners); a killed rank fails the others."""

from __future__ import annotations

import json
import time

import dist_cases
import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.slow


def test_save_at_two_ranks_resume_at_three(dist_dataset, tmp_path):
    codes = run_ranks(dist_cases.resume_job, 4, str(dist_dataset), str(tmp_path))
    assert codes == [0, 0, 0, 0], f"the ranks exited with {codes}"
    two = json.loads((tmp_path / "resume-2.json").read_text())
    three = json.loads((tmp_path / "resume-3.json").read_text())
    assert three["resumed_from"] == 3 and len(three["losses"]) == 6
    assert three["losses"][:3] == two["losses"]
    assert three["hot_rows"] == two["hot_rows"] == 40  # the hot set came back from new owners
    # one process on the same global batches: the 2-rank job's first 3, then the 3-rank job's
    ref = dist_cases.resume_reference(str(dist_dataset), str(tmp_path))
    for got, want in zip(three["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    tables = dist_cases.checkpoint_tables(str(tmp_path / "ckpt"))
    assert dist_cases.compare_tables(tables, ref["tables"]) <= 1e-5


def test_a_killed_rank_makes_the_others_fail_fast(dist_dataset, tmp_path):
    t0 = time.monotonic()
    codes = run_ranks(
        dist_cases.die_at_step, 2, str(dist_dataset), str(tmp_path), 1, 2, timeout_s=60.0
    )
    elapsed = time.monotonic() - t0
    assert (tmp_path / "killed").exists()
    assert codes[1] == -9  # SIGKILL
    assert codes[0] not in (0, None), codes  # failed on its own, before the deadline
    assert elapsed < 60.0
    error = (tmp_path / "error-0.txt").read_text()
    assert error.startswith("DistributedError: rank 0 of 2:"), error
    assert "another rank died" in error
