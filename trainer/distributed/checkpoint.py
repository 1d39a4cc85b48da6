"""Checkpoints of a multi-rank job: consistent at a step boundary, resumable at any world size.

Layout of a checkpoint directory::

    checkpoint.pt                            rank 0, written last (atomic rename): the step, the
                                             world size, the dense model and optimizers, the
                                             readers' position, losses, the hot sets, and
                                             ``sparse`` = the folder below
    sparse/step-000000120/
        rank-00000-of-00002.pt               each rank: every row it owns (hot ones included,
        rank-00001-of-00002.pt               from its replica), ids + values + optimizer state

A save is collective: every rank writes its rows (to a temporary name, fsynced, renamed), all
ranks meet, then rank 0 writes ``checkpoint.pt`` naming the folder and removes older folders.
A crash before that rename leaves the previous ``checkpoint.pt`` and its folder intact, so the
last complete checkpoint is always whole.

Resuming at another world size: every rank reads every saved rank file and keeps the rows it
owns now (``owner_of(id, W)``); the hot sets are installed again from their new owners.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recpipe.errors import RecpipeError
from trainer.checkpoint import CHECKPOINT_FILE, load_checkpoint
from trainer.checkpoint import save_checkpoint as save_state
from trainer.distributed.comm import Comm
from trainer.distributed.exchange import ShardedEmbeddings

__all__ = [
    "CHECKPOINT_FILE",
    "load_sparse",
    "read_checkpoint",
    "read_part",
    "save_checkpoint",
    "save_parts",
]

KIND = "distributed"


def _rank_file(folder: Path, rank: int, world_size: int) -> Path:
    return folder / f"rank-{rank:05d}-of-{world_size:05d}.pt"


def save_parts(
    root: str | os.PathLike[str],
    *,
    comm: Comm,
    area: str,
    step: int,
    part: Mapping[str, Any],
    doc: Mapping[str, Any],
) -> Path:
    """A collective checkpoint at ``step``: every rank writes its ``part`` to
    ``root/area/step-N/rank-R-of-W.pt``; once all have, rank 0 writes ``checkpoint.pt`` (``doc``
    with ``area`` naming that folder) and removes the older folders of ``area``.

    Returns:
        the path of ``checkpoint.pt``.
    """
    root = Path(root)
    folder = root / area / f"step-{step:09d}"
    folder.mkdir(parents=True, exist_ok=True)
    save_state(dict(part), _rank_file(folder, comm.rank, comm.world_size))
    comm.barrier(what="the checkpoint's barrier")
    path = root / CHECKPOINT_FILE
    if comm.rank == 0:
        save_state({**doc, area: str(folder.relative_to(root))}, path)
        for old in (root / area).iterdir():
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier(what="the checkpoint's barrier")
    return path


def read_part(
    root: str | os.PathLike[str], state: Mapping[str, Any], area: str, *, rank: int,
    world_size: int,
) -> dict[str, Any]:  # fmt: skip
    """Rank ``rank``'s part of the checkpoint ``state`` (saved by :func:`save_parts` at
    ``world_size`` ranks), checked to be of its step.

    Raises:
        RecpipeError: the part is missing or of another step.
    """
    path = _rank_file(Path(root) / state[area], rank, world_size)
    part = load_checkpoint(path)
    if part is None:
        msg = f"{path}: rank {rank}'s part of the checkpoint is missing"
        raise RecpipeError(msg)
    if part.get("step") != state["step"]:
        msg = f"{path}: rows of step {part.get('step')!r}, the checkpoint is at {state['step']}"
        raise RecpipeError(msg)
    return part


def save_checkpoint(
    root: str | os.PathLike[str],
    *,
    comm: Comm,
    sparse: ShardedEmbeddings,
    step: int,
    state: Mapping[str, Any],
) -> Path:
    """Save the job at ``step`` (collective). ``state`` is what rank 0 keeps besides the rows
    (dense model, optimizers, readers, ...; the same on every rank).

    Returns:
        the path of ``checkpoint.pt``.
    """
    rows = {"step": step, "rank": comm.rank, "world_size": comm.world_size,
            "rows": sparse.owned_rows()}  # fmt: skip
    doc = {**state, "kind": KIND, "step": step, "world_size": comm.world_size,
           "hot": dict(zip(sparse.names, sparse.hot_sets(), strict=True))}  # fmt: skip
    return save_parts(root, comm=comm, area="sparse", step=step, part=rows, doc=doc)


def read_checkpoint(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job state in ``root/checkpoint.pt`` (``None`` when there is none yet).

    Raises:
        RecpipeError: the file is unreadable or not a multi-rank checkpoint.
    """
    path = Path(root) / CHECKPOINT_FILE
    state = load_checkpoint(path)
    if state is not None and state.get("kind") != KIND:
        msg = (
            f"{path}: not a multi-rank checkpoint (written by a single-process run?); resume it "
            "the way it was written"
        )
        raise RecpipeError(msg)
    return state


def load_sparse(
    root: str | os.PathLike[str], state: Mapping[str, Any], *, sparse: ShardedEmbeddings
) -> None:
    """Give this rank the rows it owns of the checkpoint ``state`` (saved at any world size)
    and reinstall the saved hot sets (collective)."""
    saved = int(state["world_size"])
    parts = [
        read_part(root, state, "sparse", rank=rank, world_size=saved)["rows"]
        for rank in range(saved)
    ]
    sparse.load_owned_rows(parts)
    hot = state.get("hot", {})
    sparse.set_hot([hot[name].copy() if name in hot else [] for name in sparse.names])
