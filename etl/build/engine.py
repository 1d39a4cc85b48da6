"""The engine interface of ``etl build``: engines move data; validation and writing are shared.

A build is one pass through these phases (:func:`etl.build.driver.build` drives them)::

    read lines -> validate -> deduplicate -> join labels -> sessionize -> count
        -> quarantine (shared writer) -> sorted rows (shared writer) -> manifest (shared)

An :class:`Engine` implements the data movement of each phase with its own machinery (DuckDB
SQL, Polars frames, a Spark job); everything that decides what a row *is* or what a file
*holds* lives once, in shared code it calls or hands its rows to:

- lines: :func:`etl.build.inputs.read_lines` (numbering, line ends, over-long lines);
- validation: :class:`etl.build.validate.Validator` (:attr:`BuildJob.validator`), as SQL for an
  engine running DuckDB or as Arrow batches in, Arrow batches out for any other;
- the quarantine detail of a repeated request id: :func:`duplicate_rows`;
- which sessions ``sample_sessions`` keeps: :func:`sample_condition` / :func:`sampled`;
- every output byte: :mod:`etl.build.output` (Parquet writer, quarantine, manifest).

The rules an engine must follow exactly, and what the shared code guarantees in return, are
written down in ``docs/etl-engines.md``; the engines are tested against each other on every
corpus of the test suite (byte-identical part files, equal quarantine and counts).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import pyarrow as pa

from etl import reasons
from etl.build.config import ENGINES, BuildConfig
from etl.build.inputs import InputFile, read_lines_at
from etl.build.output import BuildCounts
from etl.build.validate import Validator
from recpipe.errors import DataError
from schemas import DatasetSchema

__all__ = [
    "BuildJob",
    "Engine",
    "Kind",
    "duplicate_rows",
    "duplicate_rows_in",
    "engine_class",
    "sample_condition",
    "sampled",
]

Kind = Literal["features", "events"]


@dataclass
class BuildJob:
    """What one build hands its engine.

    Attributes:
        schema: the dataset schema.
        config: the build's options (the engine refuses those it cannot honour in
            :meth:`Engine.check_config`).
        feature_files: feature inputs; a row's ``file_id`` is its index here.
        event_files: event inputs, likewise.
        validator: the shared validation (its ``max_line_bytes`` is the reader's limit).
        work_dir: the temporary output directory; scratch files may go below it.
        bar: a progress-bar factory, ``bar(desc, total=..., unit=...)`` -> a context manager
            with ``update(n)``.
    """

    schema: DatasetSchema
    config: BuildConfig
    feature_files: list[InputFile]
    event_files: list[InputFile]
    validator: Validator
    work_dir: Path
    bar: Callable[..., Any]

    def files(self, kind: Kind) -> list[InputFile]:
        """The inputs of ``kind``."""
        return self.feature_files if kind == "features" else self.event_files


class Engine(ABC):
    """One build's data movement; the driver calls the methods below in this order.

    Row identity everywhere is ``(file_id, line_no)``; "input order" means ordered by it.
    """

    #: the name in :data:`etl.build.config.ENGINES`
    name: ClassVar[str]

    def __init__(self, job: BuildJob) -> None:
        self.job = job

    @classmethod  # noqa: B027 - an optional hook: engines that honour every option keep it
    def check_config(cls, config: BuildConfig) -> None:
        """Refuse, with a :class:`~recpipe.errors.DataError` naming it, an option this engine
        cannot honour (called before anything is read or written)."""

    @abstractmethod
    def load(self, kind: Kind) -> None:
        """Read every line of ``job.files(kind)`` (:func:`~etl.build.inputs.read_lines`) and keep
        its validated row (``job.validator``): good rows with their typed columns, bad ones
        with reason, detail, raw line and source. Every line yields exactly one row."""

    @abstractmethod
    def deduplicate(self) -> None:
        """Quarantine every good feature row whose ``request_id`` an earlier good row (input
        order) has, with the rows of :func:`duplicate_rows`."""

    @abstractmethod
    def join_labels(self) -> None:
        """A request's label: the max over its good events' labels; 0.0 without one."""

    @abstractmethod
    def sessionize(self) -> None:
        """Give every good, deduplicated row its session (``docs/etl-engines.md``: the raw key,
        the session id as the rank of ``(first ts, key)``, the sample of :func:`sampled`)."""

    @abstractmethod
    def counts(self) -> BuildCounts:
        """The counts of the manifest (:class:`~etl.build.output.BuildCounts`)."""

    @abstractmethod
    def quarantined(self, kind: Kind) -> Iterator[pa.RecordBatch | pa.Table]:
        """The bad rows of ``kind`` in input order, with the columns of
        :func:`etl.build.output.write_quarantine`."""

    @abstractmethod
    def rows(self) -> Iterator[pa.RecordBatch]:
        """The rows kept, in the build's order, as the dataset's columns (missing features
        filled; the pass-through columns ``request_id``, ``user_id``, ``session_id_raw`` of
        :meth:`schemas.DatasetSchema.dataset_arrow_schema` last), plus :data:`etl.build.output.PARTITION_MS` with ``partition_by="hour"``.

        Session order: by ``(session id, ts, file_id, line_no)``; time order: by ``(ts,
        session id, file_id, line_no)``. The batches form one stream; their sizes do not
        matter (the writer cuts row groups itself)."""

    def write_quarantine(self, kind: Kind, path: Path) -> bool:
        """Write the ``kind`` quarantine file ``path`` where the rows are (an engine whose
        workers write it, with :func:`etl.build.output.write_quarantine`) and return True, or
        return False (the default) to hand :meth:`quarantined` to the driver's writer."""
        return False

    def write_dataset(self, rows: int) -> tuple[Any, list[dict]] | None:
        """Write the dataset's part files where the rows are (an engine whose workers write
        them with the shared writer), or return None (the default) to hand :meth:`rows` to the
        driver's writer. Called once, after :meth:`counts` (``rows``: its ``rows_out``).

        Returns:
            ``(writer, files)``: an object with the attributes of
            :class:`~etl.build.writer.SessionAlignedWriter` that
            :func:`~etl.build.output.build_manifest` reads, and the manifest's ``files``.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the engine holds (connections, scratch files); called once, always."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_class(name: str) -> type[Engine]:
    """The engine registered as ``name`` in :data:`etl.build.config.ENGINES`.

    Raises:
        DataError: an unknown name.
    """
    if name not in ENGINES:
        raise DataError(f"`engine` must be one of {sorted(ENGINES)}, got {name!r}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def duplicate_rows(dups: pa.Table, job: BuildJob) -> pa.Table:
    """Quarantine rows of repeated request ids: the reason, a detail naming the first, the raw line.

    Args:
        dups: ``file_id``, ``line_no``, ``request_id`` of each repeat, and ``first_file``,
            ``first_line`` of the request's first good row (input order).
        job: the build (its feature files and line limit).

    Returns:
        ``file_id``, ``line_no``, ``reason``, ``detail``, ``raw``, ``source``, ``source_line``
        (in no particular order).
    """
    return duplicate_rows_in(dups, job.feature_files, max_line_bytes=job.validator.max_line_bytes)


def duplicate_rows_in(dups: pa.Table, files: list[InputFile], *, max_line_bytes: int) -> pa.Table:
    """:func:`duplicate_rows` given the feature ``files`` and the reader's line limit (what a
    worker process has, without the build's :class:`BuildJob`)."""
    import duckdb

    raw = read_lines_at(files, dups.select(["file_id", "line_no"]), max_line_bytes=max_line_bytes)
    paths = pa.table(
        {
            "file_id": pa.array(range(len(files)), pa.int32()),
            "path": [str(f.path) for f in files],
        }
    )
    con = duckdb.connect()
    try:
        con.register("d", dups)
        con.register("r", raw)
        con.register("p", paths)
        return con.sql(
            f"""
            SELECT d.file_id::INTEGER AS file_id, d.line_no::BIGINT AS line_no,
                   '{reasons.DUPLICATE_REQUEST_ID}' AS reason,
                   'field `request_id`: ' || to_json(d.request_id)::VARCHAR || ' already seen at '
                     || p.path || ':' || d.first_line::VARCHAR AS detail,
                   r.raw::VARCHAR AS raw, r.source::VARCHAR AS source,
                   r.source_line::BIGINT AS source_line
            FROM d LEFT JOIN r USING (file_id, line_no) LEFT JOIN p ON p.file_id = d.first_file
            """
        ).to_arrow_table()
    finally:
        con.close()


def sample_condition(column: str, config: BuildConfig) -> str | None:
    """DuckDB SQL true for the session keys ``sample_sessions`` keeps (None: keep all).

    A session is kept when ``hash(key || '#seed') >> 11`` (DuckDB's 64-bit hash, top 53 bits)
    is below ``sample_sessions * 2**53``: seeded, and the same in every engine.
    """
    if config.sample_sessions >= 1.0:
        return None
    threshold = int(config.sample_sessions * (1 << 53))
    return f"(hash({column} || '#{int(config.seed)}') >> 11) < {threshold}"


def sampled(keys: pa.Array | pa.ChunkedArray, config: BuildConfig) -> pa.Array:
    """Whether ``sample_sessions`` keeps each session key of ``keys`` (:func:`sample_condition`,
    run in an in-memory DuckDB), as a boolean array."""
    import duckdb

    cond = sample_condition("skey", config)
    if cond is None:
        return pa.array([True] * len(keys))
    con = duckdb.connect()
    try:
        con.register("k", pa.table({"skey": keys}))
        return con.sql(f"SELECT {cond} AS keep FROM k").to_arrow_table().column(0).combine_chunks()
    finally:
        con.close()
