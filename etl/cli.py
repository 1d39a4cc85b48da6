"""``recpipe etl {validate,infer-schema,shard,build,verify}``: the ETL stages as one command group.

Before ``shard`` or ``build`` does any work, :func:`etl.paths.check_output` checks its ``--out``
against its inputs (the logs, ``--events``, ``--schema``) and the file system.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["register_cli"]

_Command = Callable[[argparse.Namespace], int]


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``etl`` with its ``validate``, ``infer-schema``, ``shard``, ``build`` and ``verify``
    subcommands."""
    from etl import build, infer_schema, shard, validate_logs, verify

    parser = subparsers.add_parser(
        "etl",
        help="raw logs -> session-clustered zstd Parquet (validate, infer-schema, shard, build, verify)",
        description=(
            "Turn raw inference logs (their format: docs/data-contract.md) into a "
            "session-clustered, zstd-compressed Parquet dataset. `validate` dry-runs the build "
            "over a sample and suggests schema fixes; `infer-schema` guesses a schema from a sample of the logs; `shard` routes feature logs to N zstd shards by session (RecD O1); `build` "
            "validates, sessionizes, joins labels, clusters by session and writes Parquet (O2); "
            "`verify` checks a built dataset against its manifest (sizes, sha256, page checksums)."
        ),
    )
    stages = parser.add_subparsers(dest="stage", metavar="<stage>", required=True)
    validate_logs.register_cli(stages)
    infer_schema.register_cli(stages)
    shard.register_cli(stages)
    build.register_cli(stages)
    verify.register_cli(stages)
    for stage, kind in (("shard", "shards"), ("build", "dataset")):
        stage_parser = stages.choices[stage]
        stage_parser.set_defaults(func=_checking_out(stage_parser.get_default("func"), kind))


def _checking_out(run: _Command, kind: str) -> _Command:
    """``run`` preceded by the check of ``--out`` against the stage's inputs."""

    def checked(args: argparse.Namespace) -> int:
        from etl.paths import check_output

        inputs = [args.inputs, getattr(args, "events", None), args.schema]
        check_output(args.out, kind=kind, inputs=inputs, overwrite=args.overwrite)
        return run(args)

    return checked
