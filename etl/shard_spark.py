"""The Spark engine of ``etl shard`` (``engine="spark"``): the local shard's files, as a Spark job.

The output is byte-identical to the local engine's (``engine="local"``): the same shard files,
the same ``_unroutable.jsonl.zst`` and the same counts in ``_shard.json`` (all but
``elapsed_s`` and the engine's own options), whatever the partition count, the executors,
adaptive coalescing or task retries. Spark moves the lines; recpipe's own code decides where
each one goes and writes every file:

- **read and route**: one Spark task per input file (lines numbered as if the file were read
  whole) runs the local engine's reader (:func:`etl.shard.raw_lines`) and router
  (:func:`etl.shard.route_line`) inside ``mapInArrow``. Each line keeps the position at which
  the local engine reads it (:func:`etl.shard.read_position`: files side by side, a step of
  lines from each in turn); an unroutable line becomes its ``_unroutable`` record there.
- **flushes**: the local engine compresses each shard's buffered lines whenever the lines
  routed since the last flush pass ``buffer_mb``. When all routed lines together pass it, one
  task replays that count over the lines' lengths in read order (one small array per step
  of lines of a file, streamed) and returns the lines after which a flush falls (a few
  positions: one per ``buffer_mb``); the driver sees no line and no length.
- **write**: the lines are partitioned by shard (and by the comparison routings of
  ``compare``, which only count bytes) and sorted by read position within each partition;
  each task feeds every shard it holds, in read order and flush by flush, to the local
  engine's writer (:class:`etl.shard.ShardSink`: grouped by session within a flush, the same
  zstd stream), so the compressed bytes are the local engine's. A task writes each file
  under a fresh name in ``<temporary output>/_spark/`` and returns its name; the driver
  renames the files of the attempts Spark reports finished into place, writes the empty
  shards, and removes the rest.

The output is committed as the local engine's is: written in a temporary directory renamed
into place at the end, so a killed job leaves no complete-looking output. An input that is
not UTF-8 text or a broken zstd stream stops the job with the local engine's error, naming the
file and line (with several such files, the one whose task fails first). On a cluster, the
inputs and the output directory must be on a filesystem every executor sees under the same
path.
"""

from __future__ import annotations

import bisect
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from etl.rawio import UNROUTABLE_NAME
from etl.shard import (
    READ_STEP,
    ShardConfig,
    ShardSink,
    make_report,
    raw_lines,
    read_position,
    route_line,
    shard_path,
    sink_specs,
    unroutable_line,
    unroutable_writer,
)
from etl.spark_env import file_tasks, run_action, spark_session
from recpipe.errors import RecpipeError
from schemas import DatasetSchema

__all__ = ["run"]

_SCRATCH = "_spark"
#: the sink number of the unroutable records in the write job
_UNROUTABLE = -1
#: raw bytes of one batch of lines out of a reading task
_BATCH_BYTES = 64 << 20
#: the columns of a position in read order (:func:`etl.shard.read_position`)
_POSITION = ("g", "r", "file_id", "k")

_LINES = pa.schema(
    [
        ("g", pa.int32()),
        ("r", pa.int64()),
        ("file_id", pa.int32()),
        ("k", pa.int64()),
        ("size", pa.int64()),
        ("reason", pa.string()),
        ("used", pa.string()),
        ("skey", pa.int64()),
        ("sshard", pa.int32()),
        ("rkey", pa.int64()),
        ("rshard", pa.int32()),
        # a line: as read if routed, its `_unroutable` record if not; null in a step's row
        ("line", pa.binary()),
        # one row per step of a file's lines (``k`` its first line's): the lengths of the
        # step's routed lines (int64, 0 for an unroutable one), for the driver's flush replay
        ("step_lengths", pa.binary()),
    ]
)
#: a flush of the local engine: the read position of the line it follows
_CUTS = pa.schema([(c, pa.int32() if c in ("g", "file_id") else pa.int64()) for c in _POSITION])
_WRITTEN = pa.schema(
    [
        ("v", pa.int32()),
        ("shard", pa.int32()),
        ("path", pa.string()),
        ("lines", pa.int64()),
        ("bytes", pa.int64()),
    ]
)


def run(files: list[Path], tmp: Path, schema: DatasetSchema, cfg: ShardConfig) -> dict[str, Any]:
    """Shard ``files`` into the directory ``tmp`` as a Spark job; returns the report.

    Raises:
        CorruptInputError: an input is not UTF-8 text or not a whole zstd stream.
        RecpipeError: PySpark or Java is missing, or the Spark job failed.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    spark = spark_session(master=cfg.master, partitions=cfg.spark_partitions)
    partitions = int(cfg.spark_partitions or spark.sparkContext.defaultParallelism or 1)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _read_files(batches, files, schema, cfg)

    ids = file_tasks(spark, len(files), partitions)
    table = ids.mapInArrow(read, from_arrow_schema(_LINES)).persist()
    lines = table.where(F.col("line").isNotNull())
    scratch = tmp / _SCRATCH
    scratch.mkdir()
    try:
        counts = run_action(
            lines.groupBy("reason", "used")
            .agg(
                F.count(F.lit(1)).alias("n"),
                F.sum("size").alias("size"),
                F.min(F.struct(*_POSITION)).alias("first"),
            )
            .collect
        )
        buffer = cfg.buffer_mb << 20
        routed_bytes = sum(int(r["size"]) for r in counts if r["reason"] is None)
        cuts = _flush_cuts(table, buffer) if routed_bytes >= buffer else []
        written = _write(lines, scratch, cfg, cuts, partitions)
        sizes = _place(written, tmp, cfg)
    finally:
        table.unpersist()
        shutil.rmtree(scratch, ignore_errors=True)
    first = sorted(counts, key=lambda r: tuple(r["first"]))  # first-seen order, as read
    bad: dict[str, int] = {}
    used: dict[str, int] = {}
    for r in first:
        into, key = (bad, r["reason"]) if r["reason"] is not None else (used, r["used"])
        into[key] = into.get(key, 0) + int(r["n"])
    lines_in = sum(int(r["n"]) for r in counts)
    return make_report(
        files,
        cfg,
        schema,
        lines_in=lines_in,
        bytes_raw=sum(int(r["size"]) for r in counts) + lines_in,
        unroutable_by_reason=bad,
        routed_by_key=used,
        lines_per_shard=sizes["lines"],
        bytes_per_sink=sizes["bytes"],
    )


def _flush_cuts(table: Any, limit: int) -> list[tuple[int, ...]]:
    """The read positions of the lines after which the local engine flushes, in order.

    The replay is sequential by nature (a flush resets the count), so one task runs it over
    the steps' line lengths in read order (8 bytes a line, streamed; no line text) and
    returns only the cuts (one per ``buffer_mb`` of lines): nothing per line reaches the
    driver."""
    from pyspark.sql.pandas.types import from_arrow_schema

    steps = table.where(table.step_lengths.isNotNull()).select("g", "r", "file_id", "step_lengths")
    ordered = steps.repartition(1).sortWithinPartitions("g", "r", "file_id")

    def replay(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows = (row for b in batches for row in b.to_pylist())
        cuts = _replay(rows, limit)
        yield pa.RecordBatch.from_pylist([dict(zip(_POSITION, c)) for c in cuts], schema=_CUTS)

    found = run_action(ordered.mapInArrow(replay, from_arrow_schema(_CUTS)).toArrow)
    return sorted(tuple(r.values()) for r in found.to_pylist())


def _replay(steps: Iterator[Any], limit: int) -> list[tuple[int, ...]]:
    """The local engine's flush count replayed over ``steps`` (in read order)."""
    cuts: list[tuple[int, ...]] = []
    buffered = 0
    for row in steps:
        sums = np.cumsum(np.frombuffer(row["step_lengths"], dtype=np.int64))
        done = 0  # bytes of the step already flushed
        while len(sums):
            i = int(np.searchsorted(sums, limit - buffered + done, side="left"))
            if i == len(sums):
                buffered += int(sums[-1]) - done
                break
            cuts.append((row["g"], row["r"], row["file_id"], row["r"] * READ_STEP + i))
            done, buffered = int(sums[i]), 0
    return cuts


def _write(
    lines: Any, scratch: Path, cfg: ShardConfig, cuts: list[tuple[int, ...]], partitions: int
) -> list[dict[str, Any]]:
    """Run the write job: one file per (sink, shard) in ``scratch``; returns what was written."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    position = [F.col(c) for c in _POSITION]
    routed = lines.where(F.col("reason").isNull())
    parts = [
        lines.where(F.col("reason").isNotNull()).select(
            F.lit(_UNROUTABLE).alias("v"),
            F.lit(0).alias("shard"),
            F.lit(0).cast("long").alias("key"),
            "line",
            *position,
        )
    ]
    for v, (by, _) in enumerate(sink_specs(cfg)):
        key = "skey" if by == "session" else "rkey"
        parts.append(
            routed.select(
                F.lit(v).alias("v"),
                F.col(key[0] + "shard").alias("shard"),
                F.col(key).alias("key"),
                "line",
                *position,
            )
        )
    rows = parts[0]
    for part in parts[1:]:
        rows = rows.unionByName(part)
    rows = rows.repartition(partitions, "v", "shard").sortWithinPartitions("v", "shard", *_POSITION)

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _write_sinks(batches, scratch, cfg, cuts)

    found = run_action(rows.mapInArrow(write, from_arrow_schema(_WRITTEN)).toArrow).to_pylist()
    seen = [(r["v"], r["shard"]) for r in found]
    if len(seen) != len(set(seen)):  # cannot happen: a shard is one partition's
        raise RecpipeError(f"internal: a shard was written by two Spark tasks: {sorted(seen)}")
    return found


def _place(written: list[dict[str, Any]], tmp: Path, cfg: ShardConfig) -> dict[str, list[Any]]:
    """Rename the written shards into ``tmp``, write the empty ones; lines and bytes per sink."""
    n = cfg.num_shards
    specs = sink_specs(cfg)
    lines = [0] * n
    sizes = [[0] * n for _ in specs]
    done: set[tuple[int, int]] = set()
    for r in written:
        v, i = r["v"], r["shard"]
        done.add((v, i))
        if v == _UNROUTABLE:
            os.replace(r["path"], tmp / UNROUTABLE_NAME)
            continue
        sizes[v][i] = r["bytes"]
        if v == 0:
            lines[i] = r["lines"]
            os.replace(r["path"], shard_path(tmp, i))
    if (_UNROUTABLE, 0) not in done:
        with open(tmp / UNROUTABLE_NAME, "wb") as fh:
            unroutable_writer(fh, cfg.zstd_level).close()
    for v, (_, group) in enumerate(specs):
        for i in range(n):
            if (v, i) not in done:
                paths = [shard_path(tmp, i)] if v == 0 else None
                sink = ShardSink(1, cfg.zstd_level, group=group, paths=paths)
                sink.close()
                sizes[v][i] = sink.bytes[0]
    return {"lines": lines, "bytes": sizes}


# -- the code Spark runs in its tasks -----------------------------------------------------------


def _read_files(
    batches: Iterator[pa.RecordBatch], files: list[Path], schema: DatasetSchema, cfg: ShardConfig
) -> Iterator[pa.RecordBatch]:
    """One task: every file named in ``batches`` read and routed by the local engine's code."""
    for ids in batches:
        for file_id in ids.column("file_id").to_pylist():
            yield from _read_file(
                files[file_id], file_id, schema, cfg.max_line_bytes, cfg.num_shards
            )


def _read_file(
    path: Path, file_id: int, schema: DatasetSchema, limit: int, shards: int
) -> Iterator[pa.RecordBatch]:
    """The lines of one input (routed, or as ``_unroutable`` records) and its step rows."""
    cols: dict[str, list[Any]] = {name: [] for name in _LINES.names}
    held = 0
    lengths: list[int] = []

    def add(**values: Any) -> None:
        for name in _LINES.names:
            cols[name].append(values.get(name))

    def end_step(k: int) -> None:  # the row of the step ending before line ``k``
        g, r, _, _ = read_position(file_id, k - 1)
        add(g=g, r=r, file_id=file_id, k=r * READ_STEP, step_lengths=_int64s(lengths))
        lengths.clear()

    k = 0
    for k, (lineno, line, size) in enumerate(raw_lines(path, limit)):
        if k % READ_STEP == 0 and lengths:
            end_step(k)
        reason, skey, rkey, used = route_line(path, lineno, line, size, schema)
        lengths.append(0 if reason else len(line))
        g, r, _, _ = read_position(file_id, k)
        data = unroutable_line(path, lineno, reason, line, size) if reason else line
        add(
            g=g,
            r=r,
            file_id=file_id,
            k=k,
            size=size,
            reason=reason or None,
            used=used or None,
            skey=_signed(skey),
            sshard=skey % shards,
            rkey=_signed(rkey),
            rshard=rkey % shards,
            line=data,
        )
        held += len(data)
        if held >= _BATCH_BYTES:
            yield _batch(cols)
            cols = {name: [] for name in _LINES.names}
            held = 0
    if lengths:
        end_step(k + 1)
    if cols["g"]:
        yield _batch(cols)


def _int64s(values: list[int]) -> bytes:
    return np.asarray(values, dtype=np.int64).tobytes()


def _batch(cols: dict[str, list[Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(cols, schema=_LINES)


def _signed(key: int) -> int:
    """A 64-bit unsigned hash as the signed long Spark stores."""
    return key - (1 << 64) if key >= 1 << 63 else key


def _write_sinks(
    batches: Iterator[pa.RecordBatch], scratch: Path, cfg: ShardConfig, cuts: list[tuple[int, ...]]
) -> Iterator[pa.RecordBatch]:
    """One task: each (sink, shard) of its partition, whose lines come in read order, written by
    the local engine's writer, flush by flush; yields one row per (sink, shard) written."""
    specs = sink_specs(cfg)
    current: tuple[int, int] | None = None
    sink: Any = None
    path: Path | None = None
    flush = count = 0

    def finish() -> pa.RecordBatch:
        v, shard = current  # type: ignore[misc]
        sink.close()
        if v == _UNROUTABLE:
            size = path.stat().st_size  # type: ignore[union-attr]
        else:
            size = sink.bytes[0]
        row = {"v": [v], "shard": [shard], "path": [str(path) if path else None]}
        return pa.RecordBatch.from_pydict(
            {**row, "lines": [count], "bytes": [size]}, schema=_WRITTEN
        )

    for batch in batches:
        cols = batch.to_pydict()
        for v, shard, key, line, *pos in zip(
            cols["v"], cols["shard"], cols["key"], cols["line"], *(cols[c] for c in _POSITION)
        ):
            if (v, shard) != current:
                if current is not None:
                    yield finish()
                current, count, flush = (v, shard), 0, 0
                path = scratch / f"{v}-{shard}-{uuid.uuid4().hex}.zst" if v <= 0 else None
                if v == _UNROUTABLE:
                    sink = unroutable_writer(open(path, "wb"), cfg.zstd_level)  # noqa: SIM115
                else:
                    paths = [path] if path is not None else None
                    sink = ShardSink(1, cfg.zstd_level, group=specs[v][1], paths=paths)
            count += 1
            if v == _UNROUTABLE:
                sink.write(line)
                continue
            at = bisect.bisect_left(cuts, tuple(pos), lo=flush)
            if at != flush:  # a flush of the local engine falls before this line
                sink.flush()
                flush = at
            sink.add(0, key, line)
    if current is not None:
        yield finish()
