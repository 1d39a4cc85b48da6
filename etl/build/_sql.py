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
    "hash_id",
    "id_text",
    "ident",
    "json_path",
    "passthrough_columns",
    "passthrough_struct",
    "schema_keys",
    "sql_str",
    "sql_sum",
    "too_long_check",
    "ts_bounds",
    "ts_ms",
    "value_columns",
]

PENDING = "pending"
"""Reason of rows the fast path could not accept; they are checked again in full."""
TRAILING_COMMA_RE = r",\s*[\]}]"  # DuckDB's JSON reader accepts `[1,]`; strict JSON does not
FLOAT32_MAX = "3.4028234663852886e38"
TS_RANGE = (-9_223_372_022_400_000, 9_223_372_036_854_775)
"""The ts values (epoch ms) a build accepts: those DuckDB's ``epoch_ms`` turns into a timestamp
(about 290,000 BC .. 294,000 AD); others are quarantined as ``ts_out_of_range``."""


def ts_bounds(unit: str) -> tuple[int, int]:
    """The raw ts values (in ``unit``) whose milliseconds lie in :data:`TS_RANGE`.

    >>> ts_bounds("s")
    (-9223372022400, 9223372036854)
    """
    lo, hi = TS_RANGE
    if unit == "s":
        return -(-lo // 1000), hi // 1000
    if unit == "us":  # every int64 of microseconds is within range once in milliseconds
        return -(2**63), 2**63 - 1
    return lo, hi


def ts_ms(expr: str, unit: str) -> str:
    """SQL turning the raw BIGINT ts ``expr`` (in ``unit``, within :func:`ts_bounds`) into
    epoch milliseconds: seconds times 1000, microseconds floored to the millisecond."""
    if unit == "s":  # NULL, not an error, for a rejected row's ts beyond the range
        return f"TRY_CAST(({expr})::HUGEINT * 1000 AS BIGINT)"
    if unit == "us":
        x = f"({expr})::HUGEINT"  # an exact floor division, also below zero
        return f"CAST(({x} - (({x} % 1000) + 1000) % 1000) // 1000 AS BIGINT)"
    return expr


def hash_id(expr: str) -> str:
    """SQL of the stable id of the text ``expr`` (``[[sparse]] ids = "hash"``): the first 8
    bytes of its UTF-8 MD5 read little-endian, the top bit cleared (a non-negative int64).

    In Python: ``int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "little") & (2**63 - 1)``.
    """
    return f"(md5_number_upper({expr}) & 9223372036854775807)::BIGINT"


def id_text(expr: str) -> str:
    """SQL: the text of the JSON fragment ``expr`` holding one id of an ``ids = "hash"`` list,
    the one :func:`hash_id` hashes: a string's value (unescaped), an integer's digits."""
    return (
        f"CASE WHEN starts_with({expr}::VARCHAR, '\"') THEN {expr} ->> '$' ELSE {expr}::VARCHAR END"
    )


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
    meaningless values: they are quarantined and never written). A feature with
    ``ids = "hash"`` arrives as VARCHAR[] (the ids' texts) and leaves hashed (:func:`hash_id`).
    """
    out = [f"TRY_CAST(dv{i} AS FLOAT)" for i in range(len(schema.dense))]
    for i, f in enumerate(schema.sparse):
        v = f"sv{i}[-{int(f.max_len)}:]" if f.truncate else f"sv{i}"
        if f.ids == "hash":
            v = f"list_transform({v}, lambda x: {hash_id('x')})"
        out.append(v)
    return "".join(f"  {e} AS {n},\n" for e, n in zip(out, feature_columns(schema)))
