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
* **partial DedupeFactor** (sparse only): in the same batches of ``B`` rows in file order,
  ids in all rows / ids a partial IKJT stores (:func:`recpipe.kernels.partial_dedup`'s rule:
  a row equal to the row before it in the batch costs 0 ids, one that extends it by one id or
  slides it by one id costs 1, any other row its whole list), and the **shifted %**: the share
  of rows stored as such a one-id shift. A list that shifts on every sample (a recent-items
  history) has ``d(f) = 0`` and an IKJT factor of 1, yet a partial factor near its length.
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
repeat. Sparse features not proposed that way whose partial factor exceeds ``factor_threshold``
are proposed for a partial IKJT (``[dedup] partial``). The result is a schema ``[dedup]`` TOML
snippet.

On a time-ordered dataset ``S`` is close to 1, so the model and the measured factor of the
session-driven features collapse to ~1 even though ``d(f)`` is unchanged: clustering by session
is what lets deduplication pay.

This module computes the figures; the report they fill is
:class:`etl.stats_report.StatsReport`, and the command is :mod:`etl.stats_cli`.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from etl.stats_report import FeatureStats, SessionStats, StatsReport, dedupe_factor_model
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
]

FACTOR_THRESHOLD = 1.5
GROUP_JACCARD = 0.9
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


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

    from recpipe.progress import progress_bar

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
    steps = 3 + 2 * len(schema.feature_names) + len(schema.sparse_names) + 1
    bar = progress_bar(
        total=steps, desc="stats", unit="query", file=sys.stderr, disable=not progress
    )
    sessions, rows, batches, s_batch = _NO_SESSIONS, 0, 0, 0.0
    features, proposed, jaccard, groups = _no_features(schema), [], {}, []
    partial: list[str] = []
    group_unique: dict[str, int] = {}
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
            partial = [
                f.name
                for f in features
                if f.kind != "dense"
                and f.name not in proposed
                and f.partial_factor > factor_threshold
            ]
            group_unique = {
                "+".join(g): _group_unique_values(con, g, batch_size)
                for g in {*map(tuple, schema.dedup_groups), *groups}
                if len(g) > 1
            }
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
        group_unique_values=group_unique,
        proposed_partial=partial,
    )


def _group_unique_values(
    con: duckdb.DuckDBPyConnection, group: Sequence[str], batch_size: int
) -> int:
    """Ids a reader stores for a dedup group of several features, summed over the batches."""
    columns = [_ident(n) for n in group]
    fill = {
        "features": ", ".join(columns),
        "lengths": " + ".join(f"coalesce(len({c}), 0)" for c in columns),
    }
    return int(
        _fetch_one(con, "group_batch_unique.sql", fill, {"batch_size": batch_size})["unique_values"]
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
    """Two queries per feature (duplicates within sessions, distinct rows within batches) and
    a third per sparse feature (what a partial IKJT stores)."""
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
        packed = {"partial_values": 0, "shifted": 0}
        if kind != "dense":
            packed = _fetch_one(con, "sparse_partial.sql", q, {"batch_size": batch_size})
            bar.update(1)
        width = 4 if kind == "dense" else 8  # float32 / int64 bytes per value
        raw.append(
            {"name": name, "kind": kind, "bytes": width * dups["values"], **dups, **uniq, **packed}
        )

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
                partial_values=int(r["partial_values"]),
                shifted_rows=int(r["shifted"]),
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
