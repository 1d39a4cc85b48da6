"""recpipe: dataset schemas (feature specs, bundled example schemas, Arrow schemas).

>>> from schemas import default_schema
>>> default_schema().name
'synth'
"""

from __future__ import annotations

from schemas.schema import (
    RESERVED_NAMES,
    DatasetSchema,
    DenseFeature,
    FeatureKind,
    SparseFeature,
    default_schema,
    default_schema_path,
    load_schema,
    parse_schema,
)

__all__ = [
    "RESERVED_NAMES",
    "DatasetSchema",
    "DenseFeature",
    "FeatureKind",
    "SparseFeature",
    "default_schema",
    "default_schema_path",
    "load_schema",
    "parse_schema",
]
