"""recpipe: deduplicated data pipelines and training for session-centric recommendation logs."""

from __future__ import annotations

from recpipe.errors import (
    CorruptInputError,
    DataError,
    DependencyError,
    RecpipeError,
    SchemaError,
    StoreError,
)

__version__ = "0.1.0"

__all__ = [
    "CorruptInputError",
    "DataError",
    "DependencyError",
    "RecpipeError",
    "SchemaError",
    "StoreError",
    "__version__",
]
