"""The hybrid embedding store (HypeReca + OpenEmbedding): a KV store of embedding rows.

Host rows in chunks behind a collision-free growing id index, a hot set on the accelerator
chosen by a cost model, and a persistent tier on disk with batch-consistent checkpoints and crash
recovery. :class:`StoreEmbeddingBag` plugs it into a model under autograd.

Importing this package does not import torch; the store and the module import it lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recpipe._lazy import lazy_exports
from trainer.store.hotset import (
    CostCoefficients,
    HotPlan,
    choose_hot_rows,
    measure_costs,
    rho_curve,
)
from trainer.store.index import IdIndex
from trainer.store.persist import inspect_store

if TYPE_CHECKING:
    from trainer.store.module import StoreEmbeddingBag
    from trainer.store.store import (
        EmbeddingStore,
        Locations,
        StoreConfig,
        StoreStats,
        init_rows,
        open_store,
    )

__all__ = [
    "CostCoefficients",
    "EmbeddingStore",
    "HotPlan",
    "IdIndex",
    "Locations",
    "StoreConfig",
    "StoreEmbeddingBag",
    "StoreStats",
    "choose_hot_rows",
    "init_rows",
    "inspect_store",
    "measure_costs",
    "open_store",
    "rho_curve",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "trainer.store.store": (
            "EmbeddingStore", "Locations", "StoreConfig", "StoreStats", "init_rows", "open_store",
        ),
        "trainer.store.module": ("StoreEmbeddingBag",),
    },
)  # fmt: skip
