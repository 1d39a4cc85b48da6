"""Process groups for multi-rank training: setup from ``torchrun``'s environment, and the few
collectives the embedding exchange uses, each turning a failed peer into a clear error.

Backends: gloo when the training device is the CPU, NCCL when it is CUDA. Every group gets a
timeout, so a rank that hangs makes the others fail within it; a rank that dies closes its
connections, and its peers fail at their next collective (gloo reports the closed connection at
once). The error is a :class:`DistributedError` naming this rank and what it was doing.

A :class:`Comm` of world size 1 needs no process group: every collective is a local copy, which
makes the single-process path the same code as the distributed one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from recpipe.errors import RecpipeError

__all__ = [
    "Comm",
    "DistributedError",
    "backend_for",
    "destroy",
    "init_from_env",
    "launched_by_torchrun",
]

DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RecpipeError):
    """A collective failed (a peer died or timed out), or a distributed setup is wrong."""


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """Whether this process is a worker started by ``torchrun`` (or its launch API)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@dataclass
class Comm:
    """A process group as the exchange sees it.

    Attributes:
        group: the group (``None``: the default group, or no group at all when
            ``world_size == 1``).
        rank: this process's rank in the group.
        world_size: ranks in the group.
        device: where collective payloads must live (``cuda`` for NCCL, ``cpu`` for gloo).
        timeout_s: the group's collective timeout (reported in errors).
        dense_group: the group of the dense model's DDP (``None``: the default group); the
            same ranks as ``group`` but another group, so DDP's all-reduces never interleave
            with the exchange's collectives.
    """

    group: Any
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    dense_group: Any = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Comm:
        """A world of one process (no process group needed)."""
        return cls(None, 0, 1, torch.device(device))

    @classmethod
    def of(
        cls,
        group: Any,
        *,
        device: torch.device | str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dense_group: Any = None,
    ) -> Comm:
        """The :class:`Comm` of ``group`` for this process (``dense_group`` for DDP)."""
        return cls(
            group,
            dist.get_rank(group),
            dist.get_world_size(group),
            torch.device(device),
            timeout_s,
            dense_group,
        )

    # -- collectives ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a failed collective into a :class:`DistributedError` naming ``what``."""
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, RecpipeError):
                raise
            msg = (
                f"rank {self.rank} of {self.world_size}: {what} failed: another rank died, "
                f"hung past the {self.timeout_s:g} s timeout, or lost its connection ({exc})"
            )
            raise DistributedError(msg) from exc

    def all_to_all(
        self,
        payload: torch.Tensor,
        send: Sequence[int],
        recv: Sequence[int],
        *,
        what: str,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``all_to_all_single`` of the rows of ``payload``: ``send[d]`` rows go to rank ``d``,
        ``recv[s]`` rows come from rank ``s`` (both known beforehand: exchange counts first,
        gloo aborts on mismatched sizes). ``out``: where to receive them (a contiguous tensor
        of ``sum(recv)`` rows shaped and typed as ``payload``'s; a new one by default)."""
        rows = int(sum(recv))
        if out is None:
            out = payload.new_empty((rows, *payload.shape[1:]))
        if self.world_size == 1:
            out.copy_(payload)
            return out
        src = payload.to(self.device)
        dst = out.to(self.device)
        with self.guard(what):
            dist.all_to_all_single(
                dst, src, [int(r) for r in recv], [int(s) for s in send], group=self.group
            )
        return dst.to(payload.device) if dst.device != payload.device else dst

    def all_to_all_counts(self, counts: torch.Tensor, *, what: str) -> torch.Tensor:
        """Every rank sends row ``d`` of ``counts`` [W, ...] to rank ``d``; returns the rows
        received, row ``s`` from rank ``s``."""
        if self.world_size == 1:
            return counts.clone()
        src = counts.to(self.device)
        out = torch.empty_like(src)
        with self.guard(what):
            dist.all_to_all_single(out, src, group=self.group)
        return out.to(counts.device)

    def all_reduce(self, tensor: torch.Tensor, *, what: str, op: str = "sum") -> torch.Tensor:
        """In-place sum (or ``"max"``) over ranks; returns ``tensor``."""
        if self.world_size == 1:
            return tensor
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        buf = tensor if tensor.device == self.device else tensor.to(self.device)
        with self.guard(what):
            dist.all_reduce(buf, op=reduce_op, group=self.group)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in rank order."""
        if self.world_size == 1:
            return [tensor.clone()]
        src = tensor.to(self.device)
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        with self.guard(what):
            dist.all_gather(out, src, group=self.group)
        return [t.to(tensor.device) for t in out]

    def all_gather_rows(self, rows: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        """Every rank's ``rows`` [n_r, ...] where ``n_r`` may differ (sizes exchanged first)."""
        sizes = self.all_gather(torch.tensor([rows.shape[0]], dtype=torch.int64), what=what)
        n = [int(s) for s in sizes]
        padded = rows.new_zeros((max(n) if n else 0, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        gathered = self.all_gather(padded, what=what)
        return [g[:k] for g, k in zip(gathered, n, strict=True)]

    def barrier(self, *, what: str) -> None:
        """Wait for every rank (a tiny all-reduce: works the same on gloo and NCCL)."""
        self.all_reduce(torch.zeros(1, device=self.device), what=what)


def init_from_env(*, device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """Join the job ``torchrun`` started (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).

    Initialises the default process group with the backend for ``device`` and ``timeout_s``,
    and returns the :class:`Comm` of a second group over the same ranks for the embedding
    exchange (DDP's gradient all-reduce keeps the default group to itself, so the two never
    interleave on one group).

    Raises:
        DistributedError: not started by torchrun, or the group cannot be formed in time.
    """
    if not launched_by_torchrun():
        msg = (
            "not started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set "
            "(use `recpipe train --nproc N` or `torchrun --nproc-per-node N -m trainer ...`)"
        )
        raise DistributedError(msg)
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    backend = backend_for(dev)
    timeout = timedelta(seconds=timeout_s)
    rank = int(os.environ["RANK"])
    try:
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timeout)
        group = dist.new_group(backend=backend, timeout=timeout)
    except (RuntimeError, ValueError, dist.DistError) as exc:
        msg = f"rank {rank}: cannot join the process group ({backend}): {exc}"
        raise DistributedError(msg) from exc
    return Comm.of(group, device=dev, timeout_s=timeout_s)


def destroy() -> None:
    """Leave the process group (no-op when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
