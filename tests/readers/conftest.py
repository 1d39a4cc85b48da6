"""Hand-made clustered datasets for the reader tests (small, exact, independent of the ETL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.data import corrupt_column, session_table, write_clustered
from tests.common.schemas import TINY_SCHEMA


@pytest.fixture(scope="session")
def tiny_schema():
    """A 2-dense, 5-sparse schema with two dedup groups and two plain features."""
    from schemas import parse_schema

    return parse_schema(TINY_SCHEMA, source="tiny.toml")


@pytest.fixture(scope="session")
def make_table(tiny_schema):
    """Factory: ``session_table`` over the tiny schema."""
    return lambda **kw: session_table(tiny_schema, **kw)


@pytest.fixture
def make_dataset(tmp_path, tiny_schema):
    """Factory: a clustered dataset directory of ``files`` files with small row groups."""

    def make(
        *,
        num_sessions: int = 60,
        files: int = 2,
        row_group_rows: int = 40,
        seed: int = 0,
        name: str = "ds",
        partitions: bool = False,
    ) -> Path:
        root = tmp_path / name
        per_file = -(-num_sessions // files)
        for f in range(files):
            count = min(per_file, num_sessions - f * per_file)
            table = session_table(
                tiny_schema, num_sessions=count, seed=seed * 1000 + f, first_session=f * per_file
            )
            folder = root / f"dt=2024-01-01-{f:02d}" if partitions else root
            write_clustered(table, folder / f"part-{f:05d}.parquet", row_group_rows=row_group_rows)
        (root / "_quarantine").mkdir(parents=True, exist_ok=True)
        return root

    return make


@pytest.fixture(name="corrupt_column")
def corrupt_column_fixture():
    """The :func:`corrupt_column` helper."""
    return corrupt_column
