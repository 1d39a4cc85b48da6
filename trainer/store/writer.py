"""Checkpoints: the writer thread, the copy-on-write pool, and persisting a snapshot.

``checkpoint(step, wait=False)`` freezes the dirty rows at the step boundary (no copy) and the
writer thread stores them while training goes on, in file order, staging ~2 MB at a time under
a short lock and writing with no lock held; ``update`` of a frozen row the writer has not staged
yet first appends its image to a copy-on-write pool kept from one checkpoint to the next (so its
pages are not faulted in again), and an eviction waits for the writer. Every heavy loop of the
writer is a Numba kernel that releases the GIL.

Locking: :class:`CheckpointWriter` owns ``cow_lock``, which guards the per-slot frozen flags,
the pool and the snapshot's positions, and is taken by the training thread (``freeze``,
``cow_save``) and the writer thread (staging). :meth:`snapshot`, :meth:`cow_save` and
:meth:`start` run with the store lock held (the facade's); the writer thread never takes it.
"""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.store import _kernels as K
from trainer.store.index import saved_bytes
from trainer.store.persist import CommitRecord, append_checkpoint_log, write_file, write_ids

if TYPE_CHECKING:
    from trainer.store.cache import RowCache
    from trainer.store.home import Home

__all__ = ["CheckpointWriter", "Snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """What one checkpoint writes, frozen at a step boundary.

    Attributes:
        step: the step just completed.
        slots: int64 [Uc] the frozen cache slots (their rows changed since the last checkpoint).
        rows: int64 [Uc + Uh] the rows of ``slots``, then the changed hot rows.
        hot_image: float32 [Uh, W] the values of the changed hot rows.
        num_rows: rows in the table.
        index: the id index's arrays (``IdIndex.frozen_view``) when this checkpoint saves the
            index, else None.
        new_ids: the ids of the rows added since the last commit (int64 bytes).
        hot_ids: the ids of the hot set (int64 bytes).
        seconds: how long taking the snapshot blocked training.
        optimizer_step: the optimizer steps the store has taken (Adam's bias correction).
    """

    step: int
    slots: np.ndarray
    rows: np.ndarray
    hot_image: np.ndarray
    num_rows: int
    index: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None
    new_ids: bytes
    hot_ids: bytes
    seconds: float
    optimizer_step: int = 0


class CheckpointWriter:
    """Writes snapshots to the store directory in a background thread, one at a time.

    Args:
        home: the rows' home file and commit records.
        cache: the host cache whose frozen slots are written (its current slab is read).
        ids_crc: CRC of the committed ``ids.bin`` prefix.
        index_saved: what the last saved index covers (None: none is saved).
        chunk_rows: the pool grows by at least this many rows.
    """

    def __init__(
        self,
        home: Home,
        cache: RowCache,
        *,
        ids_crc: int,
        index_saved: dict[str, int] | None,
        chunk_rows: int,
    ) -> None:
        self._home = home
        self._cache = cache
        self._width = home.file.meta.width
        self._chunk_rows = chunk_rows
        self._ids_crc = ids_crc
        self._index_saved = index_saved
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[dict[str, Any]] | None = None
        self.rows_written = 0
        self.checkpoints = home.commit.epoch
        self.last_step = home.commit.step
        # copy-on-write of the rows of the checkpoint in flight (see freeze / cow_save)
        self.cow_lock = threading.Lock()
        self.frozen = np.zeros(0, dtype=np.bool_)  # per slot: not yet copied by the writer
        self._cp_pos = np.zeros(0, dtype=np.int64)  # slot -> position in the snapshot
        self.cow_pool = np.zeros((0, self._width), dtype=np.float32)  # images, kept warm
        self._cow_used = 0
        self.cow_saved = np.zeros(0, dtype=np.int64)  # snapshot entry -> pool row, or -1

    # ------------------------------------------------------------------ the training side

    @property
    def in_flight(self) -> bool:
        """A checkpoint was started and not waited for."""
        return self._inflight is not None

    def wants_index(self, num_rows: int) -> bool:
        """Whether a checkpoint of ``num_rows`` rows saves the index (it grew by 1/4)."""
        last = self._index_saved
        return bool(num_rows) and (last is None or num_rows * 4 >= last["rows"] * 5)

    def freeze(self, slots: np.ndarray) -> None:
        """Mark cache ``slots`` as the snapshot's: the writer copies them, an update of one it
        has not copied yet saves its image first (:meth:`cow_save`)."""
        with self.cow_lock:
            self._fit(self._cache.capacity)
            self.frozen[slots] = True
            if self._cp_pos.size < self.frozen.size:
                self._cp_pos = np.full(self.frozen.size, -1, dtype=np.int64)
            self._cp_pos[slots] = np.arange(slots.size)
            self.cow_saved = np.full(slots.size, -1, dtype=np.int64)
            self._cow_used = 0

    def _fit(self, num_slots: int) -> None:
        """Frozen flags for every slot of a slab grown to ``num_slots`` (under ``cow_lock``)."""
        if self.frozen.size < num_slots:
            grown = np.zeros(num_slots, dtype=np.bool_)
            grown[: self.frozen.size] = self.frozen
            self.frozen = grown

    def cow_save(self, slab: np.ndarray, slots: np.ndarray) -> None:
        """Before updating ``slots`` of ``slab``, save the image of those the writer has not
        staged yet."""
        with self.cow_lock:
            self._fit(slab.shape[0])
            while True:
                used = K.cow_save(
                    slab,
                    slots,
                    self.frozen,
                    self._cp_pos,
                    self.cow_saved,
                    self.cow_pool,
                    self._cow_used,
                )
                self._cow_used = used
                if used < self.cow_pool.shape[0] or not self.frozen[slots].any():
                    return
                grown = np.empty((max(2 * used, self._chunk_rows), self._width), np.float32)
                grown[:used] = self.cow_pool[:used]
                self.cow_pool = grown

    def is_committed(self, snap: Snapshot) -> bool:
        """True when ``snap`` is the committed state: same step, no row written since, same
        rows and hot set."""
        commit = self._home.commit
        return (
            commit.epoch > 0
            and snap.step == commit.step
            and snap.optimizer_step == commit.optimizer_steps
            and snap.rows.size == 0
            and snap.index is None
            and snap.num_rows == commit.num_rows
            and len(snap.hot_ids) // 8 == commit.num_hot
            and zlib.crc32(snap.hot_ids) == commit.hot_crc
        )

    def committed_info(self, snap: Snapshot) -> dict[str, Any]:
        """The summary of a checkpoint that found its state already committed."""
        return {
            "step": snap.step,
            "epoch": self._home.commit.epoch,
            "rows": snap.num_rows,
            "rows_written": 0,
            "bytes_written": 0,
            "snapshot_seconds": round(snap.seconds, 6),
            "seconds": round(snap.seconds, 6),
            "writer_cpu_seconds": 0.0,
            "time": time.time(),
            "already_committed": True,
        }

    def start(self, snap: Snapshot) -> Future[dict[str, Any]]:
        """Write ``snap`` in the writer thread (no checkpoint may be in flight)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="recpipe-checkpoint")
        self._inflight = self._executor.submit(self._persist, snap)
        return self._inflight

    def wait(self) -> dict[str, Any] | None:
        """Wait for the checkpoint in flight (if any) and return its summary (errors re-raised)."""
        future, self._inflight = self._inflight, None
        return None if future is None else future.result()

    def shutdown(self) -> None:
        """Stop the writer thread (after :meth:`wait`)."""
        if self._executor is not None:
            self._executor.shutdown()

    # ------------------------------------------------------------------ the writer thread

    def _write_frozen(
        self, slots: np.ndarray, rows: np.ndarray, pos: np.ndarray, *, batch: int = 8192
    ) -> None:
        """Write the frozen ``slots`` holding ``rows`` (or their saved images) to disk positions
        ``pos``.

        In file order (one page fault per page; in random order, which cache-slot order
        becomes once slots are reused, the same writes cost several times more; no sort
        needed), a batch at a time: under the copy-on-write lock a batch is only copied to a
        staging buffer (8192 rows: ~2 MB at D = 64), so an ``update`` never waits for the disk; the
        staged rows are then written to the memory-mapped file with the lock released.
        (Starting each batch's write-back at once with ``sync_file_range`` was tried: less
        writer time alone, no gain beside training.)
        """
        if not slots.size:
            return
        order = K.order_by_row(rows, int(rows.max()) + 1)
        staging = np.empty((min(batch, slots.size), self._width), dtype=np.float32)
        for lo in range(0, slots.size, batch):
            ks = order[lo : lo + batch]
            out = staging[: ks.size]
            with self.cow_lock:  # the slab may have grown meanwhile: always the current one
                K.stage_frozen(
                    self._cache.slab_np, slots, ks, self.frozen, self.cow_saved, self.cow_pool, out
                )
            self._home.file.write_block(out.view(np.uint32), pos[ks])

    def _persist(self, snap: Snapshot) -> dict[str, Any]:
        """Write a snapshot and commit it (the writer thread)."""
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        home = self._home
        rows, num_rows, slots = snap.rows, snap.num_rows, snap.slots
        home.release_previous()
        home.file.ensure(num_rows)
        if rows.size:
            pos = home.write_pos(rows)  # never the committed copy: a crash leaves it intact
            self._write_frozen(slots, rows[: slots.size], pos[: slots.size])
            hot = snap.hot_image
            home.file.write(hot.view(np.uint32), np.arange(len(hot)), pos[slots.size :])
            home.mark_written(rows, pos)
            self.rows_written += rows.size
        if home.sync:
            home.file.sync()
        last = home.commit
        write_ids(home.root / "ids.bin", snap.new_ids, at_row=last.num_rows, sync=home.sync)
        self._ids_crc = zlib.crc32(snap.new_ids, self._ids_crc)
        epoch = last.epoch + 1
        if snap.hot_ids:
            write_file(home.root / f"hot-{epoch}.bin", snap.hot_ids, sync=home.sync)
        copies = home.copy_bitmap(num_rows)
        write_file(home.root / f"copies-{epoch}.bin", copies, sync=home.sync)
        index_info = last.index
        if snap.index is not None:
            data, index_info = saved_bytes(snap.index)
            index_info = dict(index_info, epoch=epoch)
            write_file(home.root / f"index-{epoch}.bin", memoryview(data).cast("B"), sync=home.sync)
        commit = CommitRecord(
            step=snap.step,
            epoch=epoch,
            num_rows=num_rows,
            ids_crc=self._ids_crc,
            num_hot=len(snap.hot_ids) // 8,
            hot_crc=zlib.crc32(snap.hot_ids),
            copies_crc=zlib.crc32(copies),
            index=index_info,
            optimizer_step=snap.optimizer_step,
        )
        home.commit_to(commit)
        self._index_saved = index_info
        info = {
            "step": snap.step,
            "epoch": epoch,
            "rows": num_rows,
            "rows_written": int(rows.size),
            "bytes_written": int(rows.size) * home.file.meta.disk_width * 4 + len(snap.new_ids),
            "snapshot_seconds": round(snap.seconds, 6),
            "seconds": round(time.perf_counter() - t0 + snap.seconds, 6),
            "writer_cpu_seconds": round(time.thread_time() - cpu0, 6),
            "time": time.time(),
        }
        append_checkpoint_log(home.root, info)
        self.checkpoints += 1
        self.last_step = snap.step
        return info
