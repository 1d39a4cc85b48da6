"""SQL pieces shared by the two tiers of the build's validation (:mod:`etl.build.validate`)."""

from __future__ import annotations

from etl import reasons
from schemas import DatasetSchema

__all__ = [
    "FLOAT32_MAX",
    "PENDING",
    "TRAILING_COMMA_RE",
    "TS_RANGE",
    "feature_columns",
    "ident",
    "json_path",
    "passthrough_columns",
    "passthrough_struct",
    "schema_keys",
    "sql_str",
    "sql_sum",
    "too_long_check",
    "value_columns",
]

PENDING = "pending"
"""Reason of rows the fast path could not accept; they are checked again in full."""
TRAILING_COMMA_RE = r",\s*[\]}]"  # DuckDB's JSON reader accepts `[1,]`; strict JSON does not
FLOAT32_MAX = "3.4028234663852886e38"
TS_RANGE = (-9_223_372_022_400_000, 9_223_372_036_854_775)
"""The ts values (epoch ms) a build accepts: those DuckDB's ``epoch_ms`` turns into a timestamp
(about 290,000 BC .. 294,000 AD); others are quarantined as ``ts_out_of_range``."""


def sql_str(text: str) -> str:
    """Quote ``text`` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def sql_sum(terms: list[str]) -> str:
    """The SQL sum of ``terms`` as a balanced tree of ``+`` (``0`` when empty).

    A chain ``a + b + c ...`` nests one level per term, and DuckDB refuses expressions deeper
    than 1,000 levels (``max_expression_depth``): a schema of a thousand features would not
    parse. Balanced, the depth is the log of the number of terms.

    >>> sql_sum(["a", "b", "c"])
    '(a + (b + c))'
    """
    if not terms:
        return "0"
    if len(terms) == 1:
        return terms[0]
    half = len(terms) // 2
    return f"({sql_sum(terms[:half])} + {sql_sum(terms[half:])})"


def ident(name: str) -> str:
    """Quote ``name`` as a SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def schema_keys(schema: DatasetSchema) -> tuple[str, str, str, str]:
    """The raw record keys: request id, session id, user id, timestamp."""
    return "request_id", schema.session_key, schema.user_key, schema.time_key


def json_path(*keys: str) -> str:
    """A JSON path to nested object keys: ``$."a"."b"``."""
    quoted = ('"' + k.replace("\\", "\\\\").replace('"', '\\"') + '"' for k in keys)
    return "$." + ".".join(quoted)


def passthrough_columns(schema: DatasetSchema, *, good: str) -> str:
    """SQL select-list lines ``p0..``: the schema's ``passthrough`` keys of the record as text
    (a string's value, any other JSON value as its JSON text; NULL when absent or ``null``),
    for the rows where ``good`` holds. The parsed record ``j`` holds each key as a JSON
    fragment (:func:`passthrough_struct`)."""
    out = []
    for i, name in enumerate(schema.passthrough):
        v = f"j.{ident(name)}"
        out.append(
            f"  CASE WHEN {good} THEN CASE WHEN json_type({v}) = 'VARCHAR' THEN {v} ->> '$' "
            f"WHEN json_type({v}) <> 'NULL' THEN {v}::VARCHAR END END AS p{i},\n"
        )
    return "".join(out)


def passthrough_struct(schema: DatasetSchema) -> str:
    """The passthrough keys' entries of a ``from_json`` struct (each a JSON fragment), each
    with a leading ``, ``; ``""`` without passthrough keys."""
    return "".join(f', "{n}": "JSON"' for n in schema.passthrough)


def feature_columns(schema: DatasetSchema) -> list[str]:
    """Internal column names of the validated feature table, dense then sparse."""
    return [f"d{i}" for i in range(len(schema.dense))] + [
        f"s{i}" for i in range(len(schema.sparse))
    ]


def too_long_check(max_line_bytes: int) -> tuple[str, str, str]:
    """The check of a line the reader cut (``too_long`` holds its length)."""
    return (
        "too_long IS NOT NULL",
        reasons.LINE_TOO_LONG,
        f"'line of ' || too_long || ' bytes, longer than `max_line_bytes` = {int(max_line_bytes)}"
        " (raw: its first bytes only)'",
    )


def value_columns(schema: DatasetSchema) -> str:
    """SQL select-list lines for ``d0..`` / ``s0..``, from the columns ``dv0..`` / ``sv0..``.

    Dense: float32; sparse: BIGINT[], longer than ``max_len`` -> the last ``max_len`` ids;
    missing (absent or ``null``) -> NULL, filled when the dataset is written (bad rows get
    meaningless values: they are quarantined and never written).
    """
    out = [f"TRY_CAST(dv{i} AS FLOAT)" for i in range(len(schema.dense))]
    for i, f in enumerate(schema.sparse):
        out.append(f"sv{i}[-{int(f.max_len)}:]" if f.truncate else f"sv{i}")
    return "".join(f"  {e} AS {n},\n" for e, n in zip(out, feature_columns(schema)))
