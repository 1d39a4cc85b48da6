"""PNG plots of a :class:`etl.stats.StatsReport` (matplotlib, Agg canvas, no pyplot state).

Each figure is titled with the dataset (the schema's name and the directory); the features plot
colours each proposed dedup group (and the features proposed for a partial IKJT) in its tick
labels and measured bars, with a legend naming the group's features, and labels the proposal
threshold line with its value. :func:`features_figure` and :func:`sessions_figure` return the
figures; :func:`plot_report` writes them as PNG.

This module does not import :mod:`etl.stats` (which imports it to draw): it reads a report
through :class:`PlottedReport`, the attributes it plots.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "PlottedReport",
    "dataset_title",
    "features_figure",
    "plot_features",
    "plot_report",
    "plot_sessions",
    "sessions_figure",
]

# one colour per proposed group (tab10 without its blue, which the other bars use)
_GROUP_COLOURS = (
    "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
)  # fmt: skip
_PARTIAL_COLOUR = "#7f7f7f"
_MEASURED_COLOUR = "#4c72b0"
_MODEL_COLOUR = "#c7c7c7"


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
    proposed_groups: Sequence[Sequence[str]]
    schema: Any  # schemas.DatasetSchema | None: its name titles the plots

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


def dataset_title(report: PlottedReport) -> str:
    """The dataset as the plots title it: the schema's name, the directory and the row order."""
    name = getattr(report.schema, "name", None) or report.dataset.name
    return f"dataset {name}: {report.dataset} (order: {report.order or 'unknown'})"


def plot_sessions(report: PlottedReport, path: str | Path) -> Path:
    """Write :func:`sessions_figure` to ``path`` as PNG."""
    return _save(sessions_figure(report), path)


def plot_features(report: PlottedReport, path: str | Path) -> Path:
    """Write :func:`features_figure` to ``path`` as PNG."""
    return _save(features_figure(report), path)


def sessions_figure(report: PlottedReport) -> Figure:
    """Histogram of samples per session in log2 bins; mean, median, p99 and max in the title."""
    fig = _figure(7.0, 4.4)
    ax = fig.add_subplot()
    hist = report.sessions.histogram
    labels = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi, _, _ in hist]
    counts = [n for _, _, n, _ in hist]
    ax.bar(range(len(hist)), counts, color=_MEASURED_COLOUR)
    ax.set_xticks(range(len(hist)), labels, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_xlabel("samples per session (log2 bins)")
    ax.set_ylabel("sessions")
    s = report.sessions
    fig.suptitle(dataset_title(report), fontsize=10)
    ax.set_title(
        f"{report.rows:,} samples in {s.sessions:,} sessions: "
        f"mean {s.mean:.1f}, median {s.median:.0f}, p99 {s.p99:.0f}, max {s.max:,}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def features_figure(report: PlottedReport) -> Figure:
    """Per feature: exact/partial duplicate % (top) and DedupeFactor model vs measured (bottom),
    the proposed groups coloured and named in the legend, the proposal threshold labelled."""
    import numpy as np

    names = [f.name for f in report.features]
    x = np.arange(len(names))
    colour = _proposal_colours(report)
    fig = _figure(max(7.0, 0.7 * len(names) + 2.0) + 3.5, 7.6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    fig.suptitle(dataset_title(report), fontsize=10)

    exact = [f.exact_pct for f in report.features]
    partial = [f.partial_pct for f in report.features]
    top.bar(x, exact, color=_MEASURED_COLOUR, label="exact duplicate")
    top.bar(x, partial, bottom=exact, color="#dd8452", label="partial (one-id shift)")
    top.set_ylabel("% of samples with a previous\nsample in the session")
    top.set_ylim(0, 100)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    top.set_title("duplicate share per feature", fontsize=9)

    width = 0.4
    bottom.bar(
        x - width / 2,
        [f.model_factor for f in report.features],
        width,
        color=_MODEL_COLOUR,
        label="model (RecD)",
    )
    bottom.bar(
        x + width / 2,
        [f.measured_factor for f in report.features],
        width,
        color=[colour.get(n, (_MEASURED_COLOUR, ""))[0] for n in names],
    )  # in the legend as one patch per colour, below
    thr = report.factor_threshold
    bottom.axhline(
        thr,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"proposal threshold: measured factor > {thr:g}x",
    )
    bottom.annotate(
        f"threshold {thr:g}x",
        xy=(1.0, thr),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=8,
    )
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
    handles, _ = bottom.get_legend_handles_labels()  # the model bars, the threshold line
    handles.insert(1, _patch(_MEASURED_COLOUR, "measured, not proposed"))
    handles += [_patch(shade, label) for shade, label in dict.fromkeys(colour.values())]
    bottom.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    bottom.set_xticks(x, names, rotation=45, ha="right")
    for tick in bottom.get_xticklabels():
        if tick.get_text() in colour:
            tick.set_color(colour[tick.get_text()][0])
            tick.set_fontweight("bold")
    fig.tight_layout()
    return fig


def _proposal_colours(report: PlottedReport) -> dict[str, tuple[str, str]]:
    """``{feature: (colour, legend label)}`` of every proposed feature."""
    out: dict[str, tuple[str, str]] = {}
    for k, group in enumerate(report.proposed_groups):
        shade = _GROUP_COLOURS[k % len(_GROUP_COLOURS)]
        label = textwrap.fill(f"proposed group {k + 1}: {', '.join(group)}", 44)
        out.update((n, (shade, label)) for n in group)
    partial = list(getattr(report, "proposed_partial", ()))
    if partial:
        label = textwrap.fill(f"proposed partial IKJT: {', '.join(partial)}", 44)
        out.update((n, (_PARTIAL_COLOUR, label)) for n in partial)
    return out


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label)


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.canvas.print_png(str(path))
    return path
