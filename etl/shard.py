"""``recpipe etl shard``: route raw feature logs to N zstd shards by session (RecD O1).

Every line of the input goes to exactly one place:

- ``shard-NNNNN.jsonl.zst`` (N of them), chosen by a stable hash (BLAKE2b) of the session key:
  ``session_id`` when the record has one, else ``user_id``, so that sessions the build derives
  from the user and an inactivity gap stay in one shard. The line is copied verbatim.
- an event record among the feature logs (:func:`event_shaped`: the request id and the label,
  no feature) stops the shard with a :class:`~recpipe.errors.DataError` naming the file and
  line: routed as a feature line, it would be quarantined by the build as a duplicate of its
  request (event logs go to ``etl build --events``).
- ``_unroutable.jsonl.zst``: lines that cannot be routed (not JSON, not an object, no key, or
  longer than ``max_line_bytes``: only its first bytes are kept, with its length), as
  :func:`etl.rawio.unroutable_record` records with their source file and line number, so that
  the build quarantines them (an over-long line as ``line_too_long``). Nothing is dropped:
  ``_shard.json`` reconciles the line counts, and the build of the shards counts the same lines.

A file that is not UTF-8 text (binary, another encoding, corrupt) stops the shard with a
:class:`~recpipe.errors.CorruptInputError` naming the file and line, as it stops ``etl build``;
like any failed run, it leaves no output behind (the shards are written to a temporary
directory that is renamed into place only at the end).

Why session routing compresses better: the samples of a session repeat most of their bytes
(user features), so the closer they sit in a stream, the more zstd's match finder removes.
Routing by session puts them in the same shard; on top of that, each shard buffers its lines
and writes them *grouped by session* (first-seen order, stable within a session) before they
reach the compressor, so the repeats are adjacent instead of thousands of lines apart.
``compare`` measures this against routing by ``request_id`` with the same N and zstd level.

Two engines run it: ``local`` (this process) and ``spark`` (:mod:`etl.shard_spark`, a Spark job
running this module's reader, router and writer in its tasks), which writes the same shard
files and ``_unroutable.jsonl.zst`` byte for byte and the same counts.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import orjson
import zstandard

from etl import reasons
from etl.paths import check_output
from etl.rawio import (
    DEFAULT_MAX_LINE_BYTES,
    JSONL_PATTERNS,
    UNROUTABLE_NAME,
    expand_inputs,
    iter_raw_lines,
    unroutable_record,
)
from recpipe.config_cli import Option, add_config_options, add_quiet_option
from recpipe.errors import CorruptInputError, DataError, RecpipeError
from schemas import DatasetSchema, load_schema

__all__ = [
    "ENGINES",
    "READ_STEP",
    "READ_WIDTH",
    "ShardConfig",
    "ShardSink",
    "event_line_error",
    "event_shaped",
    "format_report",
    "make_report",
    "raw_lines",
    "read_position",
    "register_cli",
    "route_line",
    "shard",
    "shard_origins",
    "shard_path",
    "sink_specs",
    "unroutable_line",
    "unroutable_writer",
]

_log = logging.getLogger(__name__)

RouteBy = Literal["session", "request"]
Engine = Literal["local", "spark"]
#: engine name -> ``"module:function"`` running a shard into a temporary directory
#: (``(files, tmp, schema, config) -> report``); ``local`` is :func:`shard`'s own loop
ENGINES = {"spark": "etl.shard_spark:run"}

#: lines taken from each input file in turn
READ_STEP = 4096
#: input files read side by side
READ_WIDTH = 16
_MALFORMED = "malformed_json"
T = TypeVar("T")
_NO_KEY = "missing_session_key"


def shard_path(out_dir: str | Path, index: int) -> Path:
    """Path of shard ``index`` under ``out_dir``."""
    return Path(out_dir) / f"shard-{index:05d}.jsonl.zst"


@dataclass
class ShardConfig:
    """How to shard.

    Args:
        num_shards: number of output shards.
        by: routing key: ``"session"`` (RecD O1) or ``"request"`` (the baseline).
        zstd_level: zstd compression level of the shards, 1..22.
        group: group each shard's buffered lines by session before compressing them (off:
            arrival order inside each shard).
        buffer_mb: raw megabytes buffered across all shards before a flush (memory bound).
        compare: also compress the same lines routed the other ways (in memory, counting bytes
            only) and report ``shard_ratio_session_vs_request`` (off: skip the comparison
            with routing by request).
        max_line_bytes: a longer line goes to the unroutable records (``_unroutable``) as
            ``line_too_long`` (its first 1 KB and its length), never held whole.
        engine: ``"local"`` (this process) or ``"spark"`` (a Spark job, local or on a cluster,
            see ``master``: the same shard files byte for byte, the same unroutable file and
            counts).
        master: the Spark master URL of engine ``"spark"`` (None: the active session, else
            ``local[*]``), e.g. ``"spark://host:7077"``; the inputs and the output must be on a
            filesystem every executor sees under the same path.
        spark_partitions: partitions of the Spark engine's shuffle (None: the session's
            default parallelism); the output does not depend on it.
    """

    num_shards: int = 8
    by: RouteBy = "session"
    zstd_level: int = 3
    group: bool = True
    buffer_mb: int = 256
    compare: bool = True
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    engine: Engine = "local"
    master: str | None = None
    spark_partitions: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_shards, bool) or not isinstance(self.num_shards, int):
            raise RecpipeError(f"`num_shards` must be an integer, got {self.num_shards!r}")
        if not 1 <= self.num_shards <= 100_000:
            raise RecpipeError(f"`num_shards` must be in [1, 100000], got {self.num_shards!r}")
        if self.by not in get_args(RouteBy):
            raise RecpipeError(f"`by` must be one of {list(get_args(RouteBy))}, got {self.by!r}")
        if not 1 <= self.zstd_level <= 22:
            raise RecpipeError(f"`zstd_level` must be in [1, 22], got {self.zstd_level!r}")
        if not 1 <= self.buffer_mb <= 1 << 20:
            raise RecpipeError(f"`buffer_mb` must be >= 1, got {self.buffer_mb!r}")
        if isinstance(self.max_line_bytes, bool) or not (
            isinstance(self.max_line_bytes, int) and self.max_line_bytes >= 1
        ):
            raise RecpipeError(
                f"`max_line_bytes` must be a positive integer, got {self.max_line_bytes!r}"
            )
        if self.engine not in get_args(Engine):
            raise RecpipeError(
                f"`engine` must be one of {list(get_args(Engine))}, got {self.engine!r}"
            )
        if self.spark_partitions is not None and (
            isinstance(self.spark_partitions, bool)
            or not isinstance(self.spark_partitions, int)
            or self.spark_partitions < 1
        ):
            raise RecpipeError(
                f"`spark_partitions` must be a positive integer, got {self.spark_partitions!r}"
            )
        for name in ("master", "spark_partitions"):
            if getattr(self, name) is not None and self.engine != "spark":
                raise RecpipeError(
                    f"`{name}` is an option of engine 'spark', got {getattr(self, name)!r} "
                    f"with engine {self.engine!r}"
                )


def _key_hash(kind: bytes, value: Any) -> int | None:
    """Stable 64-bit hash of a key value; None if the value cannot be a key."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else b"%d" % value
    digest = hashlib.blake2b(kind + text, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _flush_order(buf: list[tuple[int, T]], *, group: bool) -> list[T]:
    """The items of one shard's buffer ``(session key, item)`` in the order a flush writes
    them: with ``group``, a session's together, sessions in first-seen order, stable within a
    session; else as buffered."""
    if not group:
        return [item for _, item in buf]
    groups: dict[int, list[T]] = {}
    for key, item in buf:
        groups.setdefault(key, []).append(item)
    return [item for g in groups.values() for item in g]


class ShardSink:
    """N compressed streams: to files, or to byte counters (for comparisons).

    ``add`` buffers a line for a shard; ``flush`` compresses each shard's buffered lines (with
    ``group``, a session's lines together, sessions in first-seen order) into that shard's one
    zstd stream; ``close`` flushes and ends the streams. The bytes depend only on the lines
    added to each shard and on where the flushes fall, so the Spark engine, feeding each
    shard's lines in read order with the same flushes, writes the same files.

    No file stays open: each write opens its shard's file to append and closes it, so any
    number of shards fits under the limit on open files (a flush writes each shard once).
    """

    def __init__(self, n: int, level: int, *, group: bool, paths: list[Path] | None = None):
        params = zstandard.ZstdCompressionParameters.from_level(level, write_checksum=1)
        self.group = group
        self.paths = list(paths) if paths else None
        for p in self.paths or ():
            p.open("wb").close()  # every shard exists, empty until its first bytes
        self.objs = [
            zstandard.ZstdCompressor(compression_params=params).compressobj() for _ in range(n)
        ]
        self.bytes = [0] * n
        self.lines = [0] * n
        self.buffers: list[list[tuple[int, bytes]]] = [[] for _ in range(n)]

    def add(self, shard: int, key: int, line: bytes) -> None:
        self.buffers[shard].append((key, line))
        self.lines[shard] += 1

    def flush(self) -> None:
        for i, buf in enumerate(self.buffers):
            if not buf:
                continue
            text = b"\n".join(_flush_order(buf, group=self.group)) + b"\n"
            self._emit(i, self.objs[i].compress(text))
            self.buffers[i] = []

    def close(self) -> None:
        self.flush()
        for i, obj in enumerate(self.objs):
            self._emit(i, obj.flush())

    def _emit(self, i: int, data: bytes) -> None:
        self.bytes[i] += len(data)
        if self.paths and data:
            try:
                with self.paths[i].open("ab") as fh:
                    fh.write(data)
            except OSError as exc:  # a full disk: name the shard
                raise OSError(exc.errno, exc.strerror, str(self.paths[i])) from None


@dataclass(frozen=True)
class _Keys:
    """The record keys routing reads: session, user, request id (the logs' spellings)."""

    session: str
    user: str
    request: str

    @classmethod
    def of(cls, schema: DatasetSchema) -> _Keys:
        return cls(schema.session_key, schema.user_key, schema.raw_key("request_id"))


def _route_keys(rec: dict, keys: _Keys) -> tuple[int | None, int | None, str]:
    """(session-routing hash, request-routing hash, key used) of a parsed record."""
    session = rec.get(keys.session)
    if session is not None:
        skey, used = _key_hash(b"s", session), keys.session
    else:
        skey, used = _key_hash(b"u", rec.get(keys.user)), keys.user
    rkey = _key_hash(b"r", rec.get(keys.request))
    return skey, rkey, used


def event_shaped(rec: dict, schema: DatasetSchema) -> bool:
    """Whether a parsed record is an event record (docs/data-contract.md, "An event line"):
    a request id and the label key, and no feature: neither ``dense`` nor ``sparse`` nor any
    of the schema's feature keys at the top level (a flat layout's). ``ts`` may be there or not.
    """
    if rec.get(schema.raw_key("request_id")) is None or schema.label_key not in rec:
        return False
    if "dense" in rec or "sparse" in rec:
        return False
    return not any(schema.raw_key(name) in rec for name in schema.feature_names)


def event_line_error(path: Path | str, lineno: int, schema: DatasetSchema) -> DataError:
    """The error of ``etl shard`` on an event record among the feature logs."""
    return DataError(
        f"{path}: line {lineno}: an event record (`{schema.raw_key('request_id')}` and "
        f"`{schema.label_key}`, no features) among the feature logs; `etl shard` routes feature "
        "logs only, and the build would quarantine it as a duplicate of its request\n"
        "hint: leave the event logs out of the shard's inputs and pass them to "
        "`etl build --events` (`etl validate FEATURES --events EVENTS` checks both)"
    )


def route_line(
    path: Path, lineno: int, line: bytes, size: int, schema: DatasetSchema
) -> tuple[str, int, int, str]:
    """``(reason, session hash, request hash, key used)`` of one raw line.

    ``reason`` is empty for a routable line (then the hashes are set), else why the line is
    unroutable (then the hashes are 0 and the key empty).

    Raises:
        CorruptInputError: the line is not UTF-8 text.
        DataError: the line is an event record (:func:`event_shaped`), naming file and line.
    """
    return _route(path, lineno, line, size, _Keys.of(schema), refuse_events=schema)


def _route(
    path: Path,
    lineno: int,
    line: bytes,
    size: int,
    keys: _Keys,
    *,
    refuse_events: DatasetSchema | None,
) -> tuple[str, int, int, str]:
    """:func:`route_line` given the routing keys; event records raise only with
    ``refuse_events`` (the schema naming the label and feature keys)."""
    if size > len(line):  # longer than max_line_bytes: its prefix only
        return reasons.LINE_TOO_LONG, 0, 0, ""
    rec = _parse(line, path, lineno)
    if not isinstance(rec, dict):
        return _MALFORMED, 0, 0, ""
    if refuse_events is not None and event_shaped(rec, refuse_events):
        raise event_line_error(path, lineno, refuse_events)
    skey, rkey, used = _route_keys(rec, keys)
    if skey is None:
        return _NO_KEY, 0, 0, ""
    if rkey is None:  # no usable request_id: any stable spread will do
        rkey = _key_hash(b"l", line.decode("utf-8", "replace"))
    return "", skey, rkey, used  # type: ignore[return-value]


def unroutable_line(path: Path, lineno: int, reason: str, line: bytes, size: int) -> bytes:
    """The line of ``_unroutable.jsonl.zst`` (newline included) for an unroutable raw line."""
    long = size if reason == reasons.LINE_TOO_LONG else None
    return unroutable_record(path, lineno, reason, line, size=long) + b"\n"


def unroutable_writer(fh: Any, level: int) -> Any:
    """The zstd stream writer of ``_unroutable.jsonl.zst`` over the open file ``fh``."""
    return zstandard.ZstdCompressor(level=level, write_checksum=True).stream_writer(fh)


def _interleave(files: list[Path], max_line_bytes: int) -> Iterator[tuple[Path, int, bytes, int]]:
    """``(file, line number, line, size)`` taking ``READ_STEP`` lines from each file in turn.

    Logs split over hosts are each in time order; reading them round-robin keeps the buffer a
    time slice of all of them, so a session's lines from different files meet in one flush.
    At most ``READ_WIDTH`` files are open at once.
    """
    for start in range(0, len(files), READ_WIDTH):
        group = files[start : start + READ_WIDTH]
        readers = [(p, raw_lines(p, max_line_bytes)) for p in group]
        while readers:
            alive = []
            for path, reader in readers:
                for taken, (lineno, line, size) in enumerate(reader, 1):
                    yield path, lineno, line, size
                    if taken == READ_STEP:
                        alive.append((path, reader))
                        break
            readers = alive


def read_position(file_index: int, ordinal: int) -> tuple[int, int, int, int]:
    """Where :func:`_interleave` yields line ``ordinal`` (0-based, blank lines not counted) of
    input ``file_index``: positions sort as the lines are read.

    >>> read_position(17, 5000) < read_position(16, 9000) < read_position(33, 0)
    True
    """
    return file_index // READ_WIDTH, ordinal // READ_STEP, file_index, ordinal


def raw_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes, int]]:
    """``(line number, line, size)`` of a JSON Lines file, or of a Parquet file's rows as the
    JSON objects ``etl build`` reads from it (:func:`etl.build.inputs.read_lines`)."""
    if not path.name.endswith(".parquet"):
        yield from iter_raw_lines(path, max_line_bytes=max_line_bytes)
        return
    from etl.build.inputs import InputFile, read_lines

    for batch in read_lines(InputFile(path, "parquet"), 0, max_line_bytes=max_line_bytes):
        numbers = batch.column("line_no").to_pylist()
        sizes = batch.column("too_long").to_pylist()
        for n, text, size in zip(numbers, batch.column("line").to_pylist(), sizes):
            line = text.encode()
            yield n, line, size if size is not None else len(line)


def _parse(line: bytes, path: Path, lineno: int) -> Any:
    """The parsed line, or None when it is not JSON.

    Raises:
        CorruptInputError: the line is not UTF-8 text, as ``etl build`` refuses such a file.
    """
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    try:  # orjson refuses invalid UTF-8 too: only lines it refused need this check
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = (
            f"{path}: line {lineno}: not UTF-8 text (byte {line[exc.start]:#04x} at byte "
            f"{exc.start} of the line); the file is binary, corrupt or not JSON Lines\n"
            "hint: `etl build` refuses it too; fix or remove the file"
        )
        raise CorruptInputError(msg) from None
    if lineno == 1:  # a byte-order mark may open the file (the build accepts it too)
        text = text.removeprefix("\ufeff")
    try:  # NaN / Infinity / integers beyond 64 bits: not strict JSON, but routable
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def shard(
    inputs: str | Path | Iterable[str | Path],
    out_dir: str | Path,
    *,
    schema: DatasetSchema | None = None,
    config: ShardConfig | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Route feature-log lines to ``config.num_shards`` zstd shards.

    Args:
        inputs: ``.jsonl`` / ``.jsonl.zst`` / ``.parquet`` files, directories or globs (the
            raw-log contract: docs/data-contract.md); Parquet rows are routed as JSON lines.
        out_dir: output directory; written to a temporary sibling and renamed into place.
        schema: names the session and user keys; defaults to the bundled schema.
        config: sharding options.
        overwrite: replace an existing ``out_dir``.
        progress: show a tqdm progress bar on stderr.

    Returns:
        The report also written to ``out_dir/_shard.json`` (line counts that reconcile:
        ``lines_in == sum(lines_per_shard) + lines_unroutable``, bytes, and with ``compare``
        the bytes of each routing and ``shard_ratio_session_vs_request``).

    Raises:
        DataError: on missing inputs or an existing ``out_dir`` without ``overwrite``; on an
            event record among the inputs (:func:`event_shaped`), naming its file and line.
        CorruptInputError: naming the file, on a broken zstd input or a file that is not
            UTF-8 text (naming the line too).
        RecpipeError: the shards cannot be written (a full disk), naming ``out_dir``; shards
            already there are left as they were.
    """
    cfg = config or ShardConfig()
    schema = schema or load_schema(None)
    files = expand_inputs(inputs, patterns=(*JSONL_PATTERNS, "*.parquet"))
    out = Path(out_dir)
    check_output(out, kind="shards", inputs=[inputs], overwrite=overwrite, arg="out_dir")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    n = cfg.num_shards
    try:
        if cfg.engine == "local":
            report = _run(files, tmp, schema, cfg, progress)
        else:  # an engine module, imported when chosen (it imports this one)
            module, _, name = ENGINES[cfg.engine].partition(":")
            report = getattr(importlib.import_module(module), name)(files, tmp, schema, cfg)
        report["elapsed_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "_shard.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        if out.exists():  # swapped, then removed: a crash never leaves neither in place
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # inputs are read with errors of their own: the output
            from etl.build.output import output_error

            raise output_error(out, exc) from None
        raise
    report["out_dir"] = str(out)
    report["shards"] = [str(shard_path(out, i)) for i in range(n)]
    _log.info("sharded %d input file(s) into %d shard(s) at %s", len(files), n, out)
    return report


def _run(files: list[Path], tmp: Path, schema: DatasetSchema, cfg: ShardConfig, progress: bool):
    n = cfg.num_shards
    specs = sink_specs(cfg)
    # the main sink writes the shards; the comparison sinks only count compressed bytes
    sinks = [
        ShardSink(n, cfg.zstd_level, group=group, paths=[shard_path(tmp, i) for i in range(n)])
        if v == 0
        else ShardSink(n, cfg.zstd_level, group=group)
        for v, (_, group) in enumerate(specs)
    ]
    session_routed = [by == "session" for by, _ in specs]
    bad_fh = open(tmp / UNROUTABLE_NAME, "wb")  # noqa: SIM115 - closed below
    bad_writer = unroutable_writer(bad_fh, cfg.zstd_level)
    bad_by_reason: dict[str, int] = {}
    keys_used: dict[str, int] = {}
    lines_in = raw_bytes = buffered = 0
    limit = cfg.buffer_mb << 20
    bar = None
    if progress:
        from recpipe.progress import progress_bar

        bar = progress_bar(unit=" lines", unit_scale=True, desc="shard", file=sys.stderr)
    try:
        for path, lineno, line, size in _interleave(files, cfg.max_line_bytes):
            lines_in += 1
            raw_bytes += size + 1
            reason, skey, rkey, used = route_line(path, lineno, line, size, schema)
            if reason:
                bad_by_reason[reason] = bad_by_reason.get(reason, 0) + 1
                bad_writer.write(unroutable_line(path, lineno, reason, line, size))
                continue
            keys_used[used] = keys_used.get(used, 0) + 1
            for sink, by_session in zip(sinks, session_routed):
                key = skey if by_session else rkey
                sink.add(key % n, key, line)
            buffered += len(line)
            if buffered >= limit:
                for sink in sinks:
                    sink.flush()
                buffered = 0
            if bar is not None and lines_in % 8192 == 0:
                bar.update(8192)
        for sink in sinks:
            sink.close()
        if bar is not None:
            bar.update(lines_in % 8192)
    finally:
        bad_writer.close()
        bad_fh.close()
        if bar is not None:
            bar.close()
    return make_report(
        files,
        cfg,
        schema,
        lines_in=lines_in,
        bytes_raw=raw_bytes,
        unroutable_by_reason=bad_by_reason,
        routed_by_key=keys_used,
        lines_per_shard=sinks[0].lines,
        bytes_per_sink=[s.bytes for s in sinks],
    )


def shard_origins(
    shard_dir: str | Path, wanted: Iterable[tuple[int, int]]
) -> dict[tuple[int, int], tuple[str, int]] | None:
    """Where lines of the shards in ``shard_dir`` came from, found by replaying the shard.

    A shard holds its lines verbatim, regrouped by session: the file and line each came from
    is not written. This reads the inputs listed in ``_shard.json`` again and routes, buffers
    and groups their lines as :func:`shard` did (the Spark engine writes the same files), up
    to the last line wanted; nothing is compressed or written.

    Args:
        shard_dir: a directory written by :func:`shard`.
        wanted: ``(shard index, line number)`` pairs (line numbers from 1).

    Returns:
        ``{(shard index, line): (input file, line)}`` for the wanted lines found, or None when
        ``_shard.json`` cannot be read or an input is gone or no longer of the size it had.
    """
    try:
        report = orjson.loads((Path(shard_dir) / "_shard.json").read_bytes())
        cfg = report["config"]
        files = [Path(i["path"]) for i in report["inputs"]]
        if any(
            not p.is_file() or p.stat().st_size != i["bytes"]
            for p, i in zip(files, report["inputs"])
        ):
            return None
        keys = _Keys(
            report["session_key"], report["user_key"], report.get("request_key", "request_id")
        )
        n, limit, by = int(cfg["num_shards"]), int(cfg["buffer_mb"]) << 20, cfg["by"]
        group, max_line_bytes = bool(cfg["group"]), int(cfg["max_line_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    todo: dict[int, set[int]] = {}
    for i, line_no in wanted:
        todo.setdefault(i, set()).add(line_no)
    left = sum(len(v) for v in todo.values())
    found: dict[tuple[int, int], tuple[str, int]] = {}
    buffers: list[list[tuple[int, tuple[str, int]]]] = [[] for _ in range(n)]
    written = [0] * n

    def flush() -> None:
        nonlocal left
        for i, buf in enumerate(buffers):
            if not buf:
                continue
            mine = todo.get(i, ())
            for origin in _flush_order(buf, group=group):
                written[i] += 1
                if written[i] in mine:
                    found[(i, written[i])] = origin
                    left -= 1
            buffers[i] = []

    buffered = 0
    for path, lineno, line, size in _interleave(files, max_line_bytes):
        if not left:
            break
        reason, skey, rkey, _ = _route(path, lineno, line, size, keys, refuse_events=None)
        if reason:
            continue
        key = skey if by == "session" else rkey
        buffers[key % n].append((key, (str(path), lineno)))
        buffered += len(line)
        if buffered >= limit:
            flush()
            buffered = 0
    flush()
    return found


def sink_specs(cfg: ShardConfig) -> list[tuple[RouteBy, bool]]:
    """``(routing, grouped)`` of the shards written, then of each comparison (bytes only)."""
    specs: list[tuple[RouteBy, bool]] = [(cfg.by, cfg.group)]
    if cfg.compare:
        if cfg.by == "session":
            specs.append(("request", False))
            if cfg.group:
                specs.append(("session", False))
        else:
            specs.append(("session", True))
    return specs


def make_report(
    files: list[Path],
    cfg: ShardConfig,
    schema: DatasetSchema,
    *,
    lines_in: int,
    bytes_raw: int,
    unroutable_by_reason: dict[str, int],
    routed_by_key: dict[str, int],
    lines_per_shard: list[int],
    bytes_per_sink: list[list[int]],
) -> dict[str, Any]:
    """The report of a shard run (without ``elapsed_s``), from its counts.

    ``bytes_per_sink`` holds the compressed bytes per shard of each of :func:`sink_specs`.

    Raises:
        RecpipeError: the counts do not reconcile (an internal error).
    """
    n_bad = sum(unroutable_by_reason.values())
    main = bytes_per_sink[0]
    report: dict[str, Any] = {
        "inputs": [{"path": str(p), "bytes": p.stat().st_size} for p in files],
        "config": asdict(cfg),
        "session_key": schema.session_key,
        "user_key": schema.user_key,
        "request_key": schema.raw_key("request_id"),
        "lines_in": lines_in,
        "lines_routed": sum(lines_per_shard),
        "lines_unroutable": n_bad,
        "unroutable_by_reason": unroutable_by_reason,
        "routed_by_key": routed_by_key,
        "lines_per_shard": lines_per_shard,
        "bytes_in": sum(p.stat().st_size for p in files),
        "bytes_raw": bytes_raw,
        "bytes_out": sum(main),
        "bytes_per_shard": main,
        "unroutable_file": UNROUTABLE_NAME,
    }
    if lines_in != report["lines_routed"] + n_bad:  # cannot happen; checked to promise it
        raise RecpipeError(f"internal: {lines_in} lines in != {report['lines_routed']} + {n_bad}")
    if cfg.compare:
        totals = [sum(b) for b in bytes_per_sink]
        if cfg.by == "session":
            session_bytes, request_bytes = totals[0], totals[1]
            plain = totals[2] if cfg.group else session_bytes
        else:
            request_bytes, session_bytes, plain = totals[0], totals[1], None
        report["compare"] = {
            "bytes_by_request": request_bytes,
            "bytes_by_session": session_bytes,
            "bytes_by_session_ungrouped": plain,
            "raw_vs_request": bytes_raw / max(request_bytes, 1),
            "raw_vs_session": bytes_raw / max(session_bytes, 1),
        }
        report["shard_ratio_session_vs_request"] = request_bytes / max(session_bytes, 1)
    return report


def format_report(report: dict[str, Any]) -> str:
    """One-screen summary of a :func:`shard` report."""
    cfg = report["config"]
    rows = [
        ("output", report.get("out_dir", "")),
        ("shards", f"{cfg['num_shards']} by {cfg['by']} (zstd {cfg['zstd_level']})"),
        ("lines in", f"{report['lines_in']:,}"),
        ("routed", f"{report['lines_routed']:,}  by key {report['routed_by_key']}"),
        (
            "unroutable",
            f"{report['lines_unroutable']:,}  {report['unroutable_by_reason'] or ''}".rstrip(),
        ),
        (
            "bytes in / raw / out",
            f"{report['bytes_in'] / 1e6:.1f} / "
            f"{report['bytes_raw'] / 1e6:.1f} / {report['bytes_out'] / 1e6:.1f} MB",
        ),
    ]
    if "compare" in report:
        c = report["compare"]
        rows.append(
            (
                "compressed by request",
                f"{c['bytes_by_request'] / 1e6:.2f} MB (raw/compressed {c['raw_vs_request']:.2f}x)",
            )
        )
        if c.get("bytes_by_session_ungrouped"):
            rows.append(
                ("by session, ungrouped", f"{c['bytes_by_session_ungrouped'] / 1e6:.2f} MB")
            )
        rows.append(
            (
                "compressed by session",
                f"{c['bytes_by_session'] / 1e6:.2f} MB (raw/compressed {c['raw_vs_session']:.2f}x)",
            )
        )
        rows.append(
            ("shard_ratio_session_vs_request", f"{report['shard_ratio_session_vs_request']:.3f}x")
        )
    rows.append(("time", f"{report.get('elapsed_s', 0):.1f} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _run_cli(args: argparse.Namespace, cfg: ShardConfig) -> int:
    schema = load_schema(args.schema) if args.schema else None
    report = shard(
        args.inputs,
        args.out,
        schema=schema,
        config=cfg,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def register_cli(stages: argparse._SubParsersAction) -> None:
    """Add ``recpipe etl shard`` to the ``etl`` stage parsers."""
    parser = stages.add_parser(
        "shard",
        help="route feature logs to N zstd shards by session (RecD O1)",
        description=(
            "Route raw feature logs (.jsonl / .jsonl.zst / .parquet files, directories, globs; "
            "their format: docs/data-contract.md) to N "
            "shard-NNNNN.jsonl.zst files by a stable hash of the session key (session_id, else "
            "user_id), grouping each shard's lines by session so zstd sees the repeats side by "
            "side. Lines that cannot be routed go to _unroutable.jsonl.zst with their file and "
            "line number; an event record (request id and label, no features) stops it: event logs "
            "go to `etl build --events`. _shard.json reconciles the counts and reports the compression ratio "
            "against routing by request. --engine spark runs it as a Spark job (--master, on a "
            "cluster) writing the same files byte for byte."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="feature-log files/dirs/globs")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    options = add_config_options(
        parser,
        ShardConfig,
        overrides={
            "max_line_bytes": Option(metavar="BYTES"),
            "master": Option(metavar="URL"),
            "spark_partitions": Option(metavar="N"),
        },
    )
    parser.add_argument("--schema", type=Path, help="schema TOML naming the session/user keys")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_quiet_option(parser)
    parser.set_defaults(func=lambda args: _run_cli(args, options.build(args)))
