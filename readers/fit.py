"""``recpipe fit``: fitted preprocessing (vocabularies, mean/std, quantile buckets) in DuckDB.

The statistics are DuckDB aggregates over the dataset's Parquet files, restricted to the
training rows (the sessions the holdout of ``--eval-fraction``/``--seed`` leaves for training,
selected in the query by the same session hash as :mod:`readers.holdout`), so nothing is loaded
whole into memory and nothing of the held-out data leaks into the model's inputs. What each
``fit`` entry computes is in :mod:`readers.fitted`; the result is written to ``--out``, or by
default beside the dataset's manifest as ``_preprocess_fitted.json``, where every reader of the
dataset finds it.

A fitted entry is fitted on the values it will see. Where no earlier entry names its feature,
those are the stored column, aggregated in SQL. Where earlier entries do (a ``HashModulo``
before a ``VocabLookup``, a ``Log1p`` before a ``Normalize``, or an earlier fitted entry), the
training rows are read through the readers (:func:`readers.dataset.iter_batches`, training
part of the holdout, no dedup) and those earlier entries, as a pipeline, rewrite them exactly as
they will in training; the feature's values are then appended to a DuckDB table and aggregated
by the same SQL. Entries are fitted in config order, so a fitted entry after another is fitted
on the values the first one's fitted parameters give.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from readers.fitted import (
    FITTED_VERSION,
    dataset_digest,
    fill_fitted,
    fit_entries,
    fit_options,
    fitted_path,
    fitted_signature,
)
from readers.holdout import holdout_splits, session_hashes
from readers.pipeline import load_preprocess_entries
from readers.source import DatasetSource, discover_files
from recpipe.errors import DataError, SchemaError
from recpipe.paths import check_output

if TYPE_CHECKING:
    import duckdb

    from readers.pipeline import Pipeline
    from schemas import DatasetSchema

__all__ = ["fit_preprocess", "register_cli"]


def fit_preprocess(
    dataset: str | os.PathLike[str],
    preprocess: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
    *,
    schema: DatasetSchema | None = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
    threads: int | None = None,
    write: bool = True,
    out: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Fit the ``fit`` entries of a preprocessing config on a dataset's training rows.

    Args:
        dataset: the clustered dataset directory.
        preprocess: the config (a TOML file with ``[[preprocess]]`` tables, or the entries).
        schema: the dataset's schema (default: its manifest's).
        eval_fraction, seed: the holdout whose training part is fitted on (as ``recpipe
            train``'s options of the same names; 0 fits on every row).
        threads: DuckDB threads (default: DuckDB's).
        write: write the state (to ``out``).
        out: the file to write (``None``: ``DATASET/_preprocess_fitted.json``). Given, nothing
            is written into the dataset: a read-only dataset can be fitted.

    Returns:
        The fitted state (what is written).

    Raises:
        SchemaError: a bad ``fit`` entry, or a fitted feature of the wrong kind.
        DataError: the dataset cannot be read, or a config has no ``fit`` entry.
    """
    import duckdb

    from readers.dataset import dataset_schema

    start = time.perf_counter()
    root = Path(dataset)
    if not root.is_dir():
        msg = f"`dataset` {os.fspath(dataset)!r} is not a dataset directory"
        raise DataError(msg)
    target = fitted_path(root) if out is None else Path(out)
    if write:  # refuse an output that cannot be written, or would replace an input, before work
        config = [preprocess] if isinstance(preprocess, str | os.PathLike) else []
        if out is None:  # into the dataset: the check of a read-only one
            check_output(target, kind="file", arg="dataset", inputs=config)
        else:
            inputs = [*config, root / "_manifest.json", *discover_files(root)]
            check_output(target, kind="file", arg="--out", inputs=inputs)
    schema = schema or dataset_schema(root)
    origin = f"{os.fspath(preprocess)} " if isinstance(preprocess, str | os.PathLike) else ""
    entries = (
        load_preprocess_entries(preprocess)
        if isinstance(preprocess, str | os.PathLike)
        else list(preprocess)
    )
    fitted = fit_entries(entries)
    if not fitted:
        msg = f"{origin.strip() or '`preprocess`'}: no [[preprocess]] entry has a `fit` key: nothing to fit"
        raise DataError(msg)
    source = DatasetSource(root, schema=schema)
    train, held = holdout_splits(
        source.splits, session_key=schema.session_key, fraction=eval_fraction, seed=seed
    )
    threshold = train[0].keep.threshold if held else None
    con = duckdb.connect(config={} if threads is None else {"threads": threads})
    try:
        # Parquet writers leave NaN out of a float column's min/max; from those statistics
        # DuckDB concludes that the column holds no NaN and folds `isnan(x)` to false, so a
        # missing value would reach the sums (a NaN mean) and the quantiles
        con.execute("SET disabled_optimizers = 'statistics_propagation'")
        _train_view(con, discover_files(root), schema, threshold=threshold, seed=seed)
        steps: list[dict[str, Any]] = []
        for i, entry in fitted:
            where = f"{origin}[[preprocess]] #{i + 1}"
            options = fit_options(entry, where=where)
            features = _entry_features(entry, schema, where=where)
            before = _steps_before(entries, i, features, steps, schema=schema, origin=origin)
            fed = [] if before is None else [f for f in features if f in _named(before)]
            queries = _fed_values(
                con, root, fed, before, schema=schema, eval_fraction=eval_fraction, seed=seed
            ) if fed and before is not None else {}  # fmt: skip
            per = {
                f: _fit_one(
                    con, entry["transform"], f, queries.get(f) or _values(f, schema), options
                )
                for f in features
            }
            for j in range(len(fed)):
                con.execute(f"DROP TABLE recpipe_fed_{j}")
            steps.append({"transform": entry["transform"], "features": per})
        rows = int(con.execute("SELECT count(*) FROM train").fetchone()[0])
    finally:
        con.close()
    state = {
        "version": FITTED_VERSION,
        "config_digest": fitted_signature(entries),
        "dataset_digest": dataset_digest(root),
        "config": origin.strip() or None,
        "dataset": os.fspath(root),
        "eval_fraction": eval_fraction,
        "seed": seed,
        "train_rows": rows,
        "held_out_rows": sum(s.num_rows for s in held),
        "steps": steps,
        "elapsed_s": time.perf_counter() - start,
    }
    if write:
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    return state


def _named(pipeline: Pipeline) -> set[str]:
    return {name for step in pipeline.transforms for name in step.features}


def _steps_before(
    entries: Sequence[Mapping[str, Any]],
    index: int,
    features: Sequence[str],
    fitted: Sequence[Mapping[str, Any]],
    *,
    schema: DatasetSchema,
    origin: str,
) -> Pipeline | None:
    """The pipeline of the entries before ``entries[index]`` that name one of ``features``
    (earlier fitted entries filled from ``fitted``, the steps fitted so far); ``None``: none."""
    from readers.pipeline import Pipeline, transform_from_config

    labels = [f"{origin}[[preprocess]] #{i + 1}" for i in range(index)]
    filled, where = fill_fitted(entries[:index], fitted, labels)
    names = set(features)
    kept = [(e, w) for e, w in zip(filled, where) if names & set(_listed(e.get("features")))]
    if not kept:
        return None
    steps = [transform_from_config(e, where=w) for e, w in kept]
    return Pipeline(steps, schema=schema, where=[w for _, w in kept])


def _listed(features: Any) -> list[str]:
    return [features] if isinstance(features, str) else list(features or ())


_FED_ROWS = 65_536  # rows per batch read while feeding a step's inputs to DuckDB


def _fed_values(
    con: duckdb.DuckDBPyConnection,
    root: Path,
    features: Sequence[str],
    before: Pipeline,
    *,
    schema: DatasetSchema,
    eval_fraction: float,
    seed: int,
) -> dict[str, str]:
    """Append each feature's values, as ``before`` hands them on, over the training rows (one
    read of them) to a DuckDB table ``recpipe_fed_J``; per feature, a query of them (``v``, as
    :func:`_values`)."""
    import pyarrow as pa
    import torch

    from readers.dataset import iter_batches
    from readers.holdout import Holdout
    from readers.source import ReaderConfig

    dense = {n: i for i, n in enumerate(schema.dense_names)}
    for j, f in enumerate(features):
        kind = "DOUBLE" if f in dense else "BIGINT"
        con.execute(f"CREATE OR REPLACE TEMP TABLE recpipe_fed_{j} (v {kind})")
    batches = iter_batches(
        root, schema=schema, config=ReaderConfig(batch_size=_FED_ROWS), transforms=before,
        dedup=False, holdout=Holdout(eval_fraction, seed=seed, part="train"),
    )  # fmt: skip
    for batch in batches:
        jagged = batch.kjt.to_dict()
        for j, f in enumerate(features):
            if f in dense:
                values = batch.dense[:, dense[f]].numpy().astype(np.float64)
                values = values[~np.isnan(values)]
            else:
                values = jagged[f].values().to(torch.int64).numpy()
            con.register("recpipe_chunk", pa.table({"v": values}))
            try:
                con.execute(f"INSERT INTO recpipe_fed_{j} SELECT v FROM recpipe_chunk")
            finally:
                con.unregister("recpipe_chunk")
    return {f: f"SELECT v FROM recpipe_fed_{j}" for j, f in enumerate(features)}


def _entry_features(entry: Mapping[str, Any], schema: DatasetSchema, *, where: str) -> list[str]:
    features = entry.get("features") or []
    features = [features] if isinstance(features, str) else list(features)
    dense, sparse = set(schema.dense_names), set(schema.sparse_names)
    for name in features:
        if name not in dense and name not in sparse:
            msg = f"{where}: `features` names {name!r}, not a feature of the schema"
            raise SchemaError(msg)
        if entry["transform"] == "VocabLookup" and name not in sparse:
            raise SchemaError(f"{where}: VocabLookup fits sparse features, {name!r} is dense")
        if entry["transform"] == "Normalize" and name not in dense:
            raise SchemaError(f"{where}: Normalize fits dense features, {name!r} is sparse")
    if not features:
        raise SchemaError(f"{where}: `features` must be a non-empty list of feature names")
    return features


def _train_view(
    con: duckdb.DuckDBPyConnection,
    files: Sequence[Path],
    schema: DatasetSchema,
    *,
    threshold: int | None,
    seed: int,
) -> None:
    """``train``: the dataset's rows the holdout leaves for training."""
    from duckdb import sqltypes

    def holdout_hash(ids: Any) -> Any:
        import pyarrow as pa

        return pa.array(session_hashes(np.asarray(ids.to_numpy(zero_copy_only=False)), seed=seed))

    con.create_function(
        "recpipe_holdout_hash", holdout_hash, [sqltypes.BIGINT], sqltypes.UBIGINT, type="arrow"
    )
    con.execute("SET VARIABLE recpipe_files = $files", {"files": [os.fspath(p) for p in files]})
    where = ""
    if threshold is not None:  # the threshold is our integer, written into the query
        where = (
            f"WHERE recpipe_holdout_hash({_ident(schema.session_key)}) >= {int(threshold)}::UBIGINT"
        )
    con.execute(
        "CREATE OR REPLACE TEMP VIEW train AS SELECT * FROM "
        f"read_parquet(getvariable('recpipe_files'), hive_partitioning = false) {where}"
    )


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _values(feature: str, schema: DatasetSchema) -> str:
    """A query of the feature's values over the training rows: ``v`` (DOUBLE or BIGINT)."""
    col = _ident(feature)
    if feature in schema.sparse_names:
        return f"SELECT unnest({col}) AS v FROM train"
    return (
        f"SELECT CAST({col} AS DOUBLE) AS v FROM train WHERE {col} IS NOT NULL AND NOT isnan({col})"
    )


def _fit_one(
    con: duckdb.DuckDBPyConnection,
    transform: str,
    feature: str,
    values: str,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """The fitted parameters of one feature from ``values``, a query of its values ``v``."""
    if transform == "VocabLookup":
        limit = "" if options["max_size"] is None else f"LIMIT {int(options['max_size'])}"
        rows = con.execute(
            f"SELECT v, count(*) AS n FROM ({values}) WHERE v IS NOT NULL GROUP BY v "
            f"HAVING count(*) >= {int(options['min_count'])} ORDER BY n DESC, v ASC {limit}"
        ).fetchall()
        return {"vocab": [int(v) for v, _ in rows]}
    if transform == "Normalize":
        # floating-point sums depend on their order: one thread sums in file order, so the
        # fitted figures are the same on every run
        threads = con.execute("SELECT current_setting('threads')").fetchone()[0]
        con.execute("SET threads = 1")
        try:
            total, n = con.execute(f"SELECT fsum(v), count(v) FROM ({values})").fetchone()
            if not n:
                msg = f"Normalize: feature {feature!r} has no value in the training rows to fit on"
                raise DataError(msg)
            mean = float(total) / n
            deviation = f"(v - {mean!r}) * (v - {mean!r})"
            (squares,) = con.execute(f"SELECT fsum({deviation}) FROM ({values})").fetchone()
        finally:
            con.execute(f"SET threads = {int(threads)}")
        std = math.sqrt(float(squares) / n)
        std = std if std > 0 and math.isfinite(std) else 1.0
        return {"mean": float(mean), "std": std}
    n = int(options["num_buckets"])
    qs = [i / n for i in range(1, n)]
    (bounds,) = con.execute(
        f"SELECT quantile_cont(CAST(v AS DOUBLE), {qs!r}) FROM ({values}) WHERE v IS NOT NULL"
    ).fetchone()
    if bounds is None:
        msg = f"Bucketize: feature {feature!r} has no value in the training rows to fit on"
        raise DataError(msg)
    return {"boundaries": sorted({float(b) for b in bounds})}


# -------------------------------------------------------------------------------------------
# the command


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe fit`` to the top-level parser."""
    parser = subparsers.add_parser(
        "fit",
        help="fit preprocessing (vocabularies, mean/std, quantile buckets) on the training rows",
        description=(
            "Compute, in DuckDB over the dataset's training rows (the sessions not held out by "
            "--eval-fraction and --seed, as `recpipe train` holds them out), what the `fit` "
            "entries of a preprocessing config ask for: VocabLookup vocabularies, Normalize "
            "mean/std, Bucketize quantile boundaries, each on the values it will see (after the "
            "config's earlier entries on the same feature). Writes --out, or by default "
            "DATASET/_preprocess_fitted.json, which every reader of the dataset then uses with "
            "that config (give readers another file with their --fitted). The file records a "
            "digest of the dataset and of the config; readers refuse it for any other."
        ),
    )
    parser.add_argument("dataset", type=Path, help="clustered dataset directory")
    parser.add_argument(
        "--preprocess", required=True, metavar="FILE", help="preprocessing config (TOML)"
    )
    parser.add_argument(
        "--eval-fraction", type=float, default=0.1,
        help="share of rows held out (as recpipe train's; default 0.1): not fitted on",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the holdout's seed (default 0)")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE",
        help="write the fitted state to FILE (JSON) and nothing into the dataset, e.g. for a "
        "read-only dataset; readers take it with --fitted FILE (default: "
        "DATASET/_preprocess_fitted.json, which readers find by themselves)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="DuckDB threads")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    state = fit_preprocess(
        args.dataset, args.preprocess, eval_fraction=args.eval_fraction, seed=args.seed,
        threads=args.threads, out=args.out,
    )  # fmt: skip
    for step in state["steps"]:
        for feature, fitted in step["features"].items():
            what = ", ".join(
                f"{k} {len(v)} entries" if isinstance(v, list) else f"{k} {v:.6g}"
                for k, v in fitted.items()
            )
            print(f"{step['transform']:<12} {feature:<24} {what}")
    print(
        f"fit: {state['train_rows']:,} training rows ({state['held_out_rows']:,} held out); "
        f"wrote {args.out or fitted_path(args.dataset)} in {state['elapsed_s']:.1f}s",
        file=sys.stderr,
    )
    return 0
