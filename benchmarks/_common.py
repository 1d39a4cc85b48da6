"""What every benchmark script measures the same way.

The development machines are shared and noisy, so a claim is always a ratio against a baseline
measured in the same run, with the cases alternated (the order rotates each repeat, so drift and
other load hit every case alike), one warm-up call per case that is not timed, the median kept,
and the spread (min, median, max over repeats) reported beside it. Where wall time is measured,
process CPU time is measured too, and a ratio's CPU-time twin is reported beside it.

>>> s = spread([3.0, 1.0, 2.0])
>>> (s["min"], s["median"], s["max"], s["repeats"])
(1.0, 2.0, 3.0, 3)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS",
    "Timing",
    "alternate",
    "environment",
    "int_list",
    "partial_schema",
    "ratio_spread",
    "spread",
    "timed",
    "timing_ratio",
    "write_results",
]

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Timing:
    """One timed call: wall and process-CPU seconds, and what the call returned."""

    wall_s: float
    cpu_s: float
    value: Any = None


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"min", "median", "max", "repeats", "values"}`` of a list of measurements."""
    if not values:
        msg = "`values` is empty: nothing was measured"
        raise ValueError(msg)
    vals = [float(v) for v in values]
    return {
        "min": min(vals),
        "median": statistics.median(vals),
        "max": max(vals),
        "repeats": len(vals),
        "values": vals,
    }


def int_list(text: str, *, minimum: int = 0, example: str = "4,8") -> tuple[int, ...]:
    """An option's comma-separated integers, each at least ``minimum`` (an argparse ``type``).

    >>> int_list("4,16")
    (4, 16)
    """
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < minimum:
        msg = f"expected integers >= {minimum} separated by commas, such as {example}, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return values


def partial_schema() -> Any:
    """The bundled synth schema with its shifting history (``user_recent_items``) read as a
    partial IKJT, as ``recpipe stats`` proposes: the schema the readers' and the trainer's
    benchmarks build with (the bundled schema leaves partial dedup opt-in)."""
    from schemas import default_schema

    schema = default_schema()
    return schema.with_dedup(schema.dedup_groups, partial=("user_recent_items",))


def ratio_spread(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """Spread of the per-repeat ratios ``numerator[i] / denominator[i]``.

    Repeat ``i`` of both sides ran back to back, so their ratio cancels most of the drift that
    separate medians would keep.
    """
    if len(numerator) != len(denominator):
        msg = f"ratio of {len(numerator)} values over {len(denominator)}: repeats must pair up"
        raise ValueError(msg)
    return spread([a / b for a, b in zip(numerator, denominator, strict=True)])


def timed(fn: Callable[[], Any]) -> Timing:
    """Run ``fn`` once, measuring wall and process-CPU time."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    value = fn()
    return Timing(time.perf_counter() - wall0, time.process_time() - cpu0, value)


def alternate(
    cases: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: bool = True,
    progress: Callable[[], None] | None = None,
) -> dict[str, list[Timing]]:
    """Time each case ``repeats`` times, alternated, the order rotating every repeat.

    Args:
        cases: name -> a call that does one measured unit of work.
        repeats: timed calls per case.
        warmup: call every case once, untimed, first (caches, Numba compilation, page cache).
        progress: called after each timed call (a progress bar's ``update``).

    Returns:
        name -> the :class:`Timing` of each repeat, in repeat order.
    """
    if repeats < 1:
        msg = f"`repeats` must be >= 1, got {repeats!r}"
        raise ValueError(msg)
    names = list(cases)
    if warmup:
        for name in names:
            cases[name]()
    out: dict[str, list[Timing]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(timed(cases[name]))
            if progress is not None:
                progress()
    return out


def timing_ratio(
    runs: Mapping[str, Sequence[Timing]], numerator: str, denominator: str, *, per: str = "time"
) -> dict[str, Any]:
    """Ratio of two alternated cases' times, wall and CPU, with their spreads.

    Args:
        runs: the output of :func:`alternate`.
        numerator, denominator: case names; the ratio is ``numerator / denominator`` of the
            times (``per="time"``) or of the rates, i.e. ``denominator / numerator`` of the times
            (``per="rate"``: "how many times faster is the numerator").

    Returns:
        ``{"median": ..., "wall": spread, "cpu": spread}``, ``median`` being the wall ratio's.
    """
    if per not in ("time", "rate"):
        msg = f"`per` must be 'time' or 'rate', got {per!r}"
        raise ValueError(msg)
    a, b = runs[numerator], runs[denominator]
    if per == "rate":
        a, b = b, a
    wall = ratio_spread([t.wall_s for t in a], [t.wall_s for t in b])
    cpu = ratio_spread([t.cpu_s for t in a], [t.cpu_s for t in b])
    return {"median": wall["median"], "wall": wall, "cpu": cpu}


def environment() -> dict[str, Any]:
    """Where the figures were measured (goes into every results file)."""
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_results(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``results`` (plus :func:`environment` under ``"environment"``) as indented JSON."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {**results, "environment": environment()}
    out.write_text(json.dumps(payload, indent=1, sort_keys=False, default=float) + "\n")
    return out
