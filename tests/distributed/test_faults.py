"""A rank killed with SIGKILL makes the others fail with a clear error, with no torchrun agent
to stop them: what the ranks on another machine see."""

from __future__ import annotations

import time

import dist_cases
import pytest
from dist_harness import join_ranks, start_ranks

pytestmark = pytest.mark.slow


def test_a_killed_rank_makes_the_others_fail_fast(dist_dataset, tmp_path):
    procs = start_ranks(dist_cases.die_at_step, 2, str(dist_dataset), str(tmp_path), 1, 2)
    try:
        deadline = time.monotonic() + 300  # start-up on a loaded machine, then 2 steps
        while not (tmp_path / "killed").exists() and procs[1].is_alive():
            assert time.monotonic() < deadline, "rank 1 did not reach the step it dies at"
            procs[1].join(0.2)
        procs[1].join(30)
        killed_at = time.monotonic()
        codes = join_ranks(procs, timeout_s=60.0)
        elapsed = time.monotonic() - killed_at
    finally:
        join_ranks(procs, timeout_s=0)
    assert codes[1] == -9  # SIGKILL
    assert codes[0] not in (0, None), codes  # failed on its own, within the minute
    assert elapsed < 60.0
    error = (tmp_path / "error-0.txt").read_text()
    assert error.startswith("DistributedError: rank 0 of 2:"), error
    assert "another rank died" in error
