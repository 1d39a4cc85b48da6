"""``recpipe etl build`` (RecD O2): raw logs -> validated, session-clustered zstd Parquet.

A build runs these phases; an engine (DuckDB by default, out of core; Polars in memory) moves
the data, and everything that decides a row or a byte is shared (the contract:
``docs/etl-engines.md``):

1. **read** every line of every input (:mod:`etl.build.inputs`): numbered, ``\\n`` or ``\\r\\n``
   line ends, a line longer than ``max_line_bytes`` cut to its first bytes.
2. **validate** each batch of lines (:mod:`etl.build.validate`): bad lines keep their raw text
   and a reason; good lines keep typed, flattened columns (sparse lists truncated).
3. **dedup**: the first record of a ``request_id`` (input order) wins; the others are
   quarantined as ``duplicate_request_id``.
4. **join**: labels are the max over a request's events (0 without one).
5. **sessionize**: the raw ``session_id``, else ``user_id`` split by ``session_gap_ms`` of
   inactivity, else the request alone. Sessions get int64 ids by (first ts, raw key), so ids
   ascend in file order; ``sample_sessions`` keeps a seeded fraction of whole sessions.
6. **count** (:class:`etl.build.output.BuildCounts`): the build fails when a schema feature is
   missing from every valid record (``fail_missing_share``, ``allow_missing_features``).
7. **write** (:mod:`etl.build.output`): the quarantine, then the rows sorted by session and ts,
   cut into row groups at session boundaries (:class:`etl.build.writer.SessionAlignedWriter`,
   encoded on a second thread), then ``_manifest.json`` with each file's size and sha256.

Everything is written into a temporary directory beside ``out_dir`` that replaces it at the
end, with ``_manifest.json`` written last (:mod:`etl.build.driver`).

Parquet settings were chosen by measurement (``python -m etl.build.tune``; figures in
``DEFAULT_SETTINGS_NOTE``, copied into each manifest): zstd level 3 and row groups of 65,536
rows; dictionary encoding is decided per column on the first row group of every build.
"""

from __future__ import annotations

from etl.build.cli import format_summary, register_cli
from etl.build.config import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_ROW_GROUP_SIZE,
    DEFAULT_ZSTD_LEVEL,
    BuildConfig,
)
from etl.build.driver import build

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_ROW_GROUP_SIZE",
    "DEFAULT_ZSTD_LEVEL",
    "BuildConfig",
    "build",
    "format_summary",
    "register_cli",
]
