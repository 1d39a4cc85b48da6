"""recpipe: dataset schemas (feature specs, bundled example schemas, Arrow schemas).

>>> from schemas import default_schema
>>> default_schema().name
'synth'
"""

from __future__ import annotations

from schemas.schema import (
    PASSTHROUGH_COLUMNS,
    RESERVED_NAMES,
    DatasetSchema,
    DenseFeature,
    FeatureKind,
    Layout,
    SparseFeature,
    default_schema,
    default_schema_path,
    load_schema,
    parse_schema,
)

__all__ = [
    "PASSTHROUGH_COLUMNS",
    "RESERVED_NAMES",
    "DatasetSchema",
    "DenseFeature",
    "FeatureKind",
    "Layout",
    "SparseFeature",
    "default_schema",
    "default_schema_path",
    "load_schema",
    "parse_schema",
]
