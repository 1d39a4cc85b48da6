"""recpipe trainer: dedup-aware modules, models, the training loop and the embedding store.

Names are re-exported lazily (PEP 562) so that ``recpipe --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "trainer.modules": (
        "AttentionPooling", "EmbeddingBagCollection", "JaggedEmbeddings", "ParameterTable",
        "SequenceEmbeddingCollection", "TableConfig",
    ),
    "trainer.models": ("DLRM", "ModelConfig"),
    "trainer.train": ("TrainConfig", "Trainer", "train"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        msg = f"module 'trainer' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
