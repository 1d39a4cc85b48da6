"""``recpipe etl build``: the command line and the summary it prints."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from etl.build.config import BuildConfig, parse_bytes
from etl.build.driver import build
from recpipe.config_cli import Option, add_config_options, add_quiet_option
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
    options = add_config_options(
        p,
        BuildConfig,
        exclude=("max_file_bytes", "dictionary"),
        overrides={
            "spill_dir": Option(type=Path),
            "session_gap_ms": Option(
                flag="--session-gap",
                metavar="GAP",
                type=_parse_gap,
                help="inactivity gap splitting a user's sessions when records have no "
                "session_id: 30m, 90s, 2h, 1500ms or milliseconds (default 30m)",
            ),
            "sample_sessions": Option(metavar="P"),
            "master": Option(metavar="URL"),
            "spark_partitions": Option(metavar="N"),
            "max_line_bytes": Option(metavar="SIZE", type=_parse_line_bytes),
            "fail_missing_share": Option(metavar="P"),
        },
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_quiet_option(p)
    p.add_argument(
        "--json", action="store_true", help="print the manifest as JSON instead of the summary"
    )
    p.set_defaults(func=lambda args: _run_cli(args, options.build(args)))


def _run_cli(args: argparse.Namespace, config: BuildConfig) -> int:
    schema = load_schema(args.schema) if args.schema else default_schema()
    manifest = build(
        args.inputs,
        args.out,
        events=args.events,
        schema=schema,
        config=config,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(json.dumps(manifest, indent=2) if args.json else format_summary(manifest, args.out))
    return 0
