"""Dedup survives SPTT: the sparse all-to-all sends the unique rows of a dedup group's features
and their inverse lookup, not the expanded rows, and ``--dedup on`` trains bit for bit as
``--dedup off`` (and as one process, to the tower tests' 1e-6).

Jobs of gloo processes on the session-clustered towers dataset: 2 "hosts" x 1 rank, and (slow)
2 hosts x 2 ranks. Regression: the all-to-all sent every batch row's ids (``to_plain()``) with
dedup on as well.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.dist_harness import run_ranks
from tests.towers import dedup_cases

LOSS_TOLERANCE = 1e-6  # the tower tests' one-process tolerance (float32)


def _relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _job(dataset, tmp_path_factory, world: int, per_host: int) -> dict:
    out = tmp_path_factory.mktemp(f"dedup{world}x{per_host}")
    codes = run_ranks(dedup_cases.run_all, world, str(dataset), str(out), per_host,
                      timeout_s=420.0)  # fmt: skip
    assert codes == [0] * world, f"the ranks exited with {codes}"
    return json.loads((out / "dedup.json").read_text())


@pytest.fixture(scope="module")
def two_hosts(towers_dataset, tmp_path_factory):
    return _job(towers_dataset, tmp_path_factory, 2, 1)


@pytest.fixture(scope="module")
def two_by_two(towers_dataset, tmp_path_factory):
    return _job(towers_dataset, tmp_path_factory, 4, 2)


def _check_ids(results: dict) -> None:
    for got in results["ids"]:
        on, off = got["on"], got["off"]
        # dedup off: every batch row's ids; dedup on: the unique rows' ids, fewer
        assert off["ids"] == got["plain_ids"]
        assert on["ids"] == got["expected_on"] < got["plain_ids"]
        assert on["ids"] <= got["ikjt_ids"]  # never more than the readers' unique rows hold
        assert off["inverse"] == off["headers"] == 0
        assert on["inverse"] == on["headers"] * got["rows"] > 0
        # what the all-to-all carried: lengths + ids (+ inverse and U per dedup group), nothing else
        for side in (on, off):
            assert side["sent"] == side["rows"] + side["ids"] + side["inverse"] + side["headers"]
            assert side["bag_rows"] == got["rows"] * len(results["ids"])
        assert on["sent"] < off["sent"]


def _check_losses(results: dict) -> None:
    for name, got in results["losses"].items():
        assert len(got["on"]) == dedup_cases.STEPS
        assert got["on"] == got["off"], name  # bitwise, every step
        assert got["bitwise"], name  # and the logits, tower and head parameters on every rank
        assert got["routed_on"] < got["routed_off"], name
        # one process on the global batches (the ranks' batches concatenated: with dedup off its
        # plain batch is deduplicated whole, so duplicates across ranks merge there)
        assert _relative(got["on"], got["reference_on"]) <= LOSS_TOLERANCE, name
        assert _relative(got["off"], got["reference_off"]) <= LOSS_TOLERANCE, name


def test_two_hosts_send_the_unique_rows_ids(two_hosts):
    _check_ids(two_hosts)


def test_two_hosts_dedup_on_trains_bitwise_as_off_and_as_one_process(two_hosts):
    _check_losses(two_hosts)


@pytest.mark.slow
def test_two_hosts_of_two_ranks_send_the_unique_rows_ids(two_by_two):
    _check_ids(two_by_two)


@pytest.mark.slow
def test_two_hosts_of_two_ranks_dedup_on_trains_bitwise_as_off(two_by_two):
    _check_losses(two_by_two)
