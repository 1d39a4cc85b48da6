"""The benchmarks' shared measuring helpers: alternation, spreads, paired ratios."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks._bench import load_benchmark

common = load_benchmark("_common")


def test_alternate_rotates_the_order_and_warms_up_once() -> None:
    calls: list[str] = []
    cases = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    runs = common.alternate(cases, repeats=3)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert {name: len(ts) for name, ts in runs.items()} == {"a": 3, "b": 3, "c": 3}


def test_alternate_without_warmup_and_with_progress() -> None:
    ticks: list[int] = []
    runs = common.alternate(
        {"x": lambda: 7}, repeats=2, warmup=False, progress=lambda: ticks.append(1)
    )
    assert [t.value for t in runs["x"]] == [7, 7]
    assert len(ticks) == 2
    with pytest.raises(ValueError, match="`repeats` must be >= 1, got 0"):
        common.alternate({"x": lambda: 7}, repeats=0)


def test_ratios_pair_repeats() -> None:
    T = common.Timing
    runs = {"fast": [T(1.0, 2.0), T(2.0, 2.0)], "slow": [T(3.0, 4.0), T(2.0, 8.0)]}
    r = common.timing_ratio(runs, "fast", "slow", per="rate")
    assert r["wall"]["values"] == [3.0, 1.0]
    assert r["cpu"]["values"] == [2.0, 4.0]
    assert r["median"] == 2.0
    assert common.timing_ratio(runs, "fast", "slow")["wall"]["values"] == [1 / 3, 1.0]
    with pytest.raises(ValueError, match="repeats must pair up"):
        common.ratio_spread([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="nothing was measured"):
        common.spread([])


def test_write_results_adds_the_environment(tmp_path) -> None:
    out = common.write_results({"ratio": 1.5}, tmp_path / "r" / "x.json")
    data = json.loads(out.read_text())
    assert data["ratio"] == 1.5
    assert data["environment"]["cpus"] >= 1
