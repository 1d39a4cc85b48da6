"""recpipe: deduplicated data pipelines and training for session-centric recommendation logs.

The tensor types are re-exported lazily (PEP 562) so that importing ``recpipe.errors`` -- which
``etl`` does -- never pulls in torch or numba.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports
from recpipe.errors import (
    CorruptInputError,
    DataError,
    DependencyError,
    RecpipeError,
    SchemaError,
    StoreError,
)

__version__ = "0.1.0"

_WHERE = {
    "recpipe.jagged": ("JaggedTensor", "KeyedJaggedTensor"),
    "recpipe.ikjt": ("InverseKeyedJaggedTensor", "PartialInverseKeyedJaggedTensor"),
    "recpipe.batch": ("Batch",),
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


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
