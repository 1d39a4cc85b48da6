"""Feature affinities from a trained model: the batch mean of ``R Rᵀ``.

``R`` is one sample's ``[F, N]`` matrix of pooled embeddings (one row per sparse feature, the
vectors a DLRM's dot interaction multiplies). Averaged over samples, ``M = mean R Rᵀ`` is the
``[F, F]`` mean of every pairwise dot product; :func:`trainer.towers.partition.affinity_from_gram`
turns it into ``|cos|`` affinities.

The model comes from a short ``recpipe train`` run (:func:`train_briefly`, through the ordinary
training loop and its checkpoint) or from an existing checkpoint (:func:`load_trained`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.checkpoint import checkpoint_file, load_checkpoint
from trainer.config import ModelConfig, TableConfig, TrainConfig
from trainer.models import DLRM

if TYPE_CHECKING:
    from recpipe.batch import Batch

__all__ = ["gram_matrix", "load_trained", "train_briefly", "training_batches"]


@torch.no_grad()
def gram_matrix(
    model: DLRM, batches: Iterable[Batch], *, max_batches: int | None = None, center: bool = False
) -> tuple[tuple[str, ...], np.ndarray, int]:
    """``mean over samples of R Rᵀ`` of the model's pooled features; with ``center``, of
    ``(R - mean R)(R - mean R)ᵀ`` (``mean R Rᵀ - mean R mean Rᵀ``, each feature's mean embedding
    taken over the same samples).

    Returns:
        the features (in the model's order), the ``[F, F]`` float64 matrix, and the samples
        averaged over.
    """
    model.eval()
    features = tuple(model.ebc.features)
    total = np.zeros((len(features), len(features)), dtype=np.float64)
    first: np.ndarray | None = None  # sum over samples of R, [F, N]
    samples = 0
    for count, batch in enumerate(batches):
        if max_batches is not None and count >= max_batches:
            break
        pooled = model.ebc(batch)
        r = torch.stack([pooled[f] for f in features], dim=1).to(torch.float64)  # (B, F, N)
        total += torch.einsum("bfn,bgn->fg", r, r).numpy()
        first = r.sum(0).numpy() + (0.0 if first is None else first)
        samples += r.shape[0]
    if not samples:
        msg = "no batch to compute the feature affinities on: the dataset's training part is empty"
        raise RecpipeError(msg)
    gram = total / samples
    if center and first is not None:
        mean = first / samples  # (F, N)
        gram = gram - mean @ mean.T
    return features, gram, samples


def _model_config(saved: dict[str, Any]) -> ModelConfig:
    fields = dict(saved)
    if fields.get("tables") is not None:
        fields["tables"] = tuple(TableConfig(**t) for t in fields["tables"])
    for name in ("bottom_mlp", "top_mlp"):
        fields[name] = tuple(fields[name])
    if isinstance(fields.get("attention"), list):
        fields["attention"] = tuple(fields["attention"])
    return ModelConfig(**fields)


def load_trained(checkpoint: str | Path) -> tuple[DLRM, TrainConfig]:
    """The model of a ``recpipe train --checkpoint DIR`` run (one process, tables in the
    module), and the run's config.

    Raises:
        RecpipeError: no checkpoint there, or one whose tables live elsewhere.
    """
    from readers.dataset import dataset_schema

    path = checkpoint_file(checkpoint)
    state = load_checkpoint(path)
    if state is None:
        msg = f"`checkpoint` {str(checkpoint)!r} holds no {path.name} (write one with `recpipe train --checkpoint DIR`)"
        raise RecpipeError(msg)
    if "config" not in state or "model_config" not in state:
        msg = f"{path}: a multi-rank checkpoint; give a one-process `recpipe train` checkpoint"
        raise RecpipeError(msg)
    config = TrainConfig(**{**state["config"], "resume": False})
    if config.store != "module":
        msg = f"{path}: its tables live in the {config.store!r} store; partition from a `--store module` run"
        raise RecpipeError(msg)
    model_config = _model_config(state["model_config"])
    config = replace(config, model=model_config)
    model = DLRM.from_schema(dataset_schema(config.dataset), model_config)
    model.load_state_dict(state["trainer"]["model"])
    return model, config


def training_batches(config: TrainConfig) -> Iterator[Batch]:
    """The training part of ``config``'s dataset (the row groups ``recpipe train`` trains on),
    read in order."""
    from readers.dataset import ParquetBatchDataset
    from readers.holdout import holdout_splits
    from readers.source import ReaderConfig

    ds = ParquetBatchDataset(config.dataset, config=ReaderConfig(batch_size=config.batch_size),
                             transforms=config.preprocess, dedup=config.dedup)  # fmt: skip
    train, _ = holdout_splits(ds.source.splits, session_key=ds.schema.session_key,
                              fraction=config.eval_fraction, seed=config.seed)  # fmt: skip
    ds.source.splits = train
    return iter(ds)


def train_briefly(config: TrainConfig, *, progress: bool = False) -> DLRM:
    """Train ``config`` (with the ordinary ``recpipe train`` loop, held-out evaluation limited
    to one batch) and return the trained model, read back from its checkpoint."""
    from trainer.train import train

    with tempfile.TemporaryDirectory(prefix="recpipe-towers-") as tmp:
        run = replace(config, checkpoint=tmp, checkpoint_every=0, resume=False, eval_batches=1,
                      metrics=None, tensorboard=None)  # fmt: skip
        train(run, progress=progress)
        model, _ = load_trained(tmp)
    return model
