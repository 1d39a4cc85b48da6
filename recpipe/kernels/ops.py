"""The public kernels: argument checks, one dispatcher per op, and the autograd wrappers.

Every op takes torch tensors and returns torch tensors on the same device; the form that runs is
chosen by ``tensor.device.type`` through :func:`recpipe.kernels.registry.get_kernel`. Checks here
are O(1) (dtypes, shapes and, on CPU, the two ends of ``offsets``): offsets are trusted to be
non-decreasing, which is what every recpipe constructor produces.

Jagged layout used throughout (``offsets[0] == 0``, ``offsets[-1] == len(values)``)::

    lists     [[a, b], [], [c, d, e]]
    values    [a, b, c, d, e]          # [N] or [N, D]
    offsets   [0, 2, 2, 5]             # [B + 1] int64
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from torch.autograd.function import once_differentiable

from recpipe.errors import DataError
from recpipe.kernels.registry import get_kernel

__all__ = [
    "ReduceMode",
    "dedup_rows",
    "jagged_index_add",
    "jagged_index_select",
    "partial_dedup",
    "segment_reduce",
]

ReduceMode = Literal["sum", "mean", "max"]
Pair = tuple[torch.Tensor, torch.Tensor]
_ID_DTYPES = (torch.int32, torch.int64)
_REDUCE_MODES = ("sum", "mean", "max")


# --------------------------------------------------------------------------------------------
# checks


def _check_offsets(offsets: torch.Tensor, name: str) -> None:
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
        got = (
            f"{offsets.dtype} of shape {tuple(offsets.shape)}"
            if isinstance(offsets, torch.Tensor)
            else type(offsets).__name__
        )
        msg = f"`{name}` must be a 1-d int64 tensor of B + 1 offsets, got {got}"
        raise DataError(msg)
    if offsets.shape[0] == 0:
        msg = f"`{name}` must hold at least one offset (B + 1 >= 1), got an empty tensor"
        raise DataError(msg)


def _check_jagged(values: torch.Tensor, offsets: torch.Tensor, vname: str, oname: str) -> None:
    _check_offsets(offsets, oname)
    if not isinstance(values, torch.Tensor) or values.dim() == 0:
        msg = f"`{vname}` must be a tensor of shape [N] or [N, ...]"
        raise DataError(msg)
    if values.device != offsets.device:
        msg = f"`{vname}` is on {values.device} but `{oname}` is on {offsets.device}"
        raise DataError(msg)
    if offsets.device.type == "cpu":  # reading the ends on a GPU would synchronise
        first, last = int(offsets[0]), int(offsets[-1])
        if first != 0 or last != values.shape[0]:
            msg = (
                f"`{oname}` must run from 0 to len(`{vname}`) = {values.shape[0]}, "
                f"got {first} .. {last}"
            )
            raise DataError(msg)


def _check_ids(values: torch.Tensor, name: str) -> None:
    if values.dim() != 1 or values.dtype not in _ID_DTYPES:
        msg = f"`{name}` must be a 1-d int32 or int64 tensor of ids, got {values.dtype} of shape {tuple(values.shape)}"
        raise DataError(msg)


def _check_indices(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dim() != 1
        or indices.dtype not in _ID_DTYPES
    ):
        msg = "`indices` must be a 1-d int64 (or int32) tensor of row numbers"
        raise DataError(msg)
    if indices.device != device:
        msg = f"`indices` is on {indices.device} but the values are on {device}"
        raise DataError(msg)
    return indices.to(torch.int64)


# --------------------------------------------------------------------------------------------
# dedup


def dedup_rows(
    values: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    *,
    hash_mask: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Find the unique rows of a group of keys and the inverse lookup of every row.

    Rows ``i`` and ``j`` are equal iff, for every key, their lists are equal element by element
    (RecD: rows whose keys changed out of step are not merged). Each row's lists are hashed and
    equality is verified on every hash match, so a hash collision never merges two rows.

    Args:
        values: per key of the group, the ids ``[N_k]`` (int32 or int64).
        offsets: per key, ``[B + 1]`` int64 offsets; the same B for every key.
        hash_mask: AND-ed into each row hash. Only for tests: ``0`` makes every row collide.

    Returns:
        ``(unique_rows, inverse)``: ``unique_rows`` int64 ``[U]`` holds the batch index of each
        unique row's first occurrence, ascending; ``inverse`` int64 ``[B]`` maps each row to
        the position of its representative in ``unique_rows``.

    Example:
        >>> import torch
        >>> u, inv = dedup_rows([torch.tensor([1, 2, 1, 2, 3])], [torch.tensor([0, 2, 4, 5])])
        >>> u.tolist(), inv.tolist()
        ([0, 2], [0, 0, 1])
    """
    values = list(values)
    offsets = list(offsets)
    if not values or len(values) != len(offsets):
        msg = (
            f"`values` and `offsets` must hold one tensor per key of the group, got "
            f"{len(values)} and {len(offsets)}"
        )
        raise DataError(msg)
    num_rows = None
    for k, (key_values, key_offsets) in enumerate(zip(values, offsets)):
        _check_jagged(key_values, key_offsets, f"values[{k}]", f"offsets[{k}]")
        _check_ids(key_values, f"values[{k}]")
        if num_rows is None:
            num_rows = key_offsets.shape[0] - 1
        elif key_offsets.shape[0] - 1 != num_rows or key_offsets.device != offsets[0].device:
            msg = (
                f"`offsets[{k}]` describes {key_offsets.shape[0] - 1} rows on "
                f"{key_offsets.device}, but `offsets[0]` {num_rows} rows on {offsets[0].device}"
            )
            raise DataError(msg)
    return cast(
        Pair, get_kernel("dedup_rows", offsets[0].device)(values, offsets, hash_mask=hash_mask)
    )


def partial_dedup(
    values: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Store lists that shifted by one id as windows into the previous row (RecD §7).

    Rows are visited in order and every row's window ends at the current end of the packed
    values. Row ``r >= 1`` with list ``L`` and previous list ``prev``:

    * ``L == prev``: reuses the previous window (nothing appended);
    * ``L == prev + [x]``, or ``L == prev[1:] + [x]`` with ``prev`` non-empty: appends only
      ``x``; the window is the previous one extended, respectively slid, by one;
    * otherwise (and for row 0) the whole of ``L`` is appended and becomes the window.

    Hence ``P <= N``, ``win_offsets[r] + win_lengths[r]`` is non-decreasing, and
    ``packed_values[win_offsets[r] : win_offsets[r] + win_lengths[r]]`` is row ``r``'s list.

    Args:
        values: ids ``[N]`` (int32 or int64).
        offsets: ``[B + 1]`` int64.

    Returns:
        ``(packed_values [P], win_offsets [B] int64, win_lengths [B] int64)``.

    Example:
        >>> import torch
        >>> packed, off, ln = partial_dedup(torch.tensor([1, 2, 3, 2, 3, 4]), torch.tensor([0, 3, 6]))
        >>> packed.tolist(), off.tolist(), ln.tolist()
        ([1, 2, 3, 4], [0, 1], [3, 3])
    """
    _check_jagged(values, offsets, "values", "offsets")
    _check_ids(values, "values")
    return cast(
        "tuple[torch.Tensor, torch.Tensor, torch.Tensor]",
        get_kernel("partial_dedup", values.device)(values, offsets),
    )


# --------------------------------------------------------------------------------------------
# jagged index select / add


class _JaggedIndexSelect(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        values: torch.Tensor,
        offsets: torch.Tensor,
        indices: torch.Tensor,
        known: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, out_offsets = get_kernel("jagged_index_select", values.device)(
            values, offsets, indices, **known
        )
        ctx.save_for_backward(offsets, indices, out_offsets)
        ctx.num_src_values = values.shape[0]
        ctx.mark_non_differentiable(out_offsets)
        return out, out_offsets

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor, _grad_offsets: Any
    ) -> tuple[Any, None, None, None]:
        offsets, indices, out_offsets = ctx.saved_tensors
        grad = get_kernel("jagged_index_add", grad_out.device)(
            grad_out.contiguous(), out_offsets, offsets, indices, ctx.num_src_values
        )
        return grad, None, None, None


def _check_known_layout(
    out_offsets: torch.Tensor | None, num_out_values: int | None, indices: torch.Tensor
) -> dict[str, Any]:
    """The caller's output layout as keyword arguments for the kernel forms (O(1) checks)."""
    known: dict[str, Any] = {}
    if out_offsets is not None:
        _check_offsets(out_offsets, "out_offsets")
        if out_offsets.shape[0] != indices.shape[0] + 1 or out_offsets.device != indices.device:
            msg = (
                f"`out_offsets` must hold M + 1 = {indices.shape[0] + 1} offsets on "
                f"{indices.device}, got {out_offsets.shape[0]} on {out_offsets.device}"
            )
            raise DataError(msg)
        known["out_offsets"] = out_offsets
    if num_out_values is not None:
        if isinstance(num_out_values, bool) or not isinstance(num_out_values, int):
            msg = f"`num_out_values` must be an int, got {num_out_values!r}"
            raise DataError(msg)
        if num_out_values < 0:
            msg = f"`num_out_values` must be >= 0, got {num_out_values!r}"
            raise DataError(msg)
        known["num_out_values"] = num_out_values
    return known


def jagged_index_select(
    values: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    *,
    out_offsets: torch.Tensor | None = None,
    num_out_values: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select rows of a jagged tensor (repeats allowed): RecD's jagged index select (O6).

    Differentiable w.r.t. floating-point ``values``; the backward is :func:`jagged_index_add`.

    The output's layout follows from ``offsets`` and ``indices``; a caller that already knows
    it passes it, and on a GPU the call then reads nothing back from the device:
    ``num_out_values`` (the output's rows, e.g. a deduplicated batch's expanded values, counted
    on the host before the batch was copied) saves the one sync for the output's size, and
    ``out_offsets`` (e.g. the batch's own offsets) the kernels that compute them. On the CPU
    both are checked against the selected rows; on a GPU they are trusted (checking them would
    read them back), so wrong ones give a wrong result there, or an out-of-range access.

    Args:
        values: ``[N]`` or ``[N, D]`` of any dtype (float16, int32, int64, ...).
        offsets: ``[B + 1]`` int64.
        indices: ``[M]`` int64 row numbers in ``0 .. B - 1``.
        out_offsets: ``[M + 1]`` int64, the output's offsets, when known.
        num_out_values: the output's length (``out_offsets[-1]``), when known on the host.

    Returns:
        ``(out_values [sum of the selected lengths(, D)], out_offsets [M + 1] int64)``.

    Raises:
        DataError: bad shapes or dtypes, or (on CPU) an index out of range or a known layout
            that is not the selected rows'.

    Example:
        >>> import torch
        >>> out, off = jagged_index_select(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]),
        ...                                torch.tensor([1, 0, 1]))
        >>> out.tolist(), off.tolist()
        ([3, 1, 2, 3], [0, 1, 3, 4])
        >>> jagged_index_select(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]),
        ...                     torch.tensor([1, 0, 1]), num_out_values=4)[0].tolist()
        [3, 1, 2, 3]
    """
    _check_jagged(values, offsets, "values", "offsets")
    indices = _check_indices(indices, values.device)
    known = _check_known_layout(out_offsets, num_out_values, indices)
    if values.requires_grad and values.dtype.is_floating_point and torch.is_grad_enabled():
        return cast(Pair, _JaggedIndexSelect.apply(values, offsets, indices, known))  # type: ignore[no-untyped-call]
    return cast(
        Pair, get_kernel("jagged_index_select", values.device)(values, offsets, indices, **known)
    )


def jagged_index_add(
    grad_values: torch.Tensor,
    out_offsets: torch.Tensor,
    src_offsets: torch.Tensor,
    indices: torch.Tensor,
    num_src_values: int,
) -> torch.Tensor:
    """Scatter-add selected rows back to their source rows: the backward of the select.

    ``result[src_offsets[indices[m]] + k] += grad_values[out_offsets[m] + k]`` for every output
    row ``m`` and position ``k`` in it; repeated indices accumulate. float16/bfloat16 gradients
    are accumulated in float32 and returned in their own dtype.

    Args:
        grad_values: ``[out_offsets[-1]]`` or ``[out_offsets[-1], D]``.
        out_offsets: ``[M + 1]`` int64, as returned by :func:`jagged_index_select`.
        src_offsets: ``[B + 1]`` int64 of the source rows.
        indices: ``[M]`` int64 in ``0 .. B - 1``.
        num_src_values: ``N``, the number of source values (``src_offsets[-1]``).

    Returns:
        ``[N(, D)]`` in the dtype of ``grad_values``.
    """
    _check_jagged(grad_values, out_offsets, "grad_values", "out_offsets")
    _check_offsets(src_offsets, "src_offsets")
    indices = _check_indices(indices, grad_values.device)
    if indices.shape[0] != out_offsets.shape[0] - 1:
        msg = (
            f"`indices` has {indices.shape[0]} rows but `out_offsets` describes "
            f"{out_offsets.shape[0] - 1}"
        )
        raise DataError(msg)
    if num_src_values < 0:
        msg = f"`num_src_values` must be >= 0, got {num_src_values!r}"
        raise DataError(msg)
    return cast(
        torch.Tensor,
        get_kernel("jagged_index_add", grad_values.device)(
            grad_values, out_offsets, src_offsets, indices, int(num_src_values)
        ),
    )


# --------------------------------------------------------------------------------------------
# segment reduce


class _SegmentReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, offsets: torch.Tensor, mode: str) -> torch.Tensor:
        out, argmax = get_kernel("segment_reduce", values.device)(values, offsets, mode)
        ctx.mode = mode
        ctx.num_values = values.shape[0]
        ctx.save_for_backward(offsets, argmax if argmax is not None else offsets)
        return cast(torch.Tensor, out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, None, None]:
        offsets, argmax = ctx.saved_tensors
        grad = get_kernel("segment_reduce_backward", grad_out.device)(
            grad_out.contiguous(),
            offsets,
            ctx.mode,
            argmax=argmax if ctx.mode == "max" else None,
            num_values=ctx.num_values,
        )
        return grad, None, None


def segment_reduce(
    values: torch.Tensor, offsets: torch.Tensor, mode: ReduceMode = "sum"
) -> torch.Tensor:
    """Pool each row's values: ``out[b] = reduce(values[offsets[b] : offsets[b + 1]])``.

    Empty rows give 0. ``max`` propagates NaN like :func:`torch.max`, and its gradient goes to
    the first maximal element of each row and column. float16/bfloat16 are computed in float32.
    Differentiable w.r.t. ``values``.

    Args:
        values: floating point ``[N]`` or ``[N, D]``.
        offsets: ``[B + 1]`` int64.
        mode: ``"sum"``, ``"mean"`` or ``"max"``.

    Returns:
        ``[B]`` or ``[B, D]`` in the dtype of ``values``.

    Example:
        >>> import torch
        >>> segment_reduce(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 2, 2, 3]), "mean").tolist()
        [1.5, 0.0, 4.0]
    """
    if mode not in _REDUCE_MODES:
        msg = f"`mode` must be one of {', '.join(_REDUCE_MODES)}, got {mode!r}"
        raise DataError(msg)
    _check_jagged(values, offsets, "values", "offsets")
    if not values.dtype.is_floating_point:
        msg = f"`values` must be floating point for segment_reduce, got {values.dtype}"
        raise DataError(msg)
    if values.requires_grad and torch.is_grad_enabled():
        return cast(torch.Tensor, _SegmentReduce.apply(values, offsets, mode))  # type: ignore[no-untyped-call]
    return cast(torch.Tensor, get_kernel("segment_reduce", values.device)(values, offsets, mode)[0])
