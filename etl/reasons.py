"""Quarantine reasons: the stable strings shared by the synthetic-log injector and the build.

Every record the build rejects lands in ``_quarantine/`` with exactly one of these reasons (the
first problem found, in the order below), and the manifest counts them per reason.
"""

from __future__ import annotations

__all__ = [
    "DUPLICATE_REQUEST_ID",
    "ID_OUT_OF_RANGE",
    "LINE_TOO_LONG",
    "LIST_TOO_LONG",
    "MALFORMED_JSON",
    "MISSING_REQUEST_ID",
    "MISSING_TS",
    "NON_FINITE",
    "QUARANTINE_REASONS",
    "TS_OUT_OF_RANGE",
    "WRONG_TYPE",
]

LINE_TOO_LONG = "line_too_long"
"""The line is longer than the build's ``max_line_bytes`` (default 64 MiB): its ``raw`` holds
only the first ``etl.rawio.LONG_LINE_PREFIX`` bytes and its ``detail`` the line's length."""
MALFORMED_JSON = "malformed_json"
"""The line is not valid JSON (or not valid UTF-8 text), e.g. a line cut short."""
MISSING_REQUEST_ID = "missing_request_id"
"""The record has no ``request_id`` (or it is ``null``), or the line is not a JSON object."""
MISSING_TS = "missing_ts"
"""The record has no ``ts`` (or it is ``null``)."""
WRONG_TYPE = "wrong_type"
"""A field has the wrong JSON type: ``ts`` not an integer, a dense value not a number, ..."""
TS_OUT_OF_RANGE = "ts_out_of_range"
"""``ts`` is an int64 outside the timestamps DuckDB can name (about 290,000 BC .. 294,000 AD:
``etl.build.validate.TS_RANGE``); such a ts cannot be an hour partition, or any time."""
NON_FINITE = "non_finite"
"""A number is NaN or +-Infinity (or overflows float32: a dense feature, an event's label)."""
ID_OUT_OF_RANGE = "id_out_of_range"
"""A sparse id is an integer outside int64."""
LIST_TOO_LONG = "list_too_long"
"""A sparse list is longer than the schema's ``max_len`` for a feature with ``truncate = false``."""
DUPLICATE_REQUEST_ID = "duplicate_request_id"
"""A second (third, ...) record with a ``request_id`` already seen; the first in file order wins."""

QUARANTINE_REASONS: tuple[str, ...] = (
    LINE_TOO_LONG,
    MALFORMED_JSON,
    MISSING_REQUEST_ID,
    MISSING_TS,
    WRONG_TYPE,
    TS_OUT_OF_RANGE,
    NON_FINITE,
    ID_OUT_OF_RANGE,
    LIST_TOO_LONG,
    DUPLICATE_REQUEST_ID,
)
