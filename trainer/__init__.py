"""recpipe trainer: dedup-aware modules, models, the training loop and the embedding store.

``EmbeddingBagCollection`` and ``EmbeddingCollection`` are TorchRec's (same configs, same outputs)
with deduplicated inputs added (:mod:`trainer.torchrec`; they need TorchRec installed); the
DLRM's own collections, on recpipe's :class:`TableConfig`, are ``PooledEmbeddings`` and
``SequenceEmbeddings``. Names are re-exported lazily (PEP 562) so that ``recpipe --help`` does
not import torch.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "DLRM",
    "AttentionPooling",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "JaggedEmbeddings",
    "ModelConfig",
    "ParameterTable",
    "PooledEmbeddings",
    "SequenceEmbeddings",
    "TableConfig",
    "TrainConfig",
    "Trainer",
    "train",
]

_WHERE = {
    "trainer.config": ("ModelConfig", "TableConfig", "TrainConfig"),
    "trainer.attention": ("AttentionPooling",),
    "trainer.modules": (
        "JaggedEmbeddings", "ParameterTable", "PooledEmbeddings",
        "SequenceEmbeddings",
    ),
    "trainer.torchrec": ("EmbeddingBagCollection", "EmbeddingCollection"),
    "trainer.models": ("DLRM",),
    "trainer.train": ("Trainer", "train"),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
