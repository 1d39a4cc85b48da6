"""The project's exception hierarchy.

Every error recpipe raises on purpose derives from :class:`RecpipeError`, so callers can catch
"anything recpipe refused" in one clause. Messages name the argument (in backticks) or, for bad
input data, the file, the row and the field, and quote the offending value.
"""

from __future__ import annotations

__all__ = [
    "CorruptInputError",
    "DataError",
    "DependencyError",
    "RecpipeError",
    "SchemaError",
    "StoreError",
]


class RecpipeError(Exception):
    """Base class of every error raised by recpipe."""


class SchemaError(RecpipeError, ValueError):
    """A dataset schema (TOML) is invalid: unknown keys, duplicate names, bad values."""


class DataError(RecpipeError, ValueError):
    """Input data does not match its contract (wrong column type, missing column, ...)."""


class CorruptInputError(DataError):
    """An input file cannot be decoded at all (truncated zstd frame, not Parquet, ...)."""


class DependencyError(RecpipeError, ImportError):
    """An optional dependency is missing; the message says how to install it."""


class StoreError(RecpipeError):
    """The embedding store is inconsistent, corrupted, or used incorrectly."""
