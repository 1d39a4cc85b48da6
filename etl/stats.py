"""``recpipe stats``: how much duplication a clustered dataset holds, and what to deduplicate.

Every number comes from DuckDB SQL over the dataset's Parquet files (the queries live in
``etl/sql/*.sql``, one per file). Samples are numbered in *file order* (files by name, rows in
file order), which is the order a reader streams them, so batches of ``B`` rows here are the
batches a trainer would see.

Per feature ``f`` the report holds:

* **exact-duplicate %**: of the samples that have a previous sample in their session (ordered
  by ``ts``, ties by file position), the share whose value equals the previous one. This is RecD's
  ``d(f)`` (as a fraction), so ``d(f) = exact% / 100``.
* **partial-duplicate %** (sparse only): of the same samples, the share that is not an exact
  duplicate but a *one-step shift* of the previous list ``p`` (length ``n``): ``p + [x]``
  (append), ``[x] + p`` (prepend), ``p[1:] + [x]`` (slide left, ``n >= 2``) or
  ``[x] + p[:-1]`` (slide right, ``n >= 2``), ``x`` any id. A partial IKJT stores such rows
  as a window into the previous row's values.
* **average length** (ids per sample; 1 for dense) and **byte share**: the feature's logical
  bytes (8 per id for sparse, 4 per value for dense) over all features' logical bytes; the
  compressed Parquet bytes per column are reported too.
* **DedupeFactor, model** (RecD): ``l*B / (l*B*(1 - (S-1)/S * d))`` where ``S`` is the average
  number of samples a session contributes to a batch of ``B`` rows in file order.
* **DedupeFactor, measured**: in real batches of ``B`` rows in file order, ids in all rows
  / ids in the distinct rows of each batch (dense: rows / distinct values per batch). The same
  ratio over all sparse features together is :attr:`StatsReport.sparse_factor`. Note that a
  low-cardinality feature (a few hundred categories) repeats across sessions too, so its
  measured factor can far exceed the model's.

Proposals: sparse features whose measured factor exceeds ``factor_threshold`` (1.5) are worth
deduplicating (dense features are reported too, but a ``[dedup]`` group holds sparse features
only: dense values travel as one small ``[B, F]`` tensor). Among them, features that change on
the same samples (Jaccard similarity of their change-sample sets >= ``group_jaccard``, 0.9) are
grouped greedily in schema order, since one IKJT's rows are merged only when all of its lists
repeat. The result is a schema ``[dedup]`` TOML snippet.

On a time-ordered dataset ``S`` is close to 1, so the model and the measured factor of the
session-driven features collapse to ~1 even though ``d(f)`` is unchanged: clustering by session
is what lets deduplication pay.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from recpipe.errors import CorruptInputError, DataError

if TYPE_CHECKING:
    import duckdb
    import numpy as np

    from schemas import DatasetSchema

__all__ = [
    "FeatureStats",
    "SessionStats",
    "StatsReport",
    "compute_stats",
    "dataset_files",
    "dedupe_factor_model",
    "register_cli",
]

FACTOR_THRESHOLD = 1.5
GROUP_JACCARD = 0.9
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


# --------------------------------------------------------------------------------------------
# Report types
# --------------------------------------------------------------------------------------------


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
        jaccard: pairwise Jaccard similarity of the proposed features' change-sample sets.
        factor_threshold, group_jaccard: the thresholds used for the proposals.
        elapsed_s: wall time of the statistics.
        schema: the dataset schema the report was computed with.
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
        """The proposed groups as a schema ``[dedup]`` TOML snippet."""
        if self.schema is not None:
            return self.schema.with_dedup(tuple(self.proposed_groups)).dedup_toml()
        from schemas import DatasetSchema, SparseFeature

        names = [n for g in self.proposed_groups for n in g]
        stub = DatasetSchema("stats", (), tuple(SparseFeature(n, "user", 1) for n in names))
        return stub.with_dedup(tuple(self.proposed_groups)).dedup_toml()

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
                    "yes" if f.name in self.proposed_features else "-",
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
            "measured = ids in batch / ids in its distinct rows"
        )
        lines.append(
            f"all sparse features together: measured {self.sparse_factor:.2f}x, "
            f"model {self.sparse_model_factor:.2f}x"
        )
        if self.samples_per_batch_session < 2.0:
            lines.append(
                f"!! S = {self.samples_per_batch_session:.2f}: a batch holds about one sample per "
                "session, so deduplication cannot pay even where d(f) is high (all sparse "
                f"features: {self.sparse_factor:.2f}x). Cluster rows by session "
                "(`recpipe etl build`, order=session)."
            )
        if self.proposed_groups:
            lines.append(
                f"proposed: {len(self.proposed_features)} features with measured factor > "
                f"{self.factor_threshold:g}x, in {len(self.proposed_groups)} groups "
                f"(changing together: Jaccard >= {self.group_jaccard:g})"
            )
            lines.append(self.dedup_toml().rstrip("\n"))
        else:
            lines.append(f"proposed: none (no measured factor > {self.factor_threshold:g}x)")
        return "\n".join(lines)


def dedupe_factor_model(d: float, s: float) -> float:
    """RecD's DedupeFactor model ``l*B / (l*B*(1 - (S-1)/S * d))`` (``l*B`` cancels).

    Args:
        d: exact-duplicate fraction of the feature, in ``[0, 1]``.
        s: average samples per session in a batch, ``>= 1``.
    """
    stored = 1.0 - (s - 1.0) / s * d if s > 0 else 1.0
    return 1.0 / stored if stored > 0 else math.inf


# --------------------------------------------------------------------------------------------
# Computation
# --------------------------------------------------------------------------------------------


def dataset_files(dataset_dir: str | Path, *, allow_empty: bool = False) -> list[Path]:
    """The dataset's ``part-*.parquet`` files (Hive partitions included) in file order.

    Args:
        dataset_dir: the dataset directory.
        allow_empty: return ``[]`` for a directory without Parquet parts (a build that kept
            no rows writes none) instead of raising.

    Raises:
        DataError: ``dataset_dir`` is not a directory or holds no Parquet part.
    """
    root = Path(dataset_dir)
    if not root.is_dir():
        msg = f"`dataset_dir` {str(root)!r} is not a directory"
        raise DataError(msg)
    files = sorted(
        p.resolve()
        for p in root.rglob("part-*.parquet")
        if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
    )
    if not files and not allow_empty:
        msg = (
            f"`dataset_dir` {str(root)!r} holds no part-*.parquet files\n"
            "hint: build one with `recpipe etl build`"
        )
        raise DataError(msg)
    return files


def compute_stats(
    dataset_dir: str | Path,
    *,
    schema: DatasetSchema | None = None,
    batch_size: int = 4096,
    threads: int | None = None,
    factor_threshold: float = FACTOR_THRESHOLD,
    group_jaccard: float = GROUP_JACCARD,
    progress: bool = False,
) -> StatsReport:
    """Measure the duplication of a clustered dataset and propose dedup groups.

    Args:
        dataset_dir: a clustered dataset (the output of ``etl build``).
        schema: its schema; ``None`` reads it from the dataset's ``_manifest.json``.
        batch_size: ``B``, the batch size of the DedupeFactor (model and measured).
        threads: DuckDB threads (``None``: DuckDB's default, all cores).
        factor_threshold: propose features whose measured factor exceeds this.
        group_jaccard: group proposed features whose change-sample sets have at least this
            Jaccard similarity.
        progress: show a progress bar on stderr.

    Returns:
        The :class:`StatsReport`. A valid empty dataset (a build that kept no rows, or Parquet
        parts without rows) gives a report of zeros: no sessions, no batches, ``S`` 0, every
        feature without values or duplicates and with factors 1, nothing proposed.

    Raises:
        DataError: the dataset is missing, holds no Parquet part without a manifest saying the
            build kept no rows, or lacks a column of the schema.
        CorruptInputError: a dataset file is not readable Parquet.
        SchemaError: the manifest's schema is invalid.
    """
    import duckdb
    from tqdm import tqdm

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        msg = f"`batch_size` must be a positive integer, got {batch_size!r}"
        raise DataError(msg)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        msg = f"`threads` must be a positive integer or None, got {threads!r}"
        raise DataError(msg)
    if not factor_threshold >= 1.0:
        msg = f"`factor_threshold` must be >= 1.0, got {factor_threshold!r}"
        raise DataError(msg)
    if not 0.0 < group_jaccard <= 1.0:
        msg = f"`group_jaccard` must be in (0, 1], got {group_jaccard!r}"
        raise DataError(msg)

    start = time.perf_counter()
    root = Path(dataset_dir)
    manifest = _read_manifest(root)
    files = dataset_files(root, allow_empty=_built_empty(manifest))
    if schema is None:
        schema = _schema_from_manifest(root, manifest)

    config: dict[str, Any] = {"preserve_insertion_order": False}
    if threads is not None:
        config["threads"] = threads
    con = duckdb.connect(config=config)
    steps = 3 + 2 * len(schema.feature_names) + 1
    bar = tqdm(total=steps, desc="stats", unit="query", file=sys.stderr, disable=not progress)
    sessions, rows, batches, s_batch = _NO_SESSIONS, 0, 0, 0.0
    features, proposed, jaccard, groups = _no_features(schema), [], {}, []
    keys = {"session": _ident(schema.session_key), "time": _ident(schema.time_key)}
    try:
        if files:  # else an empty build: every figure stays zero
            con.execute("SET VARIABLE recpipe_files = $files", {"files": [str(p) for p in files]})
            _run(con, "files.sql")
            _run(con, "samples.sql")
            _check_columns(con, files, schema)
            sessions, rows = _session_stats(con, keys)
        bar.update(2)
        if rows:
            pairs = _fetch_one(con, "batch_sessions.sql", keys, {"batch_size": batch_size})
            batches, s_batch = int(pairs["batches"]), rows / int(pairs["batch_sessions"])
            bar.update(1)
            features = _feature_stats(con, schema, keys, batch_size, s_batch, bar)
            proposed = [
                f.name
                for f in features
                if f.kind != "dense" and f.measured_factor > factor_threshold
            ]
            changes = {name: _change_rows(con, keys, name, rows) for name in proposed}
            jaccard = _jaccard_matrix(changes)
            groups = _greedy_groups(proposed, jaccard, group_jaccard)
            bar.update(1)
    except (duckdb.InvalidInputException, duckdb.IOException) as exc:
        reason = str(exc).splitlines()[0]
        msg = f"`dataset_dir` {str(root)!r}: a dataset file cannot be read as Parquet: {reason}"
        raise CorruptInputError(msg) from None
    finally:
        bar.close()
        con.close()

    return StatsReport(
        dataset=root,
        order=manifest.get("order") if manifest else None,
        files=len(files),
        rows=rows,
        batch_size=batch_size,
        batches=batches,
        samples_per_batch_session=s_batch,
        sessions=sessions,
        features=features,
        proposed_features=proposed,
        proposed_groups=groups,
        jaccard=jaccard,
        factor_threshold=factor_threshold,
        group_jaccard=group_jaccard,
        elapsed_s=time.perf_counter() - start,
        schema=schema,
    )


def _built_empty(manifest: dict[str, Any] | None) -> bool:
    """The manifest is of a build that kept no rows (and so wrote no part file)."""
    return bool(manifest) and manifest.get("rows_out") == 0 and manifest.get("files") == []


#: the samples-per-session statistics of a dataset without rows
_NO_SESSIONS = SessionStats(sessions=0, mean=0.0, median=0.0, p90=0.0, p99=0.0, max=0, histogram=())


def _no_features(schema: DatasetSchema) -> list[FeatureStats]:
    """Every feature's statistics on no rows: zero counts, no duplicates, factors 1."""
    kinds = {f.name: "dense" for f in schema.dense} | {f.name: f.kind for f in schema.sparse}
    zeros = dict.fromkeys(
        (
            "rows",
            "rows_with_prev",
            "exact_duplicates",
            "partial_duplicates",
            "values",
            "unique_values",
            "logical_bytes",
            "parquet_bytes",
        ),
        0,
    )
    return [
        FeatureStats(
            name=name,
            kind=kind,
            **zeros,
            avg_len=0.0,
            byte_share=0.0,
            d=0.0,
            model_factor=1.0,
            measured_factor=1.0,
        )
        for name, kind in kinds.items()
    ]


def _session_stats(
    con: duckdb.DuckDBPyConnection, keys: dict[str, str]
) -> tuple[SessionStats, int]:
    """Samples-per-session summary and log2 histogram; also returns the row count."""
    summary = _fetch_one(con, "session_summary.sql", keys)
    rows = int(summary["rows"])
    if rows == 0:
        return _NO_SESSIONS, 0
    histogram = tuple(
        (2**b, 2 ** (b + 1), int(n), int(s))
        for b, n, s in _run(con, "session_histogram.sql", keys).fetchall()
    )
    stats = SessionStats(
        sessions=int(summary["sessions"]),
        mean=float(summary["mean"]),
        median=float(summary["median"]),
        p90=float(summary["p90"]),
        p99=float(summary["p99"]),
        max=int(summary["max"]),
        histogram=histogram,
    )
    return stats, rows


def _feature_stats(
    con: duckdb.DuckDBPyConnection,
    schema: DatasetSchema,
    keys: dict[str, str],
    batch_size: int,
    s_batch: float,
    bar: Any,
) -> list[FeatureStats]:
    """Two queries per feature: duplicates within sessions, distinct rows within batches."""
    kinds = {f.name: "dense" for f in schema.dense} | {f.name: f.kind for f in schema.sparse}
    parquet_bytes = {col: int(c) for col, c, _ in _run(con, "column_bytes.sql").fetchall()}
    raw = []
    for name, kind in kinds.items():
        bar.set_postfix_str(name)
        prefix = "dense" if kind == "dense" else "sparse"
        q = {**keys, "feature": _ident(name)}
        dups = _fetch_one(con, f"{prefix}_duplicates.sql", q)
        bar.update(1)
        uniq = _fetch_one(con, f"{prefix}_batch_unique.sql", q, {"batch_size": batch_size})
        bar.update(1)
        width = 4 if kind == "dense" else 8  # float32 / int64 bytes per value
        raw.append({"name": name, "kind": kind, "bytes": width * dups["values"], **dups, **uniq})

    total_bytes = sum(r["bytes"] for r in raw) or 1
    features = []
    for r in raw:
        d = r["exact"] / r["rows_with_prev"] if r["rows_with_prev"] else 0.0
        features.append(
            FeatureStats(
                name=r["name"],
                kind=r["kind"],
                rows=int(r["rows"]),
                rows_with_prev=int(r["rows_with_prev"]),
                exact_duplicates=int(r["exact"]),
                partial_duplicates=int(r["partial"]),
                values=int(r["values"]),
                unique_values=int(r["unique_values"]),
                avg_len=r["values"] / r["rows"] if r["rows"] else 0.0,
                logical_bytes=int(r["bytes"]),
                byte_share=r["bytes"] / total_bytes,
                parquet_bytes=parquet_bytes.get(r["name"], 0),
                d=d,
                model_factor=dedupe_factor_model(d, s_batch),
                measured_factor=r["values"] / r["unique_values"] if r["unique_values"] else 1.0,
            )
        )
    return features


def _change_rows(
    con: duckdb.DuckDBPyConnection, keys: dict[str, str], name: str, rows: int
) -> np.ndarray:
    """Boolean [rows] vector: the sample's value of ``name`` differs from its predecessor's."""
    import numpy as np

    changed = np.zeros(rows, dtype=np.bool_)
    q = {**keys, "feature": _ident(name)}
    positions = _run(con, "change_rows.sql", q).fetchnumpy()["_row"]
    changed[np.asarray(positions, dtype=np.int64)] = True
    return changed


def _jaccard_matrix(changes: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Pairwise Jaccard similarity of boolean change vectors (two empty sets: 1.0)."""
    names = list(changes)
    out: dict[str, dict[str, float]] = {a: {} for a in names}
    for i, a in enumerate(names):
        for b in names[i:]:
            inter = int((changes[a] & changes[b]).sum())
            union = int((changes[a] | changes[b]).sum())
            out[a][b] = out[b][a] = inter / union if union else 1.0
    return out


def _greedy_groups(
    names: Sequence[str], jaccard: dict[str, dict[str, float]], threshold: float
) -> list[tuple[str, ...]]:
    """Group ``names`` in order: a feature joins the first group it matches with every member."""
    groups: list[list[str]] = []
    for name in names:
        for group in groups:
            if all(jaccard[name][other] >= threshold for other in group):
                group.append(name)
                break
        else:
            groups.append([name])
    return [tuple(g) for g in groups]


def _sql(name: str, identifiers: dict[str, str] | None = None) -> str:
    """Load ``etl/sql/<name>`` and fill its ``{placeholder}`` identifiers (already quoted)."""
    text = resources.files("etl").joinpath("sql", name).read_text(encoding="utf-8")
    identifiers = identifiers or {}

    def fill(match: re.Match[str]) -> str:
        return identifiers[match.group(1)]

    return _PLACEHOLDER.sub(fill, text)


def _run(
    con: duckdb.DuckDBPyConnection,
    name: str,
    identifiers: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
) -> duckdb.DuckDBPyConnection:
    return con.execute(_sql(name, identifiers), params or {})


def _fetch_one(
    con: duckdb.DuckDBPyConnection,
    name: str,
    identifiers: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    cursor = _run(con, name, identifiers, params)
    row = cursor.fetchone()
    return dict(zip([c[0] for c in cursor.description], row))


def _ident(name: str) -> str:
    """Quote ``name`` as a DuckDB identifier (column names cannot be bound as parameters)."""
    return '"' + name.replace('"', '""') + '"'


_NUMERIC_TYPES = frozenset(
    [
        "TINYINT",
        "SMALLINT",
        "INTEGER",
        "BIGINT",
        "HUGEINT",
        "UTINYINT",
        "USMALLINT",
        "UINTEGER",
        "UBIGINT",
        "FLOAT",
        "DOUBLE",
    ]
)


def _check_columns(
    con: duckdb.DuckDBPyConnection, files: list[Path], schema: DatasetSchema
) -> None:
    columns = {row[0]: row[1] for row in con.execute("DESCRIBE samples").fetchall()}
    needed = [schema.session_key, schema.time_key, *schema.dense_names, *schema.sparse_names]
    missing = [c for c in needed if c not in columns]
    if missing:
        msg = (
            f"dataset file {str(files[0])!r} lacks column(s) {', '.join(map(repr, missing))} of "
            f"schema {schema.name!r}\nhint: pass the schema the dataset was built with (`--schema`)"
        )
        raise DataError(msg)
    wrong = [
        f"{name!r} is {columns[name]}, expected {expected}"
        for names, ok, expected in (
            (schema.sparse_names, lambda t: t.endswith("[]"), "a list"),
            (schema.dense_names, lambda t: t in _NUMERIC_TYPES, "a number"),
        )
        for name in names
        if not ok(columns[name])
    ]
    if wrong:
        msg = f"dataset file {str(files[0])!r}: column {'; '.join(wrong)} (schema {schema.name!r})"
        raise DataError(msg)


def _read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / "_manifest.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        msg = f"manifest {str(path)!r} is not valid JSON: {exc}"
        raise DataError(msg) from exc


def _schema_from_manifest(root: Path, manifest: dict[str, Any] | None) -> DatasetSchema:
    from schemas import parse_schema

    text = (manifest or {}).get("schema")
    if not isinstance(text, str) or not text.strip():
        msg = (
            f"`dataset_dir` {str(root)!r} has no `_manifest.json` with a `schema`\n"
            "hint: pass the dataset's schema (`--schema PATH`)"
        )
        raise DataError(msg)
    return parse_schema(text, source=f"{root / '_manifest.json'} [schema]")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe stats``."""
    parser = subparsers.add_parser(
        "stats",
        help="DuckDB duplication statistics and dedup proposals",
        description=(
            "Measure how much duplication a clustered dataset holds, with DuckDB SQL over its "
            "Parquet files: samples per session; per feature the exact- and partial-duplicate %, "
            "average length, byte share, d(f), and RecD's DedupeFactor model next to the factor "
            "measured in real batches of --batch-size rows in file order. Proposes the sparse "
            "features to deduplicate (measured factor > 1.5) and groups of features that change "
            "together, as a schema [dedup] snippet. Writes stats.json and PNG plots to --out. "
            "First, every part file's size and sha256 are compared with the manifest (DuckDB "
            "does not check Parquet page checksums, so a corrupt page would skew the figures "
            "silently); `recpipe etl verify` also checks every page."
        ),
    )
    parser.add_argument("dataset", type=Path, help="clustered dataset directory (etl build output)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for stats.json and the plots (default: DATASET/_stats); not the "
        "dataset, nor a folder in it unless its name starts with `_` or `.`",
    )
    parser.add_argument(
        "--schema", default=None, help="schema TOML (default: the one in DATASET/_manifest.json)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="batch size B of the dedup factors (4096)"
    )
    parser.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: all)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the check of every part file's size and sha256 against the manifest (DuckDB "
        "does not check Parquet page checksums, so without it a corrupt page can skew the "
        "figures silently; `recpipe etl verify` also checks every page)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report instead of the table"
    )
    parser.set_defaults(func=_main)


def _verify_digests(dataset: Path) -> None:
    """Sizes and sha256 of the part files against the manifest, before DuckDB reads them."""
    from etl.verify import verify_digests

    if not dataset.is_dir():
        return  # compute_stats says what is wrong
    report = verify_digests(dataset, progress=sys.stderr.isatty())
    if report is None:
        print(
            f"stats: {dataset} not verified: its manifest records no sha256 digests (or it has "
            "no manifest); a corrupt page would go unnoticed",
            file=sys.stderr,
        )
        return
    report.raise_if_failed(hint=f"`recpipe etl verify {dataset}` checks every page too")


def _main(args: argparse.Namespace) -> int:
    from etl.paths import check_output

    out = args.out if args.out is not None else Path(args.dataset) / "_stats"
    check_output(out, kind="stats", inputs=[args.dataset, args.schema])
    if not args.no_verify:
        _verify_digests(args.dataset)
    schema = None
    if args.schema is not None:
        from schemas import load_schema

        schema = load_schema(args.schema)
    if args.batch_size < 1:
        msg = f"`--batch-size` must be a positive integer, got {args.batch_size!r}"
        raise DataError(msg)
    report = compute_stats(
        args.dataset,
        schema=schema,
        batch_size=args.batch_size,
        threads=args.threads,
        progress=sys.stderr.isatty(),
    )
    written = [report.write_json(out / "stats.json")]
    if not args.no_plots:
        written += report.plot(out)
        if not report.rows:
            print("stats: no plots: the dataset holds no rows", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format_table())
        print()
    print(
        f"stats: {report.rows:,} samples, {len(report.features)} features, "
        f"{report.elapsed_s:.1f}s; wrote {', '.join(str(p) for p in written)}",
        file=sys.stderr,
    )
    return 0
