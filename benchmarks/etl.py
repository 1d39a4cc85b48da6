"""ETL benchmark: what session clustering buys, measured in one run against baselines.

Default mode, on ``--requests`` synthetic requests (1M by default, ``--quick``: 50k):

1. ``synth``: write feature and event logs (``.jsonl.zst``).
2. ``shard``: route the feature logs to ``--shards`` zstd shards by session, and compare their
   bytes with shards routed by request (RecD O1).
3. ``build`` clustered (``order="session"``) and ``build`` time-ordered (``order="time"``, the
   pre-RecD baseline, same writer settings), each in a child process whose wall time and
   peak RSS are measured.
4. a DuckDB one-liner baseline in a child process: read the same JSON shards, join nothing,
   ``ORDER BY session_id, ts``, write zstd Parquet in one ``COPY`` statement.
5. ``stats`` on both datasets: DedupeFactor per feature at ``--batch-size`` (4096).
6. ``build --engine polars`` of the clustered dataset: ``polars_vs_duckdb_build`` = its time /
   DuckDB's, and ``polars_same_parquet`` whether its part files are byte-identical to the DuckDB
   engine's. Skipped with ``--threads`` (the Polars engine takes no thread count) or
   ``--no-polars``.
7. with ``--spark``: ``build --engine spark`` (``--spark-master``, default ``local[*]``) of the
   clustered dataset, alternated with the others: ``spark_local_vs_duckdb_build`` = its time /
   DuckDB's (the JVM's start-up is timed apart, ``build_spark_startup_s``) and
   ``spark_same_rows`` whether its part files, read in the manifest's order, hold the DuckDB
   engine's rows in its order (Spark's tasks write a file set of their own).

The clustered build, the one-liner and the Polars build are timed as every benchmark here times
(``benchmarks/_common.py``): one untimed warm-up run each, then ``--repeat`` (3) rounds with
the order rotating, each ratio the median of the per-round ratios with its spread (min, median,
max) and its CPU-time twin beside it (each child measures its own wall and process-CPU seconds
around the build or the ``COPY``).

Out-of-core mode (``--memory-limit 512MB``): synth, then only the clustered build with that
DuckDB memory limit in a child process; reports its peak RSS and how much larger than the limit
the raw logs are (size ``--requests`` so that they are at least 4x the limit).

Spark scale-out mode (``--spark-scaleout``): what the Spark engine's driver and cluster do as the
data grows. (a) ``spark_driver_rss_growth``: a local Spark build at each of
``--spark-rss-sizes`` (1000000,4000000) requests in a child process; the Python driver's peak RSS
(that process alone, polled every 50 ms) at the largest size over that at the smallest (target
<= 1.2: the driver only coordinates), with the JVM's peak heap at each size beside it (a
``local`` JVM runs the tasks too, so its heap is the executors' as well). (b) the build of
``--requests`` requests on a standalone cluster started here (``etl.build.spark_cluster``) with
each of ``--spark-workers`` (1,2) workers of one core: ``build_spark_standalone`` (seconds) per worker
count, ``--repeat`` rounds each (no warm-up round: every build is a fresh driver) with their
spread. (c) ``spark_local_vs_duckdb_build`` at
``--requests``: local Spark vs DuckDB, alternated rounds, with spread. Results go under
``spark_scaleout``; the other figures of the file are kept.

Scale mode (``--scale 1000000,4000000``): for each size, synth that many requests and build
them with each engine (DuckDB, Polars unless ``--no-polars``, Spark with ``--spark``),
alternated, without the warm-up round (every build is a fresh child process, and the logs were
just written, so the page cache is warm); reports seconds per million input rows per engine and
size, and how that figure grows from the smallest size to the largest (1.0: cost linear in the
input). ``--scale-engines spark`` runs only those engines and keeps the others' figures at the
same sizes; each size records the load average when it started (the box may be shared).

Results go to ``benchmarks/results/etl.json`` (the out-of-core run under the key
``out_of_core``, the scale run under ``scale``, each kept across the other modes' runs) and are
printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS as RESULTS_DIR
from benchmarks._common import Timing, alternate, timing_ratio, write_results

REPO = Path(__file__).resolve().parents[1]
RESULTS = RESULTS_DIR / "etl.json"
TARGETS = {
    "parquet_ratio_time_vs_clustered": (">=", 3.0),
    "build_vs_duckdb_oneliner": ("<=", 1.5),
}
PEAK_RSS_TARGET_MB = 1536.0

__all__ = ["main", "merge_scale", "run_benchmark", "run_out_of_core", "run_scale"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "ETL benchmark: synth -> shard -> build (clustered) -> build (time-ordered) -> stats, "
            "against a DuckDB one-liner, in one run. With --memory-limit: the out-of-core build "
            "alone, reporting its peak RSS."
        ),
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="synthetic requests (default 1000000; --quick 50000)",
    )
    parser.add_argument("--quick", action="store_true", help="a small run (50k requests)")
    parser.add_argument("--seed", type=int, default=0, help="synth seed (0)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="alternated rounds of the clustered build, the one-liner and the Polars build, "
        "after one warm-up each; ratios are medians of the rounds (3)",
    )
    parser.add_argument("--shards", type=int, default=8, help="shards of `etl shard` (8)")
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="B of the dedup factors (4096)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="DuckDB threads of builds, one-liner and stats"
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        help="out-of-core mode: build with this DuckDB memory limit, e.g. 512MB",
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="work directory (default: a temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--no-polars",
        dest="polars",
        action="store_false",
        help="skip the `--engine polars` builds",
    )
    parser.add_argument(
        "--spark",
        action="store_true",
        help="also build with `--engine spark` (needs recpipe[spark]): spark_local_vs_duckdb_build",
    )
    parser.add_argument(
        "--spark-master", default=None, help="Spark master of the Spark builds (local[*])"
    )
    parser.add_argument(
        "--spark-scaleout",
        action="store_true",
        help="Spark scale-out mode: spark_driver_rss_growth, standalone build time per worker "
        "count, spark_local_vs_duckdb_build",
    )
    parser.add_argument(
        "--spark-rss-sizes",
        default="1000000,4000000",
        metavar="SIZES",
        help="Spark scale-out mode: requests of the driver RSS builds (1000000,4000000)",
    )
    parser.add_argument(
        "--spark-workers",
        default="1,2",
        metavar="COUNTS",
        help="Spark scale-out mode: standalone cluster worker counts (1,2)",
    )
    parser.add_argument(
        "--spark-partitions",
        type=int,
        default=None,
        help="Spark scale-out mode: --spark-partitions of its builds (Spark's default)",
    )
    parser.add_argument(
        "--scale",
        default=None,
        metavar="SIZES",
        help="scale mode: requests per run, comma-separated (e.g. 1000000,4000000): seconds "
        "per million rows per engine and size",
    )
    parser.add_argument(
        "--scale-engines",
        default=None,
        metavar="ENGINES",
        help="scale mode: only these engines, comma-separated (default: duckdb, polars unless "
        "--no-polars, spark with --spark); the other engines' figures at the same sizes are kept",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON ({RESULTS})")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 50_000 if args.quick else 1_000_000
    if args.requests < 1:
        parser.error(f"`--requests` must be >= 1, got {args.requests}")
    if args.repeat < 1:
        parser.error(f"`--repeat` must be >= 1, got {args.repeat}")
    if args.scale is not None:
        try:
            args.scale = [int(v) for v in args.scale.split(",")]
        except ValueError:
            parser.error(
                f"`--scale` must be request counts like 1000000,4000000, got {args.scale!r}"
            )
        if not args.scale or min(args.scale) < 1:
            parser.error(f"`--scale` sizes must be >= 1, got {args.scale}")
    for name in ("spark_rss_sizes", "spark_workers"):
        try:
            setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v.strip()])
        except ValueError:
            parser.error(f"`--{name.replace('_', '-')}` must be integers like 1,2")
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be integers >= 1")
    if args.scale_engines is None:
        args.scale_engines = ["duckdb", *(["polars"] if args.polars else [])]
        args.scale_engines += ["spark"] if args.spark else []
    else:
        args.scale_engines = [e.strip() for e in args.scale_engines.split(",") if e.strip()]
        unknown = sorted(set(args.scale_engines) - {"duckdb", "polars", "spark"})
        if unknown or not args.scale_engines:
            parser.error(
                f"`--scale-engines` must name duckdb, polars or spark, got {unknown or 'none'}"
            )
    return args


# --------------------------------------------------------------------------------------------
# Children: each measured step runs in its own process (wall time + peak RSS of that process).
# --------------------------------------------------------------------------------------------


def _child(spec: dict[str, Any]) -> None:
    """Run one step described by ``spec`` and write its result JSON to ``spec['result']``."""
    try:
        result = _CHILD_STEPS[spec["kind"]](spec)
    except Exception as exc:
        Path(spec["result"]).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise
    Path(spec["result"]).write_text(json.dumps(result, default=str))


def _child_build(spec: dict[str, Any]) -> dict[str, Any]:
    from etl.build import BuildConfig, build

    config = BuildConfig(**spec["config"])
    startup = None
    if config.engine == "spark":  # the JVM's start-up, timed apart from the build
        from etl.spark_env import spark_session

        start = time.perf_counter()
        spark_session(master=config.master)
        startup = time.perf_counter() - start
    cpu, start = _tree_cpu_s(), time.perf_counter()
    manifest = build(
        spec["features"], spec["out"], events=spec["events"], config=config, overwrite=True
    )
    return {
        "elapsed_s": time.perf_counter() - start,
        "cpu_s": _tree_cpu_s() - cpu,
        "manifest": manifest,
        "spark_startup_s": startup,
        "jvm_heap_peak_mb": _jvm_heap_peak_mb() if config.engine == "spark" else None,
    }


def _jvm_heap_peak_mb() -> float:
    """The Spark driver JVM's peak heap: the sum of its heap pools' peak use (MB)."""
    from pyspark.sql import SparkSession

    jvm = SparkSession.getActiveSession().sparkContext._jvm
    pools = jvm.java.lang.management.ManagementFactory.getMemoryPoolMXBeans()
    heap = [p for p in pools if str(p.getType().name()) == "HEAP"]
    return sum(p.getPeakUsage().getUsed() for p in heap) / 2**20


def _tree_cpu_s() -> float:
    """CPU seconds of this process and its live descendants (a Spark engine's JVM and its
    Python workers run there)."""
    import psutil

    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _child_oneliner(spec: dict[str, Any]) -> dict[str, Any]:
    import duckdb

    con = duckdb.connect(config={"threads": spec["threads"]} if spec["threads"] else {})
    out = spec["out"].replace("'", "''")  # COPY ... TO takes no bound parameter
    con.execute("SET VARIABLE inputs = $inputs", {"inputs": spec["features"]})
    cpu, start = time.process_time(), time.perf_counter()
    con.execute(
        "COPY (SELECT * FROM read_json(getvariable('inputs'), format = 'newline_delimited') "
        f"ORDER BY session_id, ts) TO '{out}' (FORMAT parquet, COMPRESSION zstd)"
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    rows = con.execute(f"SELECT count(*) FROM read_parquet('{out}')").fetchone()[0]
    return {"elapsed_s": elapsed, "cpu_s": cpu, "rows": rows}


_CHILD_STEPS = {"build": _child_build, "oneliner": _child_oneliner}


def _run_child(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``spec`` in a child process and measure it.

    Returns the child's result plus ``ok``, ``wall_s``, ``peak_rss_mb`` (the child's
    ``ru_maxrss`` from ``wait4`` where it is the child's own, else the polled figure) and
    ``polled_rss_mb`` (psutil, child and descendants, every 50 ms). A failed step has
    ``ok: False`` and ``error``.
    """
    import resource

    import psutil

    spec = {**spec, "result": str(work / f"_{spec['kind']}_{time.monotonic_ns()}.json")}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.etl", "--child", json.dumps(spec)], cwd=REPO
    )
    ps = psutil.Process(proc.pid)
    polled = own = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            tree = [ps, *ps.children(recursive=True)]
            rss = [p.memory_info().rss for p in tree]
            polled, own = max(polled, sum(rss)), max(own, rss[0])
        except psutil.Error:
            pass
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    result_path = Path(spec["result"])
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    # exec() keeps the high-water RSS of the forked parent image, so the child's ru_maxrss is
    # its own peak only when it exceeds the parent's; otherwise trust the polled figure.
    child_max = usage.ru_maxrss / 1024  # KiB on Linux
    parent_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    polled_mb = polled / 2**20
    result.update(
        ok=proc.returncode == 0,
        wall_s=time.perf_counter() - start,
        peak_rss_mb=max(child_max, polled_mb) if child_max > parent_max else polled_mb,
        polled_rss_mb=polled_mb,
        own_rss_mb=own / 2**20,  # the child process alone (a Spark driver's Python side)
        parent_rss_mb=parent_max,
    )
    if not result["ok"]:
        result.setdefault("error", f"exit code {proc.returncode}")
    return result


def _require(result: dict[str, Any], step: str) -> dict[str, Any]:
    if not result["ok"]:
        raise RuntimeError(f"benchmark step {step!r} failed: {result['error']}")
    return result


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


def _dir_bytes(root: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in root.rglob(pattern) if p.is_file())


def _uncompressed_bytes(files: list[Path]) -> int:
    import zstandard

    total = 0
    for path in files:
        with open(path, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh) as reader:
            while chunk := reader.read(1 << 24):
                total += len(chunk)
    return total


def _synth(work: Path, args: argparse.Namespace):
    from etl.synth import SynthConfig, generate

    start = time.perf_counter()
    raw = generate(
        work / "raw", SynthConfig(num_requests=args.requests, seed=args.seed), progress=True
    )
    return raw, time.perf_counter() - start


def _shard(raw, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, Any], float]:
    """Shard by session (comparing with routing by request); return (files, report, seconds)."""
    from etl.shard import ShardConfig, shard

    start = time.perf_counter()
    report = shard(
        raw.features,
        work / "shards",
        config=ShardConfig(num_shards=args.shards),
        overwrite=True,
        progress=True,
    )
    return [str(p) for p in report["shards"]], report, time.perf_counter() - start


def _stats(dataset: Path, args: argparse.Namespace):
    from etl.stats import compute_stats

    return compute_stats(dataset, batch_size=args.batch_size, threads=args.threads, progress=True)


def _build_config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"threads": args.threads, **extra}
    return {k: v for k, v in config.items() if v is not None}


def run_benchmark(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The default mode; returns the results dictionary."""
    raw, t_synth = _synth(work, args)
    shards, shard_report, t_shard = _shard(raw, work, args)
    events = [str(p) for p in raw.events]

    def build_spec(order: str, name: str) -> dict[str, Any]:
        config = _build_config(args, order=order)
        out = str(work / name)
        return {"kind": "build", "features": shards, "events": events, "out": out, "config": config}

    oneliner_spec = {
        "kind": "oneliner",
        "features": shards,
        "out": str(work / "oneliner.parquet"),
        "threads": args.threads,
    }
    polars = args.polars and args.threads is None
    polars_spec = {
        "kind": "build",
        "features": shards,
        "events": events,
        "out": str(work / "clustered_polars"),
        "config": {"order": "session", "engine": "polars"},
    }
    specs = {
        "clustered": (build_spec("session", "clustered"), "build clustered"),
        "oneliner": (oneliner_spec, "DuckDB one-liner"),
    }
    if polars:
        specs["polars"] = (polars_spec, "build --engine polars")
    if args.spark:
        specs["spark"] = (
            {**polars_spec, "out": str(work / "clustered_spark"), "config": _spark_config(args)},
            "build --engine spark",
        )
    runs = _alternated(specs, work, repeat=args.repeat)
    clustered, oneliner = runs["clustered"], runs["oneliner"]
    vs_oneliner = timing_ratio(runs, "clustered", "oneliner")
    engines: dict[str, Any] = {"polars_vs_duckdb_build": None}
    if polars:
        vs_duckdb = timing_ratio(runs, "polars", "clustered")
        engines = {
            "build_polars_s": _median_wall(runs["polars"]),
            "build_polars_s_runs": [t.wall_s for t in runs["polars"]],
            "build_polars_peak_rss_mb": max(t.value["peak_rss_mb"] for t in runs["polars"]),
            "polars_vs_duckdb_build": vs_duckdb["median"],
            "polars_vs_duckdb_build_spread": vs_duckdb,
            "polars_same_parquet": _same_parts(work / "clustered", work / "clustered_polars"),
        }
    if args.spark:
        vs_duckdb = timing_ratio(runs, "spark", "clustered")
        engines |= {
            "build_spark_s": _median_wall(runs["spark"]),
            "build_spark_s_runs": [t.wall_s for t in runs["spark"]],
            "build_spark_startup_s": statistics.median(
                t.value["spark_startup_s"] for t in runs["spark"]
            ),
            "build_spark_peak_rss_mb": max(t.value["peak_rss_mb"] for t in runs["spark"]),
            "spark_master": _spark_config(args)["master"],
            "spark_local_vs_duckdb_build": vs_duckdb["median"],
            "spark_local_vs_duckdb_build_spread": vs_duckdb,
            "spark_same_rows": _same_rows(work / "clustered", work / "clustered_spark"),
        }
    print("[etl bench] build time-ordered", file=sys.stderr)
    timed = _require(_run_child(build_spec("time", "time_ordered"), work), "build time-ordered")
    print("[etl bench] stats", file=sys.stderr)
    t0 = time.perf_counter()
    st_clustered = _stats(work / "clustered", args)
    t_stats_clustered = time.perf_counter() - t0
    t0 = time.perf_counter()
    st_timed = _stats(work / "time_ordered", args)
    t_stats_timed = time.perf_counter() - t0

    bytes_clustered = _dir_bytes(work / "clustered", "part-*.parquet")
    bytes_timed = _dir_bytes(work / "time_ordered", "part-*.parquet")
    bytes_oneliner = (work / "oneliner.parquet").stat().st_size
    manifest = clustered[-1].value["manifest"]
    rows_in = int(manifest.get("rows_in", raw.num_requests))
    users = [f for f in st_clustered.features if f.kind == "user"]
    user_values = sum(f.values for f in users) or 1

    return {
        "requests": raw.num_requests,
        "seed": args.seed,
        "shards": args.shards,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "raw_bytes": _dir_bytes(raw.root, "*.zst"),
        "rows_in": rows_in,
        "rows_out": int(manifest.get("rows_out", st_clustered.rows)),
        "sessions": st_clustered.sessions.sessions,
        "parquet_bytes_clustered": bytes_clustered,
        "parquet_bytes_time_ordered": bytes_timed,
        "parquet_bytes_duckdb_oneliner": bytes_oneliner,
        "parquet_ratio_time_vs_clustered": bytes_timed / bytes_clustered,
        "shard_ratio_session_vs_request": shard_report.get("shard_ratio_session_vs_request"),
        "shard_bytes": shard_report.get("compare"),
        "build_s": _median_wall(clustered),
        "build_time_ordered_s": timed["elapsed_s"],
        "duckdb_oneliner_s": _median_wall(oneliner),
        "repeat": args.repeat,
        "build_s_runs": [t.wall_s for t in clustered],
        "build_cpu_s_runs": [t.cpu_s for t in clustered],
        "duckdb_oneliner_s_runs": [t.wall_s for t in oneliner],
        "duckdb_oneliner_cpu_s_runs": [t.cpu_s for t in oneliner],
        "duckdb_oneliner_rows": oneliner[-1].value["rows"],
        "build_rows_per_s": rows_in / _median_wall(clustered),
        "build_vs_duckdb_oneliner": vs_oneliner["median"],
        "build_vs_duckdb_oneliner_spread": vs_oneliner,
        "build_peak_rss_mb": max(t.value["peak_rss_mb"] for t in clustered),
        # where the last clustered build's wall and CPU seconds went, phase by phase (a phase
        # whose CPU is well under twice its wall leaves a core idle on 2 cores)
        "build_phase_s": manifest.get("phase_s"),
        "build_phase_cpu_s": manifest.get("phase_cpu_s"),
        "build_time_ordered_peak_rss_mb": timed["peak_rss_mb"],
        "duckdb_oneliner_peak_rss_mb": max(t.value["peak_rss_mb"] for t in oneliner),
        "synth_s": t_synth,
        "shard_s": t_shard,
        "stats_clustered_s": t_stats_clustered,
        "stats_time_ordered_s": t_stats_timed,
        "samples_per_session_mean": st_clustered.sessions.mean,
        "samples_per_batch_session_clustered": st_clustered.samples_per_batch_session,
        "samples_per_batch_session_time_ordered": st_timed.samples_per_batch_session,
        "user_exact_dup_pct": 100.0 * sum(f.d * f.values for f in users) / user_values,
        "user_byte_share": sum(f.byte_share for f in users),
        "dedup_factor_all_sparse_clustered": st_clustered.sparse_factor,
        "dedup_factor_all_sparse_time_ordered": st_timed.sparse_factor,
        "dedup_factor_clustered": st_clustered.measured_factors,
        "dedup_factor_time_ordered": st_timed.measured_factors,
        "dedup_factor_model_clustered": st_clustered.model_factors,
        "dedup_factor_model_time_ordered": st_timed.model_factors,
        "proposed_groups_clustered": [list(g) for g in st_clustered.proposed_groups],
        "proposed_groups_time_ordered": [list(g) for g in st_timed.proposed_groups],
        "parquet_settings": manifest.get("parquet"),
        **engines,
    }


def _spark_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"order": "session", "engine": "spark", "master": args.spark_master or "local[*]"}


def run_scale(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Scale mode: each engine's seconds per million input rows at each of ``args.scale``."""
    from etl.synth import SynthConfig, generate

    engines = args.scale_engines
    configs = {
        "duckdb": _build_config(args, order="session"),
        "polars": {"order": "session", "engine": "polars"},
        "spark": _spark_config(args),
    }
    per_engine: dict[str, dict[str, Any]] = {e: {} for e in engines}
    for size in args.scale:
        raw = generate(
            work / f"raw-{size}", SynthConfig(num_requests=size, seed=args.seed), progress=True
        )
        inputs = {
            "features": [str(p) for p in raw.features],
            "events": [str(p) for p in raw.events],
        }
        specs = {
            e: (
                {
                    "kind": "build",
                    **inputs,
                    "out": str(work / f"scale-{size}-{e}"),
                    "config": configs[e],
                },
                f"scale {size:,}: build --engine {e}",
            )
            for e in engines
        }
        load = os.getloadavg()[0]  # the box is shared: how busy it was when this size started
        runs = _alternated(specs, work, repeat=args.repeat, warmup=False)
        for e in engines:
            rows = int(runs[e][-1].value["manifest"]["rows_in"])
            wall = _median_wall(runs[e])
            cpu = statistics.median(t.cpu_s for t in runs[e])
            per_engine[e][str(size)] = {
                "rows_in": rows,
                "load_average": load,
                "s": wall,
                "cpu_s": cpu,
                "s_runs": [t.wall_s for t in runs[e]],
                "s_per_million_rows": wall / (rows / 1e6),
                "cpu_s_per_million_rows": cpu / (rows / 1e6),
            }
        for e in engines:
            shutil.rmtree(work / f"scale-{size}-{e}", ignore_errors=True)
        shutil.rmtree(work / f"raw-{size}", ignore_errors=True)
    lo, hi = str(min(args.scale)), str(max(args.scale))
    return {
        "sizes": list(args.scale),
        "repeat": args.repeat,
        "engines": per_engine,
        "growth": {
            e: per_engine[e][hi]["s_per_million_rows"] / per_engine[e][lo]["s_per_million_rows"]
            for e in engines
        },
    }


def merge_scale(kept: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` scale figures, with the engines it did not run taken from ``kept`` when ``kept``
    measured the same sizes (Spark's builds take long enough to be run on their own).

    >>> a = {"sizes": [1], "repeat": 1, "engines": {"duckdb": {}}, "growth": {"duckdb": 1.0}}
    >>> b = {"sizes": [1], "repeat": 1, "engines": {"spark": {}}, "growth": {"spark": 2.0}}
    >>> sorted(merge_scale(a, b)["growth"].items())
    [('duckdb', 1.0), ('spark', 2.0)]
    >>> sorted(merge_scale({**a, "sizes": [2]}, b)["engines"])
    ['spark']
    """
    if not kept or kept.get("sizes") != new["sizes"]:
        return new
    engines = {**kept["engines"], **new["engines"]}
    growth = {**kept["growth"], **new["growth"]}
    return {**new, "engines": engines, "growth": growth}


def _alternated(
    specs: dict[str, tuple[dict[str, Any], str]], work: Path, *, repeat: int, warmup: bool = True
) -> dict[str, list[Timing]]:
    """Run each child step ``repeat`` times alternated (after a warm-up run each unless
    ``warmup`` is false, order rotating); each :class:`Timing` holds the child's own wall and CPU seconds and its result."""

    def case(name: str):
        spec, label = specs[name]

        def run() -> dict[str, Any]:
            print(f"[etl bench] {label}", file=sys.stderr)
            return _require(_run_child(spec, work), label)

        return run

    runs = alternate({name: case(name) for name in specs}, repeats=repeat, warmup=warmup)
    return {
        name: [Timing(t.value["elapsed_s"], t.value["cpu_s"], t.value) for t in timings]
        for name, timings in runs.items()
    }


def _median_wall(timings: list[Timing]) -> float:
    return statistics.median(t.wall_s for t in timings)


def _same_parts(a: Path, b: Path) -> bool:
    """Whether two datasets' part files have the same names and bytes."""
    parts_a = sorted(p.relative_to(a) for p in a.rglob("part-*.parquet"))
    parts_b = sorted(p.relative_to(b) for p in b.rglob("part-*.parquet"))
    return parts_a == parts_b and all((a / p).read_bytes() == (b / p).read_bytes() for p in parts_a)


def _same_rows(a: Path, b: Path) -> bool:
    """Whether two datasets' part files, read in their manifests' order, hold the same rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(root: Path) -> pa.Table | None:
        files = json.loads((root / "_manifest.json").read_text())["files"]
        tables = [pq.read_table(root / f["path"], partitioning=None) for f in files]
        return pa.concat_tables(tables) if tables else None

    ta, tb = rows(a), rows(b)
    return (ta is None and tb is None) or (ta is not None and tb is not None and ta.equals(tb))


def run_spark_scaleout(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Spark scale-out mode (the module docstring); returns ``spark_scaleout``."""
    from etl.build.spark_cluster import standalone_cluster
    from etl.synth import SynthConfig, generate

    spark = {**_spark_config(args), "spark_partitions": args.spark_partitions}
    spark = {k: v for k, v in spark.items() if v is not None}

    def inputs(size: int) -> dict[str, Any]:
        raw = generate(
            work / f"raw-{size}", SynthConfig(num_requests=size, seed=args.seed), progress=True
        )
        return {"features": [str(p) for p in raw.features], "events": [str(p) for p in raw.events]}

    rss: dict[str, Any] = {}
    for size in sorted(set(args.spark_rss_sizes)):
        spec = {"kind": "build", **inputs(size), "out": str(work / f"rss-{size}"), "config": spark}
        print(f"[etl bench] spark driver RSS at {size:,} requests", file=sys.stderr)
        got = _require(_run_child(spec, work), f"spark build at {size:,}")
        rss[str(size)] = {
            "rows_in": got["manifest"]["rows_in"],
            "s": got["elapsed_s"],
            "python_driver_peak_rss_mb": got["own_rss_mb"],
            "jvm_heap_peak_mb": got["jvm_heap_peak_mb"],
            "tree_peak_rss_mb": got["polled_rss_mb"],
            "load_average": os.getloadavg()[0],
        }
        shutil.rmtree(work / f"rss-{size}", ignore_errors=True)
        if size != args.requests:
            shutil.rmtree(work / f"raw-{size}", ignore_errors=True)
    lo, hi = str(min(args.spark_rss_sizes)), str(max(args.spark_rss_sizes))
    main = inputs(args.requests)
    specs = {
        "duckdb": ({"kind": "build", **main, "out": str(work / "duckdb"), "config": {}}, "duckdb"),
        "spark": (
            {"kind": "build", **main, "out": str(work / "spark"), "config": spark},
            "spark local",
        ),
    }
    runs = _alternated(specs, work, repeat=args.repeat)
    vs_duckdb = timing_ratio(runs, "spark", "duckdb")
    same = _same_rows(work / "duckdb", work / "spark")
    standalone: dict[str, Any] = {}
    for workers in args.spark_workers:
        with standalone_cluster(work / f"cluster-{workers}", workers=workers) as url:
            config = {**spark, "master": url}
            spec = {"kind": "build", **main, "out": str(work / "standalone"), "config": config}
            label = f"spark standalone, {workers} worker(s)"
            timed = _alternated(
                {"standalone": (spec, label)}, work, repeat=args.repeat, warmup=False
            )
        walls = [t.wall_s for t in timed["standalone"]]
        standalone[str(workers)] = {
            "s": statistics.median(walls),
            "s_runs": walls,
            "spread": {"min": min(walls), "median": statistics.median(walls), "max": max(walls)},
            "python_driver_peak_rss_mb": max(t.value["own_rss_mb"] for t in timed["standalone"]),
            "jvm_driver_heap_peak_mb": max(
                t.value["jvm_heap_peak_mb"] for t in timed["standalone"]
            ),
            "same_rows_as_duckdb": _same_rows(work / "duckdb", work / "standalone"),
        }
    return {
        "requests": args.requests,
        "repeat": args.repeat,
        "spark_partitions": args.spark_partitions,
        "rss_sizes": sorted(set(args.spark_rss_sizes)),
        "rss": rss,
        "spark_driver_rss_growth": rss[hi]["python_driver_peak_rss_mb"]
        / rss[lo]["python_driver_peak_rss_mb"],
        "spark_jvm_heap_growth": rss[hi]["jvm_heap_peak_mb"] / rss[lo]["jvm_heap_peak_mb"],
        "spark_local_vs_duckdb_build": vs_duckdb["median"],
        "spark_local_vs_duckdb_build_spread": vs_duckdb,
        "build_duckdb_s_runs": [t.wall_s for t in runs["duckdb"]],
        "build_spark_local_s_runs": [t.wall_s for t in runs["spark"]],
        "spark_same_rows": same,
        "build_spark_standalone": standalone,
        "load_average": os.getloadavg()[0],
    }


def run_out_of_core(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Out-of-core mode: the clustered build alone under ``--memory-limit``."""
    raw, t_synth = _synth(work, args)
    compressed = _dir_bytes(raw.root, "*.zst")
    uncompressed = _uncompressed_bytes([*raw.features, *raw.events])
    limit = _parse_bytes(args.memory_limit)
    print(f"[etl bench] out-of-core build, memory limit {args.memory_limit}", file=sys.stderr)
    result = _run_child(
        {
            "kind": "build",
            "features": [str(p) for p in raw.features],
            "events": [str(p) for p in raw.events],
            "out": str(work / "clustered"),
            "config": _build_config(
                args, order="session", memory_limit=args.memory_limit, spill_dir=str(work / "spill")
            ),
        },
        work,
    )
    rows_in = int(result.get("manifest", {}).get("rows_in", raw.num_requests))
    return {
        "ok": result["ok"],
        "error": result.get("error"),
        "requests": raw.num_requests,
        "memory_limit": args.memory_limit,
        "raw_bytes_compressed": compressed,
        "raw_bytes_uncompressed": uncompressed,
        "raw_uncompressed_vs_limit": uncompressed / limit,
        "raw_compressed_vs_limit": compressed / limit,
        "rows_out": result.get("manifest", {}).get("rows_out"),
        "build_s": result["wall_s"] if not result["ok"] else result["elapsed_s"],
        "build_rows_per_s": rows_in / result["elapsed_s"] if result["ok"] else None,
        "peak_rss_mb": result["peak_rss_mb"],
        "polled_rss_mb": result["polled_rss_mb"],
        "bench_parent_rss_mb": result["parent_rss_mb"],
        "peak_rss_target_mb": PEAK_RSS_TARGET_MB,
        "synth_s": t_synth,
    }


def _parse_bytes(text: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    value = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if value.endswith(unit):
            return float(value[: -len(unit)]) * scale
    return float(value)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def format_results(results: dict[str, Any]) -> str:
    """A plain-text table of the headline figures and the per-feature dedup factors."""
    lines = []
    r = results
    if "parquet_ratio_time_vs_clustered" in r:
        lines.append(
            f"ETL benchmark: {r['requests']:,} requests, {r['rows_out']:,} rows, "
            f"{r['sessions']:,} sessions"
        )
        mb_time, mb_clustered = (
            r["parquet_bytes_time_ordered"] / 1e6,
            r["parquet_bytes_clustered"] / 1e6,
        )
        shard = r["shard_ratio_session_vs_request"]
        rss_other = (
            f"time-ordered {r['build_time_ordered_peak_rss_mb']:,.0f}, "
            f"one-liner {r['duckdb_oneliner_peak_rss_mb']:,.0f}"
        )
        batch = f"B={r['batch_size']}"
        rows = [
            (
                "parquet_ratio_time_vs_clustered",
                f"{r['parquet_ratio_time_vs_clustered']:.2f}x",
                f"{mb_time:.1f} MB / {mb_clustered:.1f} MB",
            ),
            (
                "shard_ratio_session_vs_request",
                "n/a" if shard is None else f"{shard:.2f}x",
                "bytes routed by request / by session",
            ),
            ("build_rows_per_s", f"{r['build_rows_per_s']:,.0f}", f"build {r['build_s']:.1f} s"),
            (
                "build_vs_duckdb_oneliner",
                f"{r['build_vs_duckdb_oneliner']:.2f}x",
                _spread_text(r["build_vs_duckdb_oneliner_spread"]),
            ),
            ("build_peak_rss_mb", f"{r['build_peak_rss_mb']:,.0f}", rss_other),
        ]
        if r.get("build_phase_cpu_s"):
            rows.append(("build phases, wall/CPU s", "", _phases_text(r)))
        for engine, key, detail in (
            ("polars", "polars_vs_duckdb_build", "{build_polars_peak_rss_mb:,.0f} MB"),
            (
                "spark",
                "spark_local_vs_duckdb_build",
                "{spark_master}, JVM start {build_spark_startup_s:.1f} s apart",
            ),
        ):
            if r.get(key) is not None:
                same = "byte-identical parts" if r[f"{engine}_same_parquet"] else "PARTS DIFFER"
                spread = _spread_text(r[f"{key}_spread"])
                rows.append((key, f"{r[key]:.2f}x", f"{spread}; {detail.format(**r)}; {same}"))
        rows += [
            (
                "dedup factor, all sparse",
                f"{r['dedup_factor_all_sparse_clustered']:.2f}x",
                f"time-ordered {r['dedup_factor_all_sparse_time_ordered']:.2f}x, {batch}",
            ),
            ("samples per session", f"{r['samples_per_session_mean']:.2f}", "mean"),
            ("S per batch, clustered", f"{r['samples_per_batch_session_clustered']:.2f}", batch),
            (
                "S per batch, time order",
                f"{r['samples_per_batch_session_time_ordered']:.2f}",
                batch,
            ),
            ("user exact-dup %", f"{r['user_exact_dup_pct']:.1f}", "id-weighted, user features"),
            ("user byte share", f"{100 * r['user_byte_share']:.1f}%", "of logical feature bytes"),
        ]
        lines += _aligned(("metric", "value", "detail"), rows)
        for key, (op, target) in TARGETS.items():
            value = r.get(key)
            ok = value is not None and (value >= target if op == ">=" else value <= target)
            lines.append(f"target {key} {op} {target}: {'met' if ok else 'MISSED'}")
        lines += ["", f"DedupeFactor per feature at {batch} (measured; model in parentheses)"]
        feats = [
            (
                name,
                _factors(r["dedup_factor_clustered"], r["dedup_factor_model_clustered"], name),
                _factors(
                    r["dedup_factor_time_ordered"], r["dedup_factor_model_time_ordered"], name
                ),
            )
            for name in r["dedup_factor_clustered"]
        ]
        lines += _aligned(("feature", "clustered", "time-ordered"), feats)
    scale = r.get("scale")
    if scale:
        sizes = [str(n) for n in scale["sizes"]]
        lines += ["", "scale: seconds per million input rows (wall; CPU in parentheses)"]
        rows = [
            (
                engine,
                *[
                    f"{v[n]['s_per_million_rows']:.2f} ({v[n]['cpu_s_per_million_rows']:.2f})"
                    for n in sizes
                ],
                f"{scale['growth'][engine]:.2f}x",
            )
            for engine, v in scale["engines"].items()
        ]
        lines += _aligned(("engine", *[f"{int(n):,} req" for n in sizes], "growth"), rows)
    ooc = r.get("out_of_core")
    if ooc:
        met = "met" if ooc["peak_rss_mb"] < ooc["peak_rss_target_mb"] else "MISSED"
        if not ooc.get("ok", True):
            met = "n/a, the build failed"
        lines += [
            "",
            f"out of core: {ooc['requests']:,} requests, memory limit {ooc['memory_limit']}",
        ]
        rows = [
            (
                "raw logs, uncompressed",
                f"{ooc['raw_bytes_uncompressed'] / 1e9:.2f} GB",
                f"{ooc['raw_uncompressed_vs_limit']:.1f}x the limit",
            ),
            (
                "raw logs, zstd",
                f"{ooc['raw_bytes_compressed'] / 1e9:.2f} GB",
                f"{ooc['raw_compressed_vs_limit']:.1f}x the limit",
            ),
            (
                "build",
                f"{ooc['build_s']:.1f} s",
                f"{ooc['build_rows_per_s']:,.0f} rows/s"
                if ooc.get("ok", True)
                else f"FAILED: {ooc['error'].splitlines()[0][:80]}",
            ),
            (
                "peak RSS",
                f"{ooc['peak_rss_mb']:,.0f} MB",
                f"target < {ooc['peak_rss_target_mb']:,.0f} MB: {met}",
            ),
        ]
        lines += _aligned(("metric", "value", "detail"), rows)
    return "\n".join(lines)


def _phases_text(r: dict[str, Any]) -> str:
    """``parse 8.1/13.9, write 3.2/5.0, ...``: the last clustered build's wall and CPU seconds
    per phase (CPU near twice the wall: both cores busy)."""
    wall, cpu = r["build_phase_s"], r["build_phase_cpu_s"]
    return ", ".join(f"{name} {wall[name]:.1f}/{cpu.get(name, 0.0):.1f}" for name in wall)


def _spread_text(ratio: dict[str, Any]) -> str:
    """``wall min-max over N, cpu median (min-max)`` of a :func:`timing_ratio`."""
    wall, cpu = ratio["wall"], ratio["cpu"]
    return (
        f"wall {wall['min']:.2f}-{wall['max']:.2f} over {wall['repeats']}, "
        f"cpu {cpu['median']:.2f}x ({cpu['min']:.2f}-{cpu['max']:.2f})"
    )


def _factors(measured: dict[str, float], model: dict[str, float], name: str) -> str:
    return f"{measured[name]:.2f}x ({model[name]:.2f}x)"


def _aligned(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    out = []
    for i, row in enumerate(table):
        out.append(
            "  ".join(
                c.ljust(w) if j != 1 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="recpipe-etl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    try:
        if args.memory_limit is not None:
            results = {k: v for k, v in previous.items() if k != "out_of_core"}
            results["out_of_core"] = run_out_of_core(args, work)
        elif args.spark_scaleout:
            results = {k: v for k, v in previous.items() if k != "spark_scaleout"}
            results["spark_scaleout"] = run_spark_scaleout(args, work)
        elif args.scale is not None:
            results = {k: v for k, v in previous.items() if k != "scale"}
            results["scale"] = merge_scale(previous.get("scale"), run_scale(args, work))
        else:
            results = run_benchmark(args, work)
            for kept in ("out_of_core", "scale", "spark_scaleout"):
                if kept in previous:
                    results[kept] = previous[kept]
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    results.pop("environment", None)
    write_results(results, args.out)
    print(format_results(results))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
