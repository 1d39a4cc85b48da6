"""Training checkpoints on disk: one file holding a run's whole state at a step boundary.

``DIR/checkpoint.pt`` (``torch.save``) holds ``version``, ``trainer`` (model, optimizers, step),
``reader`` (the loader's position), ``rng`` (:func:`rng_state`), the run's history and its
config. It is written to a temporary file, fsynced and renamed into place, so a crash leaves the
previous checkpoint or the new one, never a torn file. Embedding stores checkpoint themselves
(``trainer.store``); the training loop commits them before it saves this file.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recpipe.errors import RecpipeError

__all__ = [
    "CHECKPOINT_FILE",
    "CHECKPOINT_VERSION",
    "checkpoint_file",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_VERSION = 1


def checkpoint_file(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint file of a checkpoint directory."""
    return Path(directory) / CHECKPOINT_FILE


def rng_state() -> dict[str, Any]:
    """The torch, NumPy and Python RNG states (and CUDA's when there is a device)."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(state: Mapping[str, Any], path: Path) -> None:
    """Write ``state`` (tagged with :data:`CHECKPOINT_VERSION`) to ``path`` atomically and
    durably: a temporary file, fsynced, renamed into place, and the directory fsynced (so the
    rename itself survives a crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**state, "version": CHECKPOINT_VERSION}, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    path: Path, *, map_location: torch.device | str = "cpu"
) -> dict[str, Any] | None:
    """The saved state, or ``None`` when ``path`` does not exist yet.

    Raises:
        RecpipeError: the file cannot be read, or is not a recpipe checkpoint of this version.
    """
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        msg = f"{path}: cannot read the checkpoint: {exc}"
        raise RecpipeError(msg) from exc
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        msg = f"{path}: not a recpipe training checkpoint (version {CHECKPOINT_VERSION})"
        raise RecpipeError(msg)
    return state
