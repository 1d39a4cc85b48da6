"""The ``recpipe`` command line: the one layer above ``etl``, ``readers`` and ``trainer``.

Each subcommand lives next to the code it drives and exposes ``register_cli(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed namespace, returning an exit
code). Modules are imported lazily by name so that ``recpipe etl ...`` never imports torch.
Nothing in the library imports this package; ``python -m recpipe_cli`` runs it too.

The command owns the process, so it is what configures Python ``logging`` (library code only
creates ``logging.getLogger(__name__)`` loggers): one stderr handler on each recpipe package's
logger, at INFO (``--verbose``: DEBUG; ``--quiet``: WARNING). ``recpipe --quiet <command>`` also
turns the command's progress bars and progress lines off (its ``args.quiet``, the one spelling
every command uses; older spellings such as ``--no-progress`` are set too).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib import metadata

from recpipe.errors import RecpipeError

__all__ = ["PACKAGES", "SUBCOMMANDS", "build_parser", "configure_logging", "main", "version"]

PACKAGES: tuple[str, ...] = ("recpipe", "recpipe_cli", "schemas", "etl", "readers", "trainer")
"""The import packages of the distribution: the loggers :func:`configure_logging` sets up."""

_HANDLER_NAME = "recpipe-cli"

SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("synth", "etl.synth_cli", "generate deterministic synthetic session logs"),
    ("etl", "etl.cli", "shard and build: raw logs -> session-clustered zstd Parquet"),
    ("stats", "etl.stats_cli", "DuckDB duplication statistics and dedup proposals"),
    ("fit", "readers.fit", "fit preprocessing (vocabularies, mean/std, buckets) on training rows"),
    ("serve", "readers.service", "serve preprocessed batches to trainers over TCP"),
    ("train", "trainer.cli", "train a DLRM with or without dedup"),
    ("store", "trainer.store.cli", "inspect a hybrid embedding store"),
    ("towers", "trainer.towers.cli", "partition features into towers; train a towered DLRM (SPTT)"),
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
    parser.add_argument("--version", action="version", version=f"recpipe {version()}")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-q", "--quiet", dest="global_quiet", action="store_true",
        help="no progress bars or progress lines in any command; log only warnings and errors",
    )  # fmt: skip
    loudness.add_argument(
        "-v", "--verbose", dest="global_verbose", action="store_true", help="log debug messages"
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module_name, summary in SUBCOMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, help=summary, add_help=False)
            continue
        importlib.import_module(module_name).register_cli(sub)
    return parser


def version() -> str:
    """The installed distribution's version (``"unknown"`` when not installed)."""
    try:
        return metadata.version("recpipe")
    except metadata.PackageNotFoundError:
        return "unknown"


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes (tests replace it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr


def configure_logging(level: int = logging.INFO) -> None:
    """Send the recpipe packages' log records at ``level`` and above to stderr.

    One handler per package logger (:data:`PACKAGES`), replaced on a second call; the root
    logger and other libraries' loggers are left alone.
    """
    handler = _StderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)


def _apply_loudness(args: argparse.Namespace) -> None:
    """``recpipe --quiet``: set the command's own switches; then configure logging."""
    if args.global_quiet:
        for name in ("quiet", "no_progress"):  # `no_progress`: the older spelling's dest
            if hasattr(args, name):
                setattr(args, name, True)
    quiet = args.global_quiet or bool(getattr(args, "quiet", False))
    level = logging.DEBUG if args.global_verbose else logging.WARNING if quiet else logging.INFO
    configure_logging(level)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``recpipe`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    known = {name for name, _, _ in SUBCOMMANDS}
    first = next((a for a in argv if not a.startswith("-")), None)  # global options take no value
    command = first if first in known else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    _apply_loudness(args)
    try:
        return int(args.func(args) or 0)
    except RecpipeError as exc:
        print(f"recpipe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"recpipe {args.command}: interrupted", file=sys.stderr)
        return 130
