"""Dedup survives SPTT: the sparse all-to-all sends the unique rows of a dedup group's features
and their inverse lookup, not the expanded rows, and ``--dedup on`` trains bit for bit as
``--dedup off`` (and as one process, to the tower tests' 1e-6).

Jobs of gloo processes on the session-clustered towers dataset (slow: processes to start): 2
"hosts" x 1 rank, and 2 hosts x 2 ranks; and the wire format's pieces in this process. Regression: the all-to-all sent every batch row's ids (``to_plain()``) with
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


@pytest.mark.slow
def test_two_hosts_send_the_unique_rows_ids(two_hosts):
    _check_ids(two_hosts)


@pytest.mark.slow
def test_two_hosts_dedup_on_trains_bitwise_as_off_and_as_one_process(two_hosts):
    _check_losses(two_hosts)


@pytest.mark.slow
def test_two_hosts_of_two_ranks_send_the_unique_rows_ids(two_by_two):
    _check_ids(two_by_two)


@pytest.mark.slow
def test_two_hosts_of_two_ranks_dedup_on_trains_bitwise_as_off(two_by_two):
    _check_losses(two_by_two)


# -------------------------------------------------------------------------------------------
# in this process: the wire format's pieces


def test_a_groups_share_is_deduplicated_as_its_expanded_rows():
    """A destination's share of a group: the rows of its features deduplicated and numbered by
    first occurrence among the B rows, whatever order the group's unique rows come in."""
    import torch

    from recpipe.ikjt import InverseKeyedJaggedTensor
    from recpipe.jagged import KeyedJaggedTensor
    from trainer.towers.sptt import _sub_group

    # unique rows u0..u3 (a, b): (1, 7) (2, 7) (1, 8) (3, 9); b's share merges u0 and u1
    unique = KeyedJaggedTensor.from_lengths(
        ["a", "b"], torch.tensor([1, 2, 1, 3, 7, 7, 8, 9]), torch.tensor([1, 1, 1, 1, 1, 1, 1, 1])
    )
    for inverse in ([3, 1, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1]):  # first occurrences out of order, in
        group = InverseKeyedJaggedTensor.from_unique(unique, torch.tensor(inverse))
        expanded = group.to_kjt()
        for keys in (["b"], ["a"], ["a", "b"], ["b", "a"]):
            got = _sub_group(group, keys)
            want = InverseKeyedJaggedTensor.from_jagged({k: expanded[k] for k in keys})
            assert got.equals(want), (inverse, keys)


def test_one_rank_routes_dedup_on_and_off_to_the_same_unique_rows(towers_dataset):
    """On a world of one the bags of a deduplicated batch and of its plain form are the same
    IKJTs (a partial group travels expanded, then is deduplicated as the plain rows are)."""
    import dataclasses

    from recpipe.ikjt import PartialInverseKeyedJaggedTensor
    from tests.distributed.dist_cases import rank_batches
    from trainer.towers.sptt import SPTTGroups

    layout = dedup_cases.make_layout(str(towers_dataset), 1, 1)
    trainer = dedup_cases.sptt(str(towers_dataset), layout, SPTTGroups.single(), "none")
    on = rank_batches(str(towers_dataset), rank=0, world=1, dedup=True, steps=1)[0]
    off = rank_batches(str(towers_dataset), rank=0, world=1, dedup=False, steps=1)[0]
    name = next(n for n, g in on.ikjts.items() if len(g.keys()) == 1)
    windows = PartialInverseKeyedJaggedTensor.from_jagged({k: on.ikjts[name].to_kjt()[k]
                                                          for k in on.ikjts[name].keys()})  # fmt: skip
    partial = dataclasses.replace(on, ikjts={**on.ikjts, name: windows})
    routed, bags = {}, {}
    for side, batch in (("on", on), ("off", off), ("partial", partial)):
        bags[side] = trainer.route_sparse(batch)
        routed[side] = trainer.last_routed.ids
        assert bags[side].batch_size == batch.batch_size
    want = {tuple(sorted(g.keys())): g for g in bags["on"].ikjts.values()}
    assert len(want) == len(on.ikjts)
    for side in ("off", "partial"):
        got = {tuple(sorted(g.keys())): g for g in bags[side].ikjts.values()}
        assert got.keys() == want.keys(), side
        assert all(got[k].equals(want[k]) for k in want), side
        assert bags[side].kjt.equals(bags["on"].kjt), side
    assert routed["on"] < routed["partial"] < routed["off"] == off.kjt.values().numel()
