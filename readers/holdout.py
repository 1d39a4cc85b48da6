"""Held-out sessions: the part of a dataset evaluation reads and training never does.

A session is held out when the hash of its id (splitmix64, salted with the seed) falls below a
threshold. The threshold is chosen once per dataset, fraction and seed: sessions sorted by hash
are taken until their rows come closest to ``fraction`` of all rows, so the held-out share of
rows is ``fraction`` to within one session, at any size (a 20k-row dataset in one row group
too). The in-process trainer and the reader service (``recpipe serve``, asked for a
:class:`Holdout` part in the client's HELLO) call the same :func:`holdout_splits`, so for the same
dataset, fraction and seed they read the same rows::

    sessions by hash      h(a) < h(d) < h(b) < h(e) < h(c) ...
    rows, cumulated         3     5      9     12     14  ...   (of 100 rows, fraction 0.1)
    held out              a, d, b (9 rows: closest to 10)  ->  threshold h(e)
    every split           rows of held-out sessions -> the held-out part, the rest -> training

A split (row group) keeps its place in both parts with the rows of that part only (its
``num_rows`` counts them, its ``keep`` filter selects them when it is read); a split with no row
in a part is left out of it. A session is never cut: all its rows share one hash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from recpipe.errors import DataError
from recpipe.kernels.splitmix import salt_add, splitmix64

__all__ = ["Holdout", "HoldoutPart", "SessionFilter", "holdout_splits", "session_hashes"]

HoldoutPart = Literal["train", "held_out"]
_PARTS: tuple[str, ...] = ("train", "held_out")
_SALT = 0xE7A1  # mixed with the seed: the holdout hash differs from other seeded hashes


def session_hashes(sessions: np.ndarray, *, seed: int) -> np.ndarray:
    """The holdout hash (uint64) of each session id."""
    return splitmix64(np.asarray(sessions, dtype=np.int64), add=salt_add(seed * 65_537 + _SALT))


@dataclass(frozen=True)
class SessionFilter:
    """The rows of one holdout part: sessions whose hash is below (held out) or at or above
    (training) ``threshold``.

    Attributes:
        seed: the hash's seed.
        threshold: the first hash of training.
        held_out: select the held-out rows (else the training rows).
    """

    seed: int
    threshold: int
    held_out: bool

    def mask(self, sessions: np.ndarray) -> np.ndarray:
        """Boolean mask of the rows of ``sessions`` (ids) in this part."""
        below = session_hashes(sessions, seed=self.seed) < np.uint64(self.threshold)
        return below if self.held_out else ~below


def holdout_splits(
    splits: Sequence[Any], *, session_key: str, fraction: float, seed: int
) -> tuple[list[Any], list[Any]]:
    """Divide a dataset's rows into training and held-out ones by session hash.

    Reads the session column of every split once. ``fraction`` is the share of rows held out,
    met to within one session (the sessions nearest the threshold decide).

    Args:
        splits: the dataset's splits (``readers.source.Split``).
        session_key: the session column.
        fraction: share of rows to hold out, in [0, 1).
        seed: the hash's seed.

    Returns:
        ``(train, held_out)``, each in dataset order: the splits with rows in that part, each
        restricted to them (``num_rows`` and a ``keep`` :class:`SessionFilter`).

    Raises:
        DataError: a fraction outside [0, 1), or a non-zero one with fewer than two sessions.
    """
    import pyarrow.parquet as pq

    if not 0.0 <= fraction < 1.0:
        msg = f"`eval_fraction` must be in [0, 1), got {fraction!r}"
        raise DataError(msg)
    splits = list(splits)
    if fraction == 0:
        return splits, []
    per_split: list[tuple[np.ndarray, np.ndarray]] = []  # (session hashes, their rows)
    files: dict[str, Any] = {}
    try:
        for s in splits:
            pf = files.get(s.path) or files.setdefault(s.path, pq.ParquetFile(s.path))
            column = pf.read_row_group(s.row_group, columns=[session_key]).column(0)
            ids = column.to_numpy()
            if s.keep is not None:
                ids = ids[s.keep.mask(ids)]
            hashes, rows = np.unique(session_hashes(ids, seed=seed), return_counts=True)
            per_split.append((hashes, rows))
    finally:
        for pf in files.values():
            pf.close()
    threshold = _threshold(per_split, fraction)
    if threshold is None:
        sessions = len(np.unique(np.concatenate([h for h, _ in per_split] or [np.empty(0)])))
        msg = (
            f"`eval_fraction` {fraction} needs at least two sessions, the dataset has {sessions}; "
            "use --eval-fraction 0"
        )
        raise DataError(msg)
    train, held = [], []
    for s, (hashes, rows) in zip(splits, per_split, strict=True):
        n_held = int(rows[hashes < np.uint64(threshold)].sum())
        n_train = int(rows.sum()) - n_held
        if n_train:
            train.append(
                dataclasses.replace(s, num_rows=n_train, keep=SessionFilter(seed, threshold, False))
            )
        if n_held:
            held.append(
                dataclasses.replace(s, num_rows=n_held, keep=SessionFilter(seed, threshold, True))
            )
    return train, held


def _threshold(per_split: list[tuple[np.ndarray, np.ndarray]], fraction: float) -> int | None:
    """The hash below which sessions are held out: their rows closest to ``fraction`` of all,
    at least one session on each side (``None``: fewer than two sessions)."""
    if not per_split:
        return None
    hashes = np.concatenate([h for h, _ in per_split])
    rows = np.concatenate([r for _, r in per_split])
    order = np.argsort(hashes, kind="stable")
    hashes, rows = hashes[order], rows[order]
    # a session cut by a row-group boundary appears in both splits: add its rows up
    first = np.concatenate(([True], hashes[1:] != hashes[:-1]))
    unique = hashes[first]
    totals = np.add.reduceat(rows, np.flatnonzero(first))
    if len(unique) < 2:
        return None
    cumulated = np.cumsum(totals)  # rows of the first k + 1 sessions
    k = int(np.argmin(np.abs(cumulated[:-1] - fraction * cumulated[-1]))) + 1  # held: the first k
    return int(unique[k])


@dataclass(frozen=True)
class Holdout:
    """One part of a dataset divided by :func:`holdout_splits`: its training or held-out splits.

    Attributes:
        fraction: share of rows held out (whole sessions, by hash), in [0, 1) (0: nothing is
            held out).
        seed: the hash's seed.
        part: ``"train"`` (every session not held out) or ``"held_out"``.

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
        """This part's splits of ``splits`` (restricted to its rows), in dataset order (see
        :func:`holdout_splits`)."""
        train, held = holdout_splits(
            splits, session_key=session_key, fraction=self.fraction, seed=self.seed
        )
        return train if self.part == "train" else held
