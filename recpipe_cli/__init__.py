"""The ``recpipe`` command line: the one layer above ``etl``, ``readers`` and ``trainer``.

Each subcommand lives next to the code it drives and exposes ``register_cli(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed namespace, returning an exit
code). Modules are imported lazily by name so that ``recpipe etl ...`` never imports torch.
Nothing in the library imports this package; ``python -m recpipe_cli`` runs it too.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from recpipe.errors import RecpipeError

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("synth", "etl.synth", "generate deterministic synthetic session logs"),
    ("etl", "etl.cli", "shard and build: raw logs -> session-clustered zstd Parquet"),
    ("stats", "etl.stats", "DuckDB duplication statistics and dedup proposals"),
    ("serve", "readers.service", "serve preprocessed batches to trainers over TCP"),
    ("train", "trainer.cli", "train a DLRM with or without dedup"),
    ("store", "trainer.store.cli", "inspect a hybrid embedding store"),
)
"""``(command, module with register_cli, summary)`` in the order ``recpipe --help`` lists them."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser.

    Args:
        command: when given, only that subcommand's module is imported (so ``recpipe etl ...``
            never imports torch through the reader service); otherwise all of them, for
            ``--help``.
    """
    parser = argparse.ArgumentParser(
        prog="recpipe",
        description=(
            "recpipe: deduplicated data pipelines for session-centric recommendation logs "
            "(RecD end to end). Run `recpipe <command> --help` for a command's options."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module_name, summary in SUBCOMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, help=summary, add_help=False)
            continue
        importlib.import_module(module_name).register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``recpipe`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    known = {name for name, _, _ in SUBCOMMANDS}
    command = argv[0] if argv and argv[0] in known else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RecpipeError as exc:
        print(f"recpipe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"recpipe {args.command}: interrupted", file=sys.stderr)
        return 130
