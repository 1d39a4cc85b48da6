"""``user_recent_items``: the synthetic list that shifts by one id on every request (a partial
duplicate of its predecessor every time, never an exact one)."""

from __future__ import annotations

import itertools

import orjson
import pytest

from etl.rawio import iter_lines
from etl.synth import SynthConfig, generate
from schemas import default_schema


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str, list[dict]]:
    result = generate(
        tmp_path_factory.mktemp("r"), SynthConfig(num_requests=3_000, seed=5, files=2)
    )
    recs = [orjson.loads(line) for p in result.features for _, line in iter_lines(p)]
    recs.sort(key=lambda r: (r["ts"], int(r["request_id"][2:])))
    out: dict[str, list[dict]] = {}
    for r in recs:
        out.setdefault(r["session_id"], []).append(r)
    return out


def test_recent_items_append_the_previous_request_item(sessions):
    max_len = default_schema().feature("user_recent_items").max_len
    pairs = 0
    for recs in sessions.values():
        for prev, cur in itertools.pairwise(recs):
            p, c = prev["sparse"]["user_recent_items"], cur["sparse"]["user_recent_items"]
            assert c[-1] == prev["sparse"]["item_id"][0]  # the item just shown, appended ...
            assert c[:-1] == (p[1:] if len(p) == max_len else p)  # ... the oldest dropped when full
            pairs += 1
    assert pairs > 1_000
    firsts = [recs[0]["sparse"]["user_recent_items"] for recs in sessions.values()]
    assert all(5 <= len(f) <= max_len for f in firsts)  # a history drawn for the session


def test_the_bundled_schema_leaves_partial_dedup_opt_in():
    """`recpipe stats` proposes it (`--dedup-groups auto` reads it so); the bundled schema does not
    turn it on, because its gradients then sum in another order than the plain lists'."""
    schema = default_schema()
    assert schema.dedup_partial == ()
    assert schema.feature("user_recent_items").kind == "user"
    assert schema.with_dedup(schema.dedup_groups, partial=("user_recent_items",)).dedup_partial == (
        "user_recent_items",
    )
