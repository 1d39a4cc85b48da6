"""Equality of Arrow tables as the readers deliver them (NaN equal to NaN)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["tables_equal"]


def tables_equal(a: pa.Table, b: pa.Table) -> bool:
    """Equal schemas and columns, NaN equal to NaN."""
    if a.schema != b.schema or a.num_rows != b.num_rows:
        return False
    for name in a.column_names:
        x, y = a.column(name), b.column(name)
        if pa.types.is_floating(x.type):
            if not np.array_equal(x.to_numpy(), y.to_numpy(), equal_nan=True):
                return False
        elif not x.equals(y):
            return False
    return True
