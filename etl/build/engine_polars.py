"""The Polars engine of ``etl build`` (``engine="polars"``): the DuckDB engine's dataset, in memory.

Lines come from the shared reader and are validated by the shared validator (Arrow batches in,
Arrow batches out), one file per thread; deduplication, labels, sessions, counts and the final
sort are Polars frames, ordered by ``(file_id, line_no)`` wherever the rules say "input order".
The output is the DuckDB engine's, byte for byte: the same rows in the same order handed to the
same writer, the same quarantine and manifest counts (tested on every corpus of the suite).

Refused with a :class:`~recpipe.errors.DataError`, where this engine cannot honour them:
``memory_limit`` and ``spill_dir`` (the whole dataset is held in memory) and ``threads``
(Polars sizes its pool from ``POLARS_MAX_THREADS``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import pyarrow as pa

from etl.build.engine import BuildJob, Engine, Kind, duplicate_rows, sampled
from etl.build.inputs import InputFile, empty_lines, read_lines
from etl.build.output import PARTITION_MS, BuildCounts, by_reason
from etl.build.validate import BAD_COLUMNS, feature_columns
from recpipe.errors import DataError

__all__ = ["PolarsEngine"]

#: rows per Arrow batch handed to the writer
_WRITE_ROWS = 16_384


class PolarsEngine(Engine):
    """Every phase in Polars frames, in memory."""

    name = "polars"

    def __init__(self, job: BuildJob) -> None:
        super().__init__(job)
        self.good: dict[str, Any] = {}
        self.bad: dict[str, Any] = {}
        self.duplicates = 0

    @classmethod
    def check_config(cls, config: Any) -> None:
        for name in ("memory_limit", "spill_dir"):
            if getattr(config, name) is not None:
                raise DataError(
                    f"`{name}` is an option of engine 'duckdb'; engine 'polars' builds in "
                    f"memory, got {getattr(config, name)!r}\n"
                    "hint: use engine 'duckdb' for an out-of-core build"
                )
        if config.threads is not None:
            raise DataError(
                f"`threads` is an option of engine 'duckdb', got {config.threads!r}\n"
                "hint: engine 'polars' sizes its thread pool from POLARS_MAX_THREADS"
            )

    # -- read and validate --------------------------------------------------------------------

    def load(self, kind: Kind) -> None:
        import polars as pl

        v = self.job.validator
        validate = v.features if kind == "features" else v.events
        limit = self.job.config.max_line_bytes

        def one(file_id: int, f: InputFile) -> list[pa.Table]:
            return [validate(batch) for batch in read_lines(f, file_id, max_line_bytes=limit)]

        files = self.job.files(kind)
        empty = validate(empty_lines())
        tables = [empty]
        total = sum(f.path.stat().st_size for f in files)
        workers = max(1, min(os.cpu_count() or 1, len(files)))
        with (
            self.job.bar(f"parse {kind}", total=total, unit="B", unit_scale=True) as bar,
            ThreadPoolExecutor(max_workers=workers) as pool,
        ):
            jobs = {pool.submit(one, i, f): f for i, f in enumerate(files)}
            try:
                for job in as_completed(jobs):
                    tables += [t.cast(empty.schema) for t in job.result()]
                    bar.update(jobs[job].path.stat().st_size)
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
        rows = pl.from_arrow(pa.concat_tables(tables))
        bad = pl.col("reason").is_not_null()
        self.good[kind] = rows.filter(~bad).drop(BAD_COLUMNS[2:])
        self.bad[kind] = rows.filter(bad).select(BAD_COLUMNS)

    # -- dedup, labels, sessions ----------------------------------------------------------------

    def deduplicate(self) -> None:
        """Split off every good record of a request_id after the first (input order)."""
        import polars as pl

        good = self.good["features"].sort("file_id", "line_no", maintain_order=True)
        first = pl.col("request_id").is_first_distinct()
        dups = good.filter(~first).select("file_id", "line_no", "request_id")
        self.duplicates = dups.height
        if not dups.height:
            self.good["features"] = good
            return
        good = good.filter(first)
        firsts = good.join(dups.select("request_id").unique(), on="request_id").select(
            "request_id", first_file=pl.col("file_id"), first_line=pl.col("line_no")
        )
        dups = dups.join(firsts, on="request_id", how="left")
        rows = pl.from_arrow(duplicate_rows(dups.to_arrow(), self.job))
        self.good["features"] = good
        self.bad["features"] = pl.concat(
            [self.bad["features"], rows.select(BAD_COLUMNS)], how="vertical_relaxed"
        )

    def join_labels(self) -> None:
        import polars as pl

        self.labels = self.good["events"].group_by("request_id").agg(pl.col("label").max())

    def sessionize(self) -> None:
        """Session keys (as the DuckDB engine's SQL), ids ranked by (first ts, key), sampled."""
        import polars as pl

        good = self.good["features"]
        rowkeys = _session_keys(good, int(self.job.config.session_gap_ms))
        sessions = rowkeys.group_by("skey").agg(first_ts=pl.col("ts").min())
        if self.job.config.sample_sessions < 1.0:
            keep = sampled(sessions.get_column("skey").to_arrow(), self.job.config)
            sessions = sessions.filter(pl.Series(keep))
        sessions = (
            sessions.sort("first_ts", "skey")
            .with_row_index("sid")
            .with_columns(pl.col("sid").cast(pl.Int64))
        )
        self.keep = (
            good.select("file_id", "line_no", "request_id", "ts")
            .join(rowkeys.select("file_id", "line_no", "skey"), on=["file_id", "line_no"])
            .join(sessions, on="skey")
            .join(self.labels, on="request_id", how="left")
            .with_columns(pl.col("label").fill_null(0.0))
        )

    # -- counts and output ----------------------------------------------------------------------

    def counts(self) -> BuildCounts:
        good, bad = self.good["features"], self.bad["features"]
        ev_good, ev_bad = self.good["events"], self.bad["events"]
        q = by_reason(dict(bad.group_by("reason").len().iter_rows()))
        ev_q = by_reason(dict(ev_bad.group_by("reason").len().iter_rows()), events=True)
        names = self.job.schema.feature_names
        nulls = good.select(feature_columns(self.job.schema)).null_count().row(0)
        ids = good.select("request_id")
        rows_in = good.height + bad.height
        return BuildCounts(
            rows_in=rows_in,
            rows_out=self.keep.height,
            rows_quarantined=sum(q.values()),
            rows_sampled_out=good.height - self.keep.height,
            quarantine_by_reason=q,
            sessions=self.keep.get_column("sid").n_unique(),
            rows_without_event=good.join(self.labels, on="request_id", how="anti").height,
            unknown_features=self._listed("unknown"),
            unknown_keys=self._listed("unknown_keys"),
            features_missing={n: k for n, k in zip(names, nulls) if k},
            events_in=ev_good.height + ev_bad.height,
            events_quarantined=sum(ev_q.values()),
            events_quarantine_by_reason=ev_q,
            events_unknown_request=ev_good.join(ids, on="request_id", how="anti").height,
            rows_duplicate=self.duplicates,
        )

    def _listed(self, column: str) -> dict[str, int]:
        """Names in the list ``column`` of the valid, deduplicated rows -> rows naming them."""
        import polars as pl

        rows = self.good["features"].select(pl.col(column).explode().drop_nulls())
        return dict(sorted(rows.group_by(column).len().iter_rows()))

    def quarantined(self, kind: Kind) -> Iterator[pa.Table]:
        yield self.bad[kind].sort("file_id", "line_no").to_arrow()

    def rows(self) -> Iterator[pa.RecordBatch]:
        import polars as pl

        schema, config = self.job.schema, self.job.config
        cols = [
            pl.col("sid").alias(schema.session_key),
            pl.col("ts").alias(schema.time_key),
            pl.col("label").cast(pl.Float32).alias(schema.label_key),
            *[
                pl.col(f"d{i}").fill_null(float(f.fill)).cast(pl.Float32).alias(f.name)
                for i, f in enumerate(schema.dense)
            ],
            *[
                pl.col(f"s{i}").fill_null(pl.lit([], dtype=pl.List(pl.Int64))).alias(f.name)
                for i, f in enumerate(schema.sparse)
            ],
        ]
        if config.partition_by == "hour":
            basis = "first_ts" if config.order == "session" else "ts"
            cols.append(pl.col(basis).alias(PARTITION_MS))
        order = ["sid", "ts"] if config.order == "session" else ["ts", "sid"]
        wide = self.good["features"].select("file_id", "line_no", *feature_columns(schema))
        final = (
            self.keep.sort([*order, "file_id", "line_no"])
            .join(wide, on=["file_id", "line_no"], how="left", maintain_order="left")
            .select(cols)
            .to_arrow()
        )
        self.good.clear()
        self.keep = None
        yield from final.to_batches(_WRITE_ROWS)


def _session_keys(good, gap: int):
    """The raw session key ``skey`` of every good row, as the DuckDB engine's SQL."""
    import polars as pl

    rows = good.select("file_id", "line_no", "request_id", "session_key", "user_key", "ts")
    sk, uk = pl.col("session_key"), pl.col("user_key")
    keyed = rows.filter(sk.is_not_null()).select("file_id", "line_no", "ts", skey=pl.lit("s:") + sk)
    alone = rows.filter(sk.is_null() & uk.is_null()).select(
        "file_id", "line_no", "ts", skey=pl.lit("r:") + pl.col("request_id")
    )
    users = rows.filter(sk.is_null() & uk.is_not_null()).sort(
        "user_key", "ts", "file_id", "line_no"
    )
    # ts - previous ts in u64 arithmetic: exact for any two int64 (ts >= previous), as the
    # SQL's HUGEINT
    u64 = pl.col("ts").reinterpret(signed=False)
    users = users.with_columns(step=u64 - u64.shift(1).over("user_key"))
    new = pl.when(pl.col("step") <= gap).then(0).otherwise(1)
    users = users.select(
        "file_id",
        "line_no",
        "ts",
        skey=pl.format("u:{}:{}", "user_key", new.cum_sum().over("user_key")),
    )
    return pl.concat([keyed, alone, users])
