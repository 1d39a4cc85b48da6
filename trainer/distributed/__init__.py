"""Training on several processes and machines: ``torchrun`` launches, ``torch.distributed``
moves the data (gloo on CPU, NCCL on CUDA).

* :mod:`trainer.distributed.comm`: process groups, collectives that fail with a clear error.
* :mod:`trainer.distributed.exchange`: HypeReca's 2FP embedding exchange (hot rows replicated
  and all-reduced, the rest sharded by owner and exchanged by all-to-all).
* :mod:`trainer.distributed.costs`: the hot-set cost model, fitted on the job's own group.
* :mod:`trainer.distributed.dense`: DDP with summed gradients, batch norm over the global batch.
* :mod:`trainer.distributed.trainer`: one rank's model, optimizers and step.
* :mod:`trainer.distributed.batches`: global batches in one process (the reference).
* :mod:`trainer.distributed.settings`: the ranks' settings and dataset, compared at start-up.

See ``docs/distributed.md`` for the protocol and the checkpoint layout. Importing this package
does not import torch.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "Comm",
    "CostFit",
    "DistributedError",
    "DistributedTrainer",
    "ExchangeStats",
    "GlobalBatchNorm",
    "HotCandidates",
    "RowShard",
    "ShardedEmbeddings",
    "ShardedTable",
    "SparseOptimizer",
    "choose_num_hot",
    "concat_batches",
    "fit_costs",
    "global_batches",
    "owner_of",
    "sharded_table_factory",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "trainer.distributed.comm": ("Comm", "DistributedError"),
        "trainer.distributed.costs": ("CostFit", "choose_num_hot", "fit_costs"),
        "trainer.distributed.dense": ("GlobalBatchNorm",),
        "trainer.distributed.exchange": (
            "ExchangeStats", "HotCandidates", "ShardedEmbeddings", "ShardedTable",
        ),
        "trainer.distributed.shard": ("RowShard", "SparseOptimizer", "owner_of"),
        "trainer.distributed.trainer": ("DistributedTrainer", "sharded_table_factory"),
        "trainer.distributed.batches": ("concat_batches", "global_batches"),
    },
)  # fmt: skip
