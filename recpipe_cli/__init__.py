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

A failure ends in one line on stderr, ``recpipe <command>: error: ...``, and exit status 1: a
:class:`~recpipe.errors.RecpipeError` (a refusal, already phrased for the user), and an
``OSError`` or ``MemoryError`` that escapes the command (a full disk, a read-only file system, no
permission, too many open files, out of memory; torch's allocators, which raise
``RuntimeError``, too), as its ``strerror`` and the path it names;
one without a path (a full disk reports none) names the command's outputs instead, and a
failure to write stdout names ``'<stdout>'``. ``recpipe --verbose <command>`` prints the
traceback above that line. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import re
import sys
import traceback
from importlib import metadata
from typing import TextIO

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
    ("predict", "trainer.predict", "score or evaluate a dataset with a trained model"),
    ("export", "trainer.export", "write any checkpoint as one-process model weights"),
    ("store", "trainer.store.cli", "inspect a hybrid embedding store"),
    ("towers", "trainer.towers.cli", "partition features into towers; train a towered DLRM (SPTT)"),
)
"""``(command, module with register_cli, summary)`` in the order ``recpipe --help`` lists them."""

OUTPUTS: dict[str, tuple[str, ...]] = {
    "synth": ("out",),
    "etl shard": ("out",),
    "etl build": ("out", "spill_dir"),
    "etl infer-schema": ("out",),
    "stats": ("out",),
    "fit": ("out|dataset",),
    "train": ("checkpoint", "json", "metrics", "tensorboard"),
    "predict": ("out", "json"),
    "export": ("out",),
    "towers partition": ("out", "plot"),
    "towers train": ("json",),
}
"""Command -> the ``args`` attributes naming what it writes: named when a write fails with an
``OSError`` that names no file (a full disk reports only ``No space left on device``).
``"a|b"``: ``a`` if it was given, else ``b``."""

_LEADING_NAME = re.compile(r"`([A-Za-z_]\w*)`")
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def build_parser(
    command: str | None = None, *, summaries_only: bool = False
) -> argparse.ArgumentParser:
    """Build the top-level parser.

    Args:
        command: when given, only that subcommand's module is imported (so ``recpipe etl ...``
            never imports torch through the reader service); otherwise all of them.
        summaries_only: import no subcommand module: each command is only its name and summary
            (what ``recpipe --help`` and a bare ``recpipe`` show, without importing torch).
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
        if summaries_only or (command is not None and name != command):
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
    parser = build_parser(command, summaries_only=command is None)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    _apply_loudness(args)
    args.explicit = explicit_dests(parser, args, argv)
    real_stdout = sys.stdout
    if sys.stdout is sys.__stdout__ and sys.stdout is not None:
        sys.stdout = _NamedStdout(sys.stdout)  # type: ignore[assignment]
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a full disk or a closed pipe behind stdout fails here, not at exit
        return code
    except RecpipeError as exc:
        return _fail(args, with_flags(str(exc), given_flags(parser, args)))
    except OSError as exc:
        if exc.filename == _NamedStdout.NAME:
            _silence_stdout()
        return _fail(args, os_error_message(exc, outputs=_outputs(args)), exc)
    except MemoryError as exc:
        detail = f" ({exc})" if str(exc) else ""
        return _fail(args, f"out of memory{detail}", exc)
    except RuntimeError as exc:
        if not _out_of_memory(exc):
            raise
        return _fail(args, f"out of memory ({str(exc).splitlines()[0]})", exc)
    except KeyboardInterrupt:
        print(f"recpipe {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = real_stdout


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """``{dest: flag}`` of the options given a value other than their default in ``args``."""
    flags: dict[str, str] = {}
    while parser is not None:
        chosen = None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None) or "")
                continue
            given = getattr(args, action.dest, action.default) != action.default
            if action.option_strings and given and action.dest not in flags:
                long = [s for s in action.option_strings if s.startswith("--")]
                flags[action.dest] = (long or action.option_strings)[0]
        parser = chosen
    return flags


def explicit_dests(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> frozenset[str]:
    """The ``dest`` of every option written on the command line ``argv`` (by its name, an
    unambiguous prefix of it, or ``--name=value``), whatever its value: a command that merges
    saved settings (``train --resume``) keeps these and takes the rest from what it saved."""
    actions: list[argparse.Action] = []
    while parser is not None:
        chosen = None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None) or "")
            elif action.option_strings:
                actions.append(action)
        parser = chosen
    found: set[str] = set()
    for token in argv:
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        exact = [a for a in actions if name in a.option_strings]
        prefix = [a for a in actions if any(o.startswith(name) for o in a.option_strings)]
        hits = exact or (prefix if len({a.dest for a in prefix}) == 1 else [])
        found.update(a.dest for a in hits)
    return frozenset(found)


def with_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with the parameter name it starts with, in backticks, turned into the flag
    the user gave for it: the library names its parameters (``"`eval_fraction` must be ..."``);
    the user typed ``--eval-fraction``. Names later in a message (a key of an input file, say)
    are left alone.

    >>> with_flags("`eval_fraction` must be in [0, 1), got nan", {"eval_fraction": "--eval-fraction"})
    '`--eval-fraction` must be in [0, 1), got nan'
    """
    first = _LEADING_NAME.match(message)
    if first is None or first.group(1) not in flags:
        return message
    return f"`{flags[first.group(1)]}`{message[first.end() :]}"


def _fail(args: argparse.Namespace, message: str, exc: BaseException | None = None) -> int:
    """Print ``recpipe <command>: error: <message>`` (the traceback first with ``--verbose``)."""
    if exc is not None and args.global_verbose:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"recpipe {args.command}: error: {message}", file=sys.stderr)
    return 1


def os_error_message(exc: OSError, *, outputs: dict[str, str] | None = None) -> str:
    """One line for an ``OSError``: its ``strerror`` and the file(s) it names.

    A full disk, which names no file, names the ``outputs`` (flag -> path) the command writes.

    >>> os_error_message(PermissionError(errno.EACCES, "Permission denied", "/x/y"))
    "Permission denied: '/x/y'"
    >>> os_error_message(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b"))
    "Invalid cross-device link: '/a' -> '/b'"
    >>> os_error_message(OSError(errno.ENOSPC, "No space left on device"), outputs={"--out": "o"})
    "No space left on device, writing `--out` 'o'"
    """
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None:
        names = [exc.filename] if exc.filename2 is None else [exc.filename, exc.filename2]
        return f"{what}: " + " -> ".join(map(_path_repr, names))
    if exc.errno in _WRITE_ERRNOS and outputs:
        return f"{what}, writing " + ", ".join(f"`{f}` {p!r}" for f, p in outputs.items())
    return what


def _out_of_memory(exc: RuntimeError) -> bool:
    """Whether ``exc`` is torch running out of memory: its CPU allocator raises a plain
    ``RuntimeError`` (``DefaultCPUAllocator: can't allocate memory``), CUDA's a subclass."""
    torch = sys.modules.get("torch")
    cuda_oom = getattr(torch, "OutOfMemoryError", None)
    if isinstance(cuda_oom, type) and isinstance(exc, cuda_oom):
        return True
    return "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _path_repr(name: object) -> str:
    return repr(os.fsdecode(name)) if isinstance(name, (str, bytes, os.PathLike)) else repr(name)


def _outputs(args: argparse.Namespace) -> dict[str, str]:
    """``{flag: path}`` of the outputs :data:`OUTPUTS` lists for this command, as given."""
    sub = getattr(args, "stage", None) or getattr(args, "towers_command", None)
    name = f"{args.command} {sub}" if sub else args.command
    given = {}
    for choices in OUTPUTS.get(name, ()):
        dest = next((d for d in choices.split("|") if getattr(args, d, None) is not None), "")
        value = getattr(args, dest, None)
        if isinstance(value, (str, os.PathLike)):
            flag = f"--{dest.replace('_', '-')}" if dest != "dataset" else "DATASET"
            given[flag] = os.fspath(value)
    return given


class _NamedStdout:
    """``sys.stdout`` for the length of a command: an ``OSError`` writing it names ``'<stdout>'``
    (a full disk or a closed pipe behind stdout otherwise names no file)."""

    NAME = "<stdout>"

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror or str(exc), self.NAME) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror or str(exc), self.NAME) from exc

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Point file descriptor 1 at ``os.devnull``: what stdout still holds is dropped there, not
    written (and failed) again when the interpreter exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
