"""recpipe trainer: dedup-aware modules, models, the training loop and the embedding store.

Names are re-exported lazily (PEP 562) so that ``recpipe --help`` does not import torch.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "DLRM",
    "AttentionPooling",
    "EmbeddingBagCollection",
    "JaggedEmbeddings",
    "ModelConfig",
    "ParameterTable",
    "SequenceEmbeddingCollection",
    "TableConfig",
    "TrainConfig",
    "Trainer",
    "train",
]

_WHERE = {
    "trainer.config": ("ModelConfig", "TableConfig", "TrainConfig"),
    "trainer.modules": (
        "AttentionPooling", "EmbeddingBagCollection", "JaggedEmbeddings", "ParameterTable",
        "SequenceEmbeddingCollection",
    ),
    "trainer.models": ("DLRM",),
    "trainer.train": ("Trainer", "train"),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
