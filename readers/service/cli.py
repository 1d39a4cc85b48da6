"""``recpipe serve``: the reader service's command line (see :mod:`readers.service`).

The token clients must present comes from ``--token-file FILE`` or ``$RECPIPE_TOKEN``
(``--token`` works too, but a command line is visible to every user in ``ps``). A server that
listens beyond loopback (``--host 0.0.0.0``) without a token is refused unless ``--insecure``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from readers.service.config import TOKEN_ENV, ServiceConfig
from recpipe.config_cli import ConfigOptions, Option, add_config_options, add_quiet_option
from recpipe.errors import DataError

__all__ = ["read_token", "register_cli"]

# ServiceConfig's fields `recpipe serve` exposes (the rest keep their defaults).
_SERVER_OPTIONS = (
    "host", "port", "readers", "idle_readers", "queue_depth", "max_clients", "max_readers",
    "max_pending", "handshake_timeout_s", "report_every_s", "insecure",
)  # fmt: skip
_FLAGS = {"handshake_timeout_s": "--handshake-timeout", "report_every_s": "--report-every",
          "token": "--token"}  # fmt: skip
MAX_BATCH_SIZE = 1 << 24  # rows per batch
_MAX_COUNT = 1 << 30  # --warmup-batches, --read-ahead, --synthetic


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe serve`` to the top-level parser."""
    parser = subparsers.add_parser(
        "serve",
        help="serve preprocessed batches to trainers over TCP",
        description=(
            "Start reader processes that read a clustered dataset, convert and preprocess its "
            "batches (IKJT per dedup group with --dedup on), and stream them to trainers over "
            "TCP. Each client connection gets its own shard of the epoch and its own readers; "
            "trainers read with readers.service.ServiceDataset(host, port, token=...). "
            "Stop with SIGTERM or Ctrl-C."
        ),
    )
    parser.add_argument("dataset", nargs="?", help="clustered dataset directory (etl build output)")
    options = add_config_options(
        parser,
        ServiceConfig,
        include=_SERVER_OPTIONS,
        overrides={
            "handshake_timeout_s": Option(flag="--handshake-timeout", metavar="S"),
            "report_every_s": Option(flag="--report-every", metavar="S"),
        },
    )
    _add_token_options(parser)
    reader = _add_reader_config_options(parser)
    _add_reader_options(parser)
    add_quiet_option(parser)
    parser.set_defaults(func=lambda args: _cli_serve(args, options, reader))


def _add_reader_config_options(parser: argparse.ArgumentParser) -> ConfigOptions:
    """The :class:`~readers.source.ReaderConfig` options every command that reads batches
    exposes (:data:`~readers.source.COMMAND_READER_OPTIONS`), with the commands' defaults
    (shuffle on: ``--no-shuffle`` turns it off)."""
    from readers.source import COMMAND_READER_DEFAULTS, COMMAND_READER_OPTIONS, ReaderConfig

    overrides = {name: Option(default=value) for name, value in COMMAND_READER_DEFAULTS.items()}
    return add_config_options(
        parser.add_argument_group("reader"),
        ReaderConfig,
        include=COMMAND_READER_OPTIONS,
        overrides=overrides,
        owner=parser,
    )


def _flag(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _server_config(args: argparse.Namespace, options: ConfigOptions, token: str | None) -> Any:
    """The :class:`ServiceConfig` of the options; a bad value is one line naming its flag."""
    try:
        return ServiceConfig(**options.values(args), token=token)
    except DataError as exc:
        message = str(exc)
        for name in (*_SERVER_OPTIONS, "token"):
            message = message.replace(f"`{name}`", f"`{_flag(name)}`")
        raise DataError(message) from None


def _check_reader_options(args: argparse.Namespace) -> None:
    """Refuse a reader option no reader could run with, before anything starts.

    Raises:
        DataError: one line naming the flag and quoting the value.
    """
    counts = (
        ("batch_size", 1, MAX_BATCH_SIZE), ("warmup_batches", 0, _MAX_COUNT),
        ("read_ahead", 0, _MAX_COUNT), ("synthetic", 0, _MAX_COUNT),
        ("seed", 0, (1 << 63) - 1),
    )  # fmt: skip
    for name, least, most in counts:
        value = getattr(args, name)
        if value is not None and not least <= value <= most:
            msg = f"`{_flag(name)}` must be an integer in [{least}, {most:,}], got {value!r}"
            raise DataError(msg)
    if not 0.0 <= args.alpha <= 1.0:  # NaN too
        msg = f"`--alpha` must be a number in [0, 1], got {args.alpha!r}"
        raise DataError(msg)


def _add_token_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token",
        default=None,
        help=f"shared token clients must present. A token on the command line is visible to "
        f"every user in `ps`: prefer --token-file or ${TOKEN_ENV}",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"read the token from FILE (surrounding whitespace is dropped; default: ${TOKEN_ENV})",
    )


def _add_reader_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warmup-batches",
        type=int,
        default=20,
        help="batches a new reader process runs through the pipeline and drops before its first "
        "client, so that kernel loading is not paid while a trainer waits (default 20; 0: off)",
    )
    parser.add_argument(
        "--dedup",
        choices=["on", "off"],
        default="on",
        help="IKJT per dedup group (on) or one plain KJT (off)",
    )
    parser.add_argument(
        "--dedup-groups",
        default=None,
        metavar="auto|FILE",
        help="dedup groups to read with instead of the schema's: auto (the groups `recpipe "
        "stats` proposes at --batch-size) or a TOML file with a [dedup] table; no rebuild "
        "(trainers must use the same groups)",
    )
    parser.add_argument(
        "--extras",
        default="",
        metavar="COL,COL",
        help="dataset columns to deliver in Batch.extras, comma-separated (e.g. "
        "request_id,user_id: pass-through columns, strings as 64-bit keys, see "
        "docs/loaders.md); default: none, and they are not read",
    )
    parser.add_argument(
        "--preprocess",
        default=None,
        metavar="CONFIG",
        help="preprocessing config file (see readers.pipeline)",
    )
    parser.add_argument(
        "--fitted",
        default=None,
        metavar="FILE",
        help="the fitted state of the config's `fit` entries that `recpipe fit --out FILE` "
        "wrote (default: DATASET/_preprocess_fitted.json); refused if fitted on another "
        "dataset or for another config",
    )
    parser.add_argument(
        "--schema", default=None, help="schema TOML (default: the dataset's manifest)"
    )
    parser.add_argument(
        "--dispatch",
        choices=["contiguous", "esd", "laia", "random", "round-robin"],
        default="contiguous",
        help="which rows of each global batch a rank client trains on: contiguous (its own part "
        "of the stream), or a dispatch policy: esd (embedding-aware, least transfer cost), laia "
        "(cache locality), random, round-robin (see docs/dispatch.md)",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=1.0,
        metavar="A",
        help="esd: share of each global batch placed exactly (1: optimum of the cost model, "
        "0: greedy by regret; default 1)",
    )
    parser.add_argument(
        "--cache-rows",
        type=_numbers(int, zero=True),
        default=None,
        metavar="ROWS[,ROWS...]",
        help="dispatch: rows of each rank's embedding cache the dispatcher's shadow models, "
        "comma-separated (one value: every rank); give the trainers' --cache-rows (required "
        "with esd and laia, which place samples by those caches)",
    )
    parser.add_argument(
        "--bandwidths",
        type=_numbers(float),
        default=(1e9,),
        metavar="B[,B...]",
        help="dispatch: bytes/s of each rank's link, comma-separated (one value: every rank; "
        "default 1e9)",
    )
    parser.add_argument(
        "--synthetic",
        type=int,
        default=None,
        metavar="N",
        help="serve N synthetic batches instead of a dataset (checks the network path)",
    )


def _numbers(kind: type, *, zero: bool = False) -> Any:
    """An argparse type: comma-separated positive (``zero``: or zero) numbers of ``kind``, as
    a tuple."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or not all(v > 0 or (zero and v == 0) for v in values):
            what = "non-negative" if zero else "positive"
            msg = f"expected comma-separated {what} {kind.__name__}s, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return values

    return parse


def _dispatch_cut(args: argparse.Namespace) -> Any:
    """The rank cut ``--dispatch`` names (``None``: the contiguous default)."""
    if args.dispatch == "contiguous":
        return None
    from readers.dataset import dataset_schema
    from readers.dispatch.cut import rank_cut
    from schemas import load_schema

    if args.cache_rows is None and args.dispatch in ("esd", "laia"):
        msg = (
            f"`--dispatch {args.dispatch}` without `--cache-rows`: {args.dispatch} places samples "
            "by the rows each rank client's embedding cache holds; hint: give the trainers' "
            "`--cache-rows`, or dispatch without caches (`--dispatch random` or `round-robin`)"
        )
        raise DataError(msg)
    schema = dataset_schema(args.dataset) if args.schema is None else load_schema(args.schema)
    options = {} if args.cache_rows is None else {"cache_rows": args.cache_rows}
    # the rank clients' caches keep each row's home on its owner rank, as `recpipe train` does
    return rank_cut(args.dispatch, schema=schema, alpha=args.alpha, bandwidths=args.bandwidths,
                    homes="ranks", **options)  # fmt: skip


def read_token(*, token: str | None, token_file: Path | None) -> str | None:
    """The server's token: ``token``, else the contents of ``token_file``, else ``$RECPIPE_TOKEN``.

    Raises:
        DataError: both ``token`` and ``token_file`` are given, or the file cannot be read or
            holds no token.
    """
    if token is not None and token_file is not None:
        msg = "give `--token` or `--token-file`, not both"
        raise DataError(msg)
    if token_file is not None:
        try:
            text = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            msg = f"`--token-file` {os.fspath(token_file)!r}: cannot read the token: {exc}"
            raise DataError(msg) from exc
        if not text:
            msg = f"`--token-file` {os.fspath(token_file)!r} is empty"
            raise DataError(msg)
        return text
    return token if token is not None else os.environ.get(TOKEN_ENV) or None


def _cli_serve(
    args: argparse.Namespace, options: ConfigOptions, reader_options: ConfigOptions
) -> int:
    from readers.service.producers import BatchProducer, DatasetProducer, SyntheticProducer
    from readers.service.server import serve

    config = _server_config(args, options, read_token(token=args.token, token_file=args.token_file))
    _check_reader_options(args)
    reader_options.build(args)  # a value ReaderConfig refuses: one line naming its flag
    if args.quiet:  # no progress lines; the summary at the end stays
        config = dataclasses.replace(config, report_every_s=0.0)
    dedup = args.dedup == "on"
    if args.synthetic is not None and args.dispatch != "contiguous":
        msg = f"`--dispatch {args.dispatch}` needs a dataset, not --synthetic"
        raise DataError(msg)
    if args.synthetic is not None:
        producer: BatchProducer = SyntheticProducer(
            args.synthetic, batch_size=args.batch_size, dedup=dedup
        )
    elif args.dataset is None:
        msg = "`dataset` is required (or --synthetic N)"
        raise DataError(msg)
    elif not os.path.isdir(args.dataset):
        msg = f"`dataset` {args.dataset!r} is not a directory"
        raise DataError(msg)
    else:
        producer = DatasetProducer(
            args.dataset,
            cut=_dispatch_cut(args),
            batch_size=args.batch_size,
            dedup=dedup,
            preprocess=args.preprocess,
            fitted=args.fitted,
            schema=args.schema,
            dedup_groups=args.dedup_groups,
            shuffle=args.shuffle,
            seed=args.seed,
            warmup_batches=args.warmup_batches,
            read_ahead=args.read_ahead,
            verify=args.verify,
            on_error=args.on_error,
            extras=tuple(name.strip() for name in args.extras.split(",") if name.strip()),
        )
        # a dataset, schema, preprocessing config or extras column the readers cannot use
        # fails here, in one line, not in every reader once a client connects
        from readers.dataset import make_pipeline
        from readers.source import DatasetSource, ReaderConfig

        schema = producer.read_schema()
        DatasetSource(args.dataset, schema=schema, config=ReaderConfig(extras=producer.extras))
        make_pipeline(args.preprocess, schema, dataset=args.dataset, fitted=args.fitted)
        if args.dedup_groups is not None:  # "auto" runs the stats once, not in every reader
            producer = dataclasses.replace(
                producer, dedup_groups=[list(g) for g in schema.dedup_groups]
            )
    return serve(producer, config=config)
