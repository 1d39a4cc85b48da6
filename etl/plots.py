"""PNG plots of a :class:`etl.stats.StatsReport` (matplotlib, Agg canvas, no pyplot state).

This module does not import :mod:`etl.stats` (which imports it to draw): it reads a report
through :class:`PlottedReport`, the attributes it plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["PlottedReport", "plot_features", "plot_report", "plot_sessions"]


class PlottedReport(Protocol):
    """What the plots read of a :class:`etl.stats.StatsReport`."""

    dataset: Path
    order: str | None
    rows: int
    batch_size: int
    samples_per_batch_session: float
    factor_threshold: float
    sessions: Any  # etl.stats.SessionStats
    features: Sequence[Any]  # etl.stats.FeatureStats

    @property
    def sparse_factor(self) -> float: ...

    @property
    def sparse_model_factor(self) -> float: ...


def plot_report(report: PlottedReport, out_dir: str | Path) -> list[Path]:
    """Write every plot of ``report`` into ``out_dir``.

    Returns:
        ``[samples_per_session.png, features.png]``; ``[]`` (nothing written) when the report
        has no rows, since there is nothing to plot.
    """
    if not report.rows:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_sessions(report, out / "samples_per_session.png"),
        plot_features(report, out / "features.png"),
    ]


def plot_sessions(report: PlottedReport, path: str | Path) -> Path:
    """Histogram of samples per session in log2 bins, mean and p99 marked."""
    fig, canvas = _figure(7.0, 4.0)
    ax = fig.add_subplot()
    hist = report.sessions.histogram
    labels = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi, _, _ in hist]
    counts = [n for _, _, n, _ in hist]
    ax.bar(range(len(hist)), counts, color="#4c72b0")
    ax.set_xticks(range(len(hist)), labels, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_xlabel("samples per session (log2 bins)")
    ax.set_ylabel("sessions")
    s = report.sessions
    ax.set_title(
        f"{report.rows:,} samples in {s.sessions:,} sessions: "
        f"mean {s.mean:.1f}, median {s.median:.0f}, p99 {s.p99:.0f}, max {s.max:,}",
        fontsize=9,
    )
    fig.tight_layout()
    return _save(canvas, path)


def plot_features(report: PlottedReport, path: str | Path) -> Path:
    """Per feature: exact/partial duplicate % (top) and DedupeFactor model vs measured (bottom)."""
    import numpy as np

    names = [f.name for f in report.features]
    x = np.arange(len(names))
    fig, canvas = _figure(max(7.0, 0.7 * len(names) + 2.0), 7.0)
    top, bottom = fig.subplots(2, 1, sharex=True)

    exact = [f.exact_pct for f in report.features]
    partial = [f.partial_pct for f in report.features]
    top.bar(x, exact, color="#4c72b0", label="exact duplicate")
    top.bar(x, partial, bottom=exact, color="#dd8452", label="partial (one-id shift)")
    top.set_ylabel("% of samples with a previous\nsample in the session")
    top.set_ylim(0, 100)
    top.legend(loc="upper right", fontsize=8)
    top.set_title(f"{report.dataset.name} (order: {report.order or 'unknown'})", fontsize=9)

    width = 0.4
    bottom.bar(x - width / 2, [f.model_factor for f in report.features], width, label="model")
    bottom.bar(x + width / 2, [f.measured_factor for f in report.features], width, label="measured")
    bottom.axhline(report.factor_threshold, color="grey", linestyle="--", linewidth=1)
    # log scale: low-cardinality features reach factors in the hundreds, lists stay near 1-20
    top_factor = max([1.0] + [max(f.model_factor, f.measured_factor) for f in report.features])
    bottom.set_yscale("log")
    bottom.set_ylim(0.9, top_factor * 1.5)
    bottom.set_ylabel(f"DedupeFactor at B={report.batch_size} (log)")
    bottom.set_title(
        f"S = {report.samples_per_batch_session:.2f} samples/session/batch; all sparse features: "
        f"measured {report.sparse_factor:.2f}x, model {report.sparse_model_factor:.2f}x",
        fontsize=9,
    )
    bottom.legend(loc="upper right", fontsize=8)
    bottom.set_xticks(x, names, rotation=45, ha="right")
    fig.tight_layout()
    return _save(canvas, path)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, FigureCanvasAgg(fig)


def _save(canvas, path: str | Path) -> Path:
    path = Path(path)
    canvas.print_png(str(path))
    return path
