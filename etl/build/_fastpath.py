"""The fast tier of the build's validation: one typed parse and cheap text tests per line.

Nearly every good line is accepted here; every other line gets the reason
:data:`~etl.build._sql.PENDING` and its raw text, for the full checks of
:mod:`etl.build.validate`.
"""

from __future__ import annotations

from etl.build._kernels import LINE_FACT_COLUMNS
from etl.build._sql import (
    FLOAT32_MAX,
    PENDING,
    TRAILING_COMMA_RE,
    id_text,
    ident,
    passthrough_columns,
    passthrough_struct,
    schema_keys,
    sql_str,
    sql_sum,
    too_long_check,
    ts_bounds,
    ts_ms,
    value_columns,
)
from schemas import DatasetSchema

__all__ = ["fast_select"]


def fast_select(
    schema: DatasetSchema, src: str, *, guarded: bool, facts: bool, max_line_bytes: int
) -> str:
    """The fast path: one typed (lenient) parse plus cheap, conservative text tests.

    DuckDB's typed JSON extraction is lenient (``"12"`` -> 12, ``1.5`` -> 2 for an integer,
    ``true`` -> 1) and its JSON-fragment extraction is slow, so a row is accepted here only
    when plain text tests prove that no leniency was needed:

    - the line is whole (the reader did not cut it: ``too_long`` is NULL; a cut line is
      quarantined here, as ``line_too_long``),
    - as many ``"`` in the line as two per known key parsed plus two per string-valued id: no
      unknown, repeated or null keys, no number written as a string,
    - no ``true``/``false``, no trailing comma, no list where an object belongs,
    - ids are integers or strings (a number without ``.`` or exponent), ``ts`` an integer in
      :func:`~etl.build._sql.ts_bounds` (milliseconds once in ``time_unit``), sparse ids free of fractions and exponents (no ``.``, ``E`` or digit
      followed by ``e`` after the ``"sparse"`` key: the full checks quarantine ``1e5``), dense
      values finite,
      sparse lists free of NULLs (ids outside int64, strings, nulls) and short enough.
      The ids of an ``ids = "hash"`` feature are read as JSON fragments: strings (two more
      ``"`` each in the count) or plain integers; a string holding ``\\"`` fails the count.

    Values are not masked for rows that fail (they are deleted after their second look).
    Every other row is returned with the reason :data:`PENDING` and its raw line, to be
    checked in full (:func:`feature_select` without ``fast``). Lines written in another
    layout (pretty-printed, ``sparse`` before ``dense``) are still correct, only slower.
    """
    rk, sk, uk, tk = schema_keys(schema)
    ids = (rk, sk, uk, tk)
    dense_s = ", ".join(f'"{f.name}": "DOUBLE"' for f in schema.dense)
    # ``ids = "hash"``: the ids as JSON fragments (a string keeps its quotes, to be counted)
    sparse_s = ", ".join(
        f'"{f.name}": "{"JSON" if f.ids == "hash" else "BIGINT"}[]"' for f in schema.sparse
    )
    struct = "{" + ", ".join(f'"{k}": "VARCHAR"' for k in ids) + passthrough_struct(schema)
    struct += (', "dense": {' + dense_s + "}") if schema.dense else ""
    struct += (', "sparse": {' + sparse_s + "}") if schema.sparse else ""
    struct = (struct + "}").replace("'", "''")
    fields = [f"j.{ident(k)}" for k in (*ids, *schema.passthrough)]
    fields += ["j.dense"] if schema.dense else []
    fields += ["j.sparse"] if schema.sparse else []
    # each feature's value is a column of its own (``dv{i}`` / ``sv{i}``): referring to it
    # inside the record's struct would cost DuckDB a pass over every feature per reference
    values = [f"j.dense[{sql_str(f.name)}] AS dv{i}" for i, f in enumerate(schema.dense)]
    hashed = [i for i, f in enumerate(schema.sparse) if f.ids == "hash"]
    for i, f in enumerate(schema.sparse):
        raw = f"j.sparse[{sql_str(f.name)}]"
        if i not in hashed:
            values.append(f"{raw} AS sv{i}")
            continue
        # the ids' texts (``sv``), how many are strings (``sq``: two `"` each in the line) and
        # how many are neither a string nor a plain integer (``sb``: left to the full checks)
        is_str = "starts_with(x::VARCHAR, '\"')"
        plain_int = "regexp_full_match(x::VARCHAR, '-?(0|[1-9][0-9]{0,17})')"
        values += [
            f"list_transform({raw}, lambda x: {id_text('x')}) AS sv{i}",
            f"len(list_filter({raw}, lambda x: {is_str})) AS sq{i}",
            f"len(list_filter({raw}, lambda x: NOT ({is_str} OR {plain_int}))) AS sb{i}",
        ]
    fields += [f"dv{i}" for i in range(len(schema.dense))]
    fields += [f"sv{i}" for i in range(len(schema.sparse))]
    n_keys = sql_sum([f"({f} IS NOT NULL)::INTEGER" for f in fields])

    kind_col = dict(zip((rk, sk, uk, tk), ("kind_rk", "kind_sk", "kind_uk", "kind_tk")))

    def is_str(key: str) -> str:
        if facts:  # computed by etl.build._kernels.line_facts
            return f"(CASE WHEN {kind_col[key]} >= 0 THEN {kind_col[key]} = 1 END)"
        # the first non-blank character after the first `"key":` (keys sit near the start of
        # a line, so this reads a few bytes, not the line); NULL (-> not accepted) when the
        # key is written another way, e.g. `"key" :`
        pattern = sql_str('"' + key + '":')
        at = f"instr(line, {pattern})"
        first = f"left(ltrim(substr(line, {at} + {len(key) + 3}, 8)), 1)"
        return f"(CASE WHEN {at} > 0 THEN {first} = '\"' END)"

    def str_id(key: str) -> str:
        return f"(j.{ident(key)} IS NOT NULL AND {is_str(key)})"

    # a passthrough key counts its `"` as a key, and two more when its value is a string
    n_str = sql_sum(
        [f"{str_id(k)}::INTEGER" for k in (rk, sk, uk)]
        + [
            f"coalesce(json_type(j.{ident(k)}) = 'VARCHAR', FALSE)::INTEGER"
            for k in schema.passthrough
        ]
        + [f"coalesce(sq{i}, 0)" for i in hashed]
    )

    def id_ok(key: str) -> str:
        # a number is read as text: DuckDB writes a JSON double with a `.` or an exponent
        # (`1e5` -> "100000.0", `1e-300` -> "1e-300"), which TRY_CAST may still read
        col = f"j.{ident(key)}"
        as_int = (
            f"(TRY_CAST({col} AS BIGINT) IS NOT NULL "
            f"AND NOT (contains({col}, '.') OR contains(lower({col}), 'e')))"
        )
        return f"({col} IS NULL OR {is_str(key)} OR {as_int})"

    ts_lo, ts_hi = ts_bounds(schema.time_unit)
    tests = [
        "j IS NOT NULL",
        "too_long IS NULL",
        f"j.{ident(rk)} IS NOT NULL",
        f"TRY_CAST(j.{ident(tk)} AS BIGINT) BETWEEN {ts_lo} AND {ts_hi}",
        f"NOT (contains(j.{ident(tk)}, '.') OR contains(lower(j.{ident(tk)}), 'e'))",
        f"NOT {is_str(tk)}",
        id_ok(rk),
        id_ok(sk),
        id_ok(uk),
    ]
    if facts:
        tests += [f"quotes = 2 * ({n_keys}) + 2 * ({n_str})", "text_ok"]
    else:
        tests += [
            f"length(line) - length(replace(line, '\"', '')) = 2 * ({n_keys}) + 2 * ({n_str})",
            "NOT (contains(line, ',}') OR contains(line, ',]') OR CASE WHEN contains(line, ', ') "
            f"THEN regexp_matches(line, '{TRAILING_COMMA_RE}') ELSE FALSE END)",
            "NOT (contains(line, 'true') OR contains(line, 'false'))",
        ]
    # a map written as a list still parses (to a struct of NULLs): the first `"dense":` /
    # `"sparse":` must open an object, or the key must be absent (in any spelling)
    for key, present in (("dense", schema.dense), ("sparse", schema.sparse)):
        if present and not facts:
            at = f"instr(line, {sql_str(chr(34) + key + chr(34) + ':')})"
            first = f"left(ltrim(substr(line, {at} + {len(key) + 3}, 8)), 1)"
            absent = f"NOT contains(line, {sql_str(chr(34) + key + chr(34))})"
            tests.append(f"(CASE WHEN {at} > 0 THEN {first} = '{{' ELSE {absent} END)")
    for i in range(len(schema.dense)):
        v = f"dv{i}"
        tests.append(f"({v} IS NULL OR (isfinite({v}) AND abs({v}) <= {FLOAT32_MAX}))")
    for i, f in enumerate(schema.sparse):
        v = f"sv{i}"
        too_long = "" if f.truncate else f" AND len({v}) <= {int(f.max_len)}"
        tests.append(f"({v} IS NULL OR (list_count({v}) = len({v}){too_long}))")
        if f.ids == "hash":  # strings and plain integers only
            tests.append(f"coalesce(sb{i}, 0) = 0")
    if schema.sparse and not facts:
        tail = "substr(line, strpos(line, '\"sparse\"'))"
        # no fraction or exponent among the sparse ids (key names may hold an `e`)
        tests.append(
            f"NOT (contains({tail}, '.') OR contains({tail}, 'E') "
            f"OR regexp_matches({tail}, '[0-9]e'))"
        )
    fact_cols = (" " + ", ".join(LINE_FACT_COLUMNS) + ",") if facts else ""
    parse = f"from_json(line, '{struct}')"
    if guarded:
        parse = f"CASE WHEN json_valid(line) THEN {parse} END"
    cond, long_reason, long_detail = too_long_check(max_line_bytes)
    return f"""
WITH parsed AS (
  SELECT file_id, line_no, line, source, source_line, too_long,{fact_cols}
    {parse} AS j
  FROM {src}
), valued AS (
  SELECT *, {", ".join(values) if values else "NULL AS _none"} FROM parsed
), checked AS (
  SELECT *, coalesce({" AND ".join(tests)}, FALSE) AS ok FROM valued
)
SELECT
  file_id,
  line_no,
  CASE WHEN {cond} THEN '{long_reason}' WHEN NOT ok THEN '{PENDING}' END AS reason,
  CASE WHEN {cond} THEN {long_detail} END AS detail,
  CASE WHEN NOT ok THEN line END AS raw,
  CASE WHEN NOT ok THEN source END AS source,
  CASE WHEN NOT ok THEN source_line END AS source_line,
  j.{ident(rk)} AS request_id,
  j.{ident(sk)} AS session_key,
  j.{ident(uk)} AS user_key,
  {ts_ms(f"TRY_CAST(j.{ident(tk)} AS BIGINT)", schema.time_unit)} AS ts,
{value_columns(schema)}{passthrough_columns(schema, good="j IS NOT NULL")}
  NULL::VARCHAR[] AS unknown,
  NULL::VARCHAR[] AS unknown_keys
FROM checked
"""
