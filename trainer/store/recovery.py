"""Opening a store: finding its last commit, rolling back one if asked, checking every file.

Everything here reads only, except :meth:`Recovery.roll_back`, the one write an open may do
(when ``open_store(path, step=...)`` asks for the checkpoint before the last). It runs after
every check passed, so a refused open changes nothing. :func:`verify_store` opens every file
read-only.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recpipe.errors import StoreError
from trainer.store.index import IdIndex
from trainer.store.persist import (
    CommitRecord,
    RowFile,
    StoreMeta,
    load_current,
    read_copies,
    read_hot,
    read_ids,
)

__all__ = ["Recovery", "verify_store"]


@dataclass
class Recovery:
    """The state of a store's last completed checkpoint (or of the one before, on a roll-back),
    read from disk and checked against its commit record.

    Attributes:
        root: the store directory.
        commit: the checkpoint to restore.
        previous: the checkpoint before it, still restorable (None: none is).
        ids: int64 [rows] the id of each row.
        copies: int8 [rows] which on-disk copy of each row is committed.
        hot_ids: int64 [R] the ids of the hot set.
        index: the id index of ``ids``.
        index_saved: what the last saved index covers (None: none was saved).
        dropped: the commit a roll-back replaces (None: no roll-back).
    """

    root: Path
    commit: CommitRecord
    previous: CommitRecord | None
    ids: np.ndarray
    copies: np.ndarray
    hot_ids: np.ndarray
    index: IdIndex
    index_saved: dict[str, int] | None
    dropped: CommitRecord | None = None

    @classmethod
    def read(cls, root: Path, *, step: int | None, num_shards: int) -> Recovery:
        """Read and check the commit to restore: the last (``step`` None or its step), or the
        one before it (``step`` its step; :meth:`roll_back` then makes it the last).

        Raises:
            StoreError: a missing, truncated or corrupted file, or no checkpoint of ``step``.
        """
        current = load_current(root)
        commit, previous, dropped = _pick(root, current, step)
        ids = read_ids(root / "ids.bin", commit.num_rows, commit.ids_crc)
        index, index_saved = _load_index(root, commit, ids, num_shards=num_shards)
        copies = read_copies(root / f"copies-{commit.epoch}.bin", commit)
        hot_ids = read_hot(root / f"hot-{commit.epoch}.bin", commit.num_hot, commit.hot_crc)
        return cls(root, commit, previous, ids, copies, hot_ids, index, index_saved, dropped)

    def check_rows(self, file: RowFile) -> None:
        """StoreError unless ``rows.bin`` holds every committed row."""
        if file.capacity < self.commit.num_rows:
            msg = (
                f"store file {str(file.path)!r} is truncated: {file.capacity} rows, the last "
                f"checkpoint has {self.commit.num_rows}"
            )
            raise StoreError(msg)

    def roll_back(self, *, sync: bool) -> None:
        """If a roll-back was asked for: CURRENT := PREVIOUS (atomically), and the files of the
        dropped checkpoint go."""
        if self.dropped is None:
            return
        root = self.root
        self.commit.save(root, sync=sync)
        (root / "PREVIOUS").unlink()
        for name in self.dropped.files() - self.commit.files():
            (root / name).unlink(missing_ok=True)
        self.dropped = None


def _pick(
    root: Path, current: CommitRecord, step: int | None
) -> tuple[CommitRecord, CommitRecord | None, CommitRecord | None]:
    """(the commit to restore, the one kept before it, the commit a roll-back drops)."""
    if step is None or step == current.step:
        # PREVIOUS is only kept for a roll-back: a damaged one does not stop this open (the
        # next commit replaces it), but is never used
        kept = None
        if (root / "PREVIOUS").exists():
            with contextlib.suppress(StoreError):
                kept = CommitRecord.load(root, "PREVIOUS")
        return current, (kept if kept is not None and kept.epoch < current.epoch else None), None
    kept = CommitRecord.load(root, "PREVIOUS") if (root / "PREVIOUS").exists() else None
    if kept is None or kept.step != step or kept.epoch >= current.epoch:
        earlier = "" if kept is None else f" (the one before it, kept: step {kept.step})"
        msg = (
            f"store {str(root)!r} holds the checkpoint of step {current.step}{earlier}, "
            f"not of step {step}: rows were written after a later checkpoint"
        )
        raise StoreError(msg)
    return kept, None, current


def _load_index(
    root: Path, commit: CommitRecord, ids: np.ndarray, *, num_shards: int
) -> tuple[IdIndex, dict[str, int] | None]:
    """The saved index plus the ids added after it was saved (or a rebuild from the ids)."""
    info = commit.index
    if info is None:
        return IdIndex.from_ids(ids, num_shards=num_shards), None
    path = root / f"index-{info['epoch']}.bin"
    try:
        data = np.fromfile(path, dtype=np.int64)
    except FileNotFoundError:
        raise StoreError(f"store file {str(path)!r} is missing") from None
    if info["rows"] > ids.size:
        msg = f"store file {str(path)!r} does not match the ids of the store; it is corrupted"
        raise StoreError(msg)
    index = IdIndex.from_bytes(data, info, copy=False)
    rows, _ = index.insert(ids[info["rows"] :])
    if index.num_rows != ids.size or not np.array_equal(rows, np.arange(info["rows"], ids.size)):
        msg = f"store file {str(path)!r} does not match the ids of the store; it is corrupted"
        raise StoreError(msg)
    return index, info


def verify_store(path: str | os.PathLike[str]) -> int:
    """Check a store without changing it: every file of its last checkpoint against the commit
    record, and every committed row against its checksum. Opens every file read-only.

    Returns:
        the number of rows checked.

    Raises:
        StoreError: what a failed check found (the file, and the row for a bad checksum).
    """
    root = Path(path)
    if not root.is_dir():
        raise StoreError(f"`path` {str(path)!r} is not a store directory")
    meta = StoreMeta.load(root)
    state = Recovery.read(root, step=None, num_shards=16)
    n = state.commit.num_rows
    if n == 0:
        return 0
    file = RowFile(root / "rows.bin", meta, writable=False)
    try:
        state.check_rows(file)
        file.verify(2 * np.arange(n, dtype=np.int64) + state.copies)
    finally:
        file.close()
    return n
