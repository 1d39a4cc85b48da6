"""The dense half of a multi-rank model: DDP with summed gradients, batch norm over the global
batch.

Each rank's loss is the sum of its rows' losses divided by the *global* batch size, so the sum
of the ranks' gradients is the gradient of the global batch's mean loss. DDP's default hook
averages (divides by W); :func:`wrap_ddp` registers a hook that sums instead, and the sparse
exchange sums the tables' gradients the same way.

Batch norm normalises with the statistics of the batch it sees; on one rank that is a micro-batch.
:class:`GlobalBatchNorm` all-reduces the sums (differentiably: the backward all-reduces their
gradients), so every rank normalises with the global batch's mean and variance, as one process
does. ``torch.nn.SyncBatchNorm`` would do this on GPUs only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.distributed.comm import Comm

__all__ = ["GlobalBatchNorm", "global_batch_norms", "wrap_ddp"]


class _AllReduceSum(torch.autograd.Function):
    """``y = sum over ranks of x`` on every rank; backward: the same sum of the gradients (the
    loss is the sum of the ranks' losses, each of which depends on y)."""

    @staticmethod
    def forward(ctx, comm, tensor):
        ctx.comm = comm
        return comm.all_reduce(tensor.clone(), what="the batch norm's all-reduce")

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.comm.all_reduce(grad.clone(), what="the batch norm's backward")


def _all_reduce_sum(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """A differentiable sum over ranks."""
    return tensor if comm.world_size == 1 else _AllReduceSum.apply(comm, tensor)


class GlobalBatchNorm(nn.Module):
    """``BatchNorm1d`` whose training statistics are those of the global batch.

    Args:
        num_features: features F of ``[B, F]`` inputs.
        comm: the group the global batch is spread over.
        eps: added to the variance.
        momentum: running-statistics momentum.
    """

    def __init__(
        self, num_features: int, *, comm: Comm, eps: float = 1e-5, momentum: float = 0.1
    ) -> None:
        super().__init__()
        self.comm = comm
        self.eps, self.momentum = eps, momentum
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    @classmethod
    def replacing(cls, norm: nn.BatchNorm1d, comm: Comm) -> GlobalBatchNorm:
        """A global version of ``norm`` (affine-free, its running statistics copied)."""
        if norm.affine or not norm.track_running_stats or norm.momentum is None:
            msg = "GlobalBatchNorm replaces affine-free BatchNorm1d with a momentum only"
            raise ValueError(msg)
        out = cls(norm.num_features, comm=comm, eps=norm.eps, momentum=norm.momentum)
        out.to(norm.running_mean.device, norm.running_mean.dtype)
        with torch.no_grad():
            out.running_mean.copy_(norm.running_mean)
            out.running_var.copy_(norm.running_var)
            out.num_batches_tracked.copy_(norm.num_batches_tracked)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, None, None, False, 0.0,
                                self.eps)  # fmt: skip
        # one all-reduce of the count, the sums and the sums of squares, in float64: partial
        # sums on several ranks round to the same float32 mean and variance as one sum over the
        # whole batch (almost always bitwise), and float64 keeps E[x²] − E[x]² accurate
        wide = x.to(torch.float64)
        count = wide.new_tensor([float(x.shape[0])])
        sums = _all_reduce_sum(self.comm, torch.cat([wide.sum(0), (wide * wide).sum(0), count]))
        features = x.shape[1]
        n = sums[-1].detach()
        mean_wide = sums[:features] / n  # (F,)
        var_wide = (sums[features : 2 * features] / n - mean_wide * mean_wide).clamp(min=0.0)
        mean, var = mean_wide.to(x.dtype), var_wide.to(x.dtype)
        with torch.no_grad():
            m = self.momentum
            unbiased = var_wide * (n / (n - 1)) if n > 1 else var_wide
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased.detach().to(x.dtype), alpha=m)
            self.num_batches_tracked.add_(1)
        centred = x - mean  # (B, F)
        return centred * torch.rsqrt(var + self.eps)


def global_batch_norms(model: nn.Module, comm: Comm) -> int:
    """Replace every affine-free ``BatchNorm1d`` of ``model`` by a :class:`GlobalBatchNorm`.

    Returns:
        how many were replaced.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm1d) and not child.affine:
                setattr(module, child_name, GlobalBatchNorm.replacing(child, comm))
                replaced += 1
        del name
    return replaced


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
