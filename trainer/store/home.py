"""The home of every row as the running store sees it: ``rows.bin``, which of each row's two
on-disk copies is committed and which is newest, and the commit records (CURRENT, PREVIOUS).

See :mod:`trainer.store.persist` for the format and why a row has two copies.

Locks (both owned here; no other lock is taken while holding them):

- ``copies_lock`` guards the per-row copy arrays: the checkpoint writer flips them from its
  thread while a prefetch in the training (or loader) thread may grow them.
- a private lock guards the kept PREVIOUS record, released by the first row write after a commit
  from whichever thread writes first.

Every other method is called with the store lock held (see :class:`~trainer.store.EmbeddingStore`),
or from the writer thread, which no eviction overlaps (an eviction waits for the writer first).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from trainer.store.persist import CommitRecord, RowFile, fsync_dir

__all__ = ["Home"]


class Home:
    """``rows.bin`` with the copy state of every row and the commit records.

    Args:
        root: the store directory.
        file: its ``rows.bin``, opened for writing.
        commit: the last completed checkpoint.
        previous: the checkpoint before it, still restorable (None: none is).
        sync: fsync what is written (``StoreConfig.sync == "full"``).
    """

    def __init__(
        self,
        root: Path,
        file: RowFile,
        *,
        commit: CommitRecord,
        previous: CommitRecord | None,
        sync: bool,
    ) -> None:
        self.root = root
        self.file = file
        self.sync = sync
        self.commit = commit
        self._previous = previous
        self._previous_lock = threading.Lock()
        self.copies_lock = threading.Lock()
        # each row has two copies on disk: the committed one and the one written after it
        self._committed = np.zeros(0, dtype=np.int8)  # copy of the last checkpoint
        self._cur = np.zeros(0, dtype=np.int8)  # copy holding the newest value on disk

    # ------------------------------------------------------------------ per-row copy state

    def grow_rows(self, cap: int) -> None:
        """Make room for rows [0, cap) (new rows: copy 0 committed and newest)."""
        with self.copies_lock:  # the checkpoint writer flips copies concurrently
            self._committed = _grown(self._committed, cap)
            self._cur = _grown(self._cur, cap)

    def set_committed_copies(self, copies: np.ndarray) -> None:
        """Recovery: rows [0, len(copies)) are at the committed copies ``copies`` (0 or 1)."""
        n = copies.size
        with self.copies_lock:
            self._committed[:n] = copies
            self._cur[:n] = copies

    def read_pos(self, rows: np.ndarray) -> np.ndarray:
        """Positions in ``rows.bin`` of the newest on-disk copy of ``rows``."""
        return 2 * rows + self._cur[rows]

    def write_pos(self, rows: np.ndarray) -> np.ndarray:
        """Positions of the copy of ``rows`` that is not committed (the one to overwrite)."""
        return 2 * rows + 1 - self._committed[rows]

    def mark_written(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """``rows`` now have their newest value at positions ``pos``."""
        with self.copies_lock:
            self._cur[rows] = pos - 2 * rows

    def copy_bitmap(self, num_rows: int) -> bytes:
        """One bit per row of [0, num_rows): its newest copy (what a commit makes committed)."""
        with self.copies_lock:
            return np.packbits(self._cur[:num_rows].astype(np.bool_)).tobytes()

    # ------------------------------------------------------------------ rows

    def read(self, rows: np.ndarray, dst_words: np.ndarray, dst_index: np.ndarray) -> None:
        """Read the newest copy of ``rows`` into ``dst_words[dst_index]``, checking checksums."""
        self.file.read(self.read_pos(rows), dst_words, dst_index)

    def verify(self, num_rows: int) -> None:
        """Check the checksum of every row in [0, num_rows) (StoreError at the first bad)."""
        if num_rows:
            self.file.verify(self.read_pos(np.arange(num_rows)))

    def write_back(self, src_words: np.ndarray, src_index: np.ndarray, rows: np.ndarray) -> None:
        """Write ``src_words[src_index]`` (the values of ``rows``) to their uncommitted copies
        (an eviction)."""
        self.release_previous()
        self.file.ensure(int(rows.max()) + 1)
        pos = self.write_pos(rows)
        self.file.write(src_words, src_index, pos)
        self.mark_written(rows, pos)

    # ------------------------------------------------------------------ commit records

    @property
    def previous(self) -> CommitRecord | None:
        """The checkpoint before the last, while it is still restorable."""
        return self._previous

    def release_previous(self) -> None:
        """Before the first row write after a commit: the checkpoint before it stops being
        restorable, so PREVIOUS and its own files go."""
        with self._previous_lock:
            previous, self._previous = self._previous, None
            if previous is None:
                return
            (self.root / "PREVIOUS").unlink(missing_ok=True)
            if self.sync:
                fsync_dir(self.root)
            for name in previous.files() - self.commit.files():
                (self.root / name).unlink(missing_ok=True)

    def commit_to(self, record: CommitRecord) -> None:
        """Make ``record`` the last completed checkpoint (its files are written and synced):
        the last one is kept as PREVIOUS, then CURRENT is replaced (the commit point)."""
        previous = self.commit
        if previous.epoch:  # kept restorable until the next row write (release_previous)
            previous.save(self.root, sync=self.sync, name="PREVIOUS")
        record.save(self.root, sync=self.sync)  # the commit point
        n = record.num_rows
        with self.copies_lock:
            self._committed[:n] = self._cur[:n]
        self.commit = record
        with self._previous_lock:
            self._previous = previous if previous.epoch else None

    def close(self) -> None:
        self.file.close()


def _grown(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros(cap, dtype=a.dtype)
    out[: a.size] = a
    return out
