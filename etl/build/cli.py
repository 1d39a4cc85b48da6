"""``recpipe etl build``: the command line and the summary it prints."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from etl.build.config import ENGINES, MIN_ROW_GROUP_ROWS, BuildConfig, parse_bytes
from etl.build.driver import build
from recpipe.errors import DataError
from schemas import default_schema, load_schema

__all__ = ["format_summary", "register_cli"]


def format_summary(manifest: dict, out_dir: str | Path | None = None) -> str:
    """A one-screen summary of a build manifest."""
    m = manifest
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    lines = [
        f"etl build -> {out_dir}" if out_dir else "etl build",
        f"  rows in          {m['rows_in']:>12,}",
        f"  rows out         {m['rows_out']:>12,}   ({m['order']} order, {m['sessions']:,} sessions)",
        f"  quarantined      {m['rows_quarantined']:>12,}",
    ]
    if not m["rows_out"]:
        why = "the inputs hold no records" if not m["rows_in"] else "no record was kept"
        lines.insert(3, f"  !! 0 rows out: {why}; the dataset is empty (no part files)")
    lines += [f"    {r:<22}{n:>10,}" for r, n in m["quarantine_by_reason"].items() if n]
    if m["rows_sampled_out"]:
        lines.append(f"  sampled out      {m['rows_sampled_out']:>12,}")
    lines.append(
        f"  events in        {m['events_in']:>12,}   (quarantined {m['events_quarantined']:,}, "
        f"unknown request {m['events_unknown_request']:,}; requests without event "
        f"{m['rows_without_event']:,})"
    )
    if m["unknown_features"]:
        lines.append(f"  unknown features {_counted(m['unknown_features'])}")
    if m.get("unknown_keys"):
        lines.append(f"  unknown keys     {_counted(m['unknown_keys'])}   (top level: not read)")
    if m.get("features_missing"):
        valid = m["rows_in"] - m["rows_quarantined"]
        lines.append(f"  missing features {_counted(m['features_missing'], of=valid)}")
    ratio = m["compression_ratio"]
    lines += [
        f"  reconciles       {m['reconciles']}  (in = out + quarantined + sampled out)",
        f"  files            {len(m['files']):>12,}   row groups {m['row_groups']:,}, "
        f"sessions split across files {m.get('sessions_split_across_files', 0):,}",
        f"  bytes in / out   {mb(m['bytes_in'])} / {mb(m['bytes_out'])}   "
        f"(feature logs / Parquet = {f'{ratio}x' if ratio is not None else 'n/a'})",
        f"  parquet          zstd-{m['parquet']['level']}, row groups of "
        f"{m['parquet']['row_group_size']:,} rows, dictionary on "
        f"{len(m['parquet']['dictionary_columns'])} columns",
        f"  time             {m['elapsed_s']:.1f} s  {m.get('phase_s', {})}",
    ]
    lines += [f"  !! warning: {w}" for w in m.get("warnings", [])]
    return "\n".join(lines)


def _counted(counts: dict[str, int], *, of: int | None = None, shown: int = 8) -> str:
    """``name (n), ...`` for the largest counts (``of``: also the share of that many records)."""
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    share = (lambda n: f", {n / of:.0%}") if of else (lambda n: "")
    text = ", ".join(f"{k} ({n:,}{share(n)})" for k, n in top[:shown])
    return text + (f", and {len(top) - shown} more" if len(top) > shown else "")


def _parse_gap(text: str) -> int:
    """``30m``/``90s``/``2h``/``1500ms``/plain milliseconds -> milliseconds."""
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"`--session-gap` must look like 30m, 90s, 2h or 1500ms, got {text!r}"
        )
    return int(m.group(1)) * {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, None: 1}[m.group(2)]


def _parse_line_bytes(text: str) -> int:
    try:
        return parse_bytes(text, name="--max-line-bytes")
    except DataError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register_cli(stages: argparse._SubParsersAction) -> None:
    """Add ``build`` to the ``recpipe etl`` stages."""
    p = stages.add_parser(
        "build",
        help="validate, sessionize, join labels, cluster by session, write zstd Parquet",
        description=(
            "Build the session-clustered training dataset (RecD O2) from raw feature logs "
            "(and event logs; JSON Lines or Parquet, their format: docs/data-contract.md; "
            "`recpipe etl validate` checks them first): bad records go to OUT/_quarantine with a reason, sessions come "
            "from session_id or user_id + --session-gap, labels are the max over a request's "
            "events, rows are clustered by session and sorted by ts, and Parquet row groups "
            "never split a session. Runs out of core in DuckDB (--memory-limit, --spill-dir). "
            "The dataset appears atomically when the build succeeds. The engines and what "
            "they guarantee: docs/etl-engines.md."
        ),
    )
    d = BuildConfig()
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="feature logs: files, directories or globs"
    )
    p.add_argument(
        "--events",
        nargs="+",
        metavar="EV",
        help="event logs (labels; without them every label is 0)",
    )
    p.add_argument("--out", required=True, type=Path, help="dataset directory to create")
    p.add_argument("--schema", help="dataset schema TOML (default: the bundled example)")
    p.add_argument("--memory-limit", help="DuckDB memory limit, e.g. 512MB")
    p.add_argument("--spill-dir", type=Path, help="where DuckDB spills when over the limit")
    p.add_argument("--threads", type=int, help="DuckDB threads (default: all cores)")
    p.add_argument(
        "--session-gap",
        type=_parse_gap,
        default=d.session_gap_ms,
        metavar="GAP",
        help="inactivity gap splitting a user's sessions when records have no session_id (default 30m)",
    )
    p.add_argument(
        "--sample-sessions",
        type=float,
        default=1.0,
        metavar="P",
        help="keep a seeded fraction P of whole sessions (default 1.0)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --sample-sessions")
    p.add_argument(
        "--zstd-level", type=int, default=d.zstd_level, help=f"default {d.zstd_level} (measured)"
    )
    p.add_argument(
        "--row-group-size",
        type=int,
        default=d.row_group_size,
        help=f"most rows per row group, cut at session boundaries (default {d.row_group_size}, "
        "measured); smaller datasets get smaller groups, see --min-row-groups",
    )
    p.add_argument(
        "--min-row-groups",
        type=int,
        default=d.min_row_groups,
        help=f"row groups to aim at when the rows allow (default {d.min_row_groups}): a dataset "
        "with fewer rows than this many full groups gets smaller ones (at least "
        f"{MIN_ROW_GROUP_ROWS} rows); 1: groups of --row-group-size",
    )
    p.add_argument(
        "--order",
        choices=["session", "time"],
        default="session",
        help="session: clustered (default); time: the pre-RecD baseline, rows by ts",
    )
    p.add_argument(
        "--engine",
        choices=list(ENGINES),
        default="duckdb",
        help="duckdb (default): out of core; polars: in memory; spark: a Spark job, local or on "
        "a cluster (--master); the same dataset from each (polars and spark take no "
        "--memory-limit, --spill-dir or --threads)",
    )
    p.add_argument(
        "--master",
        metavar="URL",
        help="Spark master of --engine spark, e.g. spark://host:7077 (default local[*]); inputs "
        "and --out must be on a filesystem every executor sees under the same path",
    )
    p.add_argument(
        "--spark-partitions",
        type=int,
        metavar="N",
        help="partitions of --engine spark's shuffles and sort (default: Spark's parallelism; "
        "the output does not depend on it)",
    )
    p.add_argument(
        "--partition-by",
        choices=["none", "hour"],
        default="none",
        help="hour: write dt=YYYY-MM-DD-HH/ folders",
    )
    p.add_argument(
        "--max-line-bytes",
        type=_parse_line_bytes,
        default=d.max_line_bytes,
        metavar="SIZE",
        help="a longer input line is quarantined as line_too_long (its first 1 KB kept), e.g. "
        "16MB (default 64MiB)",
    )
    p.add_argument(
        "--fail-missing-share",
        type=float,
        default=d.fail_missing_share,
        metavar="P",
        help="fail when a schema feature is missing from at least a share P of the valid records "
        "(default 1.0: from every one)",
    )
    p.add_argument(
        "--allow-missing-features",
        action="store_true",
        help="build even when schema features are missing (they are still counted and reported)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--json", action="store_true", help="print the manifest as JSON instead of the summary"
    )
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    schema = load_schema(args.schema) if args.schema else default_schema()
    config = BuildConfig(
        memory_limit=args.memory_limit,
        spill_dir=args.spill_dir,
        threads=args.threads,
        session_gap_ms=args.session_gap,
        sample_sessions=args.sample_sessions,
        zstd_level=args.zstd_level,
        row_group_size=args.row_group_size,
        min_row_groups=args.min_row_groups,
        order=args.order,
        engine=args.engine,
        seed=args.seed,
        partition_by=args.partition_by,
        max_line_bytes=args.max_line_bytes,
        fail_missing_share=args.fail_missing_share,
        allow_missing_features=args.allow_missing_features,
        master=args.master,
        spark_partitions=args.spark_partitions,
    )
    manifest = build(
        args.inputs,
        args.out,
        events=args.events,
        schema=schema,
        config=config,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(json.dumps(manifest, indent=2) if args.json else format_summary(manifest, args.out))
    return 0
