"""The one validation of raw log lines: DuckDB SQL in two tiers, for every engine.

Engines hand it numbered lines (:func:`etl.build.inputs.read_lines`) and get validated rows back:
as SQL to run in their own DuckDB (:meth:`Validator.feature_sql`, :meth:`Validator.event_sql`)
or as Arrow tables (:meth:`Validator.features`, :meth:`Validator.events`, in an in-memory DuckDB).
The rules and the wording of every reason live here and nowhere else.

0. The compiled tier (:mod:`etl.build._plain`, feature lines only): a Numba kernel reads the
   lines written the plain way straight into typed columns, giving exactly the rows the SQL
   tiers would give; every other line goes on to them unchanged.
1. The fast path (:func:`feature_select` with ``fast=True``): one typed, lenient ``from_json``
   per line plus cheap text tests that prove no leniency was needed. Nearly every good line
   is accepted here. Its text tests run either in SQL or, faster, precomputed per line by
   :func:`etl.build._kernels.line_facts` (``facts=True``); both accept exactly the same lines.
2. The full checks (``fast=False``), run only on the lines the fast path did not accept: the
   line is parsed into a struct whose leaves are JSON fragments, so types are checked strictly
   (DuckDB's typed extraction would quietly turn ``"12"`` into ``12`` and ``1.5`` into ``2``).
   The first failing check, in the order of :data:`etl.reasons.QUARANTINE_REASONS`, gives the
   record's reason and a detail that names the field; a line passing them all is good.

Good rows keep typed, flattened columns and no raw text; bad rows keep the raw line. A feature
the record does not carry (absent or ``null``) is NULL in a good row: engines count those per
feature and fill them (``fill`` / ``[]``) only when they write the dataset.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from etl import reasons
from etl.build._fastpath import fast_select
from etl.build._kernels import LINE_FACT_COLUMNS, line_facts
from etl.build._plain import plain_select, split_plain
from etl.build._sql import (
    FLOAT32_MAX,
    PENDING,
    TRAILING_COMMA_RE,
    TS_RANGE,
    feature_columns,
    id_text,
    ident,
    json_path,
    passthrough_columns,
    passthrough_struct,
    schema_keys,
    sql_str,
    too_long_check,
    ts_bounds,
    ts_ms,
    value_columns,
)
from etl.build.inputs import LINE_COLUMNS
from etl.build.layout import Kind, normalize
from etl.rawio import DEFAULT_MAX_LINE_BYTES
from schemas import DatasetSchema

__all__ = [
    "PENDING",
    "TS_RANGE",
    "Validator",
    "event_select",
    "feature_columns",
    "feature_select",
    "malformed_json",
    "schema_keys",
    "sql_str",
]

_INT_TYPES = "('BIGINT', 'UBIGINT')"
_NUM_TYPES = "('BIGINT', 'UBIGINT', 'DOUBLE')"
_ID_TYPES = "('VARCHAR', 'BIGINT', 'UBIGINT')"
_INT_LIST_RE = r"\[(-?[0-9]+(,-?[0-9]+)*)?\]"
_JSON_STRING_RE = r'"([^"\\]|\\.)*"'  # a JSON string, escapes included


def _shown(fragment: str) -> str:
    """SQL for a short, quoted rendering of a JSON fragment in a detail message."""
    return f"left(({fragment})::VARCHAR, 60)"


def _num(fragment: str, to: str, types: str) -> str:
    """Cast a JSON fragment to a number only when its JSON type is one of ``types``.

    (``TRY_CAST`` of a JSON string to a number raises instead of giving NULL.)
    """
    return f"CASE WHEN json_type({fragment}) IN {types} THEN TRY_CAST({fragment} AS {to}) END"


def _case(checks: list[tuple[str, str, str]]) -> str:
    """One CASE returning ``{'r': reason, 'd': detail}`` for the first failing check, else NULL."""
    arms = "\n      ".join(
        f"WHEN {cond} THEN {{'r': {sql_str(reason)}, 'd': {detail}}}"
        for cond, reason, detail in checks
    )
    return f"CASE\n      {arms}\n    END"


def _detail(field: str, text: str, fragment: str | None = None) -> str:
    head = sql_str(f"field `{field}`: {text}")
    if fragment is None:
        return head
    return (
        f"{head} || ', got ' || coalesce(json_type({fragment}) || ' ' || {_shown(fragment)}, "
        "'nothing')"
    )


def _line_checks(rk: str, max_line_bytes: int) -> list[tuple[str, str, str]]:
    """The checks every raw log line gets first: JSON parses, the request id is there and typed."""
    # a trailing comma outside the strings (a `,]` inside a string is text)
    outside = f"regexp_replace(line, '{_JSON_STRING_RE}', '\"\"', 'g')"
    return [
        too_long_check(max_line_bytes),
        ("line IS NULL OR trim(line) = ''", reasons.MALFORMED_JSON, sql_str("empty line")),
        ("j IS NULL", reasons.MALFORMED_JSON, sql_str("not valid JSON")),
        (  # the cheap test first: the strings are cut out only from the lines it flags
            f"regexp_matches(line, '{TRAILING_COMMA_RE}') "
            f"AND regexp_matches({outside}, '{TRAILING_COMMA_RE}')",
            reasons.MALFORMED_JSON,
            sql_str("not valid JSON (trailing comma)"),
        ),
        (
            f"j.{ident(rk)} IS NULL OR json_type(j.{ident(rk)}) = 'NULL'",
            reasons.MISSING_REQUEST_ID,
            sql_str(f"field `{rk}`: missing (or the line is not a JSON object)"),
        ),
        (
            f"json_type(j.{ident(rk)}) NOT IN {_ID_TYPES}",
            reasons.WRONG_TYPE,
            _detail(rk, "expected a string or an integer", f"j.{ident(rk)}"),
        ),
    ]


_NOT_INT_LIST = f"NOT regexp_full_match({{v}}::VARCHAR, '{_INT_LIST_RE}')"
#: the checks of one feature: (condition over the fragment ``{v}`` and typed column ``dv{i}`` /
#: ``sv{i}``, reason, what was expected), in reason order
_DENSE_CHECKS = (
    (
        "{v} IS NOT NULL AND json_type({v}) NOT IN ('NULL', 'BIGINT', 'UBIGINT', 'DOUBLE')",
        reasons.WRONG_TYPE,
        "expected a number",
    ),
    (
        f"NOT isfinite(dv{{i}}) OR abs(dv{{i}}) > {FLOAT32_MAX}",
        reasons.NON_FINITE,
        "expected a finite float32",
    ),
)
#: the checks of an ``ids = "hash"`` feature: a list of strings or integers (``sv{i}`` their texts)
_HASHED_CHECKS = (
    (
        "{v} IS NOT NULL AND json_type({v}) <> 'NULL' AND (json_type({v}) <> 'ARRAY' OR "
        "len(list_filter(from_json({v}, '[\"JSON\"]'), "
        "lambda x: coalesce(json_type(x), 'NULL') NOT IN ('VARCHAR', 'BIGINT', 'UBIGINT'))) > 0)",
        reasons.WRONG_TYPE,
        "expected a list of string or integer ids",
    ),
)
_SPARSE_CHECKS = (
    (
        f"{{v}} IS NOT NULL AND json_type({{v}}) = 'ARRAY' AND {_NOT_INT_LIST} "
        "AND regexp_matches({v}::VARCHAR, '[\\[,](-?Infinity|NaN)[,\\]]')",
        reasons.NON_FINITE,
        "expected finite integer ids",
    ),
    (
        "{v} IS NOT NULL AND json_type({v}) <> 'NULL' "
        f"AND (json_type({{v}}) <> 'ARRAY' OR {_NOT_INT_LIST})",
        reasons.WRONG_TYPE,
        "expected a list of integer ids",
    ),
    ("list_count(sv{i}) < len(sv{i})", reasons.ID_OUT_OF_RANGE, "ids must fit in int64"),
)


#: the select list of the columns every row has (set only for a bad row ``bad``)
_BAD_ROW = """  file_id,
  line_no,
  bad.r AS reason,
  bad.d AS detail,
  CASE WHEN bad IS NOT NULL THEN line END AS raw,
  CASE WHEN bad IS NOT NULL THEN source END AS source,
  CASE WHEN bad IS NOT NULL THEN source_line END AS source_line,"""


_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}


def _ts_text(schema: DatasetSchema) -> str:
    """How a detail names the expected ts: ``an int64 (epoch milliseconds)``."""
    return f"an int64 (epoch {_UNIT_NAMES[schema.time_unit]}, `time_unit` = {schema.time_unit!r})"


def _id_texts(fragment: str) -> str:
    """SQL: the texts of the ids of the JSON list ``fragment`` (a string's value, an integer's
    digits), for ``ids = "hash"``."""
    return f"list_transform(from_json({fragment}, '[\"JSON\"]'), lambda x: {id_text('x')})"


def _parsed(src: str, struct: str) -> str:
    """The CTE ``parsed``: the lines of ``src``, each parsed into ``struct`` (NULL if not JSON)."""
    return f"""parsed AS (
  SELECT file_id, line_no, line, source, source_line, too_long,
    CASE WHEN json_valid(line) THEN from_json(line, '{struct}') END AS j
  FROM {src}
)"""


def _feature_checks(table, field: str, *, v: str, i: int) -> list[tuple[str, str, str]]:
    """The checks of ``table`` for one feature (fragment ``v``, typed column number ``i``)."""
    return [
        (cond.format(v=v, i=i), reason, _detail(field, text, v)) for cond, reason, text in table
    ]


def feature_select(
    schema: DatasetSchema,
    src: str,
    *,
    fast: bool,
    guarded: bool = True,
    facts: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> str:
    """SELECT over ``src`` (:data:`etl.build.inputs.LINE_COLUMNS`): validated feature rows.

    With ``fast``, rows that pass cheap, conservative text tests are accepted and every other
    row gets the reason :data:`PENDING` (and keeps its raw line): run those few again without
    ``fast``, where the full checks (slow in DuckDB even when they are not needed, so kept off
    the main path) give the real reason, or accept the row. ``guarded=False`` (fast path only)
    skips the ``json_valid`` guard: the statement then fails on the first malformed line, and
    the caller retries the file guarded — an optimistic saving of one parse per clean file.
    ``facts`` (fast path only): ``src`` also carries the columns of
    :func:`etl.build._kernels.line_facts`, which replace the text tests done in SQL. A line the
    reader cut (``too_long`` set) is quarantined as ``line_too_long`` by both tiers;
    ``max_line_bytes`` is the limit its detail names.

    Columns (:data:`FEATURE_COLUMNS`): ``file_id``, ``line_no``, ``reason``, ``detail``,
    ``raw``, ``source`` and ``source_line`` (bad rows only), ``request_id``, ``session_key``
    (raw session id as text, or NULL), ``user_key``, ``ts``, the dense columns ``d0..`` (float,
    NULL when missing), the sparse columns ``s0..`` (BIGINT[], truncated, NULL when missing),
    ``unknown`` (``dense.x`` / ``sparse.y``: map keys the schema does not know, or NULL) and
    ``unknown_keys`` (top-level keys the build does not read, or NULL).
    """
    rk, sk, uk, tk = schema_keys(schema)
    ts_lo, ts_hi = ts_bounds(schema.time_unit)
    dense_s = ", ".join(f'"{f.name}": "JSON"' for f in schema.dense)
    sparse_s = ", ".join(f'"{f.name}": "JSON"' for f in schema.sparse)
    struct = (
        "{" + ", ".join(f'"{k}": "JSON"' for k in (rk, sk, uk, tk)) + passthrough_struct(schema)
    )
    struct += (', "dense": {' + dense_s + "}") if schema.dense else ""
    struct += (', "sparse": {' + sparse_s + "}") if schema.sparse else ""
    struct = (struct + "}").replace("'", "''")
    checks: list[tuple[str, str, str]] = [
        *_line_checks(rk, max_line_bytes),
        (
            f"j.{ident(tk)} IS NULL OR json_type(j.{ident(tk)}) = 'NULL'",
            reasons.MISSING_TS,
            sql_str(f"field `{tk}`: missing"),
        ),
        (
            f"json_type(j.{ident(tk)}) NOT IN {_INT_TYPES} "
            f"OR {_num(f'j.{ident(tk)}', 'BIGINT', _INT_TYPES)} IS NULL",
            reasons.WRONG_TYPE,
            _detail(tk, f"expected {_ts_text(schema)}", f"j.{ident(tk)}"),
        ),
        (
            f"{_num(f'j.{ident(tk)}', 'BIGINT', _INT_TYPES)} NOT BETWEEN {ts_lo} AND {ts_hi}",
            reasons.TS_OUT_OF_RANGE,
            _detail(
                tk,
                f"expected epoch {_UNIT_NAMES[schema.time_unit]} in {ts_lo}..{ts_hi}",
                f"j.{ident(tk)}",
            ),
        ),
        (
            f"j.{ident(sk)} IS NOT NULL AND json_type(j.{ident(sk)}) NOT IN ('NULL', 'VARCHAR', 'BIGINT', 'UBIGINT')",
            reasons.WRONG_TYPE,
            _detail(sk, "expected a string or an integer", f"j.{ident(sk)}"),
        ),
        (
            f"j.{ident(uk)} IS NOT NULL AND json_type(j.{ident(uk)}) NOT IN ('NULL', 'VARCHAR', 'BIGINT', 'UBIGINT')",
            reasons.WRONG_TYPE,
            _detail(uk, "expected a string or an integer", f"j.{ident(uk)}"),
        ),
        (
            "coalesce(json_type(line, '$.dense'), 'NULL') NOT IN ('NULL', 'OBJECT')",
            reasons.WRONG_TYPE,
            "'field `dense`: expected an object, got ' || json_type(line, '$.dense')",
        ),
        (
            "coalesce(json_type(line, '$.sparse'), 'NULL') NOT IN ('NULL', 'OBJECT')",
            reasons.WRONG_TYPE,
            "'field `sparse`: expected an object, got ' || json_type(line, '$.sparse')",
        ),
    ]
    # dense: numbers (null = missing -> fill), finite and within float32; sparse: lists of
    # int64 (null = missing -> empty list)
    # (each feature's JSON fragment is a column of its own, ``df{i}`` / ``sf{i}``: referring to
    # it inside the record's struct would cost DuckDB a pass over every feature per reference)
    for i, feat in enumerate(schema.dense):
        checks += _feature_checks(_DENSE_CHECKS, f"dense.{feat.name}", v=f"df{i}", i=i)
    for i, feat in enumerate(schema.sparse):
        field = f"sparse.{feat.name}"
        table = _HASHED_CHECKS if feat.ids == "hash" else _SPARSE_CHECKS
        checks += _feature_checks(table, field, v=f"sf{i}", i=i)
        if not feat.truncate:
            too_many = f"{sql_str(f' ids > max_len {feat.max_len} (truncate = false)')}"
            checks.append(
                (
                    f"len(sv{i}) > {int(feat.max_len)}",
                    reasons.LIST_TOO_LONG,
                    f"{sql_str(f'field `{field}`: ')} || len(sv{i}) || {too_many}",
                )
            )
    fragments = [f"j.dense[{sql_str(f.name)}] AS df{i}" for i, f in enumerate(schema.dense)]
    fragments += [f"j.sparse[{sql_str(f.name)}] AS sf{i}" for i, f in enumerate(schema.sparse)]
    typed = [f"TRY_CAST(df{i}::VARCHAR AS DOUBLE) AS dv{i}" for i in range(len(schema.dense))]
    typed += [
        f"{_id_texts(f'sf{i}')} AS sv{i}"
        if f.ids == "hash"
        else f"from_json(sf{i}, '[\"BIGINT\"]') AS sv{i}"
        for i, f in enumerate(schema.sparse)
    ]
    if fast:
        return fast_select(schema, src, guarded=guarded, facts=facts, max_line_bytes=max_line_bytes)

    def text_of(col: str) -> str:
        return f"CASE WHEN starts_with({col}::VARCHAR, '\"') THEN {col} ->> '$' ELSE {col}::VARCHAR END"

    return f"""
WITH {_parsed(src, struct)}, fragments AS (
  SELECT *, {", ".join(fragments) if fragments else "NULL AS _none"} FROM parsed
), typed AS (
  SELECT *, {", ".join(typed) if typed else "NULL AS _none2"} FROM fragments
), checked AS (
  SELECT *,
    {_case(checks)} AS bad
  FROM typed
)
SELECT
{_BAD_ROW}
  CASE WHEN bad IS NULL THEN {text_of(f"j.{ident(rk)}")} END AS request_id,
  CASE WHEN bad IS NULL AND j.{ident(sk)}::VARCHAR <> 'null' THEN {text_of(f"j.{ident(sk)}")} END
    AS session_key,
  CASE WHEN bad IS NULL AND j.{ident(uk)}::VARCHAR <> 'null' THEN {text_of(f"j.{ident(uk)}")} END
    AS user_key,
  CASE WHEN bad IS NULL THEN {ts_ms(f"TRY_CAST(j.{ident(tk)}::VARCHAR AS BIGINT)", schema.time_unit)} END
    AS ts,
{value_columns(schema)}{passthrough_columns(schema, good="bad IS NULL")}  CASE WHEN bad IS NULL THEN {_unknown_keys(schema)} END AS unknown,
  CASE WHEN bad IS NULL THEN {_unknown_top_keys(schema)} END AS unknown_keys
FROM checked
"""


def _unknown_keys(schema: DatasetSchema) -> str:
    known_dense = "[" + ", ".join(sql_str(f.name) for f in schema.dense) + "]::VARCHAR[]"
    known_sparse = "[" + ", ".join(sql_str(f.name) for f in schema.sparse) + "]::VARCHAR[]"
    return f"""nullif(
    list_transform(list_filter(coalesce(json_keys(line, '$.dense'), []),
                               lambda k: NOT list_contains({known_dense}, k)),
                   lambda k: 'dense.' || k)
    || list_transform(list_filter(coalesce(json_keys(line, '$.sparse'), []),
                                  lambda k: NOT list_contains({known_sparse}, k)),
                      lambda k: 'sparse.' || k),
    []::VARCHAR[])"""


def _unknown_top_keys(schema: DatasetSchema) -> str:
    keys = (*schema_keys(schema), "dense", "sparse", *schema.passthrough)
    known = "[" + ", ".join(sql_str(k) for k in keys) + "]"
    return f"""nullif(list_filter(coalesce(json_keys(line), []),
                         lambda k: NOT list_contains({known}::VARCHAR[], k)), []::VARCHAR[])"""


def event_select(
    schema: DatasetSchema, src: str, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> str:
    """SELECT over ``src`` (:data:`etl.build.inputs.LINE_COLUMNS`): validated event rows.

    Columns (:data:`EVENT_COLUMNS`): ``file_id``, ``line_no``, ``reason``, ``detail``, ``raw``,
    ``source`` and ``source_line`` (bad rows only), ``request_id``, ``label`` (DOUBLE; booleans
    count as 0/1; a number beyond float32, the type of the dataset's label, is ``non_finite``;
    a missing or ``null`` label is ``wrong_type``, its detail saying which).
    """
    rk, _, _, tk = schema_keys(schema)
    lk = schema.label_key
    struct = "{" + ", ".join(f'"{k}": "JSON"' for k in (rk, tk, lk)) + "}"
    struct = struct.replace("'", "''")
    lab = f"j.{ident(lk)}"
    checks: list[tuple[str, str, str]] = [
        *_line_checks(rk, max_line_bytes),
        (
            f"j.{ident(tk)} IS NOT NULL AND json_type(j.{ident(tk)}) <> 'NULL' "
            f"AND (json_type(j.{ident(tk)}) NOT IN {_INT_TYPES} "
            f"OR {_num(f'j.{ident(tk)}', 'BIGINT', _INT_TYPES)} IS NULL)",
            reasons.WRONG_TYPE,
            _detail(tk, f"expected {_ts_text(schema)}", f"j.{ident(tk)}"),
        ),
        (
            f"{lab} IS NULL AND json_type(line, {sql_str(json_path(lk))}) IS NULL",
            reasons.WRONG_TYPE,
            sql_str(f"field `{lk}`: missing"),
        ),
        (
            f"{lab} IS NULL OR json_type({lab}) = 'NULL'",
            reasons.WRONG_TYPE,
            sql_str(f"field `{lk}`: null, expected a number"),
        ),
        (
            f"json_type({lab}) NOT IN ('BIGINT', 'UBIGINT', 'DOUBLE', 'BOOLEAN')",
            reasons.WRONG_TYPE,
            _detail(lk, "expected a number", lab),
        ),
        (
            f"NOT isfinite({_num(lab, 'DOUBLE', _NUM_TYPES)})",
            reasons.NON_FINITE,
            _detail(lk, "expected a finite number", lab),
        ),
        (
            f"abs({_num(lab, 'DOUBLE', _NUM_TYPES)}) > {FLOAT32_MAX}",
            reasons.NON_FINITE,
            _detail(lk, "expected a number within float32", lab),
        ),
    ]
    label = (
        f"CASE json_type({lab}) WHEN 'BOOLEAN' THEN TRY_CAST({lab} AS BOOLEAN)::DOUBLE "
        f"ELSE {_num(lab, 'DOUBLE', _NUM_TYPES)} END"
    )
    rid = f"j.{ident(rk)}"
    return f"""
WITH {_parsed(src, struct)}, checked AS (
  SELECT *, {_case(checks)} AS bad FROM parsed
)
SELECT
{_BAD_ROW}
  CASE WHEN bad IS NULL THEN
    CASE json_type({rid}) WHEN 'VARCHAR' THEN {rid} ->> '$' ELSE {rid}::VARCHAR END END AS request_id,
  CASE WHEN bad IS NULL THEN {label} END AS label
FROM checked
"""


#: the columns every validated row has first (bad rows fill them; good rows leave the rest NULL)
BAD_COLUMNS: tuple[str, ...] = (
    "file_id",
    "line_no",
    "reason",
    "detail",
    "raw",
    "source",
    "source_line",
)


class Validator:
    """The validation of one build: the schema's SQL, with the limit of the reader.

    Args:
        schema: the dataset schema.
        max_line_bytes: the reader's line limit (named in ``line_too_long`` details).

    Thread-safe: :meth:`features` and :meth:`events` may run on several threads at once (each
    call uses its own cursor of one in-memory DuckDB connection).
    """

    def __init__(self, schema: DatasetSchema, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self.schema = schema
        self.max_line_bytes = int(max_line_bytes)
        self.keys = schema_keys(schema)
        self._con: Any = None
        self._lock = threading.Lock()

    # -- SQL, for engines that run DuckDB themselves ------------------------------------------

    def feature_sql(
        self, src: str, *, fast: bool, guarded: bool = True, facts: bool = False
    ) -> str:
        """:func:`feature_select` over the relation ``src`` (a table, view or subquery)."""
        return feature_select(
            self.schema,
            src,
            fast=fast,
            guarded=guarded,
            facts=facts,
            max_line_bytes=self.max_line_bytes,
        )

    def event_sql(self, src: str) -> str:
        """:func:`event_select` over the relation ``src``."""
        return event_select(self.schema, src, max_line_bytes=self.max_line_bytes)

    def split_plain(self, lines: pa.Table) -> tuple[pa.Table | None, pa.Table]:
        """The plain lines of a batch of feature lines (in the nested layout), read by the
        compiled tier, and the rest: :func:`etl.build._plain.split_plain`."""
        return split_plain(self.schema, lines)

    def plain_sql(self, src: str) -> str:
        """Validated feature rows (every one good) from :meth:`split_plain`'s parsed rows in
        the relation ``src``: :func:`etl.build._plain.plain_select`."""
        return plain_select(self.schema, src)

    def with_facts(self, lines: pa.Table) -> pa.Table:
        """``lines`` plus the columns of :func:`etl.build._kernels.line_facts` (``facts=True``)."""
        chunks = lines.column("line").chunks or [pa.array([], pa.large_string())]
        facts = [line_facts(chunk, self.keys) for chunk in chunks]  # no copy of the text
        for name in LINE_FACT_COLUMNS:
            lines = lines.append_column(name, pa.chunked_array([f[name] for f in facts]))
        return lines

    def normalize(self, lines: pa.Table, kind: Kind) -> pa.Table:
        """``lines`` in the nested layout under the dataset's names (unchanged unless the
        schema has ``layout = "flat"`` or a ``[keys]`` mapping: :mod:`etl.build.layout`)."""
        if not self.schema.remapped:
            return lines
        with self._cursor() as cur:
            return normalize(self.schema, lines, kind=kind, con=cur)

    # -- Arrow in, Arrow out, for any engine --------------------------------------------------

    def features(self, lines: pa.Table) -> pa.Table:
        """Validated feature rows (the columns of :func:`feature_select`) of a batch of lines.

        Args:
            lines: numbered lines with :data:`etl.build.inputs.LINE_COLUMNS`, as read (they
                go through :meth:`normalize` here).

        Returns:
            one row per line, in no particular order: ``reason`` NULL for a good row.
        """
        lines = self.normalize(lines, "features")
        with self._cursor() as cur:
            parsed, lines = self.split_plain(lines)  # plain lines first, compiled
            plain = None
            if parsed is not None:
                plain = cur.sql(self.plain_sql(self._register(cur, parsed))).to_arrow_table()
            view = self._register(cur, self.with_facts(lines))
            fast = self._run(
                cur, lambda g: self.feature_sql(view, fast=True, guarded=g, facts=True)
            )
            if plain is not None:
                fast = pa.concat_tables([plain, fast.cast(plain.schema)])
            is_pending = pc.fill_null(pc.equal(fast.column("reason"), PENDING), False)
            pending = fast.filter(is_pending)
            if not pending.num_rows:
                return fast
            done = fast.filter(pc.invert(is_pending))
            again = pending.select(["file_id", "line_no", "raw", "source", "source_line"])
            again = again.rename_columns(list(LINE_COLUMNS[:5])).append_column(
                "too_long", pa.nulls(again.num_rows, pa.int64())
            )
            view = self._register(cur, again)
            full = cur.sql(self.feature_sql(view, fast=False)).to_arrow_table()
            return pa.concat_tables([done, full.cast(done.schema)])

    def events(self, lines: pa.Table) -> pa.Table:
        """Validated event rows (the columns of :func:`event_select`) of a batch of lines
        (as read: they go through :meth:`normalize` here)."""
        lines = self.normalize(lines, "events")
        with self._cursor() as cur:
            view = self._register(cur, lines)
            return cur.sql(self.event_sql(view)).to_arrow_table()

    def close(self) -> None:
        """Close the in-memory DuckDB of :meth:`features` and :meth:`events` (if opened)."""
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    def _cursor(self) -> Any:
        import duckdb

        with self._lock:
            if self._con is None:
                self._con = duckdb.connect()
                self._con.execute("SET enable_progress_bar = false")
        return self._con.cursor()

    @staticmethod
    def _register(cur: Any, table: pa.Table) -> str:
        view = f"_recpipe_lines_{next(_VIEWS)}"
        cur.register(view, table)
        return view

    @staticmethod
    def _run(cur: Any, sql) -> pa.Table:
        """``sql(guarded=False)`` (optimistic: no JSON guard), again guarded on malformed JSON."""
        import duckdb

        try:
            return cur.sql(sql(False)).to_arrow_table()
        except (duckdb.InvalidInputException, UnicodeDecodeError) as exc:
            if not malformed_json(exc):
                raise
            return cur.sql(sql(True)).to_arrow_table()


_VIEWS = itertools.count()


def malformed_json(exc: Exception) -> bool:
    """Whether the optimistic (unguarded) parse failed on a malformed line: DuckDB says so, or
    its message quotes the line cut inside a UTF-8 character (Python cannot decode it)."""
    return isinstance(exc, UnicodeDecodeError) or "malformed json" in str(exc).lower()
