"""What the training commands write, checked before any work (:mod:`recpipe.paths`).

``recpipe train`` writes ``--json`` and ``--metrics`` (files), ``--checkpoint`` and
``--tensorboard`` (directories of its own files); ``recpipe towers train`` writes ``--json``.
None of them may be, hold or lie inside what the run reads (the dataset, ``--preprocess``,
``--dedup-groups``, a ``--towers`` plan) or another of its outputs, be a directory where a file
is written (or a file where a directory is), or sit where nothing can be written: each is
refused, naming the option and the path, before anything is read or trained.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from recpipe.paths import check_outputs

if TYPE_CHECKING:
    from trainer.config import TrainConfig

__all__ = ["check_train_outputs"]


def check_train_outputs(
    config: TrainConfig,
    *,
    json: str | os.PathLike[str] | None = None,
    reads: Iterable[str | os.PathLike[str] | None] = (),
) -> None:
    """Refuse an output of a training run that must not or cannot be written.

    Args:
        config: the run (its dataset, preprocessing and dedup-group files are read; its
            ``metrics``, ``checkpoint`` and ``tensorboard`` are written).
        json: the summary file (``--json``).
        reads: what else the command reads (e.g. a ``--towers`` plan).

    Raises:
        DataError: naming the option, the path and why (:func:`recpipe.paths.check_output`).
    """
    outputs = (
        ("--json", json, "file"),
        ("--metrics", config.metrics, "file"),
        ("--checkpoint", config.checkpoint, "directory"),
        ("--tensorboard", config.tensorboard, "directory"),
    )
    dedup_groups = None if config.dedup_groups == "auto" else config.dedup_groups
    check_outputs(
        outputs, inputs=[config.dataset, config.preprocess, config.fitted, dedup_groups, *reads]
    )
