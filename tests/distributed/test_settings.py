"""Ranks started with different settings or datasets are refused at start-up, on every rank,
in one line naming the setting and each rank's value.

Regressions: `--lr`, `--seed` and `--hot-rows` that differed between ranks trained silently;
another dataset or `--steps` on one rank hung the job until `--dist-timeout`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import settings_cases
from dist_harness import run_ranks

from tests.common.data import synthetic_dataset

pytestmark = pytest.mark.slow  # two spawned ranks, as every multi-rank test

TIMEOUT_S = 240.0  # spawn and import on a loaded machine; the checks themselves take no time


@pytest.fixture(scope="module")
def outcome(dist_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("settings")
    other = synthetic_dataset(root / "other", requests=300, seed=9, files=1)
    copy = root / "copy"
    shutil.copytree(dist_dataset, copy)
    out = root / "out"
    out.mkdir()
    codes = run_ranks(settings_cases.started_apart, 2, str(dist_dataset), str(other), str(copy),
                      str(out), timeout_s=TIMEOUT_S)  # fmt: skip
    assert codes == [0, 0], codes
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]  # every rank refuses, with the same message
    return seen[0], dist_dataset, other


def check_message(message: str | None, *needles: str) -> None:
    assert message is not None, "the ranks trained with different settings"
    first, *rest = message.splitlines()
    assert first.startswith("the 2 ranks were started with different settings: "), message
    assert rest == ["hint: start every rank with the same options and the same dataset"]
    for needle in needles:
        assert needle in first, message


def test_another_lr_is_refused(outcome):
    seen, _, _ = outcome
    check_message(seen["lr"], "`--lr` 0.05 (rank 0), 0.1 (rank 1)")
    assert "`--steps`" not in seen["lr"]


def test_every_differing_setting_is_named(outcome):
    seen, _, _ = outcome
    check_message(seen["seed_hot_rows"], "`--hot-rows` 16 (rank 0), 17 (rank 1)",
                  "`--seed` 0 (rank 0), 1 (rank 1)")  # fmt: skip


def test_another_steps_or_dataset_fails_at_once_instead_of_hanging(outcome):
    seen, dataset, other = outcome
    check_message(seen["steps"], "`--steps` 2 (rank 0), 3 (rank 1)")
    check_message(seen["dataset"], f"`DATASET` '{dataset}' (files ", f"(rank 0), '{other}' (files ")


def test_the_same_data_elsewhere_and_local_options_agree(outcome):
    seen, _, _ = outcome
    assert seen["agree"] == "ok"
