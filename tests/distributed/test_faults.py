"""A rank killed with SIGKILL makes the others fail with a clear error, with no torchrun agent
to stop them: what the ranks on another machine see."""

from __future__ import annotations

import time

import dist_cases
import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.slow


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
