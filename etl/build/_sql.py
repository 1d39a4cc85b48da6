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
    "schema_keys",
    "sql_str",
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


def ident(name: str) -> str:
    """Quote ``name`` as a SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def schema_keys(schema: DatasetSchema) -> tuple[str, str, str, str]:
    """The raw record keys: request id, session id, user id, timestamp."""
    return "request_id", schema.session_key, schema.user_key, schema.time_key


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


def value_columns(schema: DatasetSchema, dense: str | None, sparse: str | None) -> str:
    """SQL select-list lines for ``d0..`` / ``s0..``, from typed structs or from ``dv``/``sv``.

    Dense: float32; sparse: BIGINT[], longer than ``max_len`` -> the last ``max_len`` ids;
    missing (absent or ``null``) -> NULL, filled when the dataset is written (bad rows get
    meaningless values: they are quarantined and never written).
    """
    out = []
    for i, f in enumerate(schema.dense):
        v = f"{dense}[{sql_str(f.name)}]" if dense else f"dv{i}"
        out.append(f"TRY_CAST({v} AS FLOAT)")
    for i, f in enumerate(schema.sparse):
        v = f"{sparse}[{sql_str(f.name)}]" if sparse else f"sv{i}"
        out.append(f"{v}[-{int(f.max_len)}:]" if f.truncate else v)
    return "".join(f"  {e} AS {n},\n" for e, n in zip(out, feature_columns(schema)))
