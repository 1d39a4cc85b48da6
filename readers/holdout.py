"""Held-out row groups: the part of a dataset evaluation reads and training never does.

A dataset's splits (row groups, :class:`readers.source.Split`) are divided once, with a seed,
into training and held-out ones, never cutting a session. The in-process trainer and the reader
service (``recpipe serve``, asked for a :class:`Holdout` part in the client's HELLO) call the same
:func:`holdout_splits`, so for the same dataset, fraction and seed they read the same rows::

    all splits      s0 s1 s2 s3 s4 s5 s6 s7 s8 s9
    drawn (seed)          s2          s6              round(fraction * n) of them
    held out              s2          s6              unless a session crosses into training
    train           s0 s1    s3 s4 s5    s7 s8 s9
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from recpipe.errors import DataError

__all__ = ["Holdout", "HoldoutPart", "holdout_splits"]

HoldoutPart = Literal["train", "held_out"]
_PARTS: tuple[str, ...] = ("train", "held_out")


def holdout_splits(
    splits: Sequence[Any], *, session_key: str, fraction: float, seed: int
) -> tuple[list[Any], list[Any]]:
    """Divide row groups into training and held-out ones, never splitting a session.

    ``round(fraction * n)`` row groups are drawn with ``seed``; a drawn row group whose first or
    last session also begins or ends a training row group (a session longer than a row group)
    goes back to training, so no held-out row belongs to a training session.

    Args:
        splits: the dataset's splits (``readers.source.Split``: ``path``, ``row_group``).
        session_key: the session column.
        fraction: share of row groups to hold out, in [0, 1).
        seed: the draw's seed.

    Returns:
        ``(train, held_out)``, each in dataset order.

    Raises:
        DataError: a non-zero fraction with fewer than two row groups.
    """
    import pyarrow.parquet as pq

    if not 0.0 <= fraction < 1.0:
        msg = f"`eval_fraction` must be in [0, 1), got {fraction!r}"
        raise DataError(msg)
    splits = list(splits)
    if fraction == 0:
        return splits, []
    if len(splits) < 2:
        msg = (
            f"`eval_fraction` {fraction} needs at least two row groups, the dataset has "
            f"{len(splits)}; use --eval-fraction 0 or rebuild with a smaller --row-group-size"
        )
        raise DataError(msg)
    n_eval = min(max(round(fraction * len(splits)), 1), len(splits) - 1)
    chosen = set(np.random.default_rng([seed, 0xE7A1]).permutation(len(splits))[:n_eval].tolist())
    ends: list[tuple[Any, Any]] = []
    files: dict[str, Any] = {}
    for s in splits:
        pf = files.get(s.path) or files.setdefault(s.path, pq.ParquetFile(s.path))
        col = pf.read_row_group(s.row_group, columns=[session_key]).column(0)
        ends.append((col[0].as_py(), col[-1].as_py()) if len(col) else (None, None))
    train_ends = {e for i, pair in enumerate(ends) if i not in chosen for e in pair}
    held = [i for i in sorted(chosen) if not ({*ends[i]} - {None}) & train_ends]
    held_set = set(held)
    return [s for i, s in enumerate(splits) if i not in held_set], [splits[i] for i in held]


@dataclass(frozen=True)
class Holdout:
    """One part of a dataset divided by :func:`holdout_splits`: its training or held-out splits.

    Attributes:
        fraction: share of row groups held out, in [0, 1) (0: nothing is held out).
        seed: the draw's seed.
        part: ``"train"`` (every split not held out) or ``"held_out"``.

    >>> Holdout(0.1, seed=3, part="held_out").other()
    Holdout(fraction=0.1, seed=3, part='train')
    """

    fraction: float
    seed: int = 0
    part: HoldoutPart = "train"

    def __post_init__(self) -> None:
        fraction_ok = isinstance(self.fraction, int | float) and not isinstance(self.fraction, bool)
        if not (fraction_ok and 0.0 <= self.fraction < 1.0):
            msg = f"`fraction` must be a number in [0, 1), got {self.fraction!r}"
            raise DataError(msg)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            msg = f"`seed` must be an integer, got {self.seed!r}"
            raise DataError(msg)
        if self.part not in _PARTS:
            msg = f"`part` must be one of {', '.join(map(repr, _PARTS))}, got {self.part!r}"
            raise DataError(msg)

    def other(self) -> Holdout:
        """The complementary part (same fraction and seed)."""
        return Holdout(self.fraction, self.seed, "held_out" if self.part == "train" else "train")

    def select(self, splits: Sequence[Any], *, session_key: str) -> list[Any]:
        """This part's splits of ``splits``, in dataset order (see :func:`holdout_splits`)."""
        train, held = holdout_splits(
            splits, session_key=session_key, fraction=self.fraction, seed=self.seed
        )
        return train if self.part == "train" else held
