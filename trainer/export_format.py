"""The file ``recpipe export`` writes (:mod:`trainer.export`): its format tag, and reading it
back as a document or as the one-process checkpoint state ``recpipe predict`` reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recpipe.errors import RecpipeError

if TYPE_CHECKING:
    from schemas import DatasetSchema
    from trainer.config import ModelConfig
    from trainer.models import DLRM

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "as_checkpoint",
    "build_model",
    "is_export",
    "read_export",
]

EXPORT_FORMAT = "recpipe-export"
EXPORT_VERSION = 1


def is_export(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file (not a checkpoint directory or its ``checkpoint.pt``)."""
    p = Path(path)
    return p.is_file() and p.name != "checkpoint.pt"


def read_export(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The document :func:`trainer.export.export_checkpoint` wrote to ``path``.

    Raises:
        RecpipeError: unreadable, or not a ``recpipe export`` file.
    """
    import torch

    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any file torch cannot read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = f"{path}: cannot read it as a `recpipe export` file: {first}"
        raise RecpipeError(msg) from None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        msg = (
            f"{path}: not a `recpipe export` file (write one with `recpipe export CKPT --out FILE`)"
        )
        raise RecpipeError(msg)
    if doc.get("format_version") != EXPORT_VERSION:
        msg = f"{path}: an export of format version {doc.get('format_version')!r}; this recpipe reads {EXPORT_VERSION}"
        raise RecpipeError(msg)
    return doc


def as_checkpoint(doc: dict[str, Any]) -> dict[str, Any]:
    """An export seen as a one-process checkpoint's state (what ``recpipe predict`` reads)."""
    return {"config": doc["config"], "model_config": doc["model_config"],
            "trainer": {"model": doc["model"], "step": doc["step"]},
            "dataset_id": doc.get("dataset_id"), "tower_model": doc.get("tower_model")}  # fmt: skip


def build_model(state: dict[str, Any], schema: DatasetSchema, config: ModelConfig) -> DLRM:
    """The untrained model an export (or :func:`as_checkpoint` of one, or a one-process
    checkpoint) holds weights for: a :class:`~trainer.models.DLRM`, or the
    :class:`~trainer.towers.model.TowerDLRM` of a towers run with tower modules (its
    ``tower_model``: the plan's towers and the modules' settings)."""
    from trainer.models import DLRM

    towers = state.get("tower_model")
    if towers is None:
        return DLRM.from_schema(schema, config)
    from trainer.towers.config import TowerModuleConfig, TowerPlan
    from trainer.towers.model import TowerDLRM

    plan = TowerPlan(tuple(tuple(t) for t in towers["plan"]))
    return TowerDLRM.from_schema(schema, config, plan=plan,
                                 towers=TowerModuleConfig(**towers["module"]))  # fmt: skip
