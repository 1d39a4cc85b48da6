"""Towers under ``--optimizer adam``: the tables' lazy Adam keeps its moments with the rank that
holds each table and counts the job's steps; 2 hosts x 1 rank train as one process on the
global batches (the tower tests' 1e-6, relative, float32)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.dist_harness import run_ranks
from tests.towers import adam_towers_cases

LOSS_TOLERANCE = 1e-6  # the tower tests' one-process tolerance (float32)


@pytest.mark.slow
def test_two_hosts_under_adam_train_as_one_process(towers_dataset, tmp_path):
    codes = run_ranks(adam_towers_cases.run_all, 2, str(towers_dataset), str(tmp_path), 1,
                      timeout_s=420.0)  # fmt: skip
    assert codes == [0, 0], f"the ranks exited with {codes}"
    results = json.loads((tmp_path / "adam.json").read_text())
    assert sorted(results) == sorted(adam_towers_cases.CASES)
    for name, got in results.items():
        assert len(got["losses"]) == adam_towers_cases.STEPS, name
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], got["reference"],
                                                        strict=True))  # fmt: skip
        assert worst <= LOSS_TOLERANCE, (name, worst, got)
        # every rank holding tables counted every step (Adam's bias correction)
        assert set(got["table_steps"]) - {-1} == {adam_towers_cases.STEPS}, got["table_steps"]
