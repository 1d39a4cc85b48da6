"""recpipe: deduplicated data pipelines and training for session-centric recommendation logs.

The tensor types are re-exported lazily (PEP 562) so that importing ``recpipe.errors`` -- which
``etl`` does -- never pulls in torch or numba.
"""

from __future__ import annotations

import importlib
from typing import Any

from recpipe.errors import (
    CorruptInputError,
    DataError,
    DependencyError,
    RecpipeError,
    SchemaError,
    StoreError,
)

__version__ = "0.1.0"

_LAZY = {
    "JaggedTensor": "recpipe.jagged",
    "KeyedJaggedTensor": "recpipe.jagged",
    "InverseKeyedJaggedTensor": "recpipe.ikjt",
    "PartialInverseKeyedJaggedTensor": "recpipe.ikjt",
    "Batch": "recpipe.batch",
}

__all__ = [
    "Batch",
    "CorruptInputError",
    "DataError",
    "DependencyError",
    "InverseKeyedJaggedTensor",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "PartialInverseKeyedJaggedTensor",
    "RecpipeError",
    "SchemaError",
    "StoreError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'recpipe' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(importlib.import_module(module), name)
