"""``recpipe etl build`` (RecD O2): raw logs -> validated, session-clustered zstd Parquet.

The whole build runs in DuckDB, out of core (``memory_limit`` + a spill directory):

1. **parse**: each input file is read as raw lines (``read_csv`` with a delimiter that never
   occurs), numbered, parsed once with ``from_json`` and validated in SQL
   (:mod:`etl._build_sql`). Feature lines stream to Python in Arrow batches, where one
   compiled pass (:func:`etl._build_io.line_facts`) does the text tests that prove the lenient
   typed parse safe; several files are parsed at once (one DuckDB cursor each). Bad lines
   keep their raw text and a reason; good lines keep typed, flattened columns (dense filled,
   sparse lists truncated).
2. **dedup**: the first record of a ``request_id`` (file order) wins; the others are
   quarantined as ``duplicate_request_id``.
3. **join**: labels are the max over a request's events (0 without one).
4. **sessionize**: the raw ``session_id``, else ``user_id`` split by ``session_gap_ms`` of
   inactivity, else the request alone. Sessions get int64 ids by (first ts, raw key), so ids
   ascend in file order; ``sample_sessions`` keeps a seeded fraction of whole sessions.
5. **write**: one ``ORDER BY session_id, ts`` streamed into pyarrow, cut into row groups at
   session boundaries (:class:`etl._build_io.SessionAlignedWriter`), each encoded on a second
   thread while DuckDB fetches the next rows.

Everything is written into a temporary directory beside ``out_dir`` that replaces it at the
end, with ``_manifest.json`` written last, so a crashed run never leaves a dataset that looks
complete; the next run removes the stale directory.

Parquet settings were chosen by measurement (``python -m etl._build_tune``; figures in
``DEFAULT_SETTINGS_NOTE``, copied into each manifest): zstd level 3 and row groups of 65,536
rows; dictionary encoding is decided per column on the first row group of every build.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from etl import reasons
from etl._build_io import (
    LINE_FACT_COLUMNS,
    InputFile,
    SessionAlignedWriter,
    check_structure,
    digest,
    iter_partitioned,
    line_facts,
    list_inputs,
    source_sql,
)
from etl._build_sql import PENDING, event_select, feature_select, schema_keys, sql_str
from recpipe.errors import CorruptInputError, DataError, RecpipeError
from schemas import DatasetSchema, default_schema, load_schema

__all__ = [
    "DEFAULT_ROW_GROUP_SIZE",
    "DEFAULT_ZSTD_LEVEL",
    "BuildConfig",
    "build",
    "format_summary",
    "register_cli",
]

#: zstd level: measured on the synthetic data (see DEFAULT_SETTINGS_NOTE).
DEFAULT_ZSTD_LEVEL = 3
#: rows per row group: measured on the synthetic data (see DEFAULT_SETTINGS_NOTE).
DEFAULT_ROW_GROUP_SIZE = 65_536
DEFAULT_SETTINGS_NOTE = (
    "measured with `python -m etl._build_tune` on 200k clustered synthetic rows: zstd level "
    "1/3/6/9/12 -> 12.1/9.0/8.4/7.7/7.8 MB, write 1.5/1.7/2.4/3.2/10.9 s (3 = the knee: -25% "
    "bytes vs 1 for +8% time; beyond it bytes fall <15% for 1.5-6x the time); row groups "
    "8k/16k/32k/64k/128k/256k -> 9.29/9.12/9.03/9.00/8.96/8.94 MB (64k is within 0.7% of 256k "
    "and keeps 16 groups per 1M rows to shuffle); dictionary on all columns 14.8 MB, on none "
    "9.5 MB, on the columns measured per build 9.0 MB"
)

#: raw lines per batch whose text tests run in one compiled pass (etl._build_io.line_facts)
_FACT_BATCH_ROWS = 65_536
#: run the fast path's text tests in Numba (True) or in SQL (False: same rows accepted, slower)
_LINE_FACTS = True

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KIB|MB|MIB|GB|GIB|TB|TIB)\s*$", re.I)
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


@dataclass
class BuildConfig:
    """Options of :func:`build`.

    Attributes:
        memory_limit: DuckDB memory limit, e.g. ``"512MB"`` (None: DuckDB's default, 80% RAM).
        spill_dir: where DuckDB spills (None: a folder inside the temporary output directory).
        threads: DuckDB threads (None: all cores).
        session_gap_ms: inactivity gap that splits a user's records into sessions when they
            carry no ``session_id``.
        sample_sessions: keep this fraction of sessions (whole sessions, seeded by ``seed``).
        zstd_level: zstd compression level of the Parquet files.
        row_group_size: target rows per row group (cut at session boundaries).
        order: ``"session"`` (clustered) or ``"time"`` (the pre-RecD baseline: rows by ts only).
        engine: ``"duckdb"`` (out of core) or ``"polars"`` (in memory, the same dataset,
            quarantine and counts; refuses ``memory_limit``, ``spill_dir`` and ``threads``;
            see :mod:`etl._build_polars`).
        seed: seed of ``sample_sessions``.
        partition_by: ``"none"`` or ``"hour"`` (``dt=YYYY-MM-DD-HH/`` folders, by the session's
            first ts in session order, by the row's ts in time order).
        max_file_bytes: a part file is closed once it passes this size.
        dictionary: ``"auto"`` (measured per column on the first row group), ``"all"`` or
            ``"none"``.
    """

    memory_limit: str | None = None
    spill_dir: Path | None = None
    threads: int | None = None
    session_gap_ms: int = 30 * 60 * 1000
    sample_sessions: float = 1.0
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE
    order: Literal["session", "time"] = "session"
    engine: Literal["duckdb", "polars"] = "duckdb"
    seed: int = 0
    partition_by: Literal["none", "hour"] = "none"
    max_file_bytes: int = 256 << 20
    dictionary: Literal["auto", "all", "none"] = "auto"

    def __post_init__(self) -> None:
        if self.memory_limit is not None and not _MEMORY_RE.match(str(self.memory_limit)):
            msg = f"`memory_limit` must look like '512MB' or '4GB', got {self.memory_limit!r}"
            raise DataError(msg)
        if self.spill_dir is not None:
            self.spill_dir = Path(self.spill_dir)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise DataError(f"`threads` must be a positive integer, got {self.threads!r}")
        if not isinstance(self.session_gap_ms, int) or self.session_gap_ms <= 0:
            raise DataError(
                f"`session_gap_ms` must be a positive integer, got {self.session_gap_ms!r}"
            )
        if not 0.0 < float(self.sample_sessions) <= 1.0:
            raise DataError(f"`sample_sessions` must be in (0, 1], got {self.sample_sessions!r}")
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise DataError(f"`zstd_level` must be an integer in 1..22, got {self.zstd_level!r}")
        if not isinstance(self.row_group_size, int) or self.row_group_size < 1:
            raise DataError(
                f"`row_group_size` must be a positive integer, got {self.row_group_size!r}"
            )
        if self.order not in ("session", "time"):
            raise DataError(f"`order` must be 'session' or 'time', got {self.order!r}")
        if self.engine not in ("duckdb", "polars"):
            raise DataError(f"`engine` must be 'duckdb' or 'polars', got {self.engine!r}")
        if self.partition_by not in ("none", "hour"):
            raise DataError(f"`partition_by` must be 'none' or 'hour', got {self.partition_by!r}")
        if self.dictionary not in ("auto", "all", "none"):
            raise DataError(
                f"`dictionary` must be 'auto', 'all' or 'none', got {self.dictionary!r}"
            )
        if not isinstance(self.max_file_bytes, int) or self.max_file_bytes < 1:
            raise DataError(
                f"`max_file_bytes` must be a positive integer, got {self.max_file_bytes!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the options."""
        d = asdict(self)
        d["spill_dir"] = str(self.spill_dir) if self.spill_dir is not None else None
        return d


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(out_dir: Path) -> list[str]:
    """Remove temporary/old directories of crashed builds of ``out_dir``."""
    removed = []
    for prefix in (_TMP_PREFIX, _OLD_PREFIX):
        for p in out_dir.parent.glob(f".{out_dir.name}{prefix}*"):
            pid = p.name[len(out_dir.name) + 1 + len(prefix) :].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
    return removed


class _Phases:
    """A tqdm bar per phase (stderr), and the time each phase took."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.times: dict[str, float] = {}

    def bar(self, desc: str, total: float | None = None, unit: str = "it", **kw: Any):
        from tqdm.auto import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            disable=not self.enabled,
            file=sys.stderr,
            leave=True,
            **kw,
        )

    def timed(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.times[name] = round(self.times.get(name, 0.0) + now - t0, 3)
        return now


def _oom_error(exc: Exception) -> RecpipeError:
    first = str(exc).strip().splitlines()[0]
    return RecpipeError(
        f"DuckDB ran out of memory under `memory_limit`: {first}\n"
        "hint: raise --memory-limit (a few hundred MB at least) or lower --threads"
    )


def _duckdb_error(path: Path, exc: Exception) -> CorruptInputError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "unicode" in str(exc).lower() or "utf-8" in str(exc).lower():
        first += " (the file is not UTF-8 text: binary, corrupt or not JSON Lines)"
    return CorruptInputError(f"{path}: cannot read input: {first}")


def build(
    features: str | Path | Iterable[str | Path],
    out_dir: str | Path,
    *,
    events: str | Path | Iterable[str | Path] | None = None,
    schema: DatasetSchema | None = None,
    config: BuildConfig | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Build the session-clustered dataset (DESIGN §2.3) from raw logs (§2.1).

    Args:
        features: feature logs: a path, directory, glob, or a list of them (``.jsonl``,
            ``.jsonl.zst``, ``.parquet``).
        out_dir: the dataset directory to create (replaced atomically at the end).
        events: event logs (same forms); without them every label is 0.
        schema: the dataset schema (default: the bundled example schema).
        config: build options (default: :class:`BuildConfig()`).
        overwrite: replace an existing ``out_dir``.
        progress: show tqdm bars per phase on stderr.

    Returns:
        The manifest (also written to ``out_dir/_manifest.json``).

    Raises:
        DataError: bad arguments, missing inputs, or an existing ``out_dir`` without ``overwrite``.
        CorruptInputError: an input file that cannot be decoded (named in the message).
    """
    import duckdb

    t_start = time.perf_counter()
    schema = schema if schema is not None else default_schema()
    config = config if config is not None else BuildConfig()
    into = _build_into
    if config.engine == "polars":
        from etl import _build_polars

        _build_polars.check_config(config)
        into = _build_polars.build_into
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(
            f"`out_dir` {str(out_dir)!r} already exists; pass overwrite=True (--overwrite) to replace it"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out_dir)
    feat_files = list_inputs(features)
    ev_files = list_inputs(events) if events is not None else []
    tmp = out_dir.parent / f".{out_dir.name}{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    phases = _Phases(progress)
    base = Path(config.spill_dir) if config.spill_dir is not None else tmp
    spill = base / f"_recpipe_spill-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        try:
            manifest = into(
                duckdb,
                tmp,
                feat_files,
                ev_files,
                schema=schema,
                config=config,
                phases=phases,
                spill=spill,
            )
        finally:
            shutil.rmtree(spill, ignore_errors=True)
        manifest["elapsed_s"] = round(time.perf_counter() - t_start, 3)
        (tmp / "_manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        if out_dir.exists():
            old = (
                out_dir.parent / f".{out_dir.name}{_OLD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            )
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest["elapsed_s"] = round(time.perf_counter() - t_start, 3)
    return manifest


def _connect(duckdb: Any, spill: Path, config: BuildConfig):
    spill.mkdir(parents=True, exist_ok=True)
    # with a memory limit, tables live in a database file in the spill folder (buffer-managed,
    # evictable); without one, in memory (faster)
    db = str(spill / "_build.duckdb") if config.memory_limit is not None else ":memory:"
    con = duckdb.connect(db)
    con.execute(f"SET temp_directory = {sql_str(str(spill))}")
    if config.memory_limit is not None:
        con.execute(f"SET memory_limit = {sql_str(config.memory_limit)}")
    if config.threads is not None:
        con.execute(f"SET threads = {int(config.threads)}")
    con.execute("SET enable_progress_bar = false")
    # line numbers come from row_number() over the scan: keep scan order while parsing
    con.execute("SET preserve_insertion_order = true")
    return con, spill


def _parse_workers(config: BuildConfig, n_files: int) -> int:
    """Files parsed at once: each file's parse is one mostly single-threaded DuckDB pipeline
    (one zstd stream, line numbers in scan order), so whole files run side by side."""
    threads = config.threads if config.threads is not None else (os.cpu_count() or 1)
    return max(1, min(threads, n_files))


def _parse_one(
    con, f: InputFile, file_id: int, table: str, select, select_facts=None, keys=()
) -> None:
    """Validate one file into ``table`` on its own cursor; DuckDB errors name the file.

    With ``select_facts`` (feature JSON Lines), the raw lines stream through Python in
    batches: :func:`etl._build_io.line_facts` computes their text tests in one compiled pass
    and ``select_facts`` validates each batch with them, instead of many scans in SQL.
    """
    import duckdb

    src = source_sql(f, file_id, sql_str)
    cur = con.cursor()
    try:
        if select_facts is not None and f.kind == "jsonl":
            _parse_with_facts(con, cur, src, f"_lines_{file_id}", table, select_facts, keys)
            return
        try:  # optimistic: no JSON guard; a malformed line fails the statement
            cur.execute(f"INSERT INTO {table} {select(src, guarded=False)}")
        except duckdb.InvalidInputException as exc:
            if "malformed json" not in str(exc).lower():
                raise
            cur.execute(f"INSERT INTO {table} {select(src, guarded=True)}")
    except duckdb.OutOfMemoryException as exc:
        raise _oom_error(exc) from None
    except duckdb.Error as exc:
        raise _duckdb_error(f.path, exc) from None
    except OSError as exc:  # a DuckDB error met while pyarrow streams the lines, after batch 1
        if str(exc).startswith("Out of Memory Error"):
            raise _oom_error(exc) from None
        raise _duckdb_error(f.path, exc) from None
    finally:
        cur.close()


def _parse_with_facts(con, cur, src: str, view: str, table: str, select_facts, keys) -> None:
    """Stream ``src``'s numbered lines in Arrow batches, add :func:`line_facts`, insert each.

    The lines (and their numbers) come from the same relation as the SQL-only path, so a
    line's number, its raw text in the quarantine and the rows accepted do not depend on
    the path taken.
    """
    import duckdb
    import pyarrow as pa

    reader_cur = con.cursor()
    try:
        reader = reader_cur.sql(f"SELECT file_id, line_no, line, source, source_line FROM {src}")
        for batch in reader.to_arrow_reader(_FACT_BATCH_ROWS):
            facts = line_facts(batch.column("line"), keys)
            lines = pa.Table.from_batches([batch])
            for name in LINE_FACT_COLUMNS:
                lines = lines.append_column(name, pa.array(facts[name]))
            cur.register(view, lines)
            try:
                try:  # optimistic, as in _parse_one
                    cur.execute(f"INSERT INTO {table} {select_facts(view, guarded=False)}")
                except duckdb.InvalidInputException as exc:
                    if "malformed json" not in str(exc).lower():
                        raise
                    cur.execute(f"INSERT INTO {table} {select_facts(view, guarded=True)}")
            finally:
                cur.unregister(view)
    finally:
        reader_cur.close()


def _parse_files(
    con,
    files: list[InputFile],
    table: str,
    select,
    phases: _Phases,
    label: str,
    *,
    workers: int = 1,
    select_facts=None,
    keys: tuple[str, ...] = (),
) -> None:
    """Validate every file into ``table``, ``workers`` files at a time (one cursor each).

    Rows land in ``table`` in no particular order: every later step orders by
    ``(file_id, line_no)`` explicitly, so the output does not depend on it.
    """
    total = sum(f.path.stat().st_size for f in files)
    with phases.bar(f"parse {label}", total=total, unit="B", unit_scale=True) as bar:
        if workers <= 1:
            for file_id, f in enumerate(files):
                _parse_one(con, f, file_id, table, select, select_facts, keys)
                bar.update(f.path.stat().st_size)
            return
        with ThreadPoolExecutor(max_workers=workers) as pool:
            jobs = {
                pool.submit(_parse_one, con, f, file_id, table, select, select_facts, keys): f
                for file_id, f in enumerate(files)
            }
            try:
                for job in as_completed(jobs):
                    job.result()
                    bar.update(jobs[job].path.stat().st_size)
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise


def _build_into(
    duckdb: Any,
    tmp: Path,
    feat_files: list[InputFile],
    ev_files: list[InputFile],
    *,
    schema: DatasetSchema,
    config: BuildConfig,
    phases: _Phases,
    spill: Path,
) -> dict:

    t = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=1)  # digests overlap with DuckDB's parse
    # a truncated zstd must fail before DuckDB silently reads half of it
    for f in [*feat_files, *ev_files]:
        check_structure(f)
    checks = [pool.submit(digest, f) for f in [*feat_files, *ev_files]]
    con, spill = _connect(duckdb, spill, config)
    t = phases.timed("setup", t)

    empty = (
        "(SELECT 0 AS file_id, 0::BIGINT AS line_no, NULL::VARCHAR AS line, "
        "NULL::VARCHAR AS source, NULL::BIGINT AS source_line)"
    )
    feat_sel = lambda src, guarded=True: feature_select(schema, src, fast=True, guarded=guarded)  # noqa: E731
    con.execute(f"CREATE TABLE feat AS {feat_sel(empty)} LIMIT 0")
    side_by_side = _parse_workers(config, max(len(feat_files), len(ev_files))) > 1
    if side_by_side:  # whole files run in parallel: one DuckDB thread per statement wastes least
        con.execute("SET threads = 1")
    _parse_files(
        con,
        feat_files,
        "feat",
        feat_sel,
        phases,
        "features",
        workers=_parse_workers(config, len(feat_files)),
        select_facts=(
            (
                lambda src, guarded: feature_select(
                    schema, src, fast=True, guarded=guarded, facts=True
                )
            )
            if _LINE_FACTS
            else None
        ),
        keys=schema_keys(schema),
    )
    # the few rows the fast path did not accept: full checks on their raw lines
    pending = (
        "(SELECT file_id, line_no, raw AS line, source, source_line "
        f"FROM feat WHERE reason = '{PENDING}')"
    )
    con.execute(f"INSERT INTO feat {feature_select(schema, pending, fast=False)}")
    con.execute(f"DELETE FROM feat WHERE reason = '{PENDING}'")
    ev_sel = lambda src, guarded=True: event_select(schema, src)  # noqa: E731
    con.execute(f"CREATE TABLE ev AS {ev_sel(empty)} LIMIT 0")
    if ev_files:
        _parse_files(
            con,
            ev_files,
            "ev",
            ev_sel,
            phases,
            "events",
            workers=_parse_workers(config, len(ev_files)),
        )
    if side_by_side:
        con.execute(
            f"SET threads = {int(config.threads)}"
            if config.threads is not None
            else "RESET threads"
        )
    inputs = [c.result() for c in checks]
    pool.shutdown()
    t = phases.timed("parse", t)
    con.execute("SET preserve_insertion_order = false")

    with phases.bar("dedup, join, sessionize", total=4) as bar:
        dup_count = _quarantine_duplicates(con, feat_files)
        bar.update(1)
        con.execute(
            "CREATE TABLE labels AS SELECT request_id, max(label) AS label "
            "FROM ev WHERE reason IS NULL GROUP BY request_id"
        )
        bar.update(1)
        _sessionize(con, config)
        bar.update(1)
        counts = _counts(con)
        bar.update(1)
    t = phases.timed("dedup_join_sessionize", t)

    qdir = tmp / "_quarantine"
    qdir.mkdir()
    _write_quarantine(con, "feat", feat_files, qdir / "features.parquet")
    _write_quarantine(con, "ev", ev_files, qdir / "events.parquet")
    t = phases.timed("quarantine", t)

    # row groups are encoded on a second thread while DuckDB sorts and fetches the next rows
    writer = _dataset_writer(tmp, schema, config, background=True)
    arrow_schema = writer.schema
    con.execute(
        """
        CREATE TABLE keep AS
        SELECT f.file_id, f.line_no, f.ts, s.sid, s.first_ts, coalesce(l.label, 0)::FLOAT AS label
        FROM feat f
        JOIN rowkeys r USING (file_id, line_no)
        JOIN sessions s USING (skey)
        LEFT JOIN labels l USING (request_id)
        WHERE f.reason IS NULL
        """
    )
    chunks = _sort_chunks(con, config)

    with phases.bar("write parquet", total=counts["rows_out"], unit="row", unit_scale=True) as bar:
        try:
            for lo, hi in chunks:
                sql, part_col = _final_sql(schema, config, lo=lo, hi=hi)
                reader = con.sql(sql).to_arrow_reader(16_384)
                for part, batch in iter_partitioned(reader, column=part_col):
                    writer.write(batch.cast(arrow_schema), partition=part)
                    bar.update(batch.num_rows)
        except duckdb.OutOfMemoryException as exc:
            writer.abort()
            raise _oom_error(exc) from None
        except BaseException:
            writer.abort()
            raise
    files = writer.close()
    con.close()
    phases.timed("write", t)
    return _manifest(
        schema=schema,
        config=config,
        inputs=inputs,
        feat_files=feat_files,
        ev_files=ev_files,
        counts=counts,
        rows_duplicate=dup_count,
        writer=writer,
        files=files,
        phases=phases,
    )


def _dataset_writer(
    root: Path, schema: DatasetSchema, config: BuildConfig, *, background: bool = False
) -> SessionAlignedWriter:
    """The Parquet writer of both engines, set up from ``config`` (``background``: see
    :class:`etl._build_io.SessionAlignedWriter`)."""
    arrow_schema = schema.arrow_schema()
    return SessionAlignedWriter(
        root=root,
        schema=arrow_schema,
        session_col=schema.session_key,
        row_group_size=config.row_group_size,
        zstd_level=config.zstd_level,
        dictionary=None
        if config.dictionary == "auto"
        else (arrow_schema.names if config.dictionary == "all" else []),
        max_file_bytes=config.max_file_bytes,
        align_sessions=config.order == "session",
        background=background,
    )


def _manifest(
    *,
    schema: DatasetSchema,
    config: BuildConfig,
    inputs: list[dict],
    feat_files: list[InputFile],
    ev_files: list[InputFile],
    counts: dict[str, Any],
    rows_duplicate: int,
    writer: SessionAlignedWriter,
    files: list[dict],
    phases: _Phases,
) -> dict:
    """The manifest of both engines (without ``elapsed_s``), once the files are written.

    Raises:
        RecpipeError: "internal: ..." when the files do not hold exactly the rows and sessions
            counted (cannot happen; checked to promise it).
    """
    import pyarrow as pa

    rows_written = sum(f["rows"] for f in files)
    if rows_written != counts["rows_out"]:
        raise RecpipeError(
            f"internal: the files hold {rows_written} rows, the build counted "
            f"{counts['rows_out']} rows out"
        )
    if writer.sessions != counts["sessions"]:
        raise RecpipeError(
            f"internal: the files hold {writer.sessions} sessions, the build kept "
            f"{counts['sessions']}"
        )
    bytes_in = sum(i["bytes"] for i in inputs)
    bytes_out = sum(f["bytes"] for f in files)
    feature_bytes_in = sum(i["bytes"] for i in inputs[: len(feat_files)])
    return {
        "format": "recpipe-clustered/1",
        "schema": schema.to_toml(),
        "config": config.to_dict(),
        "order": config.order,
        "inputs": inputs,
        "feature_inputs": len(feat_files),
        "event_inputs": len(ev_files),
        **counts,
        "rows_duplicate": rows_duplicate,
        "reconciles": counts["rows_in"]
        == counts["rows_out"] + counts["rows_quarantined"] + counts["rows_sampled_out"],
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
            "row_group_size": config.row_group_size,
            "session_aligned_row_groups": config.order == "session",
            "dictionary_columns": list(writer.dictionary or []),
            "dictionary_measured": writer.dictionary_measured,
            "settings_note": DEFAULT_SETTINGS_NOTE,
        },
        "quarantine": {
            "features": "_quarantine/features.parquet",
            "events": "_quarantine/events.parquet",
        },
        "phase_s": phases.times,
        "arrow_schema": pa.schema(writer.schema).to_string(show_schema_metadata=False),
    }


def _source_name(files: list[InputFile]) -> str:
    """SQL CASE mapping file_id -> the input path."""
    if not files:
        return "NULL::VARCHAR"
    arms = " ".join(f"WHEN {i} THEN {sql_str(str(f.path))}" for i, f in enumerate(files))
    return f"CASE file_id {arms} END"


def _quarantine_duplicates(con, files: list[InputFile]) -> int:
    """Mark every record of a request_id after the first (file order) as a duplicate."""
    con.execute(
        """
        CREATE TABLE dups AS
        SELECT file_id, line_no, request_id, first_file, first_line FROM (
          SELECT file_id, line_no, request_id,
                 first_value(file_id) OVER w AS first_file,
                 first_value(line_no) OVER w AS first_line,
                 row_number() OVER w AS rn
          FROM feat
          WHERE reason IS NULL AND request_id IN (
            SELECT request_id FROM feat WHERE reason IS NULL
            GROUP BY request_id HAVING count(*) > 1)
          WINDOW w AS (PARTITION BY request_id ORDER BY file_id, line_no)
        ) WHERE rn > 1
        """
    )
    n = con.execute("SELECT count(*) FROM dups").fetchall()[0][0]
    if not n:
        return 0
    # the raw line is not kept for good rows: read back just the duplicate lines
    con.execute(
        "CREATE TABLE dup_raw "
        "(file_id INTEGER, line_no BIGINT, line VARCHAR, source VARCHAR, source_line BIGINT)"
    )
    dup_files = [
        r[0] for r in con.execute("SELECT DISTINCT file_id FROM dups ORDER BY 1").fetchall()
    ]
    for fid in dup_files:
        src = source_sql(files[fid], fid, sql_str)
        con.execute(
            f"INSERT INTO dup_raw SELECT {fid}, s.line_no, s.line, s.source, s.source_line "
            f"FROM {src} s "
            f"SEMI JOIN (SELECT line_no FROM dups WHERE file_id = {fid}) d USING (line_no)"
        )
    src_name = _source_name(files).replace("file_id", "d.first_file")
    con.execute(
        f"""
        UPDATE feat SET reason = {sql_str(reasons.DUPLICATE_REQUEST_ID)},
          detail = 'field `request_id`: ' || to_json(d.request_id)::VARCHAR
                   || ' already seen at ' || {src_name} || ':' || d.first_line::VARCHAR,
          raw = r.line, source = r.source, source_line = r.source_line
        FROM dups d LEFT JOIN dup_raw r USING (file_id, line_no)
        WHERE feat.file_id = d.file_id AND feat.line_no = d.line_no
        """
    )
    return int(n)


def _sessionize(con, config: BuildConfig) -> None:
    """Raw session keys per good row, then session ids ranked by (first ts, key), sampled."""
    gap = int(config.session_gap_ms)
    con.execute(
        f"""
        CREATE TABLE rowkeys AS
        SELECT file_id, line_no, 's:' || session_key AS skey FROM feat
          WHERE reason IS NULL AND session_key IS NOT NULL
        UNION ALL
        SELECT file_id, line_no, 'r:' || request_id FROM feat
          WHERE reason IS NULL AND session_key IS NULL AND user_key IS NULL
        UNION ALL
        SELECT file_id, line_no,
               'u:' || user_key || ':' || sum(new_session) OVER (
                 PARTITION BY user_key ORDER BY ts, file_id, line_no
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)::VARCHAR
        FROM (
          SELECT file_id, line_no, user_key, ts,
                 -- in HUGEINT: two int64 ts may lie more than 2^63 ms apart
                 CASE WHEN ts::HUGEINT - (lag(ts) OVER (
                        PARTITION BY user_key ORDER BY ts, file_id, line_no))::HUGEINT
                      <= {gap} THEN 0 ELSE 1 END AS new_session
          FROM feat WHERE reason IS NULL AND session_key IS NULL AND user_key IS NOT NULL)
        """
    )
    keep = ""
    if config.sample_sessions < 1.0:
        threshold = int(config.sample_sessions * (1 << 53))
        keep = f"WHERE (hash(skey || '#{int(config.seed)}') >> 11) < {threshold}"
    con.execute(
        f"""
        CREATE TABLE sessions AS
        SELECT skey, first_ts, row_number() OVER (ORDER BY first_ts, skey) - 1 AS sid
        FROM (SELECT r.skey, min(f.ts) AS first_ts
              FROM rowkeys r JOIN feat f USING (file_id, line_no) GROUP BY r.skey)
        {keep}
        """
    )


def _counts(con) -> dict[str, Any]:
    q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
    rows_in = q("SELECT count(*) FROM feat")[0][0]
    by_reason = dict(
        q("SELECT reason, count(*) FROM feat WHERE reason IS NOT NULL GROUP BY 1 ORDER BY 1")
    )
    good = rows_in - sum(by_reason.values())
    rows_out, sessions = q(
        "SELECT count(*), count(DISTINCT s.sid) FROM rowkeys r JOIN sessions s USING (skey)"
    )[0]
    ev_in = q("SELECT count(*) FROM ev")[0][0]
    ev_reason = dict(
        q("SELECT reason, count(*) FROM ev WHERE reason IS NOT NULL GROUP BY 1 ORDER BY 1")
    )
    ev_unknown = q(
        "SELECT count(*) FROM ev e ANTI JOIN (SELECT request_id FROM feat WHERE reason IS NULL) f "
        "USING (request_id) WHERE e.reason IS NULL"
    )[0][0]
    unlabelled = q(
        "SELECT count(*) FROM feat f ANTI JOIN labels l USING (request_id) WHERE f.reason IS NULL"
    )[0][0]
    unknown = dict(
        q(
            "SELECT name, count(*) FROM (SELECT unnest(unknown) AS name FROM feat "
            "WHERE unknown IS NOT NULL) GROUP BY 1 ORDER BY 1"
        )
    )
    return {
        "rows_in": int(rows_in),
        "rows_out": int(rows_out),
        "rows_quarantined": int(sum(by_reason.values())),
        "rows_sampled_out": int(good - rows_out),
        "quarantine_by_reason": {r: int(by_reason.get(r, 0)) for r in reasons.QUARANTINE_REASONS},
        "sessions": int(sessions),
        "rows_without_event": int(unlabelled),
        "unknown_features": {k: int(v) for k, v in unknown.items()},
        "events_in": int(ev_in),
        "events_quarantined": int(sum(ev_reason.values())),
        "events_quarantine_by_reason": {
            r: int(ev_reason.get(r, 0))
            for r in reasons.QUARANTINE_REASONS
            if r != reasons.DUPLICATE_REQUEST_ID
        },
        "events_unknown_request": int(ev_unknown),
    }


def _write_quarantine(con, table: str, files: list[InputFile], path: Path) -> None:
    """Bad rows in input order; an unroutable record names the file and line it came from."""
    src = _source_name(files)
    con.execute(
        f"""
        COPY (
          SELECT coalesce(source, {src}) AS source, coalesce(source_line, line_no) AS line,
                 reason, detail, raw
          FROM {table} WHERE reason IS NOT NULL ORDER BY file_id, line_no
        ) TO {sql_str(str(path))} (FORMAT parquet, COMPRESSION zstd)
        """
    )


def _memory_bytes(text: str) -> int:
    num, unit = _MEMORY_RE.match(text).groups()  # validated in BuildConfig
    scale = {"B": 1, "KB": 1e3, "KIB": 2**10, "MB": 1e6, "MIB": 2**20, "GB": 1e9, "GIB": 2**30}
    return int(float(num) * scale.get(unit.upper(), 1e12 if unit.upper() == "TB" else 2**40))


def _rows_per_sort_chunk(config: BuildConfig) -> int | None:
    if config.memory_limit is None:
        return None
    return max(8_192, _memory_bytes(config.memory_limit) // 2048)


def _sort_chunks(con, config: BuildConfig) -> list[tuple[int | None, int | None]]:
    """Key ranges ``[lo, hi)`` of the final sort, so that each sort fits the memory limit.

    DuckDB's sort of the wide rows (many list columns) runs out of memory well before the
    limit is reached by the small columns, so with a limit the rows are sorted in ranges of
    the sort key (session id, or ts in time order) of about ``memory_limit / 2 KB`` rows; each
    range holds whole sessions (whole timestamps), so the concatenation is the global order.
    Without a limit: one range.
    """
    budget = _rows_per_sort_chunk(config)
    if budget is None:
        return [(None, None)]
    key = "sid" if config.order == "session" else "ts"
    rows = con.execute(f"SELECT {key} AS k, count(*) AS n FROM keep GROUP BY 1 ORDER BY 1")
    got = rows.fetchnumpy()
    keys, counts = got["k"], got["n"]
    chunks: list[tuple[int | None, int | None]] = []
    lo, acc = None, 0
    for k, c in zip(keys.tolist(), counts.tolist()):
        if acc and acc + c > budget:
            chunks.append((lo, k))
            lo, acc = k, 0
        acc += c
    chunks.append((lo, None))
    return chunks


def _final_sql(
    schema: DatasetSchema, config: BuildConfig, *, lo: int | None = None, hi: int | None = None
) -> tuple[str, str | None]:
    """The sorted query the writer streams (rows with sort key in ``[lo, hi)``)."""
    ident = lambda n: '"' + n.replace('"', '""') + '"'  # noqa: E731
    cols = [
        f"k.sid AS {ident(schema.session_key)}",
        f"k.ts AS {ident(schema.time_key)}",
        f"k.label AS {ident(schema.label_key)}",
    ]
    cols += [f"f.d{i} AS {ident(d.name)}" for i, d in enumerate(schema.dense)]
    cols += [f"f.s{i} AS {ident(s.name)}" for i, s in enumerate(schema.sparse)]
    part_col = None
    if config.partition_by == "hour":
        part_col = "__dt"
        basis = "k.first_ts" if config.order == "session" else "k.ts"
        cols.append(f"strftime(epoch_ms({basis}), '%Y-%m-%d-%H') AS {part_col}")
    order = (
        "k.sid, k.ts, k.file_id, k.line_no"
        if config.order == "session"
        else "k.ts, k.sid, k.file_id, k.line_no"
    )
    key = "k.sid" if config.order == "session" else "k.ts"
    conds = ([f"{key} >= {int(lo)}"] if lo is not None else []) + (
        [f"{key} < {int(hi)}"] if hi is not None else []
    )
    where = f"WHERE {' AND '.join(conds)}" if conds else ""
    sql = f"""
        SELECT {", ".join(cols)}
        FROM feat f JOIN keep k USING (file_id, line_no)
        {where}
        ORDER BY {order}
    """
    return sql, part_col


def format_summary(manifest: dict, out_dir: str | Path | None = None) -> str:
    """A one-screen summary of a build manifest."""
    m = manifest
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    lines = [
        f"etl build -> {out_dir}" if out_dir else "etl build",
        f"  rows in          {m['rows_in']:>12,}",
        f"  rows out         {m['rows_out']:>12,}   ({m['order']} order, {m['sessions']:,} sessions)",
        f"  quarantined      {m['rows_quarantined']:>12,}",
    ]
    if not m["rows_out"]:
        why = "the inputs hold no records" if not m["rows_in"] else "no record was kept"
        lines.insert(3, f"  !! 0 rows out: {why}; the dataset is empty (no part files)")
    lines += [f"    {r:<22}{n:>10,}" for r, n in m["quarantine_by_reason"].items() if n]
    if m["rows_sampled_out"]:
        lines.append(f"  sampled out      {m['rows_sampled_out']:>12,}")
    lines.append(
        f"  events in        {m['events_in']:>12,}   (quarantined {m['events_quarantined']:,}, "
        f"unknown request {m['events_unknown_request']:,}; requests without event "
        f"{m['rows_without_event']:,})"
    )
    if m["unknown_features"]:
        lines.append(f"  unknown features {m['unknown_features']}")
    ratio = m["compression_ratio"]
    lines += [
        f"  reconciles       {m['reconciles']}  (in = out + quarantined + sampled out)",
        f"  files            {len(m['files']):>12,}   row groups {m['row_groups']:,}, "
        f"sessions split across files {m.get('sessions_split_across_files', 0):,}",
        f"  bytes in / out   {mb(m['bytes_in'])} / {mb(m['bytes_out'])}   "
        f"(feature logs / Parquet = {f'{ratio}x' if ratio is not None else 'n/a'})",
        f"  parquet          zstd-{m['parquet']['level']}, row groups of "
        f"{m['parquet']['row_group_size']:,} rows, dictionary on "
        f"{len(m['parquet']['dictionary_columns'])} columns",
        f"  time             {m['elapsed_s']:.1f} s  {m.get('phase_s', {})}",
    ]
    return "\n".join(lines)


def _parse_gap(text: str) -> int:
    """``30m``/``90s``/``2h``/``1500ms``/plain milliseconds -> milliseconds."""
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"`--session-gap` must look like 30m, 90s, 2h or 1500ms, got {text!r}"
        )
    return int(m.group(1)) * {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, None: 1}[m.group(2)]


def register_cli(stages: argparse._SubParsersAction) -> None:
    """Add ``build`` to the ``recpipe etl`` stages."""
    p = stages.add_parser(
        "build",
        help="validate, sessionize, join labels, cluster by session, write zstd Parquet",
        description=(
            "Build the session-clustered training dataset (RecD O2) from raw feature logs "
            "(and event logs): bad records go to OUT/_quarantine with a reason, sessions come "
            "from session_id or user_id + --session-gap, labels are the max over a request's "
            "events, rows are clustered by session and sorted by ts, and Parquet row groups "
            "never split a session. Runs out of core in DuckDB (--memory-limit, --spill-dir). "
            "The dataset appears atomically when the build succeeds."
        ),
    )
    d = BuildConfig()
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="feature logs: files, directories or globs"
    )
    p.add_argument("--events", nargs="+", metavar="EV", help="event logs (labels)")
    p.add_argument("--out", required=True, type=Path, help="dataset directory to create")
    p.add_argument("--schema", help="dataset schema TOML (default: the bundled example)")
    p.add_argument("--memory-limit", help="DuckDB memory limit, e.g. 512MB")
    p.add_argument("--spill-dir", type=Path, help="where DuckDB spills when over the limit")
    p.add_argument("--threads", type=int, help="DuckDB threads (default: all cores)")
    p.add_argument(
        "--session-gap",
        type=_parse_gap,
        default=d.session_gap_ms,
        metavar="GAP",
        help="inactivity gap splitting a user's sessions when records have no session_id (default 30m)",
    )
    p.add_argument(
        "--sample-sessions",
        type=float,
        default=1.0,
        metavar="P",
        help="keep a seeded fraction P of whole sessions (default 1.0)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --sample-sessions")
    p.add_argument(
        "--zstd-level", type=int, default=d.zstd_level, help=f"default {d.zstd_level} (measured)"
    )
    p.add_argument(
        "--row-group-size",
        type=int,
        default=d.row_group_size,
        help=f"target rows per row group, cut at session boundaries (default {d.row_group_size}, measured)",
    )
    p.add_argument(
        "--order",
        choices=["session", "time"],
        default="session",
        help="session: clustered (default); time: the pre-RecD baseline, rows by ts",
    )
    p.add_argument(
        "--engine",
        choices=["duckdb", "polars"],
        default="duckdb",
        help="duckdb (default): out of core; polars: in memory, the same dataset (no "
        "--memory-limit, --spill-dir or --threads)",
    )
    p.add_argument(
        "--partition-by",
        choices=["none", "hour"],
        default="none",
        help="hour: write dt=YYYY-MM-DD-HH/ folders",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--json", action="store_true", help="print the manifest as JSON instead of the summary"
    )
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    schema = load_schema(args.schema) if args.schema else default_schema()
    config = BuildConfig(
        memory_limit=args.memory_limit,
        spill_dir=args.spill_dir,
        threads=args.threads,
        session_gap_ms=args.session_gap,
        sample_sessions=args.sample_sessions,
        zstd_level=args.zstd_level,
        row_group_size=args.row_group_size,
        order=args.order,
        engine=args.engine,
        seed=args.seed,
        partition_by=args.partition_by,
    )
    manifest = build(
        args.inputs,
        args.out,
        events=args.events,
        schema=schema,
        config=config,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(json.dumps(manifest, indent=2) if args.json else format_summary(manifest, args.out))
    return 0
