"""The hybrid embedding store: host chunks + hot set on the device + persistent tier.

Tiers of a row, fastest first::

    hot set   device tensor [R, W]       the R most frequent rows (cost model), replicated
    cache     host slab [slots, W]       LRU over the rest, bounded by `cache_rows`
    home      rows.bin on disk           every row not in memory; checkpoints + recovery

``W = D + state``: the embedding and its optimizer state (row-wise Adagrad: 1 float; Adam: its
moments m and v, 2D floats) live side by side, so moving a row between tiers never loses optimizer
state. Adam's bias correction counts the store's optimizer steps
(:attr:`EmbeddingStore.optimizer_step`: one per :meth:`EmbeddingStore.update`, or the step a
caller gives it), kept in each commit record.

A step::

    loc = store.prefetch(ids)    # index ids (new ids get rows), bring rows into memory, pin them
    rows = store.pull(loc)       # [U, D] unique rows on the training device
    ...forward/backward...
    store.push(loc, grad_rows)   # [U, D] gradients of those rows
    store.update()               # fused sparse optimizer step on the pushed rows
    store.checkpoint(step)       # now and then, at a step boundary

Thread contract: ``prefetch`` may run in a loader thread ahead of the step; it and ``update``,
``checkpoint`` and ``reshard`` take the store's lock, while ``pull`` reads pinned rows without
it. The rows of a ``Locations`` stay pinned in memory until ``pin_window`` further prefetches
have been made, so a loader may run at most ``pin_window - 1`` batches ahead of the batch being
trained. ``reshard`` invalidates earlier locations (using one raises StoreError).

:class:`EmbeddingStore` is a facade over four parts, each in its own module:

    RowCache          (cache.py)     the host slab, LRU eviction, pins
    HotSet            (hotset.py)    the device rows and the access counts that choose them
    CheckpointWriter  (writer.py)    the writer thread, the copy-on-write pool, persisting
    Home, Recovery    (home.py, recovery.py)   rows.bin and the commit records; opening

Locks: the store lock (``EmbeddingStore._lock``, re-entrant) is created and taken by the facade
alone; the parts never take it themselves (the cache's eviction hook, ``wait_checkpoint``,
re-enters it from the thread that holds it), and their methods that change shared state are
documented as running under it. Two parts own a lock of their own for what the checkpoint writer
thread shares with training: ``CheckpointWriter.cow_lock`` (frozen slots, the pool) and
``Home.copies_lock`` (which copy of each row is committed). Order: the store lock, then at most
one of the parts' own locks; the writer thread takes only the parts' own locks, one at a time.

Not done here: several ranks (all-reduce of hot-row gradients, all-to-all of cold rows); the
cost model's coefficients are measured with collectives when ``torch.distributed`` is set up.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recpipe.errors import StoreError
from trainer.store import _kernels as K
from trainer.store.cache import RowCache, coalesce, init_rows, sparse_step
from trainer.store.config import Locations, StoreConfig, StoreStats, state_dim
from trainer.store.home import Home
from trainer.store.hotset import CostCoefficients, HotPlan, HotSet
from trainer.store.index import IdIndex
from trainer.store.persist import CommitRecord, RowFile, StoreMeta, refuse_store_files
from trainer.store.recovery import Recovery
from trainer.store.writer import CheckpointWriter, Snapshot

if TYPE_CHECKING:
    import torch

__all__ = [
    "EmbeddingStore",
    "Locations",
    "StoreConfig",
    "StoreStats",
    "init_rows",
    "open_store",
]

_log = logging.getLogger(__name__)


class EmbeddingStore:
    """A KV embedding store: host chunks, a device hot set, a persistent home with checkpoints.

    Create one with :meth:`create` (or :func:`open_store` to recover an existing one). See the
    module docstring for the step protocol, the thread contract and the locks.
    """

    # ------------------------------------------------------------------ construction / recovery

    def __init__(
        self,
        root: Path,
        meta: StoreMeta,
        config: StoreConfig,
        home: Home,
        *,
        ids_crc: int = 0,
        index_saved: dict[str, int] | None = None,
        _tmp: bool = False,
    ) -> None:
        import torch

        self.root = root
        self.meta = meta
        self.config = config
        self._tmp = _tmp
        self._lock = threading.RLock()  # the store lock: see the module docstring
        self._device = torch.device(config.device)
        self._dim = meta.dim
        self._home = home
        self._index = IdIndex(num_shards=config.num_shards)
        self._cache = RowCache(
            meta,
            home,
            cache_rows=config.cache_rows,
            pin_window=config.pin_window,
            before_evict=self.wait_checkpoint,
        )
        self._hot = HotSet(
            dim=meta.dim, width=meta.width, device=self._device, count_batches=config.count_batches
        )
        self._writer = CheckpointWriter(
            home, self._cache, ids_crc=ids_crc, index_saved=index_saved, chunk_rows=meta.chunk_rows
        )
        # per row (grown with the table): the id, and the dedup scratch of prefetch
        self._row_cap = 0
        self._ids_of_row = np.zeros(0, dtype=np.int64)
        self._stamp = np.zeros(0, dtype=np.int64)
        self._upos = np.zeros(0, dtype=np.int64)
        self._seq = 0
        self._pending: list[tuple[Locations, torch.Tensor]] = []
        # the optimizer steps taken (Adam's bias correction), committed with every checkpoint
        self.optimizer_step = home.commit.optimizer_steps
        self._stats = StoreStats(0, 0, 0, 0, 0, 0)
        self._closed = False

    @classmethod
    def create(cls, path: str | os.PathLike[str] | None, config: StoreConfig) -> EmbeddingStore:
        """Create an empty store in directory ``path`` (None: a temporary directory, removed on
        :meth:`close`)."""
        tmp = path is None
        root = Path(tempfile.mkdtemp(prefix="recpipe-store-")) if tmp else Path(path)
        refuse_store_files(root)
        root.mkdir(parents=True, exist_ok=True)
        meta = StoreMeta(
            dim=config.dim,
            state_dim=state_dim(config.optimizer, config.dim),
            optimizer=config.optimizer,
            eps=config.eps,
            seed=config.seed,
            init_scale=config.init_scale,
            chunk_rows=config.chunk_rows,
        )
        meta.save(root, sync=config.sync == "full")
        file = RowFile(root / "rows.bin", meta, writable=True, create=True)
        home = Home(
            root, file, commit=CommitRecord.empty(), previous=None, sync=config.sync == "full"
        )
        return cls(root, meta, config, home, _tmp=tmp)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        lr: float | None = None,
        cache_rows: int | None = None,
        device: str = "cpu",
        verify: bool = False,
        step: int | None = None,
        **options: Any,
    ) -> EmbeddingStore:
        """Open a store, restoring exactly its last completed checkpoint (crash recovery).

        Rows are not read: the home file is memory-mapped and rows come into memory as they are
        looked up, checked against their checksums. Uncommitted changes (after a crash) are
        never seen: each row's committed copy on disk is untouched until the next commit.
        Opening writes nothing to the directory, except the roll-back that ``step`` may ask for
        (after every check passed).

        Args:
            path: the store directory.
            lr: learning rate (the optimizer and its settings are the store's own).
            cache_rows: host memory budget in rows (None: unbounded).
            device: the training device.
            verify: check every row's checksum now instead of when it is first read.
            step: restore the checkpoint of this step: the last one, or the one before it if
                no row was written since the last (a trainer whose other state was saved at
                the earlier step); ``None``: the last one.
            **options: other :class:`StoreConfig` fields (``pin_window``, ``sync``, ...).

        Raises:
            StoreError: missing, truncated or corrupted files, a directory whose commit record
                (CURRENT) is missing beside checkpoint files, or no checkpoint of ``step``.
        """
        root = Path(path)
        meta = StoreMeta.load(root)
        config = StoreConfig(
            dim=meta.dim,
            optimizer=meta.optimizer,  # type: ignore[arg-type]
            lr=lr if lr is not None else StoreConfig.lr,
            eps=meta.eps,
            seed=meta.seed,
            init_scale=meta.init_scale,
            chunk_rows=meta.chunk_rows,
            cache_rows=cache_rows,
            device=device,
            **options,
        )
        state = Recovery.read(root, step=step, num_shards=config.num_shards)
        sync = config.sync == "full"
        file = RowFile(root / "rows.bin", meta, writable=True, create=state.commit.num_rows == 0)
        try:
            state.check_rows(file)
        except BaseException:
            file.close()
            raise
        home = Home(root, file, commit=state.commit, previous=state.previous, sync=sync)
        store = cls(
            root, meta, config, home, ids_crc=state.commit.ids_crc, index_saved=state.index_saved
        )
        try:
            store._restore(state, verify=verify)
            state.roll_back(sync=sync)
        except BaseException:
            store.close()
            raise
        _log.info(
            "opened store %s at step %d (%d rows)", root, state.commit.step, state.commit.num_rows
        )
        return store

    def _restore(self, state: Recovery, *, verify: bool) -> None:
        n = state.commit.num_rows
        self._index = state.index
        self._grow_rows(n)
        if self._ids_of_row.size == n:  # the ids just read become the per-row ids, uncopied
            self._ids_of_row = state.ids
        else:
            self._ids_of_row[:n] = state.ids
        self._home.set_committed_copies(state.copies)
        if verify:
            self._home.verify(n)
        if state.hot_ids.size:
            self._hot.install(self._index.lookup(state.hot_ids), self._cache, self._home)

    def _grow_rows(self, num_rows: int) -> None:
        if num_rows <= self._row_cap:
            return
        cap = max(num_rows, 2 * self._row_cap, 1024)

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.zeros(cap, dtype=a.dtype)  # zero pages come from the OS as first touched
            out[: a.size] = a
            return out

        self._ids_of_row = grown(self._ids_of_row)
        self._stamp = grown(self._stamp)  # 0: no prefetch's sequence number (they start at 1)
        self._upos = grown(self._upos)
        self._cache.grow_rows(cap)
        self._hot.grow_rows(cap)
        self._home.grow_rows(cap)
        self._row_cap = cap

    # ------------------------------------------------------------------ the KV interface

    def prefetch(self, ids: torch.Tensor | np.ndarray) -> Locations:
        """Index ``ids`` (new ids get rows), bring their rows into memory and pin them.

        Safe to call from a loader thread ahead of the step (see the module docstring).

        Args:
            ids: int64 [n] ids, any values, duplicates allowed (e.g. ``ikjt.values()``).
        """
        import torch

        if isinstance(ids, torch.Tensor):
            ids = ids.detach().to("cpu", torch.int64).numpy()
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        with self._lock:
            self._check_open()
            self._seq += 1
            seq = self._seq
            rows, first_new = self._index.insert(ids)
            num_rows = self._index.num_rows
            if num_rows > first_new:
                self._grow_rows(num_rows)
                fresh = rows >= first_new
                self._ids_of_row[rows[fresh]] = ids[fresh]
            uniq, inverse = K.unique_rows(rows, self._stamp, self._upos, seq)
            self._hot.count(uniq)
            cache = self._cache
            slots = cache.slot_of_row[uniq]
            hot = self._hot.hot_of_row[uniq] if self._hot.size else None
            cold = hot < 0 if hot is not None else None
            hit = slots >= 0
            cache.touch(slots[hit], seq)
            miss = ~hit if cold is None else (~hit & cold)
            n_miss = int(np.count_nonzero(miss))
            if n_miss:
                miss_rows = uniq[miss]
                new_slots = cache.acquire(n_miss, seq)
                cache.load(miss_rows, new_slots, first_new=first_new, ids_of_row=self._ids_of_row)
                slots[miss] = new_slots
                cache.touch(new_slots, seq)
            st = self._stats
            n_cold = uniq.size if cold is None else int(np.count_nonzero(cold))
            n_new = num_rows - first_new
            st.lookups += n_cold
            st.hot_lookups += uniq.size - n_cold
            st.new_rows += n_new
            st.misses += n_miss - n_new
            st.hits += n_cold - n_miss
            return Locations.build(
                inverse,
                slots,
                hot,
                cold,
                seq=seq,
                generation=self._hot.generation,
                device=self._device,
            )

    def pull(self, loc: Locations) -> torch.Tensor:
        """The [U, D] rows of ``loc`` on the training device (a copy)."""
        import torch

        self._check_loc(loc)
        slab = self._cache.slab  # read once: a loader thread may grow the slab meanwhile
        if loc.hot_pos is None and self._device.type == "cpu":
            out = torch.empty(loc.num_unique, self._dim)
            K.gather_rows(slab.numpy(), loc.cold_slots.numpy(), out.numpy())
            return out
        view = slab[:, : self._dim]
        if loc.hot_pos is None:
            return view.index_select(0, loc.cold_slots).to(self._device)
        out = torch.empty(loc.num_unique, self._dim, device=self._device)
        if loc.cold_slots.numel():
            out[loc.cold_pos.to(self._device)] = view.index_select(0, loc.cold_slots).to(
                self._device
            )
        out[loc.hot_pos] = self._hot.tensor[:, : self._dim].index_select(0, loc.hot_idx)
        return out

    def push(self, loc: Locations, grads: torch.Tensor) -> None:
        """Queue the gradients [U, D] of ``loc``'s rows for the next :meth:`update`."""
        self._check_loc(loc)
        if tuple(grads.shape) != (loc.num_unique, self._dim):
            msg = (
                f"`grads` must have shape ({loc.num_unique}, {self._dim}), got {tuple(grads.shape)}"
            )
            raise StoreError(msg)
        self._pending.append((loc, grads.detach()))

    def update(self, *, step: int | None = None) -> None:
        """Apply the optimizer to every pushed row (fused, sparse) and clear the pushes.

        Each call is one optimizer step, rows pushed or not (as ``torch.optim.SparseAdam``
        counts a step whose gradient has no row): :attr:`optimizer_step` becomes ``step``, or
        goes up by one when ``step`` is None. Adam's bias correction uses it; a caller that
        counts steps for several stores (a rank's tables) gives its own count.
        """
        with self._lock:
            if step is not None and step < 1:
                raise StoreError(f"`step` counts this update, so it must be >= 1, got {step!r}")
            self.optimizer_step = self.optimizer_step + 1 if step is None else int(step)
            pending, self._pending = self._pending, []
            if not pending:
                return
            cold_slots, cold_grads, hot_idx, hot_grads = [], [], [], []
            for loc, g in pending:
                self._check_loc(loc)
                if loc.hot_pos is None:
                    cold_slots.append(loc.cold_slots)
                    cold_grads.append(g)
                    continue
                cold_slots.append(loc.cold_slots)
                cold_grads.append(g[loc.cold_pos.to(g.device)])
                hot_idx.append(loc.hot_idx)
                hot_grads.append(g[loc.hot_pos])
                self._hot.dirty[loc.hot_idx_cpu] = True
            opt = {"optimizer": self.meta.optimizer, "lr": self.config.lr, "eps": self.meta.eps,
                   "step": self.optimizer_step}  # fmt: skip
            slots, grads = coalesce(cold_slots, cold_grads)
            if slots.numel():
                cache = self._cache
                if self._writer.in_flight:
                    self._writer.cow_save(cache.slab_np, slots.numpy())
                sparse_step(cache.slab_np, slots.numpy(), grads, **opt)
                cache.dirty[slots.numpy()] = True
            if hot_idx:
                idx, g = coalesce(hot_idx, hot_grads)
                self._hot.step(idx, g, **opt)

    def read_rows(self, loc: Locations) -> np.ndarray:
        """Values and optimizer state ``[U, D + state]`` (float32, a copy) of ``loc``'s rows,
        none of them hot (a rank's shard keeps its hot rows elsewhere)."""
        with self._lock:
            self._check_host_rows(loc)
            return self._cache.slab_np[loc.cold_slots.numpy()]

    def write_rows(self, loc: Locations, rows: np.ndarray) -> None:
        """Set the values and optimizer state of ``loc``'s rows (none hot) to ``rows``
        ``[U, D + state]``; the next checkpoint keeps them."""
        with self._lock:
            self._check_host_rows(loc)
            slots = loc.cold_slots.numpy()
            if self._writer.in_flight:
                self._writer.cow_save(self._cache.slab_np, slots)
            self._cache.slab_np[slots] = rows
            self._cache.dirty[slots] = True

    def _check_host_rows(self, loc: Locations) -> None:
        self._check_open()
        self._check_loc(loc)
        if loc.hot_pos is not None:
            raise StoreError("read_rows()/write_rows() of hot rows: reshard(0) first")

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, step: int, *, wait: bool = True) -> Future[dict[str, Any]]:
        """Make the state after ``step`` durable; only rows changed since the last checkpoint
        are written (batch-aware, OpenEmbedding-style).

        Call at a step boundary (after :meth:`update`). The dirty rows are frozen at once
        (see :mod:`trainer.store.writer`); writing them, fsyncing and renaming the new commit
        record (the commit point) runs in a background thread when ``wait=False``, while
        training goes on. Only one checkpoint is in flight at a time, and an eviction waits for
        it to finish.

        Args:
            step: the step just completed (recorded in the commit record).
            wait: block until the checkpoint is durable.

        Returns:
            a future of what was written (rows, bytes, seconds); ``.result()`` waits for it.
        """
        with self._lock:
            self._check_open()
            if self._pending:
                msg = "checkpoint() with pushed gradients not applied; call update() first"
                raise StoreError(msg)
            self.wait_checkpoint()
            snapshot = self._snapshot(int(step))
            if self._writer.is_committed(snapshot):
                # the commit already holds this state: a second commit record would only push
                # the one before it (the roll-back point) out of PREVIOUS
                done: Future[dict[str, Any]] = Future()
                done.set_result(self._writer.committed_info(snapshot))
                return done
            future = self._writer.start(snapshot)
        if wait:
            future.result()
        return future

    def wait_checkpoint(self) -> dict[str, Any] | None:
        """Wait for the checkpoint in flight (if any) and return its summary (errors re-raised)."""
        with self._lock:
            return self._writer.wait()

    def _snapshot(self, step: int) -> Snapshot:
        """Freeze what the checkpoint writes, at the step boundary (the only blocking part).

        Dirty cache slots are not copied here: they are frozen, the writer thread copies them in
        small batches, and an update of a frozen row first saves its image (copy-on-write). Hot
        rows are few and copied at once.
        """
        t0 = time.perf_counter()
        slots = self._cache.take_dirty()
        self._writer.freeze(slots)
        hot_rows, hot_image = self._hot.take_dirty()
        num_rows = self._index.num_rows
        committed = self._home.commit.num_rows
        return Snapshot(
            step=step,
            slots=slots,
            rows=np.concatenate([self._cache.row_of_slot[slots], hot_rows]),
            hot_image=hot_image,
            num_rows=num_rows,
            index=self._index.frozen_view() if self._writer.wants_index(num_rows) else None,
            new_ids=self._ids_of_row[committed:num_rows].tobytes(),
            hot_ids=self._ids_of_row[self._hot.rows].tobytes(),
            seconds=time.perf_counter() - t0,
            optimizer_step=self.optimizer_step,
        )

    # ------------------------------------------------------------------ hot set

    def rho(self, num_hot: int) -> float:
        """Share of counted accesses covered by the ``num_hot`` most frequent rows."""
        return self._hot.rho(num_hot, self._index.num_rows)

    def plan_hot_set(self, *, coefficients: CostCoefficients | None = None) -> HotPlan:
        """Choose R with the cost model from the counted frequencies (measures the coefficients
        once on this machine unless given)."""
        return self._hot.plan(
            self._index.num_rows, coefficients=coefficients, max_rows=self.config.hot_budget_rows
        )

    def restart_counting(self, batches: int) -> None:
        """Forget the frequencies and count again over the next ``batches`` prefetches."""
        with self._lock:
            self._hot.restart_counting(batches)

    def reshard(
        self, num_hot: int | None = None, *, coefficients: CostCoefficients | None = None
    ) -> int:
        """Re-select the hot set (the ``num_hot`` most frequent rows; None: the cost model's R),
        moving rows and their optimizer state between host and device. Earlier locations become
        invalid. Call at a step boundary.

        Returns:
            the new number of hot rows.
        """
        if num_hot is None:
            num_hot = self.plan_hot_set(coefficients=coefficients).num_hot
        if not 0 <= num_hot <= self.config.hot_budget_rows:
            msg = (
                f"`num_hot` must be in [0, hot_budget_rows={self.config.hot_budget_rows}], "
                f"got {num_hot!r}"
            )
            raise StoreError(msg)
        with self._lock:
            self._check_open()
            self.wait_checkpoint()
            if self._pending:
                msg = "reshard() with pushed gradients not applied; call update() first"
                raise StoreError(msg)
            chosen = self._hot.most_frequent(num_hot, self._index.num_rows)
            self._hot.demote_all(self._cache, self._seq)
            self._hot.install(chosen, self._cache, self._home)
            return int(chosen.size)

    # ------------------------------------------------------------------ inspection

    @property
    def num_rows(self) -> int:
        return self._index.num_rows

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def device(self) -> torch.device:
        return self._device

    def stats(self) -> StoreStats:
        """Counters (hits, misses, evictions, ...) and sizes."""
        st, cache, writer = self._stats, self._cache, self._writer
        st.rows = self._index.num_rows
        st.rows_committed = self._home.commit.num_rows
        st.chunks = self._home.file.num_chunks
        st.cache_capacity = cache.capacity
        st.cached_rows = cache.num_cached()
        st.hot_rows = self._hot.size
        st.evictions = cache.evictions
        st.written_back = cache.written_back + writer.rows_written
        st.checkpoints = writer.checkpoints
        st.last_checkpoint_step = writer.last_step
        st.index_bytes = self._index.nbytes()
        st.cache_bytes = int(cache.slab.numel() * 4)
        return st

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's id and values (float32 [rows, D + state]) in row order, from whichever
        tier holds it. For tests and tools; reads the home file for rows not in memory."""
        with self._lock:
            self.wait_checkpoint()
            n = self._index.num_rows
            values = np.empty((n, self.meta.width), dtype=np.float32)
            slots = self._cache.slot_of_row[:n]
            hot = self._hot.hot_of_row[:n]
            on_disk = np.flatnonzero((slots < 0) & (hot < 0))
            if on_disk.size:
                self._home.read(on_disk, values.view(np.uint32), on_disk)
            cached = np.flatnonzero(slots >= 0)
            values[cached] = self._cache.slab_np[slots[cached]]
            if self._hot.size:
                values[self._hot.rows] = self._hot.tensor.cpu().numpy()
            return self._ids_of_row[:n].copy(), values

    def lookup_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (-1 for ids never seen); does not add ids."""
        return self._index.lookup(np.asarray(ids, dtype=np.int64))

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _check_loc(self, loc: Locations) -> None:
        if loc.generation != self._hot.generation:
            msg = (
                f"locations of prefetch #{loc.seq} are stale: the hot set was resharded since; "
                "prefetch again"
            )
            raise StoreError(msg)

    def close(self) -> None:
        """Close the files. Changes after the last checkpoint are not kept."""
        if self._closed:
            return
        try:
            self.wait_checkpoint()
        finally:
            self._closed = True
            self._writer.shutdown()
        self._home.close()
        if self._tmp:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(path: str | os.PathLike[str], **options: Any) -> EmbeddingStore:
    """Open an existing store, restoring its last completed checkpoint (see
    :meth:`EmbeddingStore.open`)."""
    return EmbeddingStore.open(path, **options)
