"""A small clustered dataset for the tower tests (about 2k rows in row groups of 256).

Built with the bundled schema less its partial feature `user_recent_items`: 12 sparse features,
which two towers (and tower modules compressing 2x, 3x, 4x) split evenly."""

from __future__ import annotations

import pytest

from tests.common.data import synthetic_dataset


@pytest.fixture(scope="session")
def towers_dataset(tmp_path_factory):
    import dataclasses

    from schemas import default_schema

    schema = default_schema()
    schema = dataclasses.replace(
        schema,
        sparse=tuple(f for f in schema.sparse if f.name != "user_recent_items"),
        dedup_partial=(),
    )
    return synthetic_dataset(
        tmp_path_factory.mktemp("towers_data"), requests=2000, seed=5, row_group_size=256,
        schema=schema,
    )  # fmt: skip
