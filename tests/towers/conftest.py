"""A small clustered dataset for the tower tests (about 2k rows in row groups of 256)."""

from __future__ import annotations

import pytest

from tests.common.data import synthetic_dataset


@pytest.fixture(scope="session")
def towers_dataset(tmp_path_factory):
    return synthetic_dataset(
        tmp_path_factory.mktemp("towers_data"), requests=2000, seed=5, row_group_size=256
    )
