"""The Polars engine of ``etl build`` (``engine="polars"``): the DuckDB engine's dataset, in memory.

It runs the steps of :mod:`etl.build` under the same rules and gives the same output: the same
rows in the same order, the same quarantine (reasons, details, raw lines, line numbers), the
same manifest counts, and Parquet files written by the same
:class:`etl._build_io.SessionAlignedWriter` (byte-identical on the same inputs).

1. **read**: JSON Lines (plain, ``.zst``, ``.gz``) are read here and split into numbered lines
   the way DuckDB's line reader splits them (a leading BOM dropped, ``\\n`` or ``\\r\\n`` line
   ends, an empty line kept as NULL, the same line-size limit). Parquet files and
   ``etl shard``'s ``_unroutable.jsonl.zst`` become lines through the DuckDB engine's own
   relation (:func:`etl._build_io.source_sql`), so both engines validate the same text.
2. **parse**: each batch of lines gets :func:`etl._build_io.line_facts`, a text screen and one
   Polars ``str.json_decode``. A line is accepted there only when the tests of the DuckDB fast
   path (:func:`etl._build_sql.feature_select`) hold for it, checked on the raw text wherever
   Polars reads more leniently than DuckDB (``1.5`` or ``1e3`` as a ts, ``7`` as the list
   ``[7]``). Every other line (a bad one, or a good one written unusually) goes to the SQL of
   :mod:`etl._build_sql` in an in-memory DuckDB, both tiers, as in the DuckDB engine: the rules
   and the wording of every reason live in one place. Events likewise.
3. **dedup, join, sessionize, sample, sort**: Polars frames, ordered by ``(file_id, line_no)``
   wherever the SQL orders by it. ``sample_sessions`` draws with DuckDB's ``hash`` (the same
   sessions as the DuckDB engine) and a duplicate's detail quotes its id with DuckDB's
   ``to_json``.

Refused with a :class:`~recpipe.errors.DataError`, where this engine cannot give the DuckDB
engine's output: ``memory_limit`` and ``spill_dir`` (the whole dataset is held in memory) and
``threads`` (Polars sizes its pool from ``POLARS_MAX_THREADS``); and a JSON Lines file that DuckDB's
line reader splits in its own way (a bare ``\\r``, or ``\\r\\n`` line ends after ``\\n`` ones).
The quarantine files hold the same rows in the same order; their Parquet schema differs only
where DuckDB marks a column NOT NULL.
"""

from __future__ import annotations

import gzip
import itertools
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from etl import reasons
from etl._build_io import (
    LINE_FACT_COLUMNS,
    InputFile,
    check_structure,
    digest,
    iter_partitioned,
    line_facts,
    source_sql,
)
from etl._build_sql import (
    PENDING,
    TS_RANGE,
    event_select,
    feature_columns,
    feature_select,
    schema_keys,
    sql_str,
)
from recpipe.errors import CorruptInputError, DataError
from schemas import DatasetSchema

__all__ = ["build_into", "check_config"]

#: lines decoded by one ``str.json_decode`` call, and decompressed bytes read at a time:
#: on 200k synthetic rows (4 files) 64 MB / 65,536 lines took 4.3 s and 2.2 GB at peak,
#: 8 MB / 16,384 lines 3.5 s and 1.1 GB; smaller gained nothing
_BATCH_LINES = 16_384
_CHUNK_BYTES = 8 << 20
#: a batch that fails to decode is retried in this many slices; a failing slice this small
#: goes to the SQL whole
_SPLIT = 8
_MIN_SLICE = 64
#: DuckDB's line reader refuses longer lines (bytes; the first line may hold one more)
_MAX_LINE_BYTES = 1_999_999
_FLOAT32_MAX = 3.4028234663852886e38
_BOM = b"\xef\xbb\xbf"
#: numbers Polars does not read (a line with one fails to decode: the screen spares a retry)
_NON_FINITE = r"(?i)[:,\[]\s*[-+]?(nan|inf)"
_TRAILING_COMMA = r",\s*[\]}]"
_BAD = ("file_id", "line_no", "reason", "detail", "raw", "source", "source_line")
_views = itertools.count()  # unique names of the frames handed to DuckDB


def check_config(config: Any) -> None:
    """Refuse the options that belong to the DuckDB engine.

    Raises:
        DataError: naming the option.
    """
    for name in ("memory_limit", "spill_dir"):
        if getattr(config, name) is not None:
            raise DataError(
                f"`{name}` is an option of engine 'duckdb'; engine 'polars' builds in memory, "
                f"got {getattr(config, name)!r}\nhint: use engine 'duckdb' for an out-of-core build"
            )
    if config.threads is not None:
        raise DataError(
            f"`threads` is an option of engine 'duckdb', got {config.threads!r}\n"
            "hint: engine 'polars' sizes its thread pool from POLARS_MAX_THREADS"
        )


# ---------------------------------------------------------------------------------------------
# numbered lines


class _LineSplitter:
    """Split a file's bytes into lines as DuckDB's line reader (``read_csv``) does.

    The first line end sets the mode: ``\\n``, or ``\\r\\n`` (where a lone ``\\n`` also ends
    a line). An empty line is NULL. DuckDB splits a bare ``\\r`` and a ``\\r\\n`` after ``\\n``
    line ends in ways of its own: such files are refused.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.crlf: bool | None = None
        self.next_line = 1

    def split(self, chunk: bytes, *, last: bool) -> tuple[int, pa.LargeStringArray]:
        """Lines of ``chunk``: whole lines, the final one without its end when ``last``.

        Returns:
            the number of the first line, and the lines.
        """
        data = np.frombuffer(chunk, dtype=np.uint8)
        ends = np.flatnonzero(data == 10)
        if self.crlf is None and ends.size:
            self.crlf = bool(ends[0] > 0 and data[ends[0] - 1] == 13)
        crs = np.flatnonzero(data == 13)
        if crs.size:
            lf_next = data[np.minimum(crs + 1, data.size - 1)] == 10
            lf_next &= crs + 1 < data.size
            if not self.crlf or not lf_next.all():
                raise self._bare_cr(data, int(crs[0] if not self.crlf else crs[~lf_next][0]))
        starts = np.concatenate(([0], ends + 1))
        stops = np.concatenate((ends, [data.size]))
        if not last or data.size == 0 or data[-1] == 10:
            starts, stops = starts[:-1], stops[:-1]
        if self.crlf:
            stops = stops - ((stops > starts) & (data[np.maximum(stops - 1, 0)] == 13))
        lengths = stops - starts
        self.check_lengths(lengths)
        keep = np.ones(data.size, dtype=bool)
        keep[ends] = False
        keep[crs] = False
        text = data if keep.all() else data[keep]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        valid = lengths > 0
        mask = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
        lines = pa.LargeStringArray.from_buffers(
            len(lengths), pa.py_buffer(offsets), pa.py_buffer(text), mask
        )
        first = self.next_line
        self.next_line += len(lengths)
        try:
            lines.validate(full=True)
        except pa.ArrowInvalid:
            raise self._not_utf8(lines, first) from None
        return first, lines

    def check_lengths(self, lengths: np.ndarray) -> None:
        """Refuse a line DuckDB's line reader refuses (too long), as the DuckDB engine does."""
        limit = np.full(lengths.size, _MAX_LINE_BYTES - int(bool(self.crlf)), dtype=np.int64)
        if self.next_line == 1 and lengths.size:
            limit[0] = _MAX_LINE_BYTES + 1
        over = np.flatnonzero(lengths > limit)
        if over.size:
            i = int(over[0])
            raise CorruptInputError(
                f"{self.path}: cannot read input: line {self.next_line + i} is "
                f"{int(lengths[i]):,} bytes long, more than DuckDB's line reader takes "
                f"({_MAX_LINE_BYTES + 1:,} bytes)"
            )

    def _bare_cr(self, data: np.ndarray, at: int) -> DataError:
        line = self.next_line + int(np.count_nonzero(data[:at] == 10))
        return DataError(
            f"{self.path}: line {line}: a carriage return (\\r) outside a \\r\\n line end, or "
            "\\r\\n line ends after \\n ones; engine 'polars' reads \\n or \\r\\n line ends\n"
            "hint: use engine 'duckdb', or normalise the line ends"
        )

    def _not_utf8(self, lines: pa.LargeStringArray, first: int) -> CorruptInputError:
        offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)
        data = lines.buffers()[2]
        bad = 0
        for bad in range(len(lines)):
            try:
                data[int(offsets[bad]) : int(offsets[bad + 1])].to_pybytes().decode("utf-8")
            except UnicodeDecodeError:
                break
        return CorruptInputError(
            f"{self.path}: cannot read input: line {first + bad} is not valid UTF-8 "
            "(the file is not UTF-8 text: binary, corrupt or not JSON Lines)"
        )


def _open_stream(path: Path):
    """The decompressed bytes of ``path``, by extension as DuckDB's ``compression='auto'``."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    fh = open(path, "rb")  # noqa: SIM115 - the caller closes the stream, which closes it
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
    return fh


def _jsonl_batches(f: InputFile, file_id: int) -> Iterator[pa.Table]:
    """Numbered lines of a JSON Lines file, as ``source_sql``'s relation (in tables)."""
    splitter = _LineSplitter(f.path)
    try:
        stream = _open_stream(f.path)
    except OSError as exc:
        raise DataError(f"cannot read input {str(f.path)!r}: {exc}") from None
    rest, head = b"", True
    with stream:
        while True:
            try:
                data = stream.read(_CHUNK_BYTES)
            except Exception as exc:  # zstd, gzip or OS errors
                raise CorruptInputError(f"{f.path}: cannot read input: {exc}") from None
            buf = rest + data if rest else data
            if head and (len(buf) >= len(_BOM) or not data):
                buf, head = buf.removeprefix(_BOM), False
            if not data:
                if buf:
                    yield from _tables(file_id, *splitter.split(buf, last=True))
                return
            cut = buf.rfind(b"\n") + 1
            if head or not cut:  # no whole line yet
                if len(buf) > 2 * _MAX_LINE_BYTES:
                    splitter.check_lengths(np.array([len(buf)]))
                rest = buf
                continue
            rest = buf[cut:]
            yield from _tables(file_id, *splitter.split(buf[:cut], last=False))


def _tables(file_id: int, first: int, lines: pa.LargeStringArray) -> Iterator[pa.Table]:
    for lo in range(0, len(lines), _BATCH_LINES):
        part = lines.slice(lo, _BATCH_LINES)
        n = len(part)
        yield pa.table(
            {
                "file_id": pa.array(np.full(n, file_id, dtype=np.int32)),
                "line_no": pa.array(np.arange(first + lo, first + lo + n, dtype=np.int64)),
                "line": part,
                "source": pa.nulls(n, pa.large_string()),
                "source_line": pa.nulls(n, pa.int64()),
            }
        )


def _sql_batches(con, f: InputFile, file_id: int) -> Iterator[pa.Table]:
    """Numbered lines of a Parquet or unroutable file, from the DuckDB engine's relation."""
    import duckdb

    from etl.build import _duckdb_error

    cur = con.cursor()
    try:
        rel = cur.sql(
            "SELECT file_id::INTEGER AS file_id, line_no::BIGINT AS line_no, line, source, "
            "source_line "
            f"FROM {source_sql(f, file_id, sql_str)}"
        )
        for batch in rel.to_arrow_reader(_BATCH_LINES):
            yield pa.Table.from_batches([batch])
    except (duckdb.Error, OSError) as exc:
        raise _duckdb_error(f.path, exc) from None
    finally:
        cur.close()


def _line_batches(con, f: InputFile, file_id: int) -> Iterator[pa.Table]:
    return _jsonl_batches(f, file_id) if f.kind == "jsonl" else _sql_batches(con, f, file_id)


# ---------------------------------------------------------------------------------------------
# validation


def _decode(lines, dtype) -> tuple[Any, np.ndarray]:
    """``str.json_decode`` of ``lines``; when the batch fails, its slices are tried in turn.

    Returns:
        the decoded structs (NULL where a line was not decoded) and a mask of the lines decoded.
    """
    import polars as pl

    try:
        out = lines.str.json_decode(dtype)
        if len(out) == len(lines):
            return out, np.ones(len(lines), dtype=bool)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException):
        pass
    n = len(lines)
    if n <= _MIN_SLICE:
        return pl.Series(lines.name, [None] * n, dtype=dtype), np.zeros(n, dtype=bool)
    step = -(-n // _SPLIT)
    parts = [_decode(lines.slice(lo, step), dtype) for lo in range(0, n, step)]
    return pl.concat([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _screen(line, strings, *, trailing_comma: bool = False):
    """Lines worth a typed decode: one JSON object, no text Polars reads otherwise than DuckDB.

    Escapes are left to the SQL (Polars decodes a lone surrogate ``\\ud800`` where DuckDB
    finds no JSON). So are lines whose strings are not all keys and the ``strings`` string
    values expected (ids): a string where a number belongs fails the decode of the whole
    batch, as does a non-finite number, and a raw control character inside a string.
    """
    stripped = line.str.strip_chars(" ")
    keys = line.str.count_matches(r'"\s*:')
    values = line.str.count_matches(r':\s*"')
    ok = (
        stripped.str.starts_with("{")
        & stripped.str.ends_with("}")
        & ~line.str.contains("\\", literal=True)
        & ~line.str.contains(_NON_FINITE)
        & (values == strings)
        & (line.str.count_matches('"', literal=True) == 2 * (keys + values))
    )
    if trailing_comma:
        ok &= ~line.str.contains(_TRAILING_COMMA)
    return ok.fill_null(False)


def _int_text(key: str) -> str:
    """Regex: the value of ``"key":`` written as an integer (no fraction, no exponent)."""
    return rf'"{re.escape(key)}":[ \t]*(-?[0-9]+)[ \t]*[,}}]'


def _feature_dtype(schema: DatasetSchema):
    import polars as pl

    fields: dict[str, Any] = {k: pl.String for k in schema_keys(schema)}
    if schema.dense:
        fields["dense"] = pl.Struct({f.name: pl.Float64 for f in schema.dense})
    if schema.sparse:
        fields["sparse"] = pl.Struct({f.name: pl.List(pl.Int64) for f in schema.sparse})
    return pl.Struct(fields)


def _feature_tests(schema: DatasetSchema):
    """Whether a decoded line (struct ``j``) passes the DuckDB fast path, as an expression.

    The tests of :func:`etl._build_sql._fast_select` (``facts=True``), plus raw-text checks
    that stand in for DuckDB's stricter typed reading: a ts or a numeric id is an integer
    literal, every sparse value is written as a list (one ``[`` each), no string id holds a
    ``[``.
    """
    import polars as pl

    rk, sk, uk, tk = schema_keys(schema)
    line, j = pl.col("line"), pl.col("j")
    dense = [j.struct.field("dense").struct.field(f.name) for f in schema.dense]
    sparse = [j.struct.field("sparse").struct.field(f.name) for f in schema.sparse]
    present = [j.struct.field(k) for k in (rk, sk, uk, tk)] + dense + sparse
    present += [j.struct.field("dense")] if schema.dense else []
    present += [j.struct.field("sparse")] if schema.sparse else []
    as_int = lambda e: e.cast(pl.Int64, strict=False)  # noqa: E731
    tests = [
        j.struct.field(rk).is_not_null(),
        pl.col("text_ok"),
        pl.col("ts").is_between(*TS_RANGE),
    ]
    n_str = pl.lit(0, dtype=pl.Int32)
    for key, kind in ((rk, "kind_rk"), (sk, "kind_sk"), (uk, "kind_uk")):
        v = j.struct.field(key)
        is_str = v.is_not_null() & (pl.col(kind) == 1)
        number = (pl.col(kind) == 0) & line.str.contains(_int_text(key)) & as_int(v).is_not_null()
        tests.append(v.is_null() | (is_str & ~v.str.contains("[", literal=True)) | number)
        n_str = n_str + is_str.cast(pl.Int32)
    n_keys = pl.sum_horizontal([v.is_not_null().cast(pl.Int32) for v in present])
    tests.append(pl.col("quotes") == 2 * n_keys + 2 * n_str)
    n_lists = pl.sum_horizontal([pl.lit(0), *[v.is_not_null().cast(pl.Int32) for v in sparse]])
    tests.append(line.str.count_matches("[", literal=True) == n_lists)
    for v in dense:
        tests.append(v.is_null() | (v.is_finite() & (v.abs() <= _FLOAT32_MAX)))
    for f, v in zip(schema.sparse, sparse):
        whole = v.list.eval(pl.element().is_null().any()).list.first().not_()
        fits = pl.lit(True) if f.truncate else v.list.len() <= int(f.max_len)
        tests.append(v.is_null() | (whole & fits))
    return pl.all_horizontal(tests).fill_null(False)


def _feature_columns(schema: DatasetSchema):
    """Expressions of the validated feature columns (``feature_select``'s, minus the text)."""
    import polars as pl

    rk, sk, uk, _ = schema_keys(schema)
    j = pl.col("j")
    cols = [
        pl.col("file_id"),
        pl.col("line_no"),
        j.struct.field(rk).alias("request_id"),
        j.struct.field(sk).alias("session_key"),
        j.struct.field(uk).alias("user_key"),
        pl.col("ts"),
    ]
    for i, f in enumerate(schema.dense):
        v = j.struct.field("dense").struct.field(f.name)
        cols.append(v.fill_null(float(f.fill)).cast(pl.Float32).alias(f"d{i}"))
    for i, f in enumerate(schema.sparse):
        v = j.struct.field("sparse").struct.field(f.name)
        v = v.fill_null(pl.lit([], dtype=pl.List(pl.Int64)))
        cols.append((v.list.tail(int(f.max_len)) if f.truncate else v).alias(f"s{i}"))
    cols.append(pl.lit(None, dtype=pl.List(pl.String)).alias("unknown"))
    return cols


def _event_tests(schema: DatasetSchema):
    """Whether a decoded event line passes :func:`etl._build_sql.event_select` as it is."""
    import polars as pl

    rk, _, _, tk = schema_keys(schema)
    lk = schema.label_key
    line, j = pl.col("line"), pl.col("j")
    rid, ts, label = (j.struct.field(k) for k in (rk, tk, lk))
    as_int = lambda e: e.cast(pl.Int64, strict=False)  # noqa: E731
    rid_str = line.str.contains(rf'"{re.escape(rk)}":[ \t]*"')
    rid_ok = (rid_str & ~rid.str.contains("[", literal=True)) | (
        line.str.contains(_int_text(rk)) & as_int(rid).is_not_null()
    )
    n_keys = pl.sum_horizontal([e.is_not_null().cast(pl.Int32) for e in (rid, ts, label)])
    tests = [
        rid.is_not_null() & rid_ok,
        ts.is_null() | (line.str.contains(_int_text(tk)) & as_int(ts).is_not_null()),
        # larger labels are left to the SQL, and `-0` (DuckDB's integer 0) too
        label.is_finite() & (label.abs() <= _FLOAT32_MAX),
        ~line.str.contains(rf'"{re.escape(lk)}":[ \t]*-0'),
        line.str.count_matches('"', literal=True) == 2 * n_keys + 2 * rid_str.cast(pl.Int32),
        ~line.str.contains("[", literal=True),
    ]
    return pl.all_horizontal(tests).fill_null(False)


def _frame(columns: dict[str, Any], rows=None):
    """A frame with exactly ``columns`` (name -> Polars type), from ``rows`` or empty."""
    import polars as pl

    if rows is None:
        return pl.DataFrame(schema=columns)
    return rows.select([pl.col(n).cast(t) for n, t in columns.items()])


class _Parser:
    """Validates batches of numbered lines into good rows and quarantine rows (Polars frames).

    A line the Polars tests do not accept goes to the shared SQL (:mod:`etl._build_sql`) in an
    in-memory DuckDB: its fast path first, then its full checks, as in the DuckDB engine.
    """

    def __init__(self, con, schema: DatasetSchema) -> None:
        import polars as pl

        self.con = con
        self.schema = schema
        self.keys = schema_keys(schema)
        rk, _, _, tk = self.keys
        self.feature_dtype = _feature_dtype(schema)
        self.event_dtype = pl.Struct({rk: pl.String, tk: pl.String, schema.label_key: pl.Float64})
        self.good = {
            "file_id": pl.Int32,
            "line_no": pl.Int64,
            "request_id": pl.String,
            "session_key": pl.String,
            "user_key": pl.String,
            "ts": pl.Int64,
            **{f"d{i}": pl.Float32 for i in range(len(schema.dense))},
            **{f"s{i}": pl.List(pl.Int64) for i in range(len(schema.sparse))},
            "unknown": pl.List(pl.String),
        }
        self.event = {
            "file_id": pl.Int32,
            "line_no": pl.Int64,
            "request_id": pl.String,
            "label": pl.Float64,
        }
        self.bad = dict.fromkeys(_BAD, pl.String) | {
            "file_id": pl.Int32,
            "line_no": pl.Int64,
            "source_line": pl.Int64,
        }

    def features(self, lines: pa.Table) -> tuple[Any, Any]:
        """``(good, bad)`` frames of one batch of feature lines."""
        import polars as pl

        facts = line_facts(lines.column("line").combine_chunks(), self.keys)
        tk = self.keys[3]
        strings = sum((pl.col(k) == 1).cast(pl.Int32) for k in ("kind_rk", "kind_sk", "kind_uk"))
        df = pl.from_arrow(lines).with_columns(
            **{name: pl.Series(name, facts[name]) for name in LINE_FACT_COLUMNS}
        )
        df = df.with_columns(
            ts=pl.col("line").str.extract(_int_text(tk), 1).cast(pl.Int64, strict=False),
            cand=_screen(pl.col("line"), strings) & pl.col("text_ok") & (pl.col("kind_tk") == 0),
        )
        good, rest = self._typed(df, self.feature_dtype, _feature_tests(self.schema))
        good = good.select(_feature_columns(self.schema))
        if rest.height == 0:
            return _frame(self.good, good), _frame(self.bad)
        fast = self._sql(rest, lambda v: feature_select(self.schema, v, fast=True, facts=True))
        pending = fast.filter(pl.col("reason") == PENDING).select(
            "file_id", "line_no", pl.col("raw").alias("line"), "source", "source_line"
        )
        full = fast.clear()
        if pending.height:
            full = self._sql(pending, lambda v: feature_select(self.schema, v, fast=False))
        good = pl.concat([_frame(self.good, good), self._good_of(fast), self._good_of(full)])
        return good, self._bad_of(full)

    def events(self, lines: pa.Table) -> tuple[Any, Any]:
        """``(good, bad)`` frames of one batch of event lines."""
        import polars as pl

        rk = self.keys[0]
        rid_str = pl.col("line").str.contains(rf'"{re.escape(rk)}":[ \t]*"').cast(pl.Int32)
        df = pl.from_arrow(lines).with_columns(
            cand=_screen(pl.col("line"), rid_str, trailing_comma=True)
        )
        good, rest = self._typed(df, self.event_dtype, _event_tests(self.schema))
        j = pl.col("j")
        good = good.select(
            "file_id",
            "line_no",
            j.struct.field(rk).alias("request_id"),
            j.struct.field(self.schema.label_key).alias("label"),
        )
        if rest.height == 0:
            return _frame(self.event, good), _frame(self.bad)
        rows = self._sql(rest, lambda v: event_select(self.schema, v))
        sql_good = _frame(self.event, rows.filter(pl.col("reason").is_null()))
        return pl.concat([_frame(self.event, good), sql_good]), self._bad_of(rows)

    def _typed(self, df, dtype, tests) -> tuple[Any, Any]:
        """Decode the screened lines (``cand``); split off those passing ``tests``."""
        import polars as pl

        cand = df.filter(pl.col("cand"))
        decoded, ok = _decode(cand.get_column("line"), dtype)
        cand = cand.with_columns(j=decoded).with_columns(ok=tests & pl.Series(ok))
        rest = pl.concat(
            [df.filter(~pl.col("cand")), cand.filter(~pl.col("ok")).drop("j", "ok")],
            how="vertical_relaxed",
        )
        return cand.filter(pl.col("ok")), rest.drop("cand")

    def _sql(self, frame, select):
        """Rows of the SQL ``select(view)`` over ``frame`` in the in-memory DuckDB."""
        import polars as pl

        view = f"_polars_lines_{next(_views)}"
        cur = self.con.cursor()
        try:
            cur.register(view, frame.to_arrow())
            return pl.from_arrow(cur.sql(select(view)).to_arrow_table())
        finally:
            cur.close()

    def _good_of(self, rows):
        import polars as pl

        return _frame(self.good, rows.filter(pl.col("reason").is_null()))

    def _bad_of(self, rows):
        import polars as pl

        return _frame(self.bad, rows.filter(pl.col("reason").is_not_null()))


def _parse_files(con, files: list[InputFile], parse, phases, label: str) -> tuple[list, list]:
    """Validate every file (several at once, one thread each); good and bad frames."""
    goods: list = []
    bads: list = []

    def one(file_id: int, f: InputFile) -> tuple[list, list]:
        out = [parse(batch) for batch in _line_batches(con, f, file_id)]
        return [g for g, _ in out], [b for _, b in out]

    total = sum(f.path.stat().st_size for f in files)
    workers = max(1, min(os.cpu_count() or 1, len(files)))
    with (
        phases.bar(f"parse {label}", total=total, unit="B", unit_scale=True) as bar,
        ThreadPoolExecutor(max_workers=workers) as pool,
    ):
        jobs = {pool.submit(one, i, f): f for i, f in enumerate(files)}
        try:
            for job in as_completed(jobs):
                g, b = job.result()
                goods += g
                bads += b
                bar.update(jobs[job].path.stat().st_size)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
    return goods, bads


# ---------------------------------------------------------------------------------------------
# dedup, labels, sessions, counts


def _paths(files: list[InputFile]):
    import polars as pl

    return pl.DataFrame(
        {"file_id": range(len(files)), "path": [str(f.path) for f in files]},
        schema={"file_id": pl.Int32, "path": pl.String},
    )


def _duplicates(parser: _Parser, good, files: list[InputFile]) -> tuple[Any, Any]:
    """Split off every record of a request_id after the first (file order) as a duplicate.

    Args:
        good: the good rows' ``file_id``, ``line_no``, ``request_id``, ... (narrow).

    Returns:
        the good rows left, and the duplicates as quarantine rows (the detail, raw line and
        source of the DuckDB engine's).
    """
    import polars as pl

    good = good.sort("file_id", "line_no", maintain_order=True)
    first = pl.col("request_id").is_first_distinct()
    dups = good.filter(~first).select("file_id", "line_no", "request_id")
    if dups.height == 0:
        return good, _frame(parser.bad)
    good = good.filter(first)
    firsts = good.join(dups.select("request_id").unique(), on="request_id").select(
        "request_id", first_file=pl.col("file_id"), first_line=pl.col("line_no")
    )
    quoted = parser._sql(  # the id as DuckDB's to_json writes it
        dups.select("request_id").unique(),
        lambda v: f"SELECT request_id, to_json(request_id)::VARCHAR AS quoted FROM {v}",
    )
    dups = (
        dups.join(firsts, on="request_id", how="left")
        .join(quoted, on="request_id", how="left")
        .join(_paths(files).rename({"file_id": "first_file"}), on="first_file", how="left")
        .join(_read_back(parser.con, files, dups), on=["file_id", "line_no"], how="left")
        .with_columns(
            reason=pl.lit(reasons.DUPLICATE_REQUEST_ID),
            detail=pl.format(
                "field `request_id`: {} already seen at {}:{}", "quoted", "path", "first_line"
            ),
        )
    )
    return good, _frame(parser.bad, dups)


def _read_back(con, files: list[InputFile], rows):
    """The raw lines and sources of ``rows`` (``file_id``, ``line_no``), read again."""
    import polars as pl

    columns = {
        "file_id": pl.Int32,
        "line_no": pl.Int64,
        "raw": pl.String,
        "source": pl.String,
        "source_line": pl.Int64,
    }
    out = [_frame(columns)]
    for (fid,), wanted in rows.group_by("file_id"):
        for batch in _line_batches(con, files[int(fid)], int(fid)):
            got = pl.from_arrow(batch).join(wanted.select("line_no"), on="line_no", how="semi")
            out.append(_frame(columns, got.rename({"line": "raw"})))
    return pl.concat(out)


def _session_keys(good, gap: int):
    """The raw session key ``skey`` of every good row, as ``etl.build._sessionize``."""
    import polars as pl

    rows = good.select("file_id", "line_no", "request_id", "session_key", "user_key", "ts")
    sk, uk = pl.col("session_key"), pl.col("user_key")
    keyed = rows.filter(sk.is_not_null()).select("file_id", "line_no", "ts", skey=pl.lit("s:") + sk)
    alone = rows.filter(sk.is_null() & uk.is_null()).select(
        "file_id", "line_no", "ts", skey=pl.lit("r:") + pl.col("request_id")
    )
    users = rows.filter(sk.is_null() & uk.is_not_null()).sort(
        "user_key", "ts", "file_id", "line_no"
    )
    # ts - previous ts in u64 arithmetic: exact for any two int64 (ts >= previous), as the
    # SQL's HUGEINT
    u64 = pl.col("ts").reinterpret(signed=False)
    users = users.with_columns(step=u64 - u64.shift(1).over("user_key"))
    new = pl.when(pl.col("step") <= gap).then(0).otherwise(1)
    users = users.select(
        "file_id",
        "line_no",
        "ts",
        skey=pl.format("u:{}:{}", "user_key", new.cum_sum().over("user_key")),
    )
    return pl.concat([keyed, alone, users])


def _sessions(parser: _Parser, rowkeys, config: Any):
    """Sessions: ``skey``, ``first_ts``, ``sid`` (rank by first ts, key), sampled as the SQL."""
    import polars as pl

    sessions = rowkeys.group_by("skey").agg(first_ts=pl.col("ts").min())
    if config.sample_sessions < 1.0:
        threshold = int(config.sample_sessions * (1 << 53))
        salt = sql_str(f"#{int(config.seed)}")
        kept = parser._sql(
            sessions.select("skey"),
            lambda v: f"SELECT skey FROM {v} WHERE (hash(skey || {salt}) >> 11) < {threshold}",
        )
        sessions = sessions.join(kept, on="skey", how="semi")
    return (
        sessions.sort("first_ts", "skey")
        .with_row_index("sid")
        .with_columns(pl.col("sid").cast(pl.Int64))
    )


def _labels(ev_good):
    import polars as pl

    return ev_good.group_by("request_id").agg(pl.col("label").max())


def _counts(good_all, bad, good, keep, ev_good, ev_bad, labels) -> dict[str, Any]:
    """The manifest counts, as ``etl.build._counts``."""
    import polars as pl

    by_reason = dict(bad.group_by("reason").len().iter_rows())
    ev_reason = dict(ev_bad.group_by("reason").len().iter_rows())
    unknown = good_all.select(pl.col("unknown").explode().drop_nulls()).group_by("unknown").len()
    ids = good.select("request_id")
    rows_quarantined = sum(by_reason.values())
    return {
        "rows_in": good_all.height + bad.height - by_reason.get(reasons.DUPLICATE_REQUEST_ID, 0),
        "rows_out": keep.height,
        "rows_quarantined": rows_quarantined,
        "rows_sampled_out": good.height - keep.height,
        "quarantine_by_reason": {r: by_reason.get(r, 0) for r in reasons.QUARANTINE_REASONS},
        "sessions": keep.get_column("sid").n_unique(),
        "rows_without_event": good.join(labels, on="request_id", how="anti").height,
        "unknown_features": dict(sorted(unknown.iter_rows())),
        "events_in": ev_good.height + ev_bad.height,
        "events_quarantined": sum(ev_reason.values()),
        "events_quarantine_by_reason": {
            r: ev_reason.get(r, 0)
            for r in reasons.QUARANTINE_REASONS
            if r != reasons.DUPLICATE_REQUEST_ID
        },
        "events_unknown_request": ev_good.join(ids, on="request_id", how="anti").height,
    }


# ---------------------------------------------------------------------------------------------
# output


def _write_quarantine(bad, files: list[InputFile], path: Path) -> None:
    """``_quarantine/*.parquet``: the DuckDB engine's columns, rows and order.

    An unroutable record names the file and line it came from (records of several files may
    share one; they stay in the order of the unroutable file). DuckDB marks some columns NOT
    NULL from its statistics; here every column is nullable.
    """
    import polars as pl

    table = (
        bad.join(_paths(files), on="file_id", how="left")
        .sort("file_id", "line_no")
        .select(
            source=pl.coalesce("source", "path"),
            line=pl.coalesce("source_line", "line_no"),
            reason="reason",
            detail="detail",
            raw="raw",
        )
        .to_arrow()
    )
    names = ("source", "line", "reason", "detail", "raw")
    types = (pa.string(), pa.int64(), pa.string(), pa.string(), pa.string())
    pq.write_table(table.cast(pa.schema(list(zip(names, types)))), path, compression="zstd")


def _hour_labels(ms):
    """``YYYY-MM-DD-HH`` of epoch milliseconds, as DuckDB's ``strftime(epoch_ms(ms), ...)``.

    Proleptic Gregorian with a year 0 (days to civil date by H. Hinnant's algorithm); the year
    zero-padded to 4 digits within 0..9999 and written plainly outside, as DuckDB writes it.
    """
    import polars as pl

    hours = ms // 3_600_000
    z = hours // 24 + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1_460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = pl.when(mp < 10).then(mp + 3).otherwise(mp - 9)
    year = yoe + era * 400 + (month <= 2).cast(pl.Int64)
    year_text = (
        pl.when((year >= 0) & (year <= 9999))
        .then(year.cast(pl.String).str.zfill(4))
        .otherwise(year.cast(pl.String))
    )
    two = lambda e: e.cast(pl.String).str.zfill(2)  # noqa: E731
    return pl.format("{}-{}-{}-{}", year_text, two(month), two(day), two(hours % 24))


def _final_columns(schema: DatasetSchema, config: Any) -> tuple[list, str | None]:
    """The dataset's columns (and the partition label column), as ``etl.build._final_sql``."""
    import polars as pl

    cols = [
        pl.col("sid").alias(schema.session_key),
        pl.col("ts").alias(schema.time_key),
        pl.col("label").cast(pl.Float32).alias(schema.label_key),
        *[pl.col(f"d{i}").alias(f.name) for i, f in enumerate(schema.dense)],
        *[pl.col(f"s{i}").alias(f.name) for i, f in enumerate(schema.sparse)],
    ]
    if config.partition_by != "hour":
        return cols, None
    basis = "first_ts" if config.order == "session" else "ts"
    return [*cols, _hour_labels(pl.col(basis)).alias("__dt")], "__dt"


def build_into(
    duckdb: Any,
    tmp: Path,
    feat_files: list[InputFile],
    ev_files: list[InputFile],
    *,
    schema: DatasetSchema,
    config: Any,
    phases: Any,
    spill: Path,
) -> dict:
    """Build the dataset into ``tmp`` with Polars: the role of ``etl.build._build_into``.

    Returns:
        The manifest (without ``elapsed_s``), with the DuckDB engine's keys and values.
    """
    import polars as pl

    from etl.build import _dataset_writer, _manifest

    del spill  # nothing spills: the build is in memory
    t = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=1)  # digests overlap with the parse
    for f in [*feat_files, *ev_files]:
        check_structure(f)
    checks = [pool.submit(digest, f) for f in [*feat_files, *ev_files]]
    con = duckdb.connect()  # the shared SQL, for the lines the Polars tests leave
    con.execute("SET enable_progress_bar = false")
    con.execute("SET preserve_insertion_order = true")  # line numbers of Parquet rows
    parser = _Parser(con, schema)
    t = phases.timed("setup", t)

    goods, bads = _parse_files(con, feat_files, parser.features, phases, "features")
    ev_goods, ev_bads = [], []
    if ev_files:
        ev_goods, ev_bads = _parse_files(con, ev_files, parser.events, phases, "events")
    good_all = pl.concat([_frame(parser.good), *goods])
    bad = pl.concat([_frame(parser.bad), *bads])
    ev_good = pl.concat([_frame(parser.event), *ev_goods])
    ev_bad = pl.concat([_frame(parser.bad), *ev_bads])
    del goods, bads, ev_goods, ev_bads
    inputs = [c.result() for c in checks]
    pool.shutdown()
    t = phases.timed("parse", t)

    with phases.bar("dedup, join, sessionize", total=4) as bar:
        # keys and timestamps only: the wide feature columns are gathered once, sorted
        narrow = good_all.select(
            "file_id", "line_no", "request_id", "session_key", "user_key", "ts"
        )
        good, dups = _duplicates(parser, narrow, feat_files)
        bad = pl.concat([bad, dups])
        bar.update(1)
        labels = _labels(ev_good)
        bar.update(1)
        rowkeys = _session_keys(good, int(config.session_gap_ms))
        sessions = _sessions(parser, rowkeys, config)
        bar.update(1)
        keep = (
            good.join(rowkeys.select("file_id", "line_no", "skey"), on=["file_id", "line_no"])
            .join(sessions, on="skey")
            .join(labels, on="request_id", how="left")
            .with_columns(pl.col("label").fill_null(0.0))
        )
        counts = _counts(good_all, bad, good, keep, ev_good, ev_bad, labels)
        bar.update(1)
    t = phases.timed("dedup_join_sessionize", t)

    qdir = tmp / "_quarantine"
    qdir.mkdir()
    _write_quarantine(bad, feat_files, qdir / "features.parquet")
    _write_quarantine(ev_bad, ev_files, qdir / "events.parquet")
    con.close()
    t = phases.timed("quarantine", t)

    writer = _dataset_writer(tmp, schema, config)
    arrow_schema = writer.schema
    cols, part_col = _final_columns(schema, config)
    order = ["sid", "ts"] if config.order == "session" else ["ts", "sid"]
    wide = good_all.select("file_id", "line_no", *feature_columns(schema))
    final = (
        keep.sort([*order, "file_id", "line_no"])
        .join(wide, on=["file_id", "line_no"], how="left", maintain_order="left")
        .select(cols)
        .to_arrow()
    )
    del keep, good, good_all, wide
    with phases.bar("write parquet", total=counts["rows_out"], unit="row", unit_scale=True) as bar:
        for part, batch in iter_partitioned(final.to_batches(16_384), column=part_col):
            writer.write(batch.cast(arrow_schema), partition=part)
            bar.update(batch.num_rows)
    files = writer.close()
    phases.timed("write", t)
    return _manifest(
        schema=schema,
        config=config,
        inputs=inputs,
        feat_files=feat_files,
        ev_files=ev_files,
        counts=counts,
        rows_duplicate=dups.height,
        writer=writer,
        files=files,
        phases=phases,
    )
