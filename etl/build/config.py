"""The options of ``etl build`` (:class:`BuildConfig`), the engines by name, the measured defaults."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from etl.rawio import DEFAULT_MAX_LINE_BYTES
from recpipe.errors import DataError

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MIN_ROW_GROUPS",
    "DEFAULT_ROW_GROUP_SIZE",
    "DEFAULT_SETTINGS_NOTE",
    "DEFAULT_ZSTD_LEVEL",
    "ENGINES",
    "MIN_MEMORY_LIMIT",
    "MIN_ROW_GROUP_ROWS",
    "BuildConfig",
    "parse_bytes",
]

#: the smallest ``memory_limit`` a build accepts: DuckDB runs out of memory below it even on a
#: few records
MIN_MEMORY_LIMIT = 32 << 20
#: zstd level: measured on the synthetic data (see DEFAULT_SETTINGS_NOTE).
DEFAULT_ZSTD_LEVEL = 3
#: rows per row group: measured on the synthetic data (see DEFAULT_SETTINGS_NOTE).
DEFAULT_ROW_GROUP_SIZE = 65_536
#: row groups a build aims at when the rows allow (each is a split: a DataLoader worker's,
#: a reader client's or a rank's share), by writing smaller ones than ``row_group_size``
DEFAULT_MIN_ROW_GROUPS = 8
#: the smallest row group a build chooses on its own (an explicit ``row_group_size`` may be
#: smaller)
MIN_ROW_GROUP_ROWS = 64
DEFAULT_SETTINGS_NOTE = (
    "measured with `python -m etl.build.tune` on 200k clustered synthetic rows: zstd level "
    "1/3/6/9/12 -> 12.1/9.0/8.4/7.7/7.8 MB, write 1.5/1.7/2.4/3.2/10.9 s (3 = the knee: -25% "
    "bytes vs 1 for +8% time; beyond it bytes fall <15% for 1.5-6x the time); row groups "
    "8k/16k/32k/64k/128k/256k -> 9.29/9.12/9.03/9.00/8.96/8.94 MB (64k is within 0.7% of 256k "
    "and keeps 16 groups per 1M rows to shuffle); dictionary on all columns 14.8 MB, on none "
    "9.5 MB, on the columns measured per build 9.0 MB"
)

#: engine name -> ``"module:Class"`` implementing :class:`etl.build.engine.Engine`
#: (imported when chosen; see docs/etl-engines.md)
ENGINES: dict[str, str] = {
    "duckdb": "etl.build.engine_duckdb:DuckDBEngine",
    "polars": "etl.build.engine_polars:PolarsEngine",
    "spark": "etl.build.engine_spark:SparkEngine",
}

_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KIB|MB|MIB|GB|GIB|TB|TIB)?\s*$", re.I)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "KIB": 2**10,
    "MB": 10**6,
    "MIB": 2**20,
    "GB": 10**9,
    "GIB": 2**30,
    "TB": 10**12,
    "TIB": 2**40,
}


def parse_bytes(text: str, *, name: str, unit: bool = False) -> int:
    """``"512MB"``, ``"64MiB"``, ``"1000"`` (with ``unit``: a unit is required) -> bytes.

    Raises:
        DataError: naming the option ``name``, when ``text`` is not a size.
    """
    m = _BYTES_RE.match(str(text))
    if not m or (unit and not m.group(2)):
        form = "'512MB' or '4GB'" if unit else "'512MB', '64MiB' or a byte count"
        raise DataError(f"`{name}` must look like {form}, got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


@dataclass
class BuildConfig:
    """Options of :func:`etl.build.build`.

    Attributes:
        memory_limit: DuckDB memory limit, e.g. ``"512MB"`` (None: DuckDB's default, 80% RAM).
        spill_dir: where DuckDB spills (None: a folder inside the temporary output directory).
        threads: DuckDB threads (None: all cores).
        session_gap_ms: inactivity gap that splits a user's records into sessions when they
            carry no ``session_id``.
        sample_sessions: keep this fraction of sessions (whole sessions, seeded by ``seed``).
        zstd_level: zstd compression level of the Parquet files, 1..22 (the default was
            measured on synthetic data).
        row_group_size: the most rows per row group (cut at session boundaries; the default
            was measured): the target, unless the dataset is too small to fill
            ``min_row_groups`` groups of it, which then get smaller ones (:meth:`row_group_rows`).
        min_row_groups: row groups to aim at: with fewer rows than this many full groups of
            ``row_group_size``, row groups get ceil(rows / min_row_groups) rows (at least
            :data:`MIN_ROW_GROUP_ROWS` = 64), so that a small dataset still has enough splits
            for workers, clients and ranks (1: one group when the rows fit in
            ``row_group_size``).
        order: ``"session"`` (clustered) or ``"time"`` (the pre-RecD baseline: rows by ts only).
        engine: ``"duckdb"`` (out of core) or ``"polars"`` (in memory, the same dataset,
            quarantine and counts; refuses ``memory_limit``, ``spill_dir`` and ``threads``) or
            ``"spark"`` (a Spark job, local or on a cluster, see ``master``: the same dataset,
            quarantine and counts; refuses the same three); the names of :data:`ENGINES`.
        seed: seed of ``sample_sessions``.
        partition_by: ``"none"`` or ``"hour"`` (``dt=YYYY-MM-DD-HH/`` folders, by the session's
            first ts in session order, by the row's ts in time order).
        max_file_bytes: a part file is closed once it passes this size.
        dictionary: ``"auto"`` (measured per column on the first row group), ``"all"`` or
            ``"none"``.
        max_line_bytes: a longer input line is quarantined as ``line_too_long`` (its first
            1 KB kept), never read whole; on the command line a size such as ``16MB``
            (default 64MiB).
        fail_missing_share: the build fails when a schema feature is missing (absent or null)
            from at least this share of the valid records (1.0: only from every one of them).
        allow_missing_features: never fail for missing features (they are still counted and
            reported).
        master: the Spark master URL of engine ``"spark"`` (None: the active session, else
            ``local[*]``), e.g. ``"spark://host:7077"``; the inputs and the output must be on a
            filesystem every executor sees under the same path.
        spark_partitions: partitions of the Spark engine's shuffles and final sort (None: the
            session's default parallelism); the output does not depend on it.
    """

    memory_limit: str | None = None
    spill_dir: Path | None = None
    threads: int | None = None
    session_gap_ms: int = 30 * 60 * 1000
    sample_sessions: float = 1.0
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE
    min_row_groups: int = DEFAULT_MIN_ROW_GROUPS
    order: Literal["session", "time"] = "session"
    engine: Literal["duckdb", "polars", "spark"] = "duckdb"
    seed: int = 0
    partition_by: Literal["none", "hour"] = "none"
    max_file_bytes: int = 256 << 20
    dictionary: Literal["auto", "all", "none"] = "auto"
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    fail_missing_share: float = 1.0
    allow_missing_features: bool = False
    master: str | None = None
    spark_partitions: int | None = None

    def __post_init__(self) -> None:
        if self.memory_limit is not None:
            limit = parse_bytes(self.memory_limit, name="memory_limit", unit=True)
            if limit < MIN_MEMORY_LIMIT:
                raise DataError(
                    f"`memory_limit` must be at least {MIN_MEMORY_LIMIT >> 20}MiB (DuckDB needs "
                    f"that much to run a build), got {self.memory_limit!r}"
                )
        if self.spill_dir is not None:
            self.spill_dir = Path(self.spill_dir)
        self._check_positive("threads", self.threads, optional=True)
        self._check_positive("session_gap_ms", self.session_gap_ms)
        if not 0.0 < float(self.sample_sessions) <= 1.0:
            raise DataError(f"`sample_sessions` must be in (0, 1], got {self.sample_sessions!r}")
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise DataError(f"`zstd_level` must be an integer in 1..22, got {self.zstd_level!r}")
        self._check_positive("row_group_size", self.row_group_size)
        self._check_positive("min_row_groups", self.min_row_groups)
        self._check_choice("order", ("session", "time"))
        self._check_choice("engine", tuple(ENGINES))
        self._check_choice("partition_by", ("none", "hour"))
        self._check_choice("dictionary", ("auto", "all", "none"))
        self._check_positive("max_file_bytes", self.max_file_bytes)
        self._check_positive("max_line_bytes", self.max_line_bytes)
        self._check_positive("spark_partitions", self.spark_partitions, optional=True)
        for name in ("master", "spark_partitions"):
            if getattr(self, name) is not None and self.engine != "spark":
                raise DataError(
                    f"`{name}` is an option of engine 'spark', got {getattr(self, name)!r} "
                    f"with engine {self.engine!r}"
                )
        if not 0.0 < float(self.fail_missing_share) <= 1.0:
            raise DataError(
                f"`fail_missing_share` must be in (0, 1], got {self.fail_missing_share!r}"
            )

    @staticmethod
    def _check_positive(name: str, value: Any, *, optional: bool = False) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"`{name}` must be a positive integer, got {value!r}")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
            raise DataError(f"`{name}` must be {listed}, got {getattr(self, name)!r}")

    def row_group_rows(self, rows: int) -> int:
        """Rows per row group for a dataset of ``rows`` rows: ``row_group_size``, lowered to
        ``ceil(rows / min_row_groups)`` (but not below :data:`MIN_ROW_GROUP_ROWS`) when the
        dataset is too small to fill ``min_row_groups`` groups; never above ``row_group_size``.

        >>> BuildConfig().row_group_rows(20_000), BuildConfig().row_group_rows(10**6)
        (2500, 65536)
        >>> BuildConfig(row_group_size=100).row_group_rows(10_000), BuildConfig().row_group_rows(100)
        (100, 64)
        """
        want = -(-int(rows) // self.min_row_groups)
        floor = min(self.row_group_size, MIN_ROW_GROUP_ROWS)
        return max(floor, min(self.row_group_size, want))

    @property
    def memory_bytes(self) -> int | None:
        """``memory_limit`` in bytes (None without a limit)."""
        if self.memory_limit is None:
            return None
        return parse_bytes(self.memory_limit, name="memory_limit")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the options."""
        d = asdict(self)
        d["spill_dir"] = str(self.spill_dir) if self.spill_dir is not None else None
        return d
