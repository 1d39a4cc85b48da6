"""recpipe readers: Parquet -> session-packed batches -> KJT/IKJT -> preprocessing -> DataLoader.

The public names are re-exported lazily (PEP 562), so that ``recpipe --help`` and the reader
service's command-line parsing do not import torch.

>>> from readers import ReaderConfig
>>> ReaderConfig(batch_size=8).last_batch
'partial'
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "BatchConverter",
    "Bucketize",
    "Clamp",
    "DatasetSource",
    "DenseTransform",
    "FillMissing",
    "HashModulo",
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
    "SourcePosition",
    "SparseTransform",
    "Split",
    "StatefulLoader",
    "Transform",
    "Truncate",
    "VocabLookup",
    "dataset_schema",
    "group_name",
    "iter_batches",
    "make_dataloader",
    "plan_splits",
    "register_transform",
    "to_batch",
]

_WHERE = {
    "readers.source": ("DatasetSource", "ReaderConfig", "SourcePosition", "Split", "plan_splits"),
    "readers.convert": ("BatchConverter", "group_name", "to_batch"),
    "readers.transforms": (
        "Bucketize", "Clamp", "DenseTransform", "FillMissing", "HashModulo", "Log1p", "Normalize",
        "Pipeline", "SparseTransform", "Transform", "Truncate", "VocabLookup", "register_transform",
    ),
    "readers.dataset": (
        "ParquetBatchDataset", "ReaderPosition", "StatefulLoader", "dataset_schema",
        "iter_batches", "make_dataloader",
    ),
    "readers.service": ("ReaderServer", "ServiceClient", "ServiceConfig", "ServiceDataset"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        msg = f"module 'readers' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
