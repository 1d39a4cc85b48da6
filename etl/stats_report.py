"""What ``recpipe stats`` reports: :class:`StatsReport` (per-session and per-feature duplication,
dedup factors, the proposed ``[dedup]`` groups), its JSON and table forms, and RecD's
DedupeFactor model. :mod:`etl.stats` computes it; the module docstring there defines every figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = ["TABLE_KEYS", "FeatureStats", "SessionStats", "StatsReport", "dedupe_factor_model"]

TABLE_KEYS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("samples", ("rows",), ""),
    ("S", ("samples_per_batch_session",), ""),
    ("avg_len", ("features[].avg_len",), ""),
    ("bytes%", ("features[].byte_share",), "100 * "),
    ("exact%", ("features[].exact_pct",), ""),
    ("partial%", ("features[].partial_pct",), ""),
    ("d(f)", ("features[].d",), ""),
    ("model", ("features[].model_factor",), ""),
    ("measured", ("features[].measured_factor",), ""),
    ("partial", ("features[].partial_factor",), ""),
    ("dedup", ("proposed_features", "proposed_partial"), ""),
    ("all sparse features together", ("sparse_factor", "sparse_model_factor"), ""),
    ("schema's groups", ("schema_groups_factor",), ""),
    ("proposed groups", ("proposed_groups_factor",), ""),
)
"""``(label, stats.json keys, scale)``: what the table calls each figure, and the key (or keys,
``features[]`` for a per-feature entry) :meth:`StatsReport.to_dict` writes it under."""


@dataclass(frozen=True)
class SessionStats:
    """Samples per session over the whole dataset.

    Attributes:
        sessions: number of distinct sessions.
        mean, median, p90, p99, max: samples per session.
        histogram: log2 bins as ``(lo, hi, sessions, samples)``: ``lo <= n < hi``.
    """

    sessions: int
    mean: float
    median: float
    p90: float
    p99: float
    max: int
    histogram: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class FeatureStats:
    """Duplication statistics of one feature (see the module docstring for the definitions)."""

    name: str
    kind: Literal["dense", "user", "item", "context"]
    rows: int
    rows_with_prev: int
    exact_duplicates: int
    partial_duplicates: int
    values: int
    unique_values: int
    avg_len: float
    logical_bytes: int
    byte_share: float
    parquet_bytes: int
    d: float
    model_factor: float
    measured_factor: float
    partial_values: int = 0
    shifted_rows: int = 0

    @property
    def partial_factor(self) -> float:
        """Partial DedupeFactor: ids in all rows / ids a partial IKJT stores (1.0 for dense)."""
        return self.values / self.partial_values if self.partial_values else 1.0

    @property
    def shifted_pct(self) -> float:
        """Share of the rows a partial IKJT stores as a one-id shift of the row before them."""
        return 100.0 * self.shifted_rows / self.rows if self.rows else 0.0

    @property
    def exact_pct(self) -> float:
        """Exact-duplicate % (``100 * d``)."""
        return 100.0 * self.d

    @property
    def partial_pct(self) -> float:
        """Partial-duplicate % (one-step shifts, exact duplicates excluded)."""
        return 100.0 * self.partial_duplicates / self.rows_with_prev if self.rows_with_prev else 0.0


@dataclass
class StatsReport:
    """Everything ``recpipe stats`` measured on one dataset.

    Attributes:
        dataset: the dataset directory.
        order: the build's row order from the manifest (``"session"``/``"time"``), if known.
        files: number of Parquet files read.
        rows: number of samples.
        batch_size: ``B`` of the factors.
        batches: number of batches of ``B`` rows in file order.
        samples_per_batch_session: ``S``, average samples a session contributes to a batch
            (0 when there are no rows).
        sessions: samples-per-session statistics.
        features: one entry per feature, in schema order (dense first, then sparse).
        proposed_features: sparse features whose measured factor exceeds ``factor_threshold``.
        proposed_groups: dedup groups of the proposed features (features changing together).
        proposed_partial: sparse features proposed for a partial IKJT: not proposed for a
            group, and their partial factor exceeds ``factor_threshold`` (lists that shift).
        jaccard: pairwise Jaccard similarity of the proposed features' change-sample sets.
        factor_threshold, group_jaccard: the thresholds used for the proposals.
        elapsed_s: wall time of the statistics.
        schema: the dataset schema the report was computed with.
        group_unique_values: ids a reader stores per batch for each dedup group of the
            schema and of the proposal (keyed by the group's features joined by ``+``); see
            :meth:`groups_factor`.
    """

    dataset: Path
    order: str | None
    files: int
    rows: int
    batch_size: int
    batches: int
    samples_per_batch_session: float
    sessions: SessionStats
    features: list[FeatureStats]
    proposed_features: list[str]
    proposed_groups: list[tuple[str, ...]]
    jaccard: dict[str, dict[str, float]]
    factor_threshold: float
    group_jaccard: float
    elapsed_s: float
    schema: DatasetSchema | None = field(default=None, repr=False)
    group_unique_values: dict[str, int] = field(default_factory=dict)
    proposed_partial: list[str] = field(default_factory=list)

    @property
    def schema_groups(self) -> list[tuple[str, ...]]:
        """The dedup groups of the schema the report was computed with."""
        return [] if self.schema is None else [tuple(g) for g in self.schema.dedup_groups]

    @property
    def schema_partial(self) -> list[str]:
        """The ``[dedup] partial`` features of the schema the report was computed with."""
        return [] if self.schema is None else list(self.schema.dedup_partial)

    def groups_factor(self, groups: Sequence[Sequence[str]], partial: Sequence[str] = ()) -> float:
        """Measured DedupeFactor of all sparse features read with these dedup groups.

        Sparse ids in all rows / ids the reader stores: a group's ids in its distinct rows per
        batch (a row is merged only when all of the group's lists repeat), a ``partial``
        feature's packed ids, every other feature in full. This is the factor ``recpipe
        train`` reports for the groups.

        Raises:
            KeyError: a group of several features the report did not measure.
        """
        if not self.rows:
            return 1.0
        sparse = {f.name: f for f in self.features if f.kind != "dense"}
        grouped = {n for g in groups for n in g} | set(partial)
        stored = sum(f.values for n, f in sparse.items() if n not in grouped)
        stored += sum(sparse[n].partial_values for n in partial)
        for g in groups:
            if len(g) == 1:
                stored += sparse[g[0]].unique_values
            else:
                stored += self.group_unique_values["+".join(g)]
        total = sum(f.values for f in sparse.values())
        return total / stored if stored else 1.0

    def feature(self, name: str) -> FeatureStats:
        """Return the statistics of feature ``name``."""
        for stats in self.features:
            if stats.name == name:
                return stats
        msg = f"`name` {name!r} is not a feature of this report"
        raise KeyError(msg)

    @property
    def measured_factors(self) -> dict[str, float]:
        """Measured DedupeFactor per feature at ``batch_size``."""
        return {f.name: f.measured_factor for f in self.features}

    @property
    def model_factors(self) -> dict[str, float]:
        """Model DedupeFactor per feature at ``batch_size``."""
        return {f.name: f.model_factor for f in self.features}

    @property
    def sparse_factor(self) -> float:
        """Measured DedupeFactor of all sparse features together (ids / ids stored)."""
        sparse = [f for f in self.features if f.kind != "dense"]
        stored = sum(f.unique_values for f in sparse)
        return sum(f.values for f in sparse) / stored if stored else 1.0

    @property
    def sparse_model_factor(self) -> float:
        """Model DedupeFactor of all sparse features together (ids / ids the model stores)."""
        sparse = [f for f in self.features if f.kind != "dense"]
        stored = sum(f.values / f.model_factor for f in sparse)
        return sum(f.values for f in sparse) / stored if stored else 1.0

    def dedup_toml(self) -> str:
        """The proposed groups and partial features as a schema ``[dedup]`` TOML snippet."""
        groups, partial = tuple(self.proposed_groups), tuple(self.proposed_partial)
        if self.schema is not None:
            return self.schema.with_dedup(groups, partial).dedup_toml()
        from schemas import DatasetSchema, SparseFeature

        names = [*(n for g in groups for n in g), *partial]
        stub = DatasetSchema("stats", (), tuple(SparseFeature(n, "user", 1) for n in names))
        return stub.with_dedup(groups, partial).dedup_toml()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary of the whole report."""
        sessions = asdict(self.sessions)
        sessions["histogram"] = [
            {"lo": lo, "hi": hi, "sessions": n, "samples": s}
            for lo, hi, n, s in self.sessions.histogram
        ]
        features = []
        for f in self.features:
            entry = asdict(f)
            entry["exact_pct"] = f.exact_pct
            entry["partial_pct"] = f.partial_pct
            entry["partial_factor"] = f.partial_factor
            entry["shifted_pct"] = f.shifted_pct
            features.append(entry)
        return {
            "dataset": str(self.dataset),
            "order": self.order,
            "files": self.files,
            "rows": self.rows,
            "batch_size": self.batch_size,
            "batches": self.batches,
            "samples_per_batch_session": self.samples_per_batch_session,
            "samples_per_session": sessions,
            "sparse_factor": self.sparse_factor,
            "sparse_model_factor": self.sparse_model_factor,
            "features": features,
            "proposed_features": list(self.proposed_features),
            "proposed_groups": [list(g) for g in self.proposed_groups],
            "proposed_partial": list(self.proposed_partial),
            "proposed_partial_factors": {
                n: self.feature(n).partial_factor for n in self.proposed_partial
            },
            "schema_groups": [list(g) for g in self.schema_groups],
            "schema_partial": self.schema_partial,
            "schema_groups_factor": self.groups_factor(self.schema_groups, self.schema_partial),
            "proposed_groups_factor": self.groups_factor(
                self.proposed_groups, self.proposed_partial
            ),
            "dedup_toml": self.dedup_toml(),
            "jaccard": self.jaccard,
            "factor_threshold": self.factor_threshold,
            "group_jaccard": self.group_jaccard,
            "elapsed_s": self.elapsed_s,
        }

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as indented JSON to ``path`` and return it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        return path

    def plot(self, out_dir: str | Path) -> list[Path]:
        """Write the PNG plots (see :mod:`etl.plots`) into ``out_dir``; return their paths.

        A report without rows has nothing to plot: it writes none and returns ``[]``.
        """
        from etl.plots import plot_report

        return plot_report(self, out_dir)

    def format_table(self) -> str:
        """The report as plain, aligned text for a terminal."""
        s = self.sessions
        if not self.rows:
            return (
                f"dataset  {self.dataset}  (order: {self.order or 'unknown'}, {self.files} files)\n"
                "samples  0 in 0 sessions: the dataset is empty; every figure is zero, the "
                "histogram, the feature table and the proposals are skipped"
            )
        lines = [
            f"dataset  {self.dataset}  (order: {self.order or 'unknown'}, {self.files} files)",
            f"samples  {self.rows:,} in {s.sessions:,} sessions; samples/session "
            f"mean {s.mean:.2f}  median {s.median:.1f}  p90 {s.p90:.1f}  p99 {s.p99:.1f}  "
            f"max {s.max:,}",
            f"batches  {self.batches:,} of B={self.batch_size:,} rows in file order; "
            f"S = {self.samples_per_batch_session:.2f} samples per session per batch",
            "",
            "samples per session (log2 bins)",
        ]
        peak = max((n for _, _, n, _ in s.histogram), default=1)
        for lo, hi, n, _ in s.histogram:
            bar = "#" * max(1, round(40 * n / peak)) if n else ""
            lines.append(f"  {lo:>7,}-{hi - 1:<7,} {n:>9,}  {bar}")
        lines.append("")
        header = (
            "feature",
            "kind",
            "avg_len",
            "bytes%",
            "exact%",
            "partial%",
            "d(f)",
            "model",
            "measured",
            "partial",
            "dedup",
        )
        rows = [header]
        for f in self.features:
            rows.append(
                (
                    f.name,
                    f.kind,
                    f"{f.avg_len:.2f}",
                    f"{100 * f.byte_share:.1f}",
                    f"{f.exact_pct:.1f}",
                    f"{f.partial_pct:.1f}" if f.kind != "dense" else "-",
                    f"{f.d:.3f}",
                    f"{f.model_factor:.2f}x",
                    f"{f.measured_factor:.2f}x",
                    f"{f.partial_factor:.2f}x" if f.kind != "dense" else "-",
                    "yes"
                    if f.name in self.proposed_features
                    else "partial"
                    if f.name in self.proposed_partial
                    else "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for i, r in enumerate(rows):
            cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))]
            lines.append("  ".join(cells))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(
            f"DedupeFactor at B={self.batch_size:,}: model = 1 / (1 - (S-1)/S * d(f)), "
            "measured = ids in batch / ids in its distinct rows, partial = ids in batch / ids "
            "a partial IKJT stores (a row that repeats or shifts by one id the row before it "
            "costs 0 or 1 id)"
        )
        lines.append(
            "in stats.json: "
            + ", ".join(f"{label} = {scale}{' / '.join(keys)}" for label, keys, scale in TABLE_KEYS)
        )
        lines.append(
            f"all sparse features together: measured {self.sparse_factor:.2f}x, "
            f"model {self.sparse_model_factor:.2f}x"
        )
        lines += self._groups_lines()
        if self.samples_per_batch_session < 2.0:
            lines.append(
                f"!! S = {self.samples_per_batch_session:.2f}: a batch holds about one sample per "
                "session, so deduplication cannot pay even where d(f) is high (all sparse "
                f"features: {self.sparse_factor:.2f}x). Cluster rows by session "
                "(`recpipe etl build`, order=session)."
            )
        if self.proposed_groups or self.proposed_partial:
            lines.append(
                f"proposed: {len(self.proposed_features)} features with measured factor > "
                f"{self.factor_threshold:g}x, in {len(self.proposed_groups)} groups "
                f"(changing together: Jaccard >= {self.group_jaccard:g})"
            )
            if self.proposed_partial:
                lines.append(
                    f"proposed partial: {len(self.proposed_partial)} "
                    f"feature{'s' if len(self.proposed_partial) != 1 else ''} in no group with "
                    f"partial factor > {self.factor_threshold:g}x ("
                    + ", ".join(
                        f"{n} {self.feature(n).partial_factor:.2f}x" for n in self.proposed_partial
                    )
                    + "): lists that shift, stored as windows (a partial IKJT)"
                )
            lines.append(self.dedup_toml().rstrip("\n"))
        else:
            lines.append(f"proposed: none (no measured factor > {self.factor_threshold:g}x)")
        return "\n".join(lines)

    def _groups_lines(self) -> list[str]:
        def named(groups: Sequence[Sequence[str]]) -> str:
            return (
                "[" + ", ".join("[" + ", ".join(g) + "]" for g in groups) + "]"
                if groups
                else "none"
            )

        def partial(names: Sequence[str]) -> str:
            return f" + partial [{', '.join(names)}]" if names else ""

        return [
            f"sparse DedupeFactor a reader gets at B={self.batch_size:,} (--batch-size):",
            f"  schema's groups  {named(self.schema_groups)}{partial(self.schema_partial)}: "
            f"{self.groups_factor(self.schema_groups, self.schema_partial):.2f}x",
            f"  proposed groups  {named(self.proposed_groups)}{partial(self.proposed_partial)}: "
            f"{self.groups_factor(self.proposed_groups, self.proposed_partial):.2f}x "
            "(`recpipe train --dedup-groups auto` reads with them, no rebuild)",
            f"  the 'all sparse features together' {self.sparse_factor:.2f}x above counts every "
            "sparse feature deduplicated on its own (each its own group, grouped or not), so it "
            "is an upper bound for groups alone: a group merges a row only when all its lists "
            "repeat, and a feature in no group is stored whole (a partial feature can beat it: "
            "a row that shifts by one id costs one id)",
        ]


def dedupe_factor_model(d: float, s: float) -> float:
    """RecD's DedupeFactor model ``l*B / (l*B*(1 - (S-1)/S * d))`` (``l*B`` cancels).

    Args:
        d: exact-duplicate fraction of the feature, in ``[0, 1]``.
        s: average samples per session in a batch, ``>= 1``.
    """
    stored = 1.0 - (s - 1.0) / s * d if s > 0 else 1.0
    return 1.0 / stored if stored > 0 else math.inf
