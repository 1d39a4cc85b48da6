"""The dense half of a multi-rank model: DDP with summed gradients, or exact dense gradients
(:mod:`trainer.exact`, the default), and batch norm over the global batch.

Each rank's loss is the sum of its rows' losses divided by the *global* batch size, so the sum
of the ranks' gradients is the gradient of the global batch's mean loss. DDP's default hook
averages (divides by W); :func:`wrap_ddp` registers a hook that sums instead, and the sparse
exchange sums the tables' gradients the same way. DDP adds float32 partial sums, so its dense
gradients differ from one process's in the last bits (``--fast-dense``); :class:`ExactDense`
does not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.distributed.comm import Comm
from trainer.exact import ExactDense, GlobalBatchNorm, global_batch_norms

__all__ = ["ExactDense", "GlobalBatchNorm", "global_batch_norms", "wrap_ddp"]


def _sum_hook(group, bucket):  # unannotated: DDP checks the annotations' objects, not strings
    """DDP communication hook: sum the bucket over ranks (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: nn.Module, comm: Comm, *, device: torch.device) -> nn.Module:
    """``model`` under DDP on ``comm.dense_group`` with summed gradients (world size 1: as is).

    Buffers are not broadcast each step: the global batch norms keep them equal on every rank.
    """
    if comm.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(
        model, device_ids=ids, forward_sync_buffers=False, process_group=comm.dense_group
    )
    ddp.register_comm_hook(comm.dense_group, _sum_hook)
    return ddp
