"""The hybrid embedding store (HypeReca + OpenEmbedding): a KV store of embedding rows.

Host rows in chunks behind a collision-free growing id index, a hot set on the accelerator
chosen by a cost model, and a persistent tier on disk with batch-consistent checkpoints and crash
recovery. :class:`StoreEmbeddingBag` plugs it into a model under autograd, and
:class:`StoreTable` into the trainer's models as a table backend.

Modules, each importing only those above it::

    config     StoreConfig, Locations, StoreStats (value types)
    _kernels   the Numba kernels; index: the id index; persist: the on-disk format
    home       rows.bin, the copy state of each row, the commit records
    recovery   opening a store: its last commit, checked; verify_store (read-only)
    cache      the host slab, LRU, pins
    hotset     the hot set and its cost model
    writer     the checkpoint writer thread and copy-on-write pool; checkpoints: several
               stores committing one step together
    store      EmbeddingStore, the facade over the parts above; open_store
    module     StoreEmbeddingBag; table: StoreTable; cli: `recpipe store`

Importing this package does not import torch; the store and the modules import it lazily.
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
from trainer.store.recovery import verify_store

if TYPE_CHECKING:
    from trainer.store.config import Locations, StoreConfig, StoreStats
    from trainer.store.module import StoreEmbeddingBag
    from trainer.store.store import EmbeddingStore, init_rows, open_store
    from trainer.store.table import StoreTable

__all__ = [
    "CostCoefficients",
    "EmbeddingStore",
    "HotPlan",
    "IdIndex",
    "Locations",
    "StoreConfig",
    "StoreEmbeddingBag",
    "StoreStats",
    "StoreTable",
    "choose_hot_rows",
    "init_rows",
    "inspect_store",
    "measure_costs",
    "open_store",
    "rho_curve",
    "verify_store",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "trainer.store.config": ("Locations", "StoreConfig", "StoreStats"),
        "trainer.store.store": ("EmbeddingStore", "init_rows", "open_store"),
        "trainer.store.module": ("StoreEmbeddingBag",),
        "trainer.store.table": ("StoreTable",),
    },
)
