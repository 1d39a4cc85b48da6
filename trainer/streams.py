"""The batches of a training run, for every mode: one stream type and one position format.

::

    dataset -> sessions: training part | held-out part      (readers.holdout, by session hash)
    training part -> the global stream of the epoch, cut into global batches, each cut across
                     the ranks                              (readers.ranks: one process = rank 0
                                                             of a world of 1)
                     in process: RankBatchDataset + RankLoader (DataLoader workers)
                     from `recpipe serve`: ServiceRankDataset (the server runs the same reader)
    held-out part -> every rank reads all of it, in order, the last short batch included, so
                     any number of ranks evaluates one process's rows

The training position (:meth:`RunStream.state_dict`) is the rank reader's: the same in process
and through the service, and loadable at another number of ranks; a checkpoint written one way
resumes the other. With ``--on-error skip`` one process reads through the library's loader
(:class:`readers.dataset.StatefulLoader`: a skipped row group would shift every rank's rows),
whose position only that loader takes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from readers.holdout import Holdout, holdout_splits
from recpipe.errors import RecpipeError

if TYPE_CHECKING:
    from readers.ranks import RankCut
    from recpipe.batch import Batch
    from schemas import DatasetSchema
    from trainer.config import TrainConfig

__all__ = ["RunStream", "open_stream", "reader_options"]

_log = logging.getLogger(__name__)


def reader_options(config: TrainConfig) -> dict[str, Any]:
    """The :class:`readers.source.ReaderConfig` fields a run's options set (shuffle and seed
    aside, which differ between the training part and the held-out part)."""
    return {"batch_size": config.batch_size, "read_ahead": config.read_ahead,
            "verify": config.verify, "on_error": config.on_error}  # fmt: skip


class RunStream:
    """A run's training batches (resumable) and its held-out batches.

    Attributes:
        train: the training source (``RankLoader``, ``ServiceRankDataset`` or, with
            ``--on-error skip``, ``StatefulLoader``).
        splits: row groups with training rows, with held-out rows.
    """

    def __init__(
        self, train: Any, held_out: Any, *, splits: tuple[int, int], planned: Any = None
    ) -> None:
        self.train, self._held_out, self.splits = train, held_out, splits
        self._planned = planned

    @property
    def epoch(self) -> int:
        """The epoch the next training batch belongs to."""
        return int(self.train.epoch)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.train)

    def eval_batches(self) -> Iterable[Batch]:
        """Every held-out batch, in order, from the first (none without a held-out part)."""
        held = self._held_out
        if held is None:
            return iter(())
        held.set_epoch(0)
        return iter(held)

    def planned_steps(self, epochs: int) -> int | None:
        """Steps of the first ``epochs`` epochs, where the reader knows them before reading."""
        return None if self._planned is None else self._planned(epochs)

    @property
    def remainder_rows(self) -> int:
        """Training rows of the current epoch no rank is given (whole global batches only)."""
        return int(getattr(self.train, "remainder_rows", 0) or 0)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.train.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state)


def open_stream(
    config: TrainConfig,
    schema: DatasetSchema,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | None = None,
    cut: RankCut | None = None,
) -> RunStream:
    """The batches of ``config``'s run for ``rank`` of ``world_size`` (in process, or from
    ``config.service``): ``config.batch_size`` rows per rank and step.

    Raises:
        RecpipeError: an option the stream cannot honour (named).
    """
    from readers.dataset import make_pipeline
    from readers.source import DatasetSource, ReaderConfig

    cfg = config
    splits = DatasetSource(cfg.dataset, schema=schema).splits
    train, held = holdout_splits(
        splits, session_key=schema.session_key, fraction=cfg.eval_fraction, seed=cfg.seed
    )
    counts = (len(train), len(held))
    if cfg.preprocess is not None and rank == 0:
        from readers.fitted import fitted_holdout_mismatch

        why = fitted_holdout_mismatch(
            cfg.dataset, eval_fraction=cfg.eval_fraction, seed=cfg.seed, fitted=cfg.fitted
        )
        if why is not None:
            _log.warning("%s", why)
    if cfg.service is not None:
        return _service_stream(cfg, rank=rank, world_size=world_size, counts=counts)
    transforms = make_pipeline(cfg.preprocess, schema, dataset=cfg.dataset, fitted=cfg.fitted)
    options = reader_options(cfg)
    reader = ReaderConfig(**options, shuffle=cfg.shuffle, seed=cfg.seed)
    pin = device is not None and device.type == "cuda"
    if cfg.on_error != "raise":
        if world_size > 1:
            msg = (
                f"`on_error` {cfg.on_error!r} with several ranks: a skipped row group would shift "
                "every later rank's rows; use 'raise'"
            )
            raise RecpipeError(msg)
        held_out = _library_held_out(cfg, schema, transforms, held)
        return _library_stream(cfg, schema, transforms, reader, train, held_out, counts, pin)
    from readers.ranks import RankBatchDataset, RankLoader

    dataset = RankBatchDataset(
        cfg.dataset, schema=schema, config=reader, transforms=transforms, dedup=cfg.dedup,
        rank=rank, world_size=world_size, splits=train, cut=cut,
    )  # fmt: skip
    loader = RankLoader(dataset, num_workers=cfg.workers, pin_memory=pin)
    held_out = None
    if held:  # every rank: all held-out rows at the global batch size, the last short batch too
        eval_reader = ReaderConfig(**{**options, "batch_size": cfg.batch_size * world_size})
        held_out = RankBatchDataset(
            cfg.dataset, schema=schema, config=eval_reader, transforms=transforms,
            dedup=cfg.dedup, splits=held, drop_remainder=False,
        )  # fmt: skip

    def planned(epochs: int) -> int:  # every epoch deals as many global batches, about
        return len(dataset) * epochs

    return RunStream(loader, held_out, splits=counts, planned=planned)


def _library_held_out(
    cfg: TrainConfig, schema: DatasetSchema, transforms: Any, held: list[Any]
) -> Any:
    """The held-out rows through the library's dataset, in order (``--on-error skip``)."""
    if not held:
        return None
    from readers.dataset import ParquetBatchDataset
    from readers.source import ReaderConfig

    dataset = ParquetBatchDataset(
        cfg.dataset, schema=schema, config=ReaderConfig(**reader_options(cfg), shuffle=False),
        transforms=transforms, dedup=cfg.dedup,
    )  # fmt: skip
    dataset.source.splits = held
    return dataset


def _library_stream(
    cfg: TrainConfig, schema: DatasetSchema, transforms: Any, reader: Any, train: list[Any],
    held_out: Any, counts: tuple[int, int], pin: bool,
) -> RunStream:  # fmt: skip
    from readers.dataset import ParquetBatchDataset, StatefulLoader

    dataset = ParquetBatchDataset(
        cfg.dataset, schema=schema, config=reader, transforms=transforms, dedup=cfg.dedup
    )
    dataset.source.splits = train
    loader = StatefulLoader(dataset, num_workers=cfg.workers, pin_memory=pin)

    def planned(epochs: int) -> int:
        return sum(dataset.num_batches(num_workers=cfg.workers, epoch=e) for e in range(epochs))

    return RunStream(loader, held_out, splits=counts, planned=planned)


def _service_stream(
    cfg: TrainConfig, *, rank: int, world_size: int, counts: tuple[int, int]
) -> RunStream:
    """Train on the server's training part (one client per rank) and evaluate on its held-out
    part, divided as :func:`holdout_splits` divides the dataset in process (the clients check
    that the server's parts span as many row groups; the server checks the batch size)."""
    from readers.service.client import ServiceRankDataset

    train_splits, held_splits = counts
    holdout = Holdout(cfg.eval_fraction, seed=cfg.seed) if held_splits else None
    train = ServiceRankDataset(
        cfg.service, rank=rank, world_size=world_size, holdout=holdout,
        batch_size=cfg.batch_size, splits=train_splits, shuffle=cfg.shuffle, seed=cfg.seed,
    )  # fmt: skip
    held_out = None
    if holdout is not None:  # every rank: all held-out rows at the global batch size
        held_out = ServiceRankDataset(
            cfg.service, rank=0, world_size=1, holdout=holdout.other(),
            batch_size=cfg.batch_size * world_size, splits=held_splits, drop_remainder=False,
        )  # fmt: skip
    return RunStream(train, held_out, splits=counts)
