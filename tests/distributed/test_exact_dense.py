"""Exact dense gradients (``ExactDense``, the default of a multi-rank ``recpipe train``) cover
attention pooling: a batch in one piece (one process) and the same rows in two pieces (two
ranks: padded as the whole batch, partial sums added in float64) give the same forward and the
same float32 gradients, bit for bit."""

from __future__ import annotations

import torch

from trainer.attention import AttentionPooling
from trainer.distributed.comm import Comm
from trainer.distributed.dense import ExactDense
from trainer.modules import JaggedEmbeddings

DIM, MAX_LEN = 8, {"a": 6, "b": 4}


def _rows(lengths: list[int], seed: int) -> JaggedEmbeddings:
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return JaggedEmbeddings(torch.randn(int(offsets[-1]), DIM, generator=gen), offsets)


def _piece(seq: JaggedEmbeddings, rows: slice) -> JaggedEmbeddings:
    start, stop = int(seq.offsets[rows.start]), int(seq.offsets[rows.stop])
    return JaggedEmbeddings(seq.values[start:stop], seq.offsets[rows.start : rows.stop + 1] - start)


class _TwoRanks:
    """The collectives of rank 0 of two whose peer holds the other rows: the longest rows are
    the whole batch's, and the gradients are summed already (both pieces run here)."""

    world_size, rank = 2, 0

    def all_reduce(self, tensor: torch.Tensor, *, what: str, op: str = "sum") -> torch.Tensor:
        if op == "max":
            tensor.copy_(torch.tensor([6, 4]))  # the longest rows of the 12 (both within max_len)
        return tensor


def _run(pieces: list[slice]):
    """Forward and exact gradients of a 2-layer attention pooling over ``pieces`` of 12 rows:
    one piece as one process, several as ranks."""
    # piece [0, 5) holds only short rows: padded as it is, the second feature's tokens would sit
    # at other positions than in the whole batch
    seqs = {"a": _rows([1, 2, 1, 3, 2, 6, 5, 1, 4, 6, 2, 3], 1),
            "b": _rows([1, 1, 2, 1, 2, 4, 3, 4, 1, 2, 3, 4], 2)}  # fmt: skip
    target = torch.randn(12, DIM, generator=torch.Generator().manual_seed(3))
    model = AttentionPooling(("a", "b"), dim=DIM, max_len=MAX_LEN, num_layers=2, seed=0)
    exact = ExactDense(model, Comm.single() if len(pieces) == 1 else _TwoRanks())  # type: ignore[arg-type]
    outs = []
    for rows in pieces:
        out = model({f: _piece(s, rows) for f, s in seqs.items()})  # (R, D)
        ((out - target[rows]) ** 2).sum().backward()
        outs.append(out.detach())
    assert all(p.grad is None for p in model.parameters())  # all held in float64 until reduce
    exact.reduce()
    return exact, torch.cat(outs), {n: p.grad for n, p in model.named_parameters()}


def test_attention_pooling_gradients_do_not_depend_on_how_the_batch_is_split():
    exact, whole, grads = _run([slice(0, 12)])
    _, split, split_grads = _run([slice(0, 5), slice(5, 12)])
    assert exact.outside == [] and exact.layer_norms == 5 and exact.linears == 8
    assert "cls" in exact.followed and "layers.0.q_bias" in exact.followed
    assert torch.equal(whole, split)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name  # every parameter learns: the check is not vacuous
        assert torch.equal(grad, split_grads[name]), name


def test_a_parameter_used_by_another_op_is_listed_outside():
    """A parameter reaching an op that is not a view, an expand or a broadcasting add, sub or
    mul (here a matmul) keeps its float32 gradient there, and is named."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.ones(3))
            self.mix = torch.nn.Parameter(torch.eye(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + self.bias) @ self.mix

    model = Scaled()
    exact = ExactDense(model, Comm.single())
    model(torch.randn(4, 3)).sum().backward()
    exact.reduce()
    assert exact.outside == ["mix"]
    assert torch.equal(model.bias.grad, torch.full((3,), 4.0))
    assert model.mix.grad is not None
