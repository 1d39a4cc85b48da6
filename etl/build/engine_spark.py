"""The Spark engine of ``etl build`` (``engine="spark"``): the DuckDB engine's dataset, as a Spark job.

Spark moves the data; recpipe's own code decides what every row is:

- **read and validate**: one Spark task per input file runs the shared line reader
  (:func:`etl.build.inputs.read_lines`, so lines are numbered as if the file were read whole)
  and the shared validator (:class:`etl.build.validate.Validator`, Arrow in, Arrow out) inside
  ``mapInArrow``; nothing of the validation is written again in Spark SQL.
- **deduplicate, labels, sessions, counts**: Spark DataFrame steps that implement the rules of
  ``docs/etl-engines.md`` exactly as the DuckDB engine's SQL does (window functions ordered by
  ``(file_id, line_no)``, the user-gap arithmetic in exact decimals, session ids ranked by
  ``(first ts, key)``); the detail of a repeated request id comes from
  :func:`~etl.build.engine.duplicate_rows` and the sample from :func:`~etl.build.engine.sampled`
  (run inside ``mapInArrow``).
- **order**: the rows are range-partitioned by the build's sort key (whole sessions stay in one
  partition) and sorted within each partition; each task writes its sorted partition as an
  Arrow IPC file in a scratch folder inside the build's temporary output directory and returns
  the partition's first key. The driver hands the partitions, in key order, to the shared
  Parquet writer, so file names and bytes do not depend on the number of partitions or
  executors, on adaptive coalescing or on task retries (a retried task writes a new file; only
  the attempt Spark reports as finished is read).

On a cluster, the inputs and the output directory must be on a filesystem every executor sees
under the same path (NFS, a mounted bucket): the tasks open the inputs and write the scratch
files by path. Refused, as in the Polars engine: ``memory_limit``, ``spill_dir``, ``threads``
(size Spark itself: ``--master``, ``spark_partitions``, ``spark-defaults.conf``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from etl.build.config import BuildConfig
from etl.build.engine import BuildJob, Engine, Kind, duplicate_rows, sampled
from etl.build.inputs import InputFile, empty_lines, read_lines
from etl.build.output import PARTITION_MS, BuildCounts, by_reason
from etl.build.validate import BAD_COLUMNS, Validator, feature_columns
from etl.spark_env import file_tasks, spark_session
from etl.spark_env import run_action as _action
from recpipe.errors import DataError
from schemas import DatasetSchema

__all__ = ["SparkEngine"]

#: the rows of one IPC batch written by a sorting task
_WRITE_ROWS = 16_384
_SCRATCH = "_spark"


class SparkEngine(Engine):
    """Every phase as a Spark job; validation and writing are recpipe's shared code."""

    name = "spark"

    def __init__(self, job: BuildJob) -> None:
        super().__init__(job)
        config = job.config
        self.spark = spark_session(master=config.master, partitions=config.spark_partitions)
        self.partitions = int(
            config.spark_partitions or self.spark.sparkContext.defaultParallelism or 1
        )
        self._saved_conf = self.spark.conf.get("spark.sql.shuffle.partitions")
        self.spark.conf.set("spark.sql.shuffle.partitions", str(self.partitions))
        self.scratch = job.work_dir / _SCRATCH
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.tables: dict[str, Any] = {}
        self.duplicates = 0
        self._cached: list[Any] = []

    @classmethod
    def check_config(cls, config: BuildConfig) -> None:
        for name in ("memory_limit", "spill_dir", "threads"):
            if getattr(config, name) is not None:
                raise DataError(
                    f"`{name}` is an option of engine 'duckdb', got {getattr(config, name)!r}\n"
                    "hint: engine 'spark' is sized by Spark: --master, --spark-partitions "
                    "and spark-defaults.conf"
                )

    def close(self) -> None:
        for df in self._cached:
            df.unpersist()
        self.spark.conf.set("spark.sql.shuffle.partitions", self._saved_conf)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _keep(self, df: Any) -> Any:
        """``df`` cached on the executors' disks (its lineage runs once: it holds the validated
        rows). Not in memory: a whole input file's rows are one partition, and reading them back
        into the heap ran a 1 GB local driver out of memory at 1M requests."""
        from pyspark import StorageLevel

        df = df.persist(StorageLevel.DISK_ONLY)
        self._cached.append(df)
        return df

    # -- read and validate --------------------------------------------------------------------

    def load(self, kind: Kind) -> None:
        from pyspark.sql.pandas.types import from_arrow_schema

        files = self.job.files(kind)
        schema, limit = self.job.schema, self.job.config.max_line_bytes
        arrow_schema = _plain_schema(_validate(schema, limit, kind, empty_lines()).schema)
        # whole files per task (lines numbered as if each file were read whole), at most one
        # task per partition: each task builds one validator
        ids = file_tasks(self.spark, len(files), self.partitions)

        def parse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _parse_files(batches, files, schema, limit, kind, arrow_schema)

        rows = ids.mapInArrow(parse, from_arrow_schema(arrow_schema))
        with self.job.bar(f"parse {kind}", total=len(files), unit="file") as bar:
            self.tables[kind] = self._keep(rows)
            _action(self.tables[kind].count)
            bar.update(len(files))

    # -- dedup, labels, sessions ----------------------------------------------------------------

    def deduplicate(self) -> None:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        feat = self.tables["features"]
        w = Window.partitionBy("request_id").orderBy("file_id", "line_no")
        dups = (
            feat.where(F.col("reason").isNull())
            .select(
                "file_id",
                "line_no",
                "request_id",
                F.first("file_id").over(w).alias("first_file"),
                F.first("line_no").over(w).alias("first_line"),
                F.row_number().over(w).alias("rn"),
            )
            .where("rn > 1")
            .drop("rn")
        )
        found = _action(dups.toArrow)
        self.duplicates = found.num_rows
        if not found.num_rows:
            return
        rows = duplicate_rows(found, self.job)
        types = feat.schema
        bad = self.spark.createDataFrame(_plain_table(rows)).select(
            *[F.col(c).cast(types[c].dataType).alias(f"_d_{c}") for c in BAD_COLUMNS]
        )
        joined = feat.join(
            bad,
            (feat.file_id == bad._d_file_id) & (feat.line_no == bad._d_line_no),
            "left",
        )
        cols = [
            F.coalesce(F.col(f"_d_{c}"), F.col(c)).alias(c) if c in BAD_COLUMNS[2:] else F.col(c)
            for c in feat.columns
        ]
        self.tables["features"] = self._keep(joined.select(*cols))

    def join_labels(self) -> None:
        from pyspark.sql import functions as F

        ev = self.tables["events"].where(F.col("reason").isNull())
        self.labels = self._keep(ev.groupBy("request_id").agg(F.max("label").alias("label")))

    def sessionize(self) -> None:
        """Session keys (as the DuckDB engine's SQL), ids ranked by (first ts, key), sampled."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        config = self.job.config
        good = self.tables["features"].where(F.col("reason").isNull())
        rowkeys = _session_keys(good, int(config.session_gap_ms))
        sessions = rowkeys.groupBy("skey").agg(F.min("ts").alias("first_ts"))
        if config.sample_sessions < 1.0:

            def keep(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
                for b in batches:
                    yield b.filter(sampled(b.column("skey"), config))

            sessions = sessions.mapInArrow(keep, sessions.schema)
        # the rank of (first ts, key) over all sessions: one ordered window
        rank = Window.orderBy("first_ts", "skey")
        sessions = sessions.withColumn("sid", F.row_number().over(rank).cast("long") - 1)
        self.keep_rows = self._keep(
            good.select("file_id", "line_no", "request_id", "ts")
            .join(rowkeys.select("file_id", "line_no", "skey"), ["file_id", "line_no"])
            .join(sessions, "skey")
            .join(self.labels, "request_id", "left")
            .withColumn("label", F.coalesce(F.col("label"), F.lit(0.0)).cast("float"))
        )

    # -- counts and output ----------------------------------------------------------------------

    def counts(self) -> BuildCounts:
        """The manifest counts, in few Spark jobs (each aggregates one table once)."""
        from pyspark.sql import functions as F

        feat, ev = self.tables["features"], self.tables["events"]
        good = feat.where(F.col("reason").isNull())
        ev_good = ev.where(F.col("reason").isNull())

        def reasons_of(df: Any) -> tuple[int, dict[str, int]]:
            rows = _action(df.groupBy("reason").count().collect)
            return sum(int(r["count"]) for r in rows), {
                r["reason"]: int(r["count"]) for r in rows if r["reason"] is not None
            }

        rows_in, q = reasons_of(feat)
        events_in, ev_q = reasons_of(ev)
        q, ev_q = by_reason(q), by_reason(ev_q, events=True)
        out = _action(
            self.keep_rows.agg(
                F.count(F.lit(1)).alias("n"), F.countDistinct("sid").alias("s")
            ).collect
        )[0]
        unlabelled = _action(good.join(self.labels, "request_id", "left_anti").count)
        ids = good.select("request_id")
        ev_unknown = _action(ev_good.join(ids, "request_id", "left_anti").count)
        names = self.job.schema.feature_names
        cols = feature_columns(self.job.schema)
        present = _action(good.agg(F.count(F.lit(1)), *[F.count(F.col(c)) for c in cols]).collect)[
            0
        ]
        missing = {n: present[0] - k for n, k in zip(names, present[1:]) if present[0] - k}
        listed: dict[str, dict[str, int]] = {"unknown": {}, "unknown_keys": {}}
        names_of = [good.select(F.lit(c).alias("list"), F.explode(c).alias("name")) for c in listed]
        found = names_of[0].unionByName(names_of[1]).groupBy("list", "name").count()
        for r in sorted(_action(found.collect), key=lambda r: (r["list"], r["name"])):
            listed[r["list"]][r["name"]] = int(r["count"])
        rows_out = int(out["n"])
        return BuildCounts(
            rows_in=rows_in,
            rows_out=rows_out,
            rows_quarantined=sum(q.values()),
            rows_sampled_out=rows_in - sum(q.values()) - rows_out,
            quarantine_by_reason=q,
            sessions=int(out["s"]),
            rows_without_event=int(unlabelled),
            unknown_features=listed["unknown"],
            unknown_keys=listed["unknown_keys"],
            features_missing={k: int(v) for k, v in missing.items()},
            events_in=events_in,
            events_quarantined=sum(ev_q.values()),
            events_quarantine_by_reason=ev_q,
            events_unknown_request=int(ev_unknown),
            rows_duplicate=self.duplicates,
        )

    def quarantined(self, kind: Kind) -> Iterator[pa.RecordBatch]:
        from pyspark.sql import functions as F

        bad = self.tables[kind].where(F.col("reason").isNotNull()).select(*BAD_COLUMNS)
        yield from self._sorted(bad, ["file_id", "line_no"], list(BAD_COLUMNS), f"q-{kind}")

    def rows(self) -> Iterator[pa.RecordBatch]:
        from pyspark.sql import functions as F

        schema, config = self.job.schema, self.job.config
        passthrough = [f"p{i}" for i in range(len(schema.passthrough))]
        wide = self.tables["features"].select(
            "file_id", "line_no", "user_key", "session_key", *feature_columns(schema), *passthrough
        )
        k = self.keep_rows
        cols = [
            F.col("sid").alias(schema.session_key),
            F.col("ts").alias(schema.time_key),
            F.col("label").cast("float").alias(schema.label_key),
            *[
                F.coalesce(F.col(f"d{i}"), F.lit(float(d.fill)).cast("float")).alias(d.name)
                for i, d in enumerate(schema.dense)
            ],
            *[
                F.coalesce(F.col(f"s{i}"), F.array().cast("array<bigint>")).alias(s.name)
                for i, s in enumerate(schema.sparse)
            ],
            F.col("request_id"),
            F.col("user_key").alias("user_id"),
            F.col("session_key").alias("session_id_raw"),
            *[
                F.col(p).alias(name)
                for p, name in zip(passthrough, schema.passthrough, strict=True)
            ],
        ]
        if config.partition_by == "hour":
            basis = "first_ts" if config.order == "session" else "ts"
            cols.append(F.col(basis).alias(PARTITION_MS))
        order = ["sid", "ts"] if config.order == "session" else ["ts", "sid"]
        order += ["file_id", "line_no"]
        keys = [F.col(c).alias(f"_k{i}") for i, c in enumerate(order)]
        final = k.join(wide, ["file_id", "line_no"], "left").select(*keys, *cols)
        names = [c for c in final.columns if not c.startswith("_k")]
        yield from self._sorted(final, [f"_k{i}" for i in range(len(order))], names, "rows")

    def _sorted(
        self, df: Any, order: list[str], columns: list[str], name: str
    ) -> Iterator[pa.RecordBatch]:
        """``df``'s ``columns`` in the order of ``order`` (integer keys, unique per row): range
        partitions, each sorted and written by its task to an IPC file, read back in key order."""
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        folder = self.scratch / f"{name}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        meta = StructType(
            [StructField("path", StringType()), StructField("rows", LongType())]
            + [StructField(k, LongType()) for k in order]
        )
        n = self.partitions
        parts = df.repartitionByRange(n, *order).sortWithinPartitions(*order)

        def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _write_partition(batches, folder, order, columns, meta_names=meta.fieldNames())

        found = _action(parts.mapInArrow(write, meta).toArrow).to_pylist()
        found.sort(key=lambda r: tuple(r[k] for k in order))
        try:
            for part in found:
                with pa.ipc.open_file(part["path"]) as f:
                    for i in range(f.num_record_batches):
                        yield f.get_batch(i)
                os.unlink(part["path"])
        finally:
            shutil.rmtree(folder, ignore_errors=True)


# -- the code Spark runs in its tasks -----------------------------------------------------------


def _validate(schema: DatasetSchema, limit: int, kind: Kind, lines: pa.Table) -> pa.Table:
    v = Validator(schema, max_line_bytes=limit)
    try:
        return v.features(lines) if kind == "features" else v.events(lines)
    finally:
        v.close()


def _parse_files(
    batches: Iterator[pa.RecordBatch],
    files: list[InputFile],
    schema: DatasetSchema,
    limit: int,
    kind: Kind,
    arrow_schema: pa.Schema,
) -> Iterator[pa.RecordBatch]:
    """One task: every file named in ``batches`` read and validated by the shared code."""
    v = Validator(schema, max_line_bytes=limit)
    validate = v.features if kind == "features" else v.events
    try:
        for ids in batches:
            for file_id in ids.column("file_id").to_pylist():
                for lines in read_lines(files[file_id], file_id, max_line_bytes=limit):
                    yield from validate(lines).cast(arrow_schema).to_batches()
    finally:
        v.close()


def _write_partition(
    batches: Iterator[pa.RecordBatch],
    folder: Path,
    order: list[str],
    columns: list[str],
    *,
    meta_names: list[str],
) -> Iterator[pa.RecordBatch]:
    """One task: its sorted partition written to ``folder`` (a fresh file per attempt); yields
    one row ``path, rows, <first key>`` (none for an empty partition)."""
    writer, path, rows, first = None, folder / f"part-{uuid.uuid4().hex}.arrow", 0, None
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            if first is None:
                first = [batch.column(k)[0].as_py() for k in order]
            out = pa.RecordBatch.from_arrays([batch.column(c) for c in columns], names=columns)
            if writer is None:
                writer = pa.ipc.new_file(path, out.schema)
            for piece in pa.Table.from_batches([out]).to_batches(_WRITE_ROWS):
                writer.write_batch(piece)
            rows += batch.num_rows
    finally:
        if writer is not None:
            writer.close()
    if first is not None:
        values = [[str(path)], [rows], *[[v] for v in first]]
        yield pa.RecordBatch.from_arrays(
            [pa.array(v, pa.string() if i == 0 else pa.int64()) for i, v in enumerate(values)],
            names=meta_names,
        )


def _session_keys(good: Any, gap: int) -> Any:
    """The raw session key ``skey`` of every good row, as the DuckDB engine's SQL."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    sk, uk = F.col("session_key"), F.col("user_key")
    keyed = good.where(sk.isNotNull()).select(
        "file_id", "line_no", "ts", F.concat(F.lit("s:"), sk).alias("skey")
    )
    alone = good.where(sk.isNull() & uk.isNull()).select(
        "file_id", "line_no", "ts", F.concat(F.lit("r:"), F.col("request_id")).alias("skey")
    )
    w = Window.partitionBy("user_key").orderBy("ts", "file_id", "line_no")
    # in exact decimals: two int64 ts may lie more than 2^63 ms apart
    exact = F.col("ts").cast("decimal(20,0)")
    step = exact - F.lag(exact).over(w)
    users = good.where(sk.isNull() & uk.isNotNull()).select(
        "file_id",
        "line_no",
        "user_key",
        "ts",
        F.when(step <= F.lit(gap), 0).otherwise(1).alias("new_session"),
    )
    running = F.sum("new_session").over(w.rowsBetween(Window.unboundedPreceding, 0))
    users = users.select(
        "file_id",
        "line_no",
        "ts",
        F.concat(F.lit("u:"), uk, F.lit(":"), running.cast("string")).alias("skey"),
    )
    return keyed.unionByName(alone).unionByName(users)


def _plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` with large strings and lists made plain (the Arrow types Spark maps)."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(_plain_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _plain_type(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_plain_type(t.key_type), _plain_type(t.item_type))
    return t


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, _plain_type(f.type)) for f in schema])


def _plain_table(table: pa.Table) -> pa.Table:
    return table.cast(_plain_schema(table.schema))
