"""The DuckDB engine of ``etl build`` (the default): every phase in DuckDB, out of core.

With ``memory_limit`` the tables live in a database file in a spill folder (``spill_dir``, or one
inside the temporary output directory) and DuckDB spills there; the final sort runs in key
ranges that fit the limit. Several input files are parsed at once, one cursor each: a batch of
lines from :func:`etl.build.inputs.read_lines` gets its text facts and is inserted through the
validator's SQL in one statement (optimistically without the JSON guard; again with it when a
line is malformed).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import pyarrow as pa

from etl.build.engine import BuildJob, Engine, Kind, duplicate_rows, sample_condition
from etl.build.inputs import InputFile, read_error, read_lines
from etl.build.output import PARTITION_MS, BuildCounts, by_reason
from etl.build.validate import PENDING, feature_columns, malformed_json, sql_str
from etl.paths import check_output
from recpipe.errors import RecpipeError

__all__ = ["DuckDBEngine"]

#: run the fast path's text tests compiled (:func:`etl.build._kernels.line_facts`, True) or in
#: SQL (False: the same rows accepted, slower)
LINE_FACTS = True
#: read plain feature lines with the compiled tier first (:mod:`etl.build._plain`, True), or
#: every line through the SQL tiers (False: the same rows, slower)
PLAIN_TIER = True
#: rows of the final sort fetched per Arrow batch
_FETCH_ROWS = 16_384
_EMPTY_LINES = (
    "(SELECT 0::INTEGER AS file_id, 0::BIGINT AS line_no, NULL::VARCHAR AS line, "
    "NULL::VARCHAR AS source, NULL::BIGINT AS source_line, NULL::BIGINT AS too_long)"
)
_TABLES = {"features": "feat", "events": "ev"}


class DuckDBEngine(Engine):
    """Every phase as DuckDB SQL over tables ``feat`` and ``ev`` (out of core with a limit)."""

    name = "duckdb"

    def __init__(self, job: BuildJob) -> None:
        import duckdb

        super().__init__(job)
        self.duckdb = duckdb
        config = job.config
        base = Path(config.spill_dir) if config.spill_dir is not None else job.work_dir
        self.spill = base / f"_recpipe_spill-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.spill.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _io_error(exc, self.spill, config) from None
        # with a memory limit, tables live in a database file in the spill folder (buffer-
        # managed, evictable); without one, in memory (faster)
        db = str(self.spill / "_build.duckdb") if config.memory_limit is not None else ":memory:"
        try:
            self.con = con = duckdb.connect(db)
            con.execute(f"SET temp_directory = {sql_str(str(self.spill))}")
            if config.memory_limit is not None:
                con.execute(f"SET memory_limit = {sql_str(config.memory_limit)}")
            if config.threads is not None:
                con.execute(f"SET threads = {int(config.threads)}")
            con.execute("SET enable_progress_bar = false")
        except duckdb.Error as exc:
            shutil.rmtree(self.spill, ignore_errors=True)
            raise _io_error(exc, self.spill, config) from None
        self.duplicates = 0

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Refuse a ``spill_dir`` that cannot be created or written (before anything is read)."""
        if config.spill_dir is not None:
            check_output(config.spill_dir, kind="directory", arg="spill_dir")

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self.spill, ignore_errors=True)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Close; a DuckDB error out of any phase that is about its limits, not the data (out
        of memory, a spill file it cannot write), becomes one line naming the option."""
        super().__exit__(exc_type, exc, tb)
        if isinstance(exc, self.duckdb.OutOfMemoryException):
            raise _oom_error(exc, self.job.config) from None
        if isinstance(exc, self.duckdb.IOException):
            raise _io_error(exc, self.spill, self.job.config) from None

    # -- read and validate --------------------------------------------------------------------

    def load(self, kind: Kind) -> None:
        v = self.job.validator
        table = _TABLES[kind]
        if kind == "features":
            select = lambda src, guarded: v.feature_sql(  # noqa: E731
                src, fast=True, guarded=guarded, facts=LINE_FACTS
            )
        else:
            select = lambda src, guarded: v.event_sql(src)  # noqa: E731
        empty = (
            v.feature_sql(_EMPTY_LINES, fast=True)
            if kind == "features"
            else v.event_sql(_EMPTY_LINES)
        )
        self._run(f"CREATE TABLE {table} AS {empty} LIMIT 0")
        files = self.job.files(kind)
        workers = self._workers(len(files))
        if workers > 1:  # whole files side by side: one DuckDB thread per statement wastes least
            self.con.execute("SET threads = 1")
        # each batch is an INSERT; an automatic checkpoint after one (compressing the table so
        # far) costs the parse a third more CPU: checkpoint once the files are in
        self.con.execute("SET checkpoint_threshold = '1000GB'")
        try:
            self._parse_files(files, table, select, kind, workers=workers)
        finally:
            self.con.execute("RESET checkpoint_threshold")
            if workers > 1:
                threads = self.job.config.threads
                self.con.execute(f"SET threads = {int(threads)}" if threads else "RESET threads")
        if kind == "features":  # the few rows the fast path left: full checks on their raw lines
            pending = (
                "(SELECT file_id, line_no, raw AS line, source, source_line, "
                f"NULL::BIGINT AS too_long FROM feat WHERE reason = '{PENDING}')"
            )
            self._run(f"INSERT INTO feat {v.feature_sql(pending, fast=False)}")
            self._run(f"DELETE FROM feat WHERE reason = '{PENDING}'")

    def _workers(self, n_files: int) -> int:
        """Files parsed at once: each file's parse is one mostly single-threaded pipeline, so
        whole files run side by side."""
        threads = self.job.config.threads or os.cpu_count() or 1
        return max(1, min(threads, n_files))

    def _parse_files(self, files: list[InputFile], table: str, select, kind: Kind, *, workers):
        """Validate every file into ``table``, ``workers`` files at a time (one cursor each).

        Rows land in ``table`` in no particular order: every later step orders by
        ``(file_id, line_no)`` explicitly, so the output does not depend on it.
        """
        total = sum(f.path.stat().st_size for f in files)
        with (
            self.job.bar(f"parse {kind}", total=total, unit="B", unit_scale=True) as bar,
            ThreadPoolExecutor(max_workers=workers) as pool,
        ):
            jobs = {
                pool.submit(self._parse_one, f, file_id, table, select, kind): f
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

    def _parse_one(self, f: InputFile, file_id: int, table: str, select, kind: Kind) -> None:
        """Insert one file's validated lines, batch by batch, on its own cursor."""
        duckdb = self.duckdb
        facts = kind == "features" and LINE_FACTS
        view = f"_lines_{file_id}"
        cur = self.con.cursor()
        try:
            lines = read_lines(f, file_id, max_line_bytes=self.job.config.max_line_bytes)
            for batch in lines:
                batch = self.job.validator.normalize(batch, kind)
                if kind == "features" and PLAIN_TIER:  # plain lines first, compiled
                    parsed, batch = self.job.validator.split_plain(batch)
                    if parsed is not None:
                        cur.register(view, parsed)
                        try:
                            cur.execute(f"INSERT INTO {table} {self.job.validator.plain_sql(view)}")
                        finally:
                            cur.unregister(view)
                    if not batch.num_rows:
                        continue
                cur.register(view, self.job.validator.with_facts(batch) if facts else batch)
                try:
                    try:  # optimistic: no JSON guard; a malformed line fails the statement
                        cur.execute(f"INSERT INTO {table} {select(view, False)}")
                    except (duckdb.InvalidInputException, UnicodeDecodeError) as exc:
                        if not malformed_json(exc):
                            raise
                        cur.execute(f"INSERT INTO {table} {select(view, True)}")
                finally:
                    cur.unregister(view)
        except (duckdb.OutOfMemoryException, duckdb.IOException):
            raise  # about the build's limits, not the file (see __exit__)
        except duckdb.Error as exc:
            raise read_error(f.path, exc) from None
        finally:
            cur.close()

    # -- dedup, labels, sessions ----------------------------------------------------------------

    def deduplicate(self) -> None:
        self.con.execute("SET preserve_insertion_order = false")  # every step orders explicitly
        self._run(
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
        dups = self.con.sql("SELECT * FROM dups").to_arrow_table()
        self.duplicates = dups.num_rows
        if not dups.num_rows:
            return
        self.con.register("_dup_rows", duplicate_rows(dups, self.job))
        self._run(
            """
            UPDATE feat SET reason = d.reason, detail = d.detail, raw = d.raw,
              source = d.source, source_line = d.source_line
            FROM _dup_rows d WHERE feat.file_id = d.file_id AND feat.line_no = d.line_no
            """
        )
        self.con.unregister("_dup_rows")

    def join_labels(self) -> None:
        self._run(
            "CREATE TABLE labels AS SELECT request_id, max(label) AS label "
            "FROM ev WHERE reason IS NULL GROUP BY request_id"
        )

    def sessionize(self) -> None:
        """Raw session keys per good row, then session ids ranked by (first ts, key), sampled."""
        gap = int(self.job.config.session_gap_ms)
        self._run(
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
        cond = sample_condition("skey", self.job.config)
        self._run(
            f"""
            CREATE TABLE sessions AS
            SELECT skey, first_ts, row_number() OVER (ORDER BY first_ts, skey) - 1 AS sid
            FROM (SELECT r.skey, min(f.ts) AS first_ts
                  FROM rowkeys r JOIN feat f USING (file_id, line_no) GROUP BY r.skey)
            {f"WHERE {cond}" if cond else ""}
            """
        )
        self._run(
            """
            CREATE TABLE keep AS
            SELECT f.file_id, f.line_no, f.ts, s.sid, s.first_ts,
                   coalesce(l.label, 0)::FLOAT AS label
            FROM feat f
            JOIN rowkeys r USING (file_id, line_no)
            JOIN sessions s USING (skey)
            LEFT JOIN labels l USING (request_id)
            WHERE f.reason IS NULL
            """
        )

    # -- counts and output ----------------------------------------------------------------------

    def counts(self) -> BuildCounts:
        one = lambda sql: self.con.execute(sql).fetchall()[0]  # noqa: E731
        pairs = lambda sql: dict(self.con.execute(sql).fetchall())  # noqa: E731
        bad = "SELECT reason, count(*) FROM {} WHERE reason IS NOT NULL GROUP BY 1"
        q = by_reason(pairs(bad.format("feat")))
        (rows_in,) = one("SELECT count(*) FROM feat")
        rows_out, sessions = one("SELECT count(*), count(DISTINCT sid) FROM keep")
        (unlabelled,) = one(
            "SELECT count(*) FROM feat f ANTI JOIN labels l USING (request_id) "
            "WHERE f.reason IS NULL"
        )
        ev_q = by_reason(pairs(bad.format("ev")), events=True)
        (ev_in,) = one("SELECT count(*) FROM ev")
        (ev_unknown,) = one(
            "SELECT count(*) FROM ev e ANTI JOIN (SELECT request_id FROM feat "
            "WHERE reason IS NULL) f USING (request_id) WHERE e.reason IS NULL"
        )
        names = self.job.schema.feature_names
        cols = feature_columns(self.job.schema)
        present = one(
            f"SELECT count(*), {', '.join(f'count({c})' for c in cols) or '0'} "
            "FROM feat WHERE reason IS NULL"
        )
        missing = {n: present[0] - k for n, k in zip(names, present[1:]) if present[0] - k}
        listed = (
            "SELECT name, count(*) FROM (SELECT unnest({0}) AS name FROM feat "
            "WHERE reason IS NULL AND {0} IS NOT NULL) GROUP BY 1 ORDER BY 1"
        )
        return BuildCounts(
            rows_in=int(rows_in),
            rows_out=int(rows_out),
            rows_quarantined=sum(q.values()),
            rows_sampled_out=int(rows_in) - sum(q.values()) - int(rows_out),
            quarantine_by_reason=q,
            sessions=int(sessions),
            rows_without_event=int(unlabelled),
            unknown_features={k: int(v) for k, v in pairs(listed.format("unknown")).items()},
            unknown_keys={k: int(v) for k, v in pairs(listed.format("unknown_keys")).items()},
            features_missing={k: int(v) for k, v in missing.items()},
            events_in=int(ev_in),
            events_quarantined=sum(ev_q.values()),
            events_quarantine_by_reason=ev_q,
            events_unknown_request=int(ev_unknown),
            rows_duplicate=self.duplicates,
        )

    def quarantined(self, kind: Kind) -> Iterator[pa.RecordBatch]:
        rel = self.con.sql(
            "SELECT file_id, line_no, reason, detail, raw, source, source_line "
            f"FROM {_TABLES[kind]} WHERE reason IS NOT NULL ORDER BY file_id, line_no"
        )
        yield from self._fetch(rel)

    def rows(self) -> Iterator[pa.RecordBatch]:
        for lo, hi in self._sort_chunks():
            yield from self._fetch(self.con.sql(self._final_sql(lo, hi)))

    def _fetch(self, rel) -> Iterator[pa.RecordBatch]:
        try:
            yield from rel.to_arrow_reader(_FETCH_ROWS)
        except self.duckdb.OutOfMemoryException as exc:
            raise _oom_error(exc, self.job.config) from None
        except OSError as exc:  # a DuckDB error met while Arrow streams the rows
            if str(exc).startswith("Out of Memory Error"):
                raise _oom_error(exc, self.job.config) from None
            raise

    def _sort_chunks(self) -> list[tuple[int | None, int | None]]:
        """Key ranges ``[lo, hi)`` of the final sort, so that each sort fits the memory limit.

        DuckDB's sort of the wide rows (many list columns) runs out of memory well before the
        limit is reached by the small columns, so with a limit the rows are sorted in ranges of
        the sort key (session id, or ts in time order) of about ``memory_limit / 2 KB`` rows;
        each range holds whole sessions (whole timestamps), so the concatenation is the global
        order. Without a limit: one range.
        """
        budget = rows_per_sort_chunk(self.job.config)
        if budget is None:
            return [(None, None)]
        key = "sid" if self.job.config.order == "session" else "ts"
        got = self.con.execute(
            f"SELECT {key} AS k, count(*) AS n FROM keep GROUP BY 1 ORDER BY 1"
        ).fetchnumpy()
        chunks: list[tuple[int | None, int | None]] = []
        lo, acc = None, 0
        for k, c in zip(got["k"].tolist(), got["n"].tolist()):
            if acc and acc + c > budget:
                chunks.append((lo, k))
                lo, acc = k, 0
            acc += c
        chunks.append((lo, None))
        return chunks

    def _final_sql(self, lo: int | None, hi: int | None) -> str:
        """The sorted query of the rows with sort key in ``[lo, hi)``, missing features filled."""
        schema, config = self.job.schema, self.job.config
        ident = lambda n: '"' + n.replace('"', '""') + '"'  # noqa: E731
        cols = [
            f"k.sid AS {ident(schema.session_key)}",
            f"k.ts AS {ident(schema.time_key)}",
            f"k.label AS {ident(schema.label_key)}",
        ]
        cols += [
            f"coalesce(f.d{i}, {float(d.fill)!r}::FLOAT) AS {ident(d.name)}"
            for i, d in enumerate(schema.dense)
        ]
        cols += [
            f"coalesce(f.s{i}, []::BIGINT[]) AS {ident(s.name)}"
            for i, s in enumerate(schema.sparse)
        ]
        cols += ["f.request_id", "f.user_key AS user_id", "f.session_key AS session_id_raw"]
        cols += [f"f.p{i} AS {ident(name)}" for i, name in enumerate(schema.passthrough)]
        if config.partition_by == "hour":
            basis = "k.first_ts" if config.order == "session" else "k.ts"
            cols.append(f"{basis} AS {PARTITION_MS}")
        session = config.order == "session"
        order = (
            "k.sid, k.ts, k.file_id, k.line_no" if session else "k.ts, k.sid, k.file_id, k.line_no"
        )
        key = "k.sid" if session else "k.ts"
        conds = [f"{key} >= {int(lo)}"] if lo is not None else []
        conds += [f"{key} < {int(hi)}"] if hi is not None else []
        where = f"WHERE {' AND '.join(conds)}" if conds else ""
        return f"""
            SELECT {", ".join(cols)}
            FROM feat f JOIN keep k USING (file_id, line_no)
            {where}
            ORDER BY {order}
        """

    def _run(self, sql: str) -> None:
        try:
            self.con.execute(sql)
        except self.duckdb.OutOfMemoryException as exc:
            raise _oom_error(exc, self.job.config) from None


def rows_per_sort_chunk(config: Any) -> int | None:
    """Rows per range of the final sort under ``memory_limit`` (None: one sort)."""
    if config.memory_limit is None:
        return None
    return max(8_192, config.memory_bytes // 2048)


def _oom_error(exc: Exception, config: Any) -> RecpipeError:
    first = str(exc).strip().splitlines()[0]
    limit = f" = {config.memory_limit!r}" if config.memory_limit is not None else ""
    return RecpipeError(
        f"DuckDB ran out of memory under `memory_limit`{limit}: {first}\n"
        "hint: raise --memory-limit (a few hundred MB at least) or lower --threads"
    )


def _io_error(exc: Exception, spill: Path, config: Any) -> RecpipeError:
    """DuckDB (or the folder it works in) cannot write its working files: a full disk, a
    read-only or vanished ``spill_dir``."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = (
        f"`spill_dir` {str(config.spill_dir)!r}"
        if config.spill_dir is not None
        else "the build's temporary folder (next to `out_dir`)"
    )
    return RecpipeError(
        f"{where}: DuckDB cannot write its working files in {str(spill)!r}: {first}\n"
        "hint: free some space, or point --spill-dir at a file system with room"
    )
