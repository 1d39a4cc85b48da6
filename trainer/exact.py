"""Exact dense gradients and batch norm over the global batch: the dense half of every
training engine, one process or W ranks.

A float32 sum of a dense parameter's gradient over a batch rounds differently from one over a
micro-batch (and torch's own reductions round in an order that depends on the batch's shape):
training turns those last bits into differences of about 1e-6 to 1e-3 between a run in one
process and the same run on W ranks. :class:`ExactDense` (the default of ``recpipe train``, in
one process and on W ranks; ``--fast-dense`` turns it off) makes every dense parameter's
gradient a float64 sum over the rows; the ranks' sums are added in float64 and rounded once, so
one process and W ranks compute the same float32 gradients (see ``docs/distributed.md``).
``nn.Linear`` and ``nn.LayerNorm`` layers get backwards of their own; a parameter used directly
(attention pooling's tokens and biases) is followed through the forward, and where an op
broadcasts it over the rows its gradient is summed in float64 there.

Batch norm normalises with the statistics of the batch it sees; on one rank that is a micro-batch.
:class:`GlobalBatchNorm` sums the statistics in float64 and all-reduces the sums (differentiably:
the backward all-reduces their gradients), so every rank normalises with the global batch's mean
and variance, as one process does. ``torch.nn.SyncBatchNorm`` would do this on GPUs only.

The group is anything with ``rank``, ``world_size`` and ``all_reduce(tensor, what=, op=)``
(:class:`Group`; a multi-rank job's :class:`trainer.distributed.comm.Comm`); ``None`` is one
process.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from trainer.attention import AttentionPooling
from trainer.modules import ParameterTable

__all__ = ["ExactDense", "GlobalBatchNorm", "Group", "global_batch_norms"]


class Group(Protocol):
    """The ranks a global batch is spread over (what these modules need of a process group)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, *, what: str, op: str = "sum") -> torch.Tensor: ...


class _OneProcess:
    """A world of one: nothing to reduce."""

    rank, world_size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, *, what: str, op: str = "sum") -> torch.Tensor:
        return tensor


def _group(comm: Group | None) -> Group:
    return _OneProcess() if comm is None else comm


_log = logging.getLogger(__name__)


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


def _all_reduce_sum(comm: Group, tensor: torch.Tensor) -> torch.Tensor:
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
        self, num_features: int, *, comm: Group | None, eps: float = 1e-5, momentum: float = 0.1
    ) -> None:
        super().__init__()
        self.comm = _group(comm)
        self.eps, self.momentum = eps, momentum
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    @classmethod
    def replacing(cls, norm: nn.BatchNorm1d, comm: Group | None) -> GlobalBatchNorm:
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


def global_batch_norms(model: nn.Module, comm: Group | None) -> int:
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


def _live_rows(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad`` and ``x`` as float64 ``[rows, features]``, without the rows whose gradient is
    zero when the rows are tokens (``[R, T, F]``: attention's padding and, after its last
    layer, every token but the first get none): they would add exact zeros."""
    flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if grad.dim() > 2:
        live = flat_grad.ne(0).any(1).nonzero().squeeze(1)
        if live.numel() < flat_grad.shape[0]:
            flat_grad, flat_x = flat_grad.index_select(0, live), flat_x.index_select(0, live)
    return flat_grad.to(torch.float64), flat_x.to(torch.float64)


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
        wide, rows = _live_rows(grad, x)  # (rows, out), (rows, in)
        ctx.sums.add(weight, wide.t().mm(rows))  # (out, in)
        if ctx.bias is not None:
            ctx.sums.add(ctx.bias, wide.sum(0))  # (out,)
        return grad_x, None, None, None


class _ExactLayerNorm(torch.autograd.Function):
    """``F.layer_norm`` whose backward sums the weight's and the bias's gradients over the rows
    in float64 into ``sums``; the input's gradient is torch's, row by row."""

    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps, sums):
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.shape, ctx.sums = shape, sums
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad, x, ctx.shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        width = weight.numel() if weight is not None else bias.numel()
        wide = grad.reshape(-1, width).to(torch.float64)  # (rows, width)
        if weight is not None:
            normed = (x.to(torch.float64) - mean.to(torch.float64)) * rstd.to(torch.float64)
            ctx.sums.add(weight, (wide * normed.reshape(-1, width)).sum(0).view(weight.shape))
        if bias is not None:
            ctx.sums.add(bias, wide.sum(0).view(bias.shape))
        return grad_x, None, None, None, None, None


class _Tap(torch.autograd.Function):
    """``view(param)`` broadcast to ``shape`` (``view``: the ops between a parameter and the
    tensor an op broadcast); backward: the gradient summed over what was broadcast in float64
    and taken back through ``view`` in float64, into ``sums``. Nothing reaches ``param.grad``."""

    @staticmethod
    def forward(ctx, param, view, shape, sums):
        ctx.param, ctx.view, ctx.sums = param, view, sums
        with torch.no_grad():
            return view(param).expand(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        wide = ctx.param.detach().to(torch.float64).requires_grad_(True)
        with torch.enable_grad():
            seen = ctx.view(wide)
            (sum_,) = torch.autograd.grad(
                seen, wide, grad.to(torch.float64).sum_to_size(seen.shape)
            )
        ctx.sums.add(ctx.param, sum_)
        return None, None, None, None


_View = Callable[[torch.Tensor], torch.Tensor]
# ops that take a parameter to a tensor of its values, which is followed further
_VIEWS = frozenset({
    "__getitem__", "select", "narrow", "view", "reshape", "unsqueeze", "squeeze", "transpose",
    "t", "permute", "flatten", "unflatten", "contiguous",
})  # fmt: skip
# ops that broadcast a tensor: their gradient for it is a sum over the broadcast dimensions
_BROADCASTS = frozenset({
    "add", "sub", "mul", "rsub", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
    "__rmul__",
})  # fmt: skip
_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})


class _FollowParameters(TorchFunctionMode):
    """During a forward: the ops that broadcast a followed parameter (or a view of it) over the
    rows get a :class:`_Tap` in its place; a parameter that reaches any other differentiable op
    is recorded in ``uncovered`` (its gradient stays torch's float32 sum)."""

    def __init__(self, params: dict[int, tuple[str, nn.Parameter]], sums: ExactDense) -> None:
        super().__init__()
        self.params, self.sums = params, sums
        self.uncovered: set[str] = set()
        # id(tensor) -> (a weak reference to it, its parameter, the ops from the parameter)
        self._views: dict[int, tuple[weakref.ref[torch.Tensor], nn.Parameter, _View]] = {}

    def _source(self, value: object) -> tuple[nn.Parameter, _View] | None:
        """The parameter ``value`` is (or is a view of), and the ops from it to ``value``."""
        if not isinstance(value, torch.Tensor):
            return None
        found = self.params.get(id(value))
        if found is not None and found[1] is value:
            return found[1], _identity
        view = self._views.get(id(value))
        if view is not None and view[0]() is value:
            return view[1], view[2]
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sources = {i: s for i, a in enumerate(args) if (s := self._source(a)) is not None}
        sources_by_name = [s for a in kwargs.values() if (s := self._source(a)) is not None]
        if sources_by_name and torch.is_grad_enabled():  # not followed: torch's float32 sums
            self.uncovered.update(self.params[id(p)][0] for p, _ in sources_by_name)
        if not sources or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _VIEWS and list(sources) == [0]:
            out = func(*args, **kwargs)
            param, view = sources[0]
            rest = args[1:]

            def further(t: torch.Tensor) -> torch.Tensor:
                return func(view(t), *rest, **kwargs)

            self._views[id(out)] = (weakref.ref(out), param, further)
            return out
        if name in _EXPANDS and list(sources) == [0]:
            shape = func(args[0].detach(), *args[1:], **kwargs).shape
            return _Tap.apply(*sources[0], shape, self.sums)
        if name in _BROADCASTS:
            shape = torch.broadcast_shapes(
                *(a.shape if isinstance(a, torch.Tensor) else () for a in args)
            )
            args = tuple(
                _Tap.apply(*sources[i], shape, self.sums) if i in sources else a
                for i, a in enumerate(args)
            )
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.uncovered.update(self.params[id(s[0])][0] for s in sources.values())
        return out


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _padded_as_the_global_batch(attention: AttentionPooling, comm: Group):
    """``attention.pool_rows`` that, in training on several ranks, pads a micro-batch to the
    global batch's longest row of every feature, as one process pads the global batch.

    Attention pooling pads a batch to its longest row (per feature), and the second feature's
    tokens follow the first's padding: on a micro-batch of shorter rows they would sit at other
    positions than in the global batch, and attention would sum over its keys in another order.
    Every rank all-reduces its longest rows (max) and runs the layer on one more row of zeros,
    that long, whose output is dropped (it adds exact zeros to every gradient). In evaluation
    (no collective, as :class:`GlobalBatchNorm`) a micro-batch is padded as it is.
    """
    pool_rows = attention.pool_rows

    def pool(seqs):
        if not (attention.training and comm.world_size > 1):
            return pool_rows(seqs)
        longest = torch.tensor(
            [min(int((s.offsets[1:] - s.offsets[:-1]).max()) if s.num_rows else 0,
                 attention.max_len[f]) for f, s in zip(attention.features, seqs, strict=True)]
        )  # fmt: skip
        comm.all_reduce(longest, what="attention pooling's padded lengths", op="max")
        longer = []
        for seq, n in zip(seqs, longest.tolist(), strict=True):
            values = torch.cat([seq.values, seq.values.new_zeros(n, seq.values.shape[1])])
            offsets = torch.cat([seq.offsets, seq.offsets[-1:] + n])
            longer.append(dataclasses.replace(seq, values=values, offsets=offsets))
        return pool_rows(longer)[:-1]  # (R, D)

    return pool


class ExactDense:
    """The dense gradients of W ranks equal to one process's, bit for bit (in place of DDP).

    Every dense parameter's gradient is a float64 sum over the rows: ``nn.Linear`` layers
    compute their weight and bias gradients so (:class:`_ExactLinear`), ``nn.LayerNorm`` layers
    too (:class:`_ExactLayerNorm`), and any other parameter (attention pooling's CLS token,
    feature-type and position embeddings, query and value biases) is followed through the
    forward: where an op broadcasts it (or a slice of it) over the rows, the op gets it already
    broadcast and its gradient is summed over the rows in float64 (:class:`_Tap`). :meth:`reduce`
    adds the sums over the ranks in one float64 all-reduce and rounds them to the parameters'
    dtype once. A float64 sum of a few thousand float32 products is exact to about 1e-16, so
    however the global batch is split the rounded gradient is the same (a different result
    needs a sum within 1e-16 of a rounding boundary). Every other part of the step already is
    the same row by row: the forward and the inputs' gradients (each row's own arithmetic, once
    attention pooling pads a micro-batch as the global batch:
    :func:`_padded_as_the_global_batch`), the batch norms' statistics (:class:`GlobalBatchNorm`, float64
    sums), the tables' gradients (float64 sums in the exchange).

    A parameter that reaches an op other than a view, an expand or a broadcasting add, sub or
    mul keeps its float32 gradient there, widened and summed over the ranks in float64: the same
    on every rank, not bit for bit one process's. Such parameters are listed in :attr:`outside`
    (and logged once) after the first training forward.

    The embedding tables are not dense: a :class:`~trainer.modules.ParameterTable`'s weight
    keeps its own (sparse) gradient, which the table's optimizer sums per row.

    Args:
        model: the model.
        comm: the group the global batch is spread over (``None``: one process).
    """

    def __init__(self, model: nn.Module, comm: Group | None = None) -> None:
        self.comm = _group(comm)
        tables = {id(m.weight) for m in model.modules() if isinstance(m, ParameterTable)}
        self.params = [p for p in model.parameters() if p.requires_grad and id(p) not in tables]
        self._sums: dict[int, torch.Tensor] = {}
        self.linears = self.layer_norms = 0
        covered: set[int] = set(tables)
        for module in model.modules():
            if type(module) is nn.Linear:
                module.forward = self._linear_forward(module)
                self.linears += 1
            elif type(module) is nn.LayerNorm:
                module.forward = self._layer_norm_forward(module)
                self.layer_norms += 1
            else:
                if isinstance(module, AttentionPooling):
                    module.pool_rows = _padded_as_the_global_batch(module, self.comm)
                continue
            covered.update(id(p) for p in module.parameters())
        followed = {id(p): (n, p) for n, p in model.named_parameters()
                    if p.requires_grad and id(p) not in covered}  # fmt: skip
        self.followed = [n for n, _ in followed.values()]
        self.outside: list[str] = []
        self._reported = False
        if followed:
            model.forward = self._following_forward(model.forward, followed)

    def _linear_forward(self, linear: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return _ExactLinear.apply(x, linear.weight, linear.bias, self)

        return forward

    def _layer_norm_forward(self, norm: nn.LayerNorm):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return _ExactLayerNorm.apply(x, norm.normalized_shape, norm.weight, norm.bias,
                                         norm.eps, self)  # fmt: skip

        return forward

    def _following_forward(self, forward, followed: dict[int, tuple[str, nn.Parameter]]):
        def following(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            mode = _FollowParameters(followed, self)
            with mode:
                out = forward(*args, **kwargs)
            if mode.uncovered - set(self.outside):
                self.outside = sorted({*self.outside, *mode.uncovered})
                if self.comm.rank == 0:
                    _log.warning(
                        "exact dense gradients: %d parameters reach ops whose gradient sums "
                        "stay float32 (%s): not bit for bit one process's",
                        len(self.outside), ", ".join(self.outside),
                    )  # fmt: skip
            return out

        return following

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
            if p.grad is not None:  # float32 sums of uses that are not followed
                grad = p.grad.to(torch.float64) if grad is None else grad + p.grad
            if grad is None:
                grad = p.new_zeros(p.shape, dtype=torch.float64)
            parts.append(grad.reshape(-1))
        if not parts:
            return
        flat = torch.cat(parts)
        if self.comm.world_size > 1:
            self.comm.all_reduce(flat, what="the dense gradients' all-reduce")
        for p, chunk in zip(self.params, flat.split([p.numel() for p in self.params]), strict=True):
            p.grad = chunk.view(p.shape).to(p.dtype)
