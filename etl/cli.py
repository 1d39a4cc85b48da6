"""``recpipe etl {shard,build}``: the two ETL stages as one command group."""

from __future__ import annotations

import argparse

__all__ = ["register_cli"]


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``etl`` with its ``shard`` and ``build`` subcommands."""
    import importlib

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
    for name in ("etl.shard", "etl.build"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # TODO(lead): make strict once both stages land
            if exc.name == name:
                continue
            raise
        module.register_cli(stages)
