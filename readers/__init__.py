"""recpipe readers: Parquet -> session-packed batches -> KJT/IKJT -> preprocessing -> DataLoader.

The public names are re-exported lazily (PEP 562), so that ``recpipe --help`` and the reader
service's command-line parsing do not import torch.

>>> from readers import ReaderConfig
>>> ReaderConfig(batch_size=8).last_batch
'partial'
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "NULL_KEY",
    "BatchConverter",
    "Bucketize",
    "Clamp",
    "DatasetSource",
    "DenseTransform",
    "FillMissing",
    "HashModulo",
    "Holdout",
    "Log1p",
    "Normalize",
    "ParquetBatchDataset",
    "Pipeline",
    "ReaderConfig",
    "ReaderPosition",
    "ReaderServer",
    "ServiceClient",
    "ServiceConfig",
    "ServiceDataset",
    "ServiceStream",
    "SourcePosition",
    "SparseTransform",
    "Split",
    "StatefulLoader",
    "Transform",
    "Truncate",
    "VocabLookup",
    "dataset_schema",
    "group_name",
    "holdout_splits",
    "iter_batches",
    "make_dataloader",
    "plan_splits",
    "register_transform",
    "string_key",
    "string_keys",
    "to_batch",
]

_WHERE = {
    "readers.source": ("DatasetSource", "ReaderConfig", "SourcePosition", "Split", "plan_splits"),
    "readers.convert": ("BatchConverter", "group_name", "to_batch"),
    "readers.transforms": (
        "Bucketize", "Clamp", "DenseTransform", "FillMissing", "HashModulo", "Log1p", "Normalize",
        "SparseTransform", "Transform", "Truncate", "VocabLookup", "register_transform",
    ),
    "readers.pipeline": ("Pipeline",),
    "readers.dataset": (
        "ParquetBatchDataset", "ReaderPosition", "StatefulLoader", "dataset_schema",
        "iter_batches", "make_dataloader",
    ),
    "readers.holdout": ("Holdout", "holdout_splits"),
    "readers.extras": ("NULL_KEY", "string_key", "string_keys"),
    "readers.service": (
        "ReaderServer", "ServiceClient", "ServiceConfig", "ServiceDataset", "ServiceStream",
    ),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
