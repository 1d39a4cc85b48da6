"""The Spark engine of ``etl build`` (``engine="spark"``): the DuckDB engine's rows, as a Spark job.

Spark moves the data; recpipe's own code decides what every row is, and the executors do the
work: the driver plans, adds up small vectors of counts and writes ``_manifest.json`` and the
quarantine; no dataset row, and no list as long as the rows, reaches it.

- **read and validate**: one Spark task per input file, or per byte range of a large plain JSON
  Lines file, or per run of row groups of a large Parquet file (:mod:`etl.build.spark_splits`:
  lines numbered as if the file were read whole),
  runs the shared line splitter and the shared validator (:class:`etl.build.validate.Validator`,
  Arrow in, Arrow out) inside ``mapInArrow``.
- **deduplicate, labels, sessions, counts**: Spark DataFrame steps that implement the rules of
  ``docs/etl-engines.md`` exactly as the DuckDB engine's SQL does (window functions ordered by
  ``(file_id, line_no)``, the user-gap arithmetic in exact decimals). Repeated request ids: a
  window per request id, and tasks that read the repeats' lines again for their quarantine
  detail (:func:`~etl.build.engine.duplicate_rows_in`). Session ids: the rank of ``(first ts,
  key)`` by prefix sums (sessions per exact ts range counted, offsets summed on the driver,
  each range numbered from its offset by a window per range), never one ordered window. The
  sample comes from :func:`~etl.build.engine.sampled` (run inside ``mapInArrow``).
- **write** (:meth:`SparkEngine.write_dataset`): the rows fall into ``spark_partitions`` groups
  of whole, exact ranges of the sort key (sessions stay whole in session order); each group's
  task sorts its rows, writes them with the shared writer as ``[dt=.../]part-GGGGG-NNNNN.parquet``
  (in a folder of its attempt, then renamed into the temporary dataset) and returns their
  metadata. The bytes depend on ``spark_partitions`` only: not on the executors, adaptive
  coalescing or task retries (a retried task writes the same bytes).
- **quarantine** (:meth:`SparkEngine.write_quarantine`): the bad rows are range-partitioned
  and sorted by task into compressed Arrow IPC scratch files; one task then reads them in key
  order and writes the one quarantine file per kind with the shared quarantine writer (row
  groups of a fixed size). The driver gets each scratch file's path, rows and first key.
- **the dictionary columns** (``dictionary="auto"``): one task runs the dataset's first row
  group's rows (at most ``row group + 1``) through the shared writer and returns only its
  per-column measurement (:meth:`SparkEngine._dictionary`).

On a cluster, the inputs and the output directory must be on a filesystem every executor sees
under the same path (NFS, a mounted bucket): the tasks open the inputs and write the part
files by path. Refused, as in the Polars engine: ``memory_limit``, ``spill_dir``, ``threads``
(size Spark itself: ``--master``, ``spark_partitions``, ``spark-defaults.conf``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from etl.build.config import BuildConfig
from etl.build.engine import BuildJob, Engine, Kind, duplicate_rows_in, sampled
from etl.build.inputs import InputFile, empty_lines
from etl.build.output import (
    PARTITION_MS,
    BuildCounts,
    by_reason,
    dataset_writer,
    write_quarantine,
    write_rows,
)
from etl.build.spark_splits import Split, count_newlines, plan_splits, read_split
from etl.build.validate import BAD_COLUMNS, Validator, feature_columns
from etl.spark_env import run_action as _action
from etl.spark_env import spark_session
from recpipe.errors import DataError, RecpipeError
from schemas import DatasetSchema

__all__ = ["SparkEngine"]

#: the rows of one IPC batch written by a sorting task
_WRITE_ROWS = 16_384
_SCRATCH = "_spark"
#: exact ranges of the sort key per partition (the groups are made of whole ranges)
_BUCKETS_PER_PARTITION = 16
_MIN_BUCKETS = 64
#: the columns that place a row in a write group (not written)
_GROUP_COLUMNS = ("_b", "_g", "_x")
#: the manifest's keys of a file, as the shared writer lists them
_FILE_KEYS = ("path", "rows", "row_groups", "bytes", "sessions", "sha256")
#: a write task's answer: a row per file (``idx`` >= 0) and per group (``idx`` -1)
_META = pa.schema(
    [
        ("g", pa.int32()),
        ("idx", pa.int32()),
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("row_groups", pa.int64()),
        ("bytes", pa.int64()),
        ("sessions", pa.int64()),
        ("sha256", pa.string()),
        ("continuations", pa.int64()),
        ("split", pa.int64()),
    ]
)
#: the dictionary task's answer: the shared writer's measurement, a row per column
_MEASURED = pa.schema(
    [("column", pa.string()), ("dict", pa.int64()), ("plain", pa.int64()), ("use", pa.bool_())]
)


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
        self.sessions = 0
        self.dictionary_measured: dict[str, dict] | None = None
        #: the DataFrames of the phases, for a look at their plans (``frames["sessions"]``:
        #: the kept rows with their session ids; ``frames["write"]``: the write job's input)
        self.frames: dict[str, Any] = {}
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
        # a task per whole file or per byte range of a large plain JSON Lines file (lines
        # numbered as if the file were read whole), at most one task per partition: each
        # task builds one validator
        splits = plan_splits(files)
        before = self._newlines_before(files, splits)
        ids = self.spark.createDataFrame(
            [(f, a, b, before.get((f, a), 0)) for f, a, b in splits],
            "file_id int, start long, end long, before long",
        ).repartition(max(1, min(len(splits), self.partitions)), "file_id", "start")

        def parse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _parse_files(batches, files, schema, limit, kind, arrow_schema)

        rows = ids.mapInArrow(parse, from_arrow_schema(arrow_schema))
        with self.job.bar(f"parse {kind}", total=len(files), unit="file") as bar:
            self.tables[kind] = self._keep(rows)
            _action(self.tables[kind].count)
            bar.update(len(files))

    def _newlines_before(self, files: list[InputFile], splits: list[Split]) -> dict:
        """``(file_id, start)`` -> the ``\\n`` bytes of the file before ``start - 1``, for
        each byte range of ``splits`` (a job that counts them per range; the driver sums the
        small vector)."""
        ranges = [s for s in splits if s[1] >= 0 and files[s[0]].kind == "jsonl"]
        if not ranges:
            return {}
        from pyspark.sql.types import LongType, StructField, StructType

        out = StructType([StructField(c, LongType()) for c in ("file_id", "start", "newlines")])

        def count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for b in batches:
                rows = b.to_pylist()
                n = [count_newlines(files[r["file_id"]].path, r["start"], r["end"]) for r in rows]
                yield pa.RecordBatch.from_pydict(
                    {
                        "file_id": [r["file_id"] for r in rows],
                        "start": [r["start"] for r in rows],
                        "newlines": n,
                    }
                )

        df = self.spark.createDataFrame(ranges, "file_id long, start long, end long")
        found = _action(
            df.repartition(min(len(ranges), self.partitions)).mapInArrow(count, out).collect
        )
        before: dict[tuple[int, int], int] = {}
        held: dict[int, int] = {}
        for r in sorted(found, key=lambda r: (r["file_id"], r["start"])):
            key = int(r["file_id"])
            before[(key, int(r["start"]))] = held.get(key, 0)
            held[key] = held.get(key, 0) + int(r["newlines"])
        return before

    # -- dedup, labels, sessions ----------------------------------------------------------------

    def deduplicate(self) -> None:
        """Repeats of a request id found by a window per request id (hashed, never one
        partition); their quarantine rows made by tasks that read the repeats' lines again
        (:func:`~etl.build.engine.duplicate_rows_in`, the files spread over the tasks)."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

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
        dups = self._keep(dups)
        self.duplicates = int(_action(dups.count))
        if not self.duplicates:
            return
        files, limit = self.job.feature_files, self.job.config.max_line_bytes
        types = StructType([feat.schema[c] for c in BAD_COLUMNS])

        def detail(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _duplicate_details(batches, files, limit, types)

        bad = (
            dups.repartition(self.partitions, "file_id")
            .mapInArrow(detail, types)
            .select(*[F.col(c).alias(f"_d_{c}") for c in BAD_COLUMNS])
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
        """Session keys (as the DuckDB engine's SQL), sampled, and session ids by prefix sums:
        the sessions fall into :meth:`_buckets` exact ranges of their first ts; the driver
        sums the (small) vector of sessions per range, and each range numbers its sessions
        from its offset, ordered by ``(first ts, key)`` (a window per range, not one over all)."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        config = self.job.config
        good = self.tables["features"].where(F.col("reason").isNull())
        rowkeys = _session_keys(good, int(config.session_gap_ms))
        sessions = rowkeys.groupBy("skey").agg(
            F.min("ts").alias("first_ts"), F.max("ts").alias("last_ts")
        )
        if config.sample_sessions < 1.0:

            def keep(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
                for b in batches:
                    yield b.filter(sampled(b.column("skey"), config))

            sessions = sessions.mapInArrow(keep, sessions.schema)
        sessions = self._keep(sessions)
        span = _action(sessions.agg(F.min("first_ts"), F.max("last_ts")).collect)[0]
        self.ts_range = (span[0], span[1]) if span[0] is not None else (0, 0)
        self.buckets = max(_MIN_BUCKETS, _BUCKETS_PER_PARTITION * self.partitions)
        bucket = self._ts_bucket("first_ts")
        found = _action(sessions.groupBy(bucket.alias("b")).count().collect)
        per_bucket = [0] * self.buckets
        for r in found:
            per_bucket[int(r["b"])] = int(r["count"])
        self.sessions_per_ts_bucket = per_bucket
        offsets = [sum(per_bucket[:b]) for b in range(self.buckets)]
        rank = Window.partitionBy("_b").orderBy("first_ts", "skey")
        numbered = sessions.withColumn("_b", bucket).select(
            "skey",
            "first_ts",
            "last_ts",
            (_lookup(offsets, F.col("_b")) + F.row_number().over(rank) - 1).alias("sid"),
        )
        self.keep_rows = self._keep(
            good.select("file_id", "line_no", "request_id", "ts")
            .join(rowkeys.select("file_id", "line_no", "skey"), ["file_id", "line_no"])
            .join(numbered, "skey")
            .join(self.labels, "request_id", "left")
            .withColumn("label", F.coalesce(F.col("label"), F.lit(0.0)).cast("float"))
        )
        self.frames["sessions"] = self.keep_rows

    def _ts_bucket(self, column: str) -> Any:
        """The range of ``column`` (epoch ms) among :attr:`buckets` equal ranges of the
        build's ts (exact: decimal arithmetic, as ts may span more than 2**63)."""
        from pyspark.sql import functions as F

        lo, hi = self.ts_range
        return F.expr(
            f"CAST(((CAST({column} AS DECIMAL(20,0)) - CAST({lo} AS DECIMAL(20,0))) * "
            f"{self.buckets}) div CAST({hi - lo + 1} AS DECIMAL(21,0)) AS INT)"
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
        rows_out = int(_action(self.keep_rows.count))
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
        self.sessions = sum(self.sessions_per_ts_bucket)
        return BuildCounts(
            rows_in=rows_in,
            rows_out=rows_out,
            rows_quarantined=sum(q.values()),
            rows_sampled_out=rows_in - sum(q.values()) - rows_out,
            quarantine_by_reason=q,
            sessions=self.sessions,
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

    def write_quarantine(self, kind: Kind, path: Path) -> bool:
        """The bad rows of ``kind`` written by tasks: range partitions of ``(file_id,
        line_no)``, each sorted and written by its task to a compressed IPC scratch file
        (returning its path, rows and first key), then one task that reads them in key order
        and writes ``path`` with the shared quarantine writer, in row groups of a fixed size
        (the bytes do not depend on the partitions). The driver sees only that metadata."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        bad = self.tables[kind].where(F.col("reason").isNotNull()).select(*BAD_COLUMNS)
        folder = self.scratch / f"q-{kind}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        order = ["file_id", "line_no"]
        meta = StructType(
            [StructField("path", StringType()), StructField("rows", LongType())]
            + [StructField(k, LongType()) for k in order]
        )
        parts = bad.repartitionByRange(self.partitions, *order).sortWithinPartitions(*order)
        columns = list(BAD_COLUMNS)

        def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _write_partition(batches, folder, order, columns, meta_names=meta.fieldNames())

        files = self.job.files(kind)
        try:
            found = _action(parts.mapInArrow(write, meta).toArrow).to_pylist()
            found.sort(key=lambda r: tuple(r[k] for k in order))
            paths = [r["path"] for r in found]

            def merge(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
                return _merge_quarantine(batches, paths, files, path)

            one = self.spark.createDataFrame([(len(paths),)], "parts long").coalesce(1)
            written = _action(one.mapInArrow(merge, "rows long").collect)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if [int(r["rows"]) for r in written] != [sum(r["rows"] for r in found)]:
            raise RecpipeError(
                f"internal: the {kind} quarantine task wrote {[r['rows'] for r in written]} "
                f"rows of {sum(r['rows'] for r in found)}"
            )
        return True

    def quarantined(self, kind: Kind) -> Iterator[pa.RecordBatch]:
        raise RecpipeError("internal: the Spark engine's tasks write the quarantine")

    def rows(self) -> Iterator[pa.RecordBatch]:
        raise RecpipeError("internal: the Spark engine's tasks write the dataset (write_dataset)")

    def write_dataset(self, rows: int) -> tuple[Any, list[dict]]:
        """The part files, written by the tasks: the rows fall into ``spark_partitions``
        groups of whole ranges of the sort key (sessions in session order, ts in time order;
        sized by the rows per range, counted first); each group's task sorts its rows and
        writes ``[dt=.../]part-GGGGG-NNNNN.parquet`` with the shared writer and returns only
        their metadata. Nothing depends on the executors: the ranges, the groups and the
        dictionary columns are decided on the driver from small counts and a bounded sample."""
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        schema, config = self.job.schema, self.job.config
        summary = _Written(
            schema=schema.dataset_arrow_schema(),
            row_group_size=config.row_group_rows(rows),
            dictionary=None,
            dictionary_measured=None,
        )
        if not rows:
            summary.dictionary = self._dictionary(None, rows)
            return summary, []
        session_order = config.order == "session"
        k = self.keep_rows
        if session_order:  # the ranges of session ids: whole sessions per range
            s = self.sessions
            bucket = F.expr(f"CAST((sid * {self.buckets}) div {s} AS INT)")
            starts = [-(-b * s // self.buckets) for b in range(self.buckets + 1)]
            new_per_bucket = [starts[b + 1] - starts[b] for b in range(self.buckets)]
        else:  # the ranges of ts: a session may run over several groups
            bucket = self._ts_bucket("ts")
            new_per_bucket = self.sessions_per_ts_bucket
        k = k.withColumn("_b", bucket)
        counted = _action(k.groupBy("_b").count().collect)
        per_bucket = [0] * self.buckets
        for r in counted:
            per_bucket[int(r["_b"])] = int(r["count"])
        groups = _groups(per_bucket, self.partitions)
        k = k.withColumn("_g", _lookup(groups, F.col("_b")))
        if session_order:
            k = k.withColumn("_x", F.lit(False))
        else:  # the session goes on in a later group
            last, first = (_lookup(groups, self._ts_bucket(c)) for c in ("last_ts", "first_ts"))
            k = k.withColumn("_x", last != first)
        # the session ids written by the groups before each group
        floors = [
            sum(n for b, n in enumerate(new_per_bucket) if groups[b] < g) - 1
            for g in range(self.partitions)
        ]
        final, keys, names = self._final(k)
        summary.dictionary = self._dictionary(final, rows, per_bucket=per_bucket, keys=keys)
        summary.dictionary_measured = self.dictionary_measured
        hashed = _hash_keys(self.spark, self.partitions)
        parts = (
            final.withColumn("_pk", _lookup(hashed, F.col("_g")))
            .repartition(self.partitions, "_pk")
            .sortWithinPartitions("_g", *keys)
        )
        self.frames["write"] = parts
        root, scratch = self.job.work_dir, self.scratch
        dictionary = list(summary.dictionary)

        def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _write_groups(
                batches, root, scratch, schema, config, rows, dictionary, floors, names
            )

        with self.job.bar("write parquet (tasks)", total=1, unit="job") as bar:
            meta = _action(parts.mapInArrow(write, from_arrow_schema(_META)).toArrow)
            bar.update(1)
        found = sorted(meta.to_pylist(), key=lambda r: (r["g"], r["idx"]))
        files = [{c: r[c] for c in _FILE_KEYS} for r in found if r["idx"] >= 0]
        for r in found:
            if r["idx"] < 0:  # a group's session counts
                summary.sessions += r["sessions"]
                summary.session_continuations += r["continuations"]
                summary.sessions_split_across_files += r["split"]
        return summary, files

    def _final(self, k: Any) -> tuple[Any, list[str], list[str]]:
        """The dataset's columns of the kept rows ``k``, with the sort key ``_k0``.. and the
        group columns ``_g``, ``_x``; returns it, the key names, the written column names."""
        from pyspark.sql import functions as F

        schema, config = self.job.schema, self.job.config
        passthrough = [f"p{i}" for i in range(len(schema.passthrough))]
        wide = self.tables["features"].select(
            "file_id", "line_no", "user_key", "session_key", *feature_columns(schema), *passthrough
        )
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
        keys = [f"_k{i}" for i in range(len(order))]
        final = k.join(wide, ["file_id", "line_no"], "left").select(
            *[F.col(c).alias(n) for c, n in zip(order, keys)], "_b", "_g", "_x", *cols
        )
        names = [c for c in final.columns if not c.startswith("_k") and c not in _GROUP_COLUMNS]
        return final, keys, names

    def _dictionary(
        self, final: Any, rows: int, *, per_bucket: list[int] | None = None, keys: Any = None
    ) -> list[str]:
        """The dictionary-encoded columns: ``config.dictionary``'s, or with ``"auto"`` those
        the shared writer measures on the dataset's first row group (as every engine does):
        one task takes the first ``row group + 1`` rows (a bounded sample), runs them through
        the shared writer and returns only the per-column measurement (two byte counts and a
        yes or no per column): no row reaches the driver."""
        config, schema = self.job.config, self.job.schema
        if config.dictionary != "auto":
            return list(schema.dataset_arrow_schema().names) if config.dictionary == "all" else []
        if final is None:
            return []
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        want = min(rows, config.row_group_rows(rows) + 1)
        last = next(b for b in range(len(per_bucket)) if sum(per_bucket[: b + 1]) >= want)
        names = [c for c in final.columns if not c.startswith("_k") and c not in _GROUP_COLUMNS]
        head = (
            final.where(F.col("_b") <= last)
            .orderBy(*keys)
            .limit(want)
            .select(*keys, *names)
            .coalesce(1)  # the sample is one task's
        )

        def measure(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            return _measure_dictionary(batches, schema, config, rows, list(keys), names)

        found = _action(head.mapInArrow(measure, from_arrow_schema(_MEASURED)).toArrow)
        measured = {
            r["column"]: {"dict": r["dict"], "plain": r["plain"], "use": r["use"]}
            for r in found.to_pylist()
        }
        self.dictionary_measured = measured or None
        return [c for c, m in measured.items() if m["use"]]


@dataclass
class _Written:
    """What :func:`~etl.build.output.build_manifest` reads of a writer, summed over the
    tasks' writers."""

    schema: pa.Schema
    row_group_size: int
    dictionary: list[str] | None
    dictionary_measured: dict[str, dict] | None
    sessions: int = 0
    session_continuations: int = 0
    sessions_split_across_files: int = 0


def _lookup(values: list[int], index: Any) -> Any:
    """``values[index]`` as a Spark column (``index`` a column of 0-based ints)."""
    from pyspark.sql import functions as F

    return F.element_at(F.array(*[F.lit(int(v)) for v in values]), index + 1)


def _groups(per_bucket: list[int], n: int) -> list[int]:
    """The group (0..``n``-1) of each range: whole ranges, in order, about equal rows each."""
    total = max(1, sum(per_bucket))
    out, before = [], 0
    for rows in per_bucket:
        out.append(min(n - 1, before * n // total))
        before += rows
    return out


def _hash_keys(spark: Any, n: int) -> list[int]:
    """A long for each group 0..``n``-1 that Spark's hash partitioning into ``n`` partitions
    sends to the partition of that number (so each group's rows get a task of their own)."""
    from pyspark.sql import functions as F

    found: dict[int, int] = {}
    start = 0
    while len(found) < n:
        ids = spark.range(start, start + 64 * n).select(
            "id", F.expr(f"pmod(hash(id), {n})").alias("p")
        )
        for r in sorted(_action(ids.collect), key=lambda r: r["id"]):
            found.setdefault(int(r["p"]), int(r["id"]))
        start += 64 * n
    return [found[g] for g in range(n)]


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
        for tasks in batches:
            for t in tasks.to_pylist():
                split = (t["file_id"], t["start"], t["end"])
                for lines in read_split(
                    files[t["file_id"]], t["file_id"], split, t["before"], max_line_bytes=limit
                ):
                    yield from validate(lines).cast(arrow_schema).to_batches()
    finally:
        v.close()


def _duplicate_details(
    batches: Iterator[pa.RecordBatch], files: list[InputFile], limit: int, types: Any
) -> Iterator[pa.RecordBatch]:
    """One task: the quarantine rows of the repeats it holds (their files read once each)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    held = [b for b in batches if b.num_rows]
    if not held:
        return
    rows = duplicate_rows_in(pa.Table.from_batches(held), files, max_line_bytes=limit)
    yield from rows.cast(to_arrow_schema(types)).to_batches()


def _write_groups(
    batches: Iterator[pa.RecordBatch],
    root: Path,
    scratch: Path,
    schema: DatasetSchema,
    config: BuildConfig,
    rows: int,
    dictionary: list[str],
    floors: list[int],
    names: list[str],
) -> Iterator[pa.RecordBatch]:
    """One task: each group it holds (sorted by group, then key) written with the shared
    writer into a folder of this attempt, its files then renamed into the dataset as
    ``[dt=.../]part-GGGGG-NNNNN.parquet`` (a retried task writes the same bytes again); yields
    one row per file and one per group (its session counts)."""
    for g, parts in itertools.groupby(_runs(batches, "_g"), key=lambda run: run[0]):
        attempt = scratch / f"g{g:05d}-{uuid.uuid4().hex}"
        writer = dataset_writer(attempt, schema, config, rows=rows)
        writer.dictionary = dictionary
        writer.continue_after(floors[g])
        going_on: list[np.ndarray] = []  # sessions first seen here that a later group has
        sid = "_k0" if config.order == "session" else "_k1"
        rows_of = _group_rows(parts, sid, floors[g], names, going_on)
        files = write_rows(writer, rows_of, config=config)
        split = writer.split_session_ids
        split = np.union1d(split[split > floors[g]], np.concatenate([split[:0], *going_on]))
        out: dict[str, list[Any]] = {c: [] for c in _META.names}
        for i, f in enumerate(files):
            rel = Path(f["path"])
            final = rel.with_name(f"part-{g:05d}-{rel.name[len('part-') :]}")
            (root / final).parent.mkdir(exist_ok=True)
            os.replace(attempt / rel, root / final)
            _meta_row(out, g=g, idx=i, **{**f, "path": final.as_posix()})
        _meta_row(
            out,
            g=g,
            idx=-1,
            sessions=writer.sessions,
            continuations=writer.session_continuations,
            split=int(split.size),
        )
        shutil.rmtree(attempt, ignore_errors=True)
        yield pa.RecordBatch.from_pydict(out, schema=_META)


def _measure_dictionary(
    batches: Iterator[pa.RecordBatch],
    schema: DatasetSchema,
    config: BuildConfig,
    rows: int,
    keys: list[str],
    names: list[str],
) -> Iterator[pa.RecordBatch]:
    """One task: the dataset's first rows (``row group + 1`` at most, in ``keys`` order)
    written by the shared writer into a scratch folder of the executor; yields the writer's
    per-column dictionary measurement (a row per column), not the rows."""
    held = [b for b in batches if b.num_rows]
    if not held:
        return
    head = pa.Table.from_batches(held).sort_by([(k, "ascending") for k in keys])
    folder = Path(tempfile.mkdtemp(prefix="recpipe-dictionary-"))
    try:
        writer = dataset_writer(folder, schema, config, rows=rows)
        write_rows(writer, head.select(names).to_batches(), config=config)
        measured = writer.dictionary_measured or {}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    yield pa.RecordBatch.from_pydict(
        {
            "column": list(measured),
            "dict": [m["dict"] for m in measured.values()],
            "plain": [m["plain"] for m in measured.values()],
            "use": [m["use"] for m in measured.values()],
        },
        schema=_MEASURED,
    )


def _group_rows(
    parts: Iterator[tuple[int, pa.RecordBatch]],
    sid: str,
    floor: int,
    names: list[str],
    going_on: list[np.ndarray],
) -> Iterator[pa.RecordBatch]:
    """The written columns of a group's rows; adds to ``going_on`` the ids of the sessions
    first seen in the group (id above ``floor``) that go on in a later group."""
    for _, batch in parts:
        ids = batch.column(sid).to_numpy()
        on = batch.column("_x").to_numpy(zero_copy_only=False) & (ids > floor)
        if on.any():
            going_on.append(np.unique(ids[on]))
        yield batch.select(names)


def _meta_row(out: dict[str, list[Any]], **values: Any) -> None:
    for c in _META.names:
        out[c].append(values.get(c))


def _runs(batches: Iterator[pa.RecordBatch], column: str) -> Iterator[tuple[int, pa.RecordBatch]]:
    """``(value, rows)`` for each run of equal ``column`` values in ``batches``."""
    for batch in batches:
        if not batch.num_rows:
            continue
        v = batch.column(column).to_numpy()
        edges = [0, *(np.flatnonzero(v[1:] != v[:-1]) + 1).tolist(), len(v)]
        for a, b in itertools.pairwise(edges):
            yield int(v[a]), batch.slice(a, b - a)


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
                options = pa.ipc.IpcWriteOptions(compression="zstd")
                writer = pa.ipc.new_file(path, out.schema, options=options)
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


def _merge_quarantine(
    batches: Iterator[pa.RecordBatch], paths: list[str], files: list[InputFile], out: Path
) -> Iterator[pa.RecordBatch]:
    """One task: the sorted scratch files ``paths`` (in key order) written as the quarantine
    file ``out`` by the shared writer, in row groups of :data:`_WRITE_ROWS` rows (written
    aside, then renamed: a retried task writes the same bytes); yields its row count."""
    for _ in batches:  # the one row that makes this task
        pass

    def read() -> Iterator[pa.RecordBatch]:
        for name in paths:
            with pa.ipc.open_file(name) as f:
                for i in range(f.num_record_batches):
                    yield f.get_batch(i)

    aside = out.with_name(f".{out.name}.{uuid.uuid4().hex}")
    try:
        rows = write_quarantine(_rechunked(read(), _WRITE_ROWS), files, aside)
        os.replace(aside, out)
    finally:
        aside.unlink(missing_ok=True)
    yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))


def _rechunked(batches: Iterator[pa.RecordBatch], size: int) -> Iterator[pa.Table]:
    """The rows of ``batches`` again, in tables of ``size`` rows (the last one shorter)."""
    held: list[pa.RecordBatch] = []
    n = 0
    for batch in batches:
        held.append(batch)
        n += batch.num_rows
        while n >= size:
            table = pa.Table.from_batches(held)
            yield table.slice(0, size)
            rest = table.slice(size)
            held, n = rest.to_batches(), rest.num_rows
    if n:
        yield pa.Table.from_batches(held)


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
