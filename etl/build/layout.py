"""Raw records in another layout: rewritten to the nested layout before validation.

A schema with ``layout = "flat"`` (features at the top level of each record) or a ``[keys]``
mapping (the logs name the request id or features differently) describes logs that the one
validator (:mod:`etl.build.validate`) does not read as they are. Every engine, and
``recpipe etl validate``, hands such lines through :func:`normalize` first: each line that is a
JSON object becomes the nested record with the dataset's names, its values copied as JSON
fragments (so ``"12"`` stays a string and is still quarantined as ``wrong_type``); any other line
(not JSON, cut by the reader, empty) is left as it is, to be quarantined with its usual reason.

What the rewrite changes: the quarantine's ``raw`` holds the rewritten record, and the keys the
schema does not name are dropped from it, so the build's ``unknown_keys`` count stays empty
(``recpipe etl validate`` reports them from the original lines).
"""

from __future__ import annotations

from typing import Any, Literal

import pyarrow as pa

from etl.build._sql import json_path, schema_keys, sql_str
from schemas import DatasetSchema

__all__ = ["normalize", "normalize_sql"]

Kind = Literal["features", "events"]


def _fragment(path: str) -> str:
    return f"json_extract(line, {sql_str(path)})"


def normalize_sql(schema: DatasetSchema, src: str, *, kind: Kind) -> str:
    """SELECT over ``src`` (:data:`etl.build.inputs.LINE_COLUMNS`) with each JSON-object line
    rewritten to the nested layout under the dataset's names (the other columns unchanged)."""
    rk, sk, uk, tk = schema_keys(schema)
    top = (rk, tk, schema.label_key) if kind == "events" else (rk, sk, uk, tk)
    parts = [f"{sql_str(k)}, {_fragment(json_path(schema.raw_key(k)))}" for k in top]
    if kind == "features":
        parts += [f"{sql_str(k)}, {_fragment(json_path(k))}" for k in schema.passthrough]
    if kind == "features":
        for group, features in (("dense", schema.dense), ("sparse", schema.sparse)):
            if not features:
                continue
            inner = ", ".join(
                f"{sql_str(f.name)}, {_fragment(_feature_path(schema, group, f.name))}"
                for f in features
            )
            parts.append(f"{sql_str(group)}, json_object({inner})")
    obj = f"json_object({', '.join(parts)})::VARCHAR"
    return f"""
SELECT file_id, line_no,
  CASE WHEN too_long IS NULL AND json_valid(line) AND json_type(line) = 'OBJECT' THEN {obj}
       ELSE line END AS line,
  source, source_line, too_long
FROM {src}
"""


def _feature_path(schema: DatasetSchema, group: str, name: str) -> str:
    raw = schema.raw_key(name)
    return json_path(raw) if schema.layout == "flat" else json_path(group, raw)


def normalize(schema: DatasetSchema, lines: pa.Table, *, kind: Kind, con: Any = None) -> pa.Table:
    """``lines`` rewritten by :func:`normalize_sql`; unchanged when ``schema.remapped`` is False.

    Args:
        schema: the dataset schema (its ``layout`` and ``[keys]``).
        lines: numbered lines (:data:`etl.build.inputs.LINE_SCHEMA`).
        kind: ``"features"`` or ``"events"`` (events keep the request id, time and label keys).
        con: a DuckDB connection or cursor to run on (default: a new in-memory one).
    """
    if not schema.remapped or not lines.num_rows:
        return lines
    import duckdb

    cur = con.cursor() if con is not None else duckdb.connect()
    try:
        cur.register("_recpipe_layout_lines", lines)
        out = cur.sql(normalize_sql(schema, "_recpipe_layout_lines", kind=kind)).to_arrow_table()
        return out.cast(lines.schema)
    finally:
        cur.close()
