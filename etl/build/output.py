"""What every engine's build writes, written once: the dataset, the quarantine, the manifest.

An engine hands over Arrow batches and counts (see :mod:`etl.build.engine`); everything that
ends up in the output directory is made here, so the files never depend on the engine:

- the dataset: :func:`dataset_writer` and :func:`write_rows` over
  :class:`etl.build.writer.SessionAlignedWriter` (rows in the build's order, hour partitions
  from :data:`PARTITION_MS`, page checksums, each file's size and sha256);
- the quarantine: :func:`write_quarantine` (bad rows in input order, with the file and line
  they came from);
- the manifest: :func:`build_manifest`, from :class:`BuildCounts` and the writer's files; it
  says whether the counts reconcile and lists the build's :func:`build_warnings`.

Manifest keys a reader of the dataset can rely on (``_manifest.json``, format
``recpipe-clustered/1``): ``files[]`` with ``path`` (relative), ``rows``, ``row_groups``,
``bytes``, ``sessions`` and ``sha256`` (hex digest of the file's bytes); ``rows_in``,
``rows_out``, ``rows_quarantined``, ``rows_sampled_out`` and ``reconciles``;
``quarantine_by_reason``; ``unknown_features``, ``unknown_keys`` and ``features_missing``;
``warnings``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from etl import reasons
from etl.build.config import DEFAULT_SETTINGS_NOTE, BuildConfig
from etl.build.inputs import InputFile
from etl.build.writer import SessionAlignedWriter, split_hours
from recpipe.errors import RecpipeError
from schemas import DatasetSchema

__all__ = [
    "FORMAT",
    "PARTITION_MS",
    "QUARANTINE_SCHEMA",
    "BuildCounts",
    "SessionAlignedWriter",
    "build_manifest",
    "build_warnings",
    "by_reason",
    "dataset_writer",
    "output_error",
    "write_quarantine",
    "write_rows",
]

FORMAT = "recpipe-clustered/1"
#: the column of epoch ms whose hour names a row's ``dt=`` partition (``partition_by="hour"``):
#: the session's first ts in session order, the row's ts in time order
PARTITION_MS = "__partition_ms"
#: the columns of ``_quarantine/features.parquet`` and ``_quarantine/events.parquet``
QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("line", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("raw", pa.string()),
    ]
)


@dataclass
class BuildCounts:
    """The counts an engine reports (see docs/etl-engines.md for each one's definition).

    Attributes:
        rows_in: feature lines read (every line of every feature input).
        rows_out: rows written.
        rows_quarantined: feature lines quarantined (``sum(quarantine_by_reason)``).
        rows_sampled_out: valid rows dropped by ``sample_sessions``.
        quarantine_by_reason: every reason of :data:`etl.reasons.QUARANTINE_REASONS` -> count.
        sessions: sessions written.
        rows_without_event: valid rows whose request has no valid event (label 0).
        unknown_features: ``dense.x`` / ``sparse.y`` map keys the schema does not know -> the
            valid, deduplicated records carrying them.
        unknown_keys: top-level keys the build does not read -> the valid, deduplicated
            records carrying them.
        features_missing: schema feature -> valid, deduplicated records without it (absent
            or null); only features missing somewhere are listed, in schema order.
        events_in: event lines read.
        events_quarantined: event lines quarantined.
        events_quarantine_by_reason: reason -> count (all but ``duplicate_request_id``).
        events_unknown_request: valid events whose request is not a valid feature record.
        rows_duplicate: records quarantined as ``duplicate_request_id``.
    """

    rows_in: int
    rows_out: int
    rows_quarantined: int
    rows_sampled_out: int
    quarantine_by_reason: dict[str, int]
    sessions: int
    rows_without_event: int
    unknown_features: dict[str, int]
    unknown_keys: dict[str, int]
    features_missing: dict[str, int]
    events_in: int
    events_quarantined: int
    events_quarantine_by_reason: dict[str, int]
    events_unknown_request: int
    rows_duplicate: int = field(default=0)

    @property
    def rows_valid(self) -> int:
        """Records that passed validation and deduplication (before sampling)."""
        return self.rows_in - self.rows_quarantined

    @property
    def reconciles(self) -> bool:
        """``rows_in == rows_out + rows_quarantined + rows_sampled_out``."""
        return self.rows_in == self.rows_out + self.rows_quarantined + self.rows_sampled_out

    def to_dict(self) -> dict[str, Any]:
        """The manifest's count keys, in manifest order (``rows_duplicate`` apart)."""
        d = asdict(self)
        d.pop("rows_duplicate")
        return d


def by_reason(counts: Mapping[str, int], *, events: bool = False) -> dict[str, int]:
    """``counts`` over every reason, in :data:`etl.reasons.QUARANTINE_REASONS` order (0 when
    absent); events have no ``duplicate_request_id``."""
    return {
        r: int(counts.get(r, 0))
        for r in reasons.QUARANTINE_REASONS
        if not (events and r == reasons.DUPLICATE_REQUEST_ID)
    }


def dataset_writer(
    root: Path, schema: DatasetSchema, config: BuildConfig, *, rows: int | None = None
) -> SessionAlignedWriter:
    """The Parquet writer of every engine, set up from ``config`` (row groups encoded on a
    second thread while the engine fetches the next rows; the same bytes either way).

    ``rows``: the rows the build will write, which size the row groups
    (:meth:`BuildConfig.row_group_rows`); None: ``config.row_group_size``."""
    arrow_schema = schema.dataset_arrow_schema()
    return SessionAlignedWriter(
        root=root,
        schema=arrow_schema,
        session_col=schema.session_key,
        row_group_size=config.row_group_size if rows is None else config.row_group_rows(rows),
        zstd_level=config.zstd_level,
        dictionary=None
        if config.dictionary == "auto"
        else (arrow_schema.names if config.dictionary == "all" else []),
        max_file_bytes=config.max_file_bytes,
        align_sessions=config.order == "session",
        background=True,
    )


def write_rows(
    writer: SessionAlignedWriter,
    batches: Iterable[pa.RecordBatch],
    *,
    config: BuildConfig,
    progress: Callable[[int], object] | None = None,
) -> list[dict]:
    """Write the engine's sorted rows; return the files (``writer.close()``).

    Args:
        writer: from :func:`dataset_writer`.
        batches: the dataset's columns (any integer/float widths: cast to the schema) in the
            build's order, plus :data:`PARTITION_MS` with ``partition_by="hour"``.
        config: the build's options.
        progress: called with each batch's row count.

    On any error the writer is aborted (the files stay incomplete in the temporary directory).
    """
    column = PARTITION_MS if config.partition_by == "hour" else None
    try:
        for part, batch in split_hours(batches, column=column):
            writer.write(batch.cast(writer.schema), partition=part)
            if progress is not None:
                progress(batch.num_rows)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def write_quarantine(
    batches: Iterable[pa.RecordBatch | pa.Table], files: list[InputFile], path: Path
) -> int:
    """Write bad rows as :data:`QUARANTINE_SCHEMA`; return how many.

    Args:
        batches: rows with ``file_id``, ``line_no``, ``reason``, ``detail``, ``raw``,
            ``source``, ``source_line``, ordered by ``(file_id, line_no)``.
        files: the inputs, by ``file_id``.
        path: the Parquet file to write (written, without rows, when there are none).

    A row's ``source``/``line`` are its input file and line, or for an ``etl shard``
    unroutable record the file and line it came from.
    """
    paths = pa.array([str(f.path) for f in files], pa.string())
    n = 0
    with pq.ParquetWriter(
        path, QUARANTINE_SCHEMA, compression="zstd", write_page_checksum=True
    ) as out:
        for batch in batches:
            if not batch.num_rows:
                continue
            file_paths = pc.take(paths, batch.column("file_id"))
            table = pa.Table.from_arrays(
                [
                    pc.coalesce(batch.column("source").cast(pa.string()), file_paths),
                    pc.coalesce(batch.column("source_line"), batch.column("line_no")).cast(
                        pa.int64()
                    ),
                    batch.column("reason").cast(pa.string()),
                    batch.column("detail").cast(pa.string()),
                    batch.column("raw").cast(pa.string()),
                ],
                schema=QUARANTINE_SCHEMA,
            )
            out.write_table(table)
            n += table.num_rows
    return n


def build_warnings(counts: BuildCounts, *, events: bool) -> list[str]:
    """What the build did silently otherwise: every label 0, records read in part."""
    out = []
    if not events:
        out.append("no event logs (--events): every label is 0")
    elif counts.rows_out and counts.rows_without_event == counts.rows_out:
        out.append("no event matched a request kept: every label is 0")
    valid = counts.rows_valid
    everywhere = [f for f, n in counts.features_missing.items() if valid and n == valid]
    if everywhere:
        out.append(
            f"{len(everywhere)} schema feature(s) missing from every valid record, written as "
            f"their fill: {', '.join(everywhere[:10])}" + (", ..." if len(everywhere) > 10 else "")
        )
    if counts.unknown_keys:
        names = sorted(counts.unknown_keys, key=lambda k: -counts.unknown_keys[k])
        out.append(
            f"top-level keys the build does not read (features belong under `dense` and "
            f"`sparse`): {', '.join(names[:10])}" + (", ..." if len(names) > 10 else "")
        )
    return out


def build_manifest(
    *,
    schema: DatasetSchema,
    config: BuildConfig,
    inputs: list[dict],
    feat_files: list[InputFile],
    ev_files: list[InputFile],
    counts: BuildCounts,
    writer: SessionAlignedWriter,
    files: list[dict],
    phase_s: dict[str, float],
    phase_cpu_s: dict[str, float] | None = None,
) -> dict:
    """The manifest of every engine (without ``elapsed_s``), once the files are written.

    Raises:
        RecpipeError: "internal: ..." when the files do not hold exactly the rows and sessions
            counted (cannot happen; checked to promise it).
    """
    rows_written = sum(f["rows"] for f in files)
    if rows_written != counts.rows_out:
        raise RecpipeError(
            f"internal: the files hold {rows_written} rows, the build counted "
            f"{counts.rows_out} rows out"
        )
    if writer.sessions != counts.sessions:
        raise RecpipeError(
            f"internal: the files hold {writer.sessions} sessions, the build kept {counts.sessions}"
        )
    bytes_in = sum(i["bytes"] for i in inputs)
    bytes_out = sum(f["bytes"] for f in files)
    feature_bytes_in = sum(i["bytes"] for i in inputs[: len(feat_files)])
    return {
        "format": FORMAT,
        "schema": schema.to_toml(),
        "config": config.to_dict(),
        "order": config.order,
        "inputs": inputs,
        "feature_inputs": len(feat_files),
        "event_inputs": len(ev_files),
        **counts.to_dict(),
        "rows_duplicate": counts.rows_duplicate,
        "reconciles": counts.reconciles,
        "warnings": build_warnings(counts, events=bool(ev_files)),
        "files": files,
        # a file's `sessions` counts the sessions with rows in it: a session cut by a file or
        # partition boundary counts in each of its files, so their sum is `sessions` +
        # `session_continuations`
        "sessions_split_across_files": writer.sessions_split_across_files,
        "session_continuations": writer.session_continuations,
        "row_groups": sum(f["row_groups"] for f in files),
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "compression_ratio": round(feature_bytes_in / bytes_out, 4) if bytes_out else None,
        "parquet": {
            "compression": "zstd",
            "level": config.zstd_level,
            "row_group_size": writer.row_group_size,
            "row_group_size_max": config.row_group_size,
            "session_aligned_row_groups": config.order == "session",
            "dictionary_columns": list(writer.dictionary or []),
            "dictionary_measured": writer.dictionary_measured,
            "page_checksums": True,
            "settings_note": DEFAULT_SETTINGS_NOTE,
        },
        "quarantine": {
            "features": "_quarantine/features.parquet",
            "events": "_quarantine/events.parquet",
        },
        "phase_s": phase_s,
        "phase_cpu_s": phase_cpu_s or {},
        "arrow_schema": pa.schema(writer.schema).to_string(show_schema_metadata=False),
    }


def output_error(out: Path, exc: OSError, *, arg: str = "out_dir") -> RecpipeError:
    """An error writing the output ``out`` (disk full, a quota, an I/O error), as one line
    naming the output, the file when known, and the reason; the caller has removed its
    temporary output, and whatever ``out`` held before is left as it was.
    """
    where = f" ({str(exc.filename)!r})" if exc.filename else ""
    hint = ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = f"\nhint: free some space, or write `{arg}` to another file system"
    return RecpipeError(
        f"`{arg}` {str(out)!r}: cannot write the output{where}: {exc.strerror or exc}; "
        f"nothing was replaced{hint}"
    )
