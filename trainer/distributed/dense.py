"""The dense half of a multi-rank model: DDP with summed gradients, batch norm over the global
batch.

Each rank's loss is the sum of its rows' losses divided by the *global* batch size, so the sum
of the ranks' gradients is the gradient of the global batch's mean loss. DDP's default hook
averages (divides by W); :func:`wrap_ddp` registers a hook that sums instead, and the sparse
exchange sums the tables' gradients the same way.

DDP adds float32 partial sums: the dense gradients then differ from one process's in the last
bits (a float32 sum over a micro-batch rounds differently from one over the whole batch), and
training turns those bits into differences of about 1e-6 to 1e-5. :class:`ExactDense`
(``--exact-dense``) replaces DDP for models whose parameters are those of ``nn.Linear``
layers: it sums their gradients over the rows in float64, adds the ranks' sums in float64 and
rounds once, so W ranks compute the float32 gradients one process computes (see
``docs/distributed.md``).

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
from torch.autograd.function import once_differentiable

from trainer.distributed.comm import Comm

__all__ = ["ExactDense", "GlobalBatchNorm", "global_batch_norms", "wrap_ddp"]


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


class _ExactLinear(torch.autograd.Function):
    """``F.linear`` whose backward sums the weight's and the bias's gradients over the rows in
    float64 into ``sums`` instead of ``.grad``. The input's gradient is torch's float32 product,
    the same row by row whatever the batch holds."""

    @staticmethod
    def forward(ctx, x, weight, bias, sums):
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.sums = bias, sums
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        wide = grad.reshape(-1, grad.shape[-1]).to(torch.float64)  # (rows, out)
        rows = x.reshape(-1, x.shape[-1]).to(torch.float64)  # (rows, in)
        ctx.sums.add(weight, wide.t().mm(rows))  # (out, in)
        if ctx.bias is not None:
            ctx.sums.add(ctx.bias, wide.sum(0))  # (out,)
        return grad_x, None, None, None


class ExactDense:
    """The dense gradients of W ranks equal to one process's, bit for bit (in place of DDP).

    Every ``nn.Linear`` of ``model`` computes its weight and bias gradients as float64 sums over
    the rows of its input (:class:`_ExactLinear`); :meth:`reduce` adds them over the ranks in
    one float64 all-reduce and rounds them to the parameters' dtype once. A float64 sum of a
    few thousand float32 products is exact to about 1e-16, so however the global batch is split
    the rounded gradient is the same (a different result needs a sum within 1e-16 of a rounding
    boundary). Every other part of the step already is the same row by row: the forward and
    the inputs' gradients (products of one row with the weights), the batch norms' statistics
    (:class:`GlobalBatchNorm`, float64 sums), the tables' gradients (float64 sums in the
    exchange).

    Parameters that are not a ``nn.Linear``'s (attention pooling's tokens and layer norms)
    keep their float32 gradients, widened and summed over the ranks in float64: the same on
    every rank, not bit for bit one process's.

    Args:
        model: the dense model (its tables hold no ``nn.Parameter``).
        comm: the group the global batch is spread over.
    """

    def __init__(self, model: nn.Module, comm: Comm) -> None:
        self.comm = comm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._sums: dict[int, torch.Tensor] = {}
        self.linears = 0
        covered: set[int] = set()
        for module in model.modules():
            if type(module) is nn.Linear:
                module.forward = self._forward_of(module)
                self.linears += 1
                covered.update(id(p) for p in module.parameters())
        # parameters whose gradients stay float32 sums (not bit for bit one process's)
        self.outside = [n for n, p in model.named_parameters() if p.requires_grad
                        and id(p) not in covered]  # fmt: skip

    def _forward_of(self, linear: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return _ExactLinear.apply(x, linear.weight, linear.bias, self)

        return forward

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a float64 gradient sum of ``param`` (called by the backward)."""
        have = self._sums.get(id(param))
        self._sums[id(param)] = grad if have is None else have + grad

    def reduce(self) -> None:
        """Sum every parameter's gradient over the ranks in float64 and set ``.grad`` to it,
        rounded once (collective; after ``backward``)."""
        parts = []
        for p in self.params:
            grad = self._sums.pop(id(p), None)
            if grad is None:
                grad = (
                    p.grad.to(torch.float64)
                    if p.grad is not None
                    else p.new_zeros(p.shape, dtype=torch.float64)
                )
            parts.append(grad.reshape(-1))
        if not parts:
            return
        flat = torch.cat(parts)
        if self.comm.world_size > 1:
            self.comm.all_reduce(flat, what="the dense gradients' all-reduce")
        for p, chunk in zip(self.params, flat.split([p.numel() for p in self.params]), strict=True):
            p.grad = chunk.view(p.shape).to(p.dtype)


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
