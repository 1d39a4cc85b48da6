"""``recpipe etl {shard,build}``: the two ETL stages as one command group."""

from __future__ import annotations

import argparse

__all__ = ["register_cli"]


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``etl`` with its ``shard`` and ``build`` subcommands."""
    from etl import build, shard

    parser = subparsers.add_parser(
        "etl",
        help="raw logs -> session-clustered zstd Parquet (shard, build)",
        description=(
            "Turn raw inference logs into a session-clustered, zstd-compressed Parquet dataset. "
            "`shard` routes feature logs to N zstd shards by session (RecD O1); `build` "
            "validates, sessionizes, joins labels, clusters by session and writes Parquet (O2)."
        ),
    )
    stages = parser.add_subparsers(dest="stage", metavar="<stage>", required=True)
    shard.register_cli(stages)
    build.register_cli(stages)
