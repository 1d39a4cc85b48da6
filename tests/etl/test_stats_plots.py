"""`recpipe stats` plots: the dataset named in each figure's title, the proposed dedup groups
coloured and named in the legend, the threshold line labelled (issue 32 item 10). The figures
are read as matplotlib objects, not pixels."""

from __future__ import annotations

from pathlib import Path

from matplotlib.colors import to_hex

from etl.plots import features_figure, plot_report, sessions_figure
from etl.stats_report import FeatureStats, SessionStats, StatsReport
from schemas import DatasetSchema, SparseFeature

NAMES = ("a", "b", "c", "d")


def _feature(name: str, factor: float) -> FeatureStats:
    return FeatureStats(
        name=name, kind="user", rows=100, rows_with_prev=90, exact_duplicates=80,
        partial_duplicates=5, values=300, unique_values=int(300 / factor), avg_len=3.0,
        logical_bytes=2400, byte_share=0.25, parquet_bytes=800, d=0.8, model_factor=factor,
        measured_factor=factor,
    )  # fmt: skip


def make_report(tmp_path: Path) -> StatsReport:
    """A hand-made report: 4 features, groups [a, b] and [c] proposed, threshold 1.5."""
    schema = DatasetSchema("feedtest", (), tuple(SparseFeature(n, "user", 4) for n in NAMES))
    return StatsReport(
        dataset=tmp_path / "clustered", order="session", files=1, rows=100, batch_size=64,
        batches=2, samples_per_batch_session=8.0,
        sessions=SessionStats(10, 10.0, 9.0, 15.0, 20.0, 20, ((8, 16, 6, 60), (16, 32, 4, 40))),
        features=[_feature("a", 4.0), _feature("b", 4.0), _feature("c", 3.0),
                  _feature("d", 1.1)],
        proposed_features=["a", "b", "c"], proposed_groups=[("a", "b"), ("c",)],
        jaccard={}, factor_threshold=1.5, group_jaccard=0.9, elapsed_s=0.1, schema=schema,
        group_unique_values={"a+b": 100},
    )  # fmt: skip


def test_each_figure_names_the_dataset(tmp_path):
    report = make_report(tmp_path)
    for fig in (features_figure(report), sessions_figure(report)):
        title = fig.get_suptitle()
        assert "feedtest" in title and str(tmp_path / "clustered") in title, title


def test_proposed_groups_are_coloured_and_named_and_the_threshold_is_labelled(tmp_path):
    fig = features_figure(make_report(tmp_path))
    factors = fig.axes[1]
    legend = factors.get_legend()
    entries = {
        t.get_text().replace("\n", " "): to_hex(h.get_facecolor())
        for t, h in zip(legend.get_texts(), legend.legend_handles)
        if t.get_text().startswith("proposed ")
    }
    assert set(entries) == {"proposed group 1: a, b", "proposed group 2: c"}
    ticks = {t.get_text(): to_hex(t.get_color()) for t in factors.get_xticklabels()}
    assert ticks["a"] == ticks["b"] == entries["proposed group 1: a, b"]
    assert ticks["c"] == entries["proposed group 2: c"] != ticks["a"]
    assert ticks["d"] not in entries.values()  # not proposed: not marked
    measured = factors.containers[1]  # model bars, then measured bars
    bar_colours = [to_hex(bar.get_facecolor()) for bar in measured]
    assert bar_colours[:3] == [ticks["a"], ticks["b"], ticks["c"]]
    assert bar_colours[3] not in entries.values()

    (line,) = [ln for ln in factors.get_lines() if "threshold" in ln.get_label()]
    assert list(line.get_ydata()) == [1.5, 1.5]
    assert line.get_label() == "proposal threshold: measured factor > 1.5x"
    assert line.get_label() in [t.get_text() for t in legend.get_texts()]
    assert "threshold 1.5x" in [t.get_text() for t in factors.texts]


def test_plot_report_writes_both_pngs(tmp_path):
    written = plot_report(make_report(tmp_path), tmp_path / "plots")
    assert [p.name for p in written] == ["samples_per_session.png", "features.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
