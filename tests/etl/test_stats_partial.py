"""`recpipe stats` measures partial duplication (lists that shift by one id) and proposes a
``[dedup] partial`` list; the schema reads it back."""

from __future__ import annotations

import json

import pytest

from etl.stats import compute_stats
from schemas import DatasetSchema, SparseFeature, parse_schema
from tests.etl.test_stats import SCHEMA, TINY, _write

# A history that shifts on every sample of a session (never an exact repeat) and a static list.
SHIFT = DatasetSchema(
    name="shift",
    dense=(),
    sparse=(SparseFeature("recent", "user", 4), SparseFeature("static", "user", 3)),
)
SHIFT_ROWS = [
    (0, 1, [1, 2], [7, 8, 9]),
    (0, 2, [1, 2, 3], [7, 8, 9]),  # append
    (0, 3, [1, 2, 3, 4], [7, 8, 9]),  # append
    (0, 4, [2, 3, 4, 5], [7, 8, 9]),  # slide left (full at max_len 4)
    (0, 5, [3, 4, 5, 6], [7, 8, 9]),  # slide left
    (0, 6, [4, 5, 6, 7], [7, 8, 9]),  # slide left
    (0, 7, [5, 6, 7, 8], [7, 8, 9]),  # slide left
    (0, 8, [6, 7, 8, 9], [7, 8, 9]),  # slide left
]


def test_tiny_partial_numbers(tmp_path):
    report = compute_stats(_write(tmp_path / "ds", TINY, splits=(3,)), schema=SCHEMA, batch_size=4)
    hist, seller, item = (report.feature(n) for n in ("hist", "seller", "item"))
    # batch 0 hist [1,2] [1,2] [1,2,3] [9] stores 2 + 0 + 1 + 1; batch 1 [4,5,6] [5,6,7]: 3 + 1
    assert (hist.values, hist.partial_values, hist.shifted_rows) == (14, 8, 2)
    assert hist.partial_factor == pytest.approx(14 / 8)
    assert (seller.partial_values, seller.shifted_rows) == (5, 0)  # one-id lists: no shift saves
    assert (item.partial_values, item.shifted_rows) == (5, 0)
    assert report.feature("age").partial_factor == 1.0
    # hist repeats too rarely for an IKJT (14/12 ids) but shifts: proposed partial
    assert report.proposed_features == [] and report.proposed_partial == ["hist"]
    assert report.dedup_toml() == '[dedup]\ngroups = []\npartial = ["hist"]\n'
    assert report.groups_factor([], ["hist"]) == pytest.approx((14 + 6 + 6) / (8 + 6 + 6))


def test_shifting_history_gets_no_ikjt_but_a_partial_ikjt(tmp_path):
    root = _write(tmp_path / "ds", SHIFT_ROWS, schema=SHIFT)
    report = compute_stats(root, schema=SHIFT, batch_size=8)
    recent, static = report.feature("recent"), report.feature("static")
    assert recent.d == 0.0 and recent.measured_factor == 1.0  # d(f) = 0: never a repeat
    assert recent.partial_pct == 100.0  # every row a one-step shift of the one before
    assert (recent.values, recent.partial_values) == (2 + 3 + 4 * 6, 2 + 7)
    assert recent.shifted_rows == 7 and recent.shifted_pct == pytest.approx(100 * 7 / 8)
    assert static.measured_factor == 8.0 and static.partial_factor == 8.0
    assert report.proposed_groups == [("static",)] and report.proposed_partial == ["recent"]
    toml = report.dedup_toml()
    assert toml == '[dedup]\ngroups = [["static"]]\npartial = ["recent"]\n'
    data = json.loads((report.write_json(tmp_path / "stats.json")).read_text())
    assert data["proposed_partial"] == ["recent"]
    assert data["proposed_partial_factors"] == {"recent": pytest.approx(29 / 9)}
    assert data["features"][0]["partial_factor"] == pytest.approx(29 / 9)
    assert "partial" in report.format_table() and "recent 3.22x" in report.format_table()
    # the proposal pastes into the schema as is
    schema = parse_schema(SHIFT.to_toml() + "\n" + toml)
    assert schema.dedup_partial == ("recent",) and schema.dedup_groups == (("static",),)
