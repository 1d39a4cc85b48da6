"""The hybrid embedding store: host chunks + hot set on the device + persistent tier.

Tiers of a row, fastest first::

    hot set   device tensor [R, W]       the R most frequent rows (cost model), replicated
    cache     host slab [slots, W]       LRU over the rest, bounded by `cache_rows`
    home      rows.bin on disk           every row not in memory; checkpoints + recovery

``W = D + state``: the embedding and its optimizer state (row-wise Adagrad: 1 float) live side by
side, so moving a row between tiers never loses optimizer state.

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

Checkpoints: ``checkpoint(step, wait=False)`` freezes the dirty rows at the step boundary (no
copy) and a writer thread stores them while training goes on, in file order, staging ~2 MB at a
time under a short lock and writing with no lock held; ``update`` of a frozen row the writer has
not staged yet first appends its image to a copy-on-write pool kept from one checkpoint to the
next (so its pages are not faulted in again), and an eviction waits for the writer. Every heavy
loop of the writer is a Numba kernel that releases the GIL. See :mod:`trainer.store.persist` for
the on-disk format, why recovery is exact and why this storage.

Not done here: several ranks (all-reduce of hot-row gradients, all-to-all of cold rows); the
cost model's coefficients are measured with collectives when ``torch.distributed`` is set up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from recpipe.errors import StoreError
from trainer.store import _kernels as K
from trainer.store.hotset import (
    CostCoefficients,
    HotPlan,
    choose_hot_rows,
    measure_costs,
    rho_curve,
)
from trainer.store.index import IdIndex, saved_bytes
from trainer.store.persist import (
    CommitRecord,
    RowFile,
    StoreMeta,
    fsync_dir,
    read_copies,
    read_hot,
    read_ids,
    write_file,
)

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

Optimizer = Literal["sgd", "rowwise_adagrad"]
SyncMode = Literal["full", "process"]
_STATE_DIM = {"sgd": 0, "rowwise_adagrad": 1}
_NEVER = np.iinfo(np.int64).max


def init_rows(ids: np.ndarray, dim: int, *, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """The initial rows the store gives ``ids``: uniform(-scale, scale) from a hash of (seed, id).

    The same id gets the same row whatever the order it is first seen in, so an in-module table
    initialised with ``init_rows(vocab, dim)`` starts equal to the store.

    Returns:
        float32 [len(ids), dim].
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty((ids.size, dim), dtype=np.float32)
    K.init_rows(ids, np.int64(seed), float(scale), out)
    return out


@dataclass
class StoreConfig:
    """Settings of an :class:`EmbeddingStore`.

    Attributes:
        dim: embedding dimension D.
        optimizer: ``"sgd"`` or ``"rowwise_adagrad"`` (fbgemm's row-wise Adagrad).
        lr: learning rate.
        eps: Adagrad epsilon.
        seed: seed of the deterministic row init.
        init_scale: new rows are uniform(-init_scale, init_scale).
        chunk_rows: rows per chunk of the home file (it grows by whole chunks).
        cache_rows: host memory budget in rows (None: unbounded).
        num_shards: shards of the id index (a power of two).
        pin_window: a prefetch's rows stay pinned for this many prefetches.
        count_batches: batches over which access frequencies are counted for the hot set.
        hot_budget_rows: most rows the hot set may hold (device memory budget).
        device: the training device (hot set and pulled rows live there).
        sync: ``"full"`` fsyncs (durable against power loss), ``"process"`` only survives a
            killed process.
    """

    dim: int
    optimizer: Optimizer = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    seed: int = 0
    init_scale: float = 0.05
    chunk_rows: int = 16384
    cache_rows: int | None = None
    num_shards: int = 16
    pin_window: int = 2
    count_batches: int = 100
    hot_budget_rows: int = 65536
    device: str = "cpu"
    sync: SyncMode = "full"

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise StoreError(f"`dim` must be >= 1, got {self.dim!r}")
        if self.optimizer not in _STATE_DIM:
            msg = f"`optimizer` must be one of {sorted(_STATE_DIM)}, got {self.optimizer!r}"
            raise StoreError(msg)
        if not self.lr > 0:
            raise StoreError(f"`lr` must be > 0, got {self.lr!r}")
        if not self.eps > 0:
            raise StoreError(f"`eps` must be > 0, got {self.eps!r}")
        if self.chunk_rows < 1:
            raise StoreError(f"`chunk_rows` must be >= 1, got {self.chunk_rows!r}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise StoreError(f"`cache_rows` must be >= 1 or None, got {self.cache_rows!r}")
        if self.pin_window < 1:
            raise StoreError(f"`pin_window` must be >= 1, got {self.pin_window!r}")
        if self.count_batches < 0 or self.hot_budget_rows < 0:
            msg = (
                f"`count_batches` and `hot_budget_rows` must be >= 0, got "
                f"{self.count_batches!r} and {self.hot_budget_rows!r}"
            )
            raise StoreError(msg)
        if self.sync not in ("full", "process"):
            raise StoreError(f"`sync` must be 'full' or 'process', got {self.sync!r}")


@dataclass(frozen=True)
class Locations:
    """Where the unique ids of one prefetch live. Made by :meth:`EmbeddingStore.prefetch`.

    Attributes:
        inverse: int64 [n] position of each id given to ``prefetch`` among the U unique rows.
        num_unique: U.
        cold_pos: int64 [Uc] positions (among U) of rows in host memory; None if all are.
        cold_slots: int64 [Uc] their cache slots (CPU).
        hot_pos: int64 [Uh] positions of hot rows (device); None when there are none.
        hot_idx: int64 [Uh] their index in the hot tensor (device).
        hot_idx_cpu: the same on the CPU (marks rows dirty).
        seq: the prefetch's sequence number.
        generation: the hot-set generation the locations belong to.
    """

    inverse: torch.Tensor
    num_unique: int
    cold_pos: torch.Tensor | None
    cold_slots: torch.Tensor
    hot_pos: torch.Tensor | None
    hot_idx: torch.Tensor | None
    hot_idx_cpu: np.ndarray | None
    seq: int
    generation: int


@dataclass
class StoreStats:
    """Counters and sizes of a store (see :meth:`EmbeddingStore.stats`)."""

    rows: int
    rows_committed: int
    chunks: int
    cache_capacity: int
    cached_rows: int
    hot_rows: int
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    new_rows: int = 0
    hot_lookups: int = 0
    evictions: int = 0
    written_back: int = 0
    checkpoints: int = 0
    last_checkpoint_step: int = -1
    index_bytes: int = 0
    cache_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def miss_rate(self) -> float:
        """Share of cold lookups of existing rows that had to read the home file."""
        existing = self.hits + self.misses
        return self.misses / existing if existing else 0.0


class EmbeddingStore:
    """A KV embedding store: host chunks, a device hot set, a persistent home with checkpoints.

    Create one with :meth:`create` (or :func:`open_store` to recover an existing one). See the
    module docstring for the step protocol and the thread contract.
    """

    # ------------------------------------------------------------------ construction / recovery

    def __init__(self, root: Path, meta: StoreMeta, config: StoreConfig, *, _tmp: bool = False):
        import torch

        self.root = root
        self.meta = meta
        self.config = config
        self._tmp = _tmp
        self._lock = threading.RLock()
        self._device = torch.device(config.device)
        self._dim = meta.dim
        self._width = meta.width
        self._sync = config.sync == "full"
        self._commit = CommitRecord.load(root)
        self._home = RowFile(root / "rows.bin", meta)
        self._index = IdIndex(num_shards=config.num_shards)
        self._ids_crc = 0
        # per row (grown with the table)
        self._row_cap = 0
        self._ids_of_row = np.zeros(0, dtype=np.int64)
        self._slot_of_row = np.zeros(0, dtype=np.int64)
        self._hot_of_row = np.zeros(0, dtype=np.int64)
        self._stamp = np.zeros(0, dtype=np.int64)
        self._upos = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(0, dtype=np.int64)
        # each row has two copies on disk: the committed one and the one written after it
        self._committed = np.zeros(0, dtype=np.int8)  # copy of the last checkpoint
        self._cur = np.zeros(0, dtype=np.int8)  # copy holding the newest value on disk
        # per cache slot
        self._slab = torch.zeros(0, self._width)
        self._slab_np = self._slab.numpy()
        self._row_of_slot = np.zeros(0, dtype=np.int64)
        self._last_use = np.zeros(0, dtype=np.int64)
        self._dirty = np.zeros(0, dtype=np.bool_)
        self._hw = 0
        self._free = np.zeros(0, dtype=np.int64)
        # hot set
        self._hot = torch.zeros(0, self._width, device=self._device)
        self._hot_rows = np.zeros(0, dtype=np.int64)
        self._hot_dirty = np.zeros(0, dtype=np.bool_)
        self._generation = 0
        # bookkeeping
        self._seq = 0
        self._pending: list[tuple[Locations, torch.Tensor]] = []
        self._count_left = config.count_batches
        self._counted_batches = 0
        self._counted_accesses = 0
        self._coefficients: CostCoefficients | None = None
        self._stats = StoreStats(0, 0, 0, 0, 0, 0)
        self._closed = False
        self._index_saved: dict[str, int] | None = None
        # the commit before `_commit`, still restorable until the next row write (PREVIOUS)
        self._previous: CommitRecord | None = None
        self._previous_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[dict[str, Any]] | None = None
        # copy-on-write of the rows of the checkpoint in flight (see _snapshot / _cow_save)
        self._cow_lock = threading.Lock()
        self._frozen = np.zeros(0, dtype=np.bool_)  # per slot: not yet copied by the writer
        self._cp_pos = np.zeros(0, dtype=np.int64)  # slot -> position in the snapshot
        self._cow_pool = np.zeros((0, self._width), dtype=np.float32)  # images, kept warm
        self._cow_used = 0
        self._cow_saved = np.zeros(0, dtype=np.int64)  # snapshot entry -> pool row, or -1

    @classmethod
    def create(cls, path: str | os.PathLike[str] | None, config: StoreConfig) -> EmbeddingStore:
        """Create an empty store in directory ``path`` (None: a temporary directory, removed on
        :meth:`close`)."""
        tmp = path is None
        root = Path(tempfile.mkdtemp(prefix="recpipe-store-")) if tmp else Path(path)
        if (root / "meta.json").exists():
            msg = f"`path` {str(root)!r} already holds a store; use open_store() to reopen it"
            raise StoreError(msg)
        root.mkdir(parents=True, exist_ok=True)
        meta = StoreMeta(
            dim=config.dim,
            state_dim=_STATE_DIM[config.optimizer],
            optimizer=config.optimizer,
            eps=config.eps,
            seed=config.seed,
            init_scale=config.init_scale,
            chunk_rows=config.chunk_rows,
        )
        meta.save(root, sync=config.sync == "full")
        return cls(root, meta, config, _tmp=tmp)

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
            StoreError: missing, truncated or corrupted files, or no checkpoint of ``step``.
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
        store = cls(root, meta, config)
        try:
            store._pick_commit(step)
            store._recover(verify=verify)
        except BaseException:
            store.close()
            raise
        return store

    def _pick_commit(self, step: int | None) -> None:
        """Choose the commit to restore: CURRENT, or PREVIOUS when ``step`` asks for it (then
        made CURRENT on disk, and the rolled-back epoch's files removed)."""
        root = self.root
        if step is None or step == self._commit.step:
            # PREVIOUS is only kept for a roll-back: a damaged one does not stop this open (the
            # next commit replaces it), but is never used
            with contextlib.suppress(StoreError):
                kept = CommitRecord.load(root, "PREVIOUS")
                if (root / "PREVIOUS").exists() and kept.epoch < self._commit.epoch:
                    self._previous = kept
            return
        kept = CommitRecord.load(root, "PREVIOUS") if (root / "PREVIOUS").exists() else None
        if kept is None or kept.step != step or kept.epoch >= self._commit.epoch:
            earlier = "" if kept is None else f" (the one before it, kept: step {kept.step})"
            msg = (
                f"store {str(root)!r} holds the checkpoint of step {self._commit.step}{earlier}, "
                f"not of step {step}: rows were written after a later checkpoint"
            )
            raise StoreError(msg)
        dropped = self._commit
        kept.save(root, sync=self._sync)  # CURRENT := PREVIOUS, atomically: the roll-back
        (root / "PREVIOUS").unlink()
        for name in dropped.files() - kept.files():
            (root / name).unlink(missing_ok=True)
        self._commit = kept

    def _release_previous(self) -> None:
        """Before the first row write after a commit: the checkpoint before it stops being
        restorable, so PREVIOUS and its own files go."""
        with self._previous_lock:
            previous, self._previous = self._previous, None
            if previous is None:
                return
            (self.root / "PREVIOUS").unlink(missing_ok=True)
            if self._sync:
                fsync_dir(self.root)
            for name in previous.files() - self._commit.files():
                (self.root / name).unlink(missing_ok=True)

    def _recover(self, *, verify: bool) -> None:
        commit = self._commit
        home = self._home
        if home.capacity < commit.num_rows:
            msg = (
                f"store file {str(home.path)!r} is truncated: {home.capacity} rows, the last "
                f"checkpoint has {commit.num_rows}"
            )
            raise StoreError(msg)
        home.shrink(commit.num_rows)
        ids = read_ids(self.root / "ids.bin", commit.num_rows, commit.ids_crc)
        with open(self.root / "ids.bin", "r+b") as f:
            f.truncate(commit.num_rows * 8)
        self._index = self._load_index(ids)
        self._ids_crc = commit.ids_crc
        self._grow_rows(commit.num_rows)
        self._ids_of_row[: commit.num_rows] = ids
        copies = read_copies(self.root / f"copies-{commit.epoch}.bin", commit)
        self._committed[: commit.num_rows] = copies
        self._cur[: commit.num_rows] = copies
        if verify and commit.num_rows:
            bad = K.verify_rows(home.words, self._read_pos(np.arange(commit.num_rows)))
            if bad >= 0:
                msg = f"store file {str(home.path)!r} is corrupted: row {bad} fails its checksum"
                raise StoreError(msg)
        hot_ids = read_hot(self.root / f"hot-{commit.epoch}.bin", commit.num_hot, commit.hot_crc)
        if hot_ids.size:
            self._install_hot(self._index.lookup(hot_ids))
        self._stats.checkpoints = commit.epoch
        self._stats.last_checkpoint_step = commit.step

    def _load_index(self, ids: np.ndarray) -> IdIndex:
        """The saved index plus the ids added after it was saved (or a rebuild from the ids)."""
        info = self._commit.index
        if info is None:
            return IdIndex.from_ids(ids, num_shards=self.config.num_shards)
        path = self.root / f"index-{info['epoch']}.bin"
        try:
            data = np.fromfile(path, dtype=np.int64)
        except FileNotFoundError:
            raise StoreError(f"store file {str(path)!r} is missing") from None
        if info["rows"] > ids.size:
            msg = f"store file {str(path)!r} does not match the ids of the store; it is corrupted"
            raise StoreError(msg)
        index = IdIndex.from_bytes(data, info, copy=False)
        rows, _ = index.insert(ids[info["rows"] :])
        if index.num_rows != ids.size or not np.array_equal(
            rows, np.arange(info["rows"], ids.size)
        ):
            msg = f"store file {str(path)!r} does not match the ids of the store; it is corrupted"
            raise StoreError(msg)
        self._index_saved = info
        return index

    # ------------------------------------------------------------------ growth helpers

    def _grow_rows(self, num_rows: int) -> None:
        if num_rows <= self._row_cap:
            return
        cap = max(num_rows, 2 * self._row_cap, 1024)

        def grown(a: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(cap, fill, dtype=a.dtype)
            out[: a.size] = a
            return out

        self._ids_of_row = grown(self._ids_of_row, 0)
        self._slot_of_row = grown(self._slot_of_row, -1)
        self._hot_of_row = grown(self._hot_of_row, -1)
        self._stamp = grown(self._stamp, -1)
        self._upos = grown(self._upos, 0)
        self._counts = grown(self._counts, 0)
        with self._cow_lock:  # the checkpoint writer flips copies concurrently
            self._committed = grown(self._committed, 0)
            self._cur = grown(self._cur, 0)
        self._row_cap = cap

    def _grow_slab(self, need: int) -> None:
        import torch

        cur = self._slab.shape[0]
        budget = self.config.cache_rows if self.config.cache_rows is not None else _NEVER
        chunk = self.meta.chunk_rows
        new = min(budget, max(need, 2 * cur, chunk))
        new = min(budget, -(-new // chunk) * chunk)
        if new <= cur:
            return
        slab = torch.zeros(new, self._width)
        slab[:cur] = self._slab
        self._slab, self._slab_np = slab, slab.numpy()
        self._row_of_slot = np.concatenate([self._row_of_slot, np.full(new - cur, -1, np.int64)])
        self._last_use = np.concatenate([self._last_use, np.full(new - cur, -1, np.int64)])
        self._dirty = np.concatenate([self._dirty, np.zeros(new - cur, np.bool_)])
        with self._cow_lock:  # the checkpoint writer unfreezes slots concurrently
            self._frozen = np.concatenate([self._frozen, np.zeros(new - cur, np.bool_)])

    # ------------------------------------------------------------------ the KV interface

    def prefetch(self, ids: torch.Tensor | np.ndarray) -> Locations:
        """Index ``ids`` (new ids get rows), bring their rows into memory and pin them.

        Safe to call from a loader thread ahead of the step (see the module docstring).

        Args:
            ids: int64 [n] ids, any values, duplicates allowed (e.g. ``ikjt.values``).
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
            if self._count_left > 0:
                K.count_rows(uniq, self._counts)
                self._counted_batches += 1
                self._counted_accesses += uniq.size
                self._count_left -= 1
            slots = self._slot_of_row[uniq]
            has_hot = self._hot_rows.size > 0
            hot = self._hot_of_row[uniq] if has_hot else None
            cold = hot < 0 if has_hot else None
            hit = slots >= 0
            self._last_use[slots[hit]] = seq
            miss = ~hit if cold is None else (~hit & cold)
            n_miss = int(np.count_nonzero(miss))
            if n_miss:
                miss_rows = uniq[miss]
                new_slots = self._acquire(n_miss)
                self._load(miss_rows, new_slots, first_new)
                slots[miss] = new_slots
                self._last_use[new_slots] = seq
            st = self._stats
            n_cold = uniq.size if cold is None else int(np.count_nonzero(cold))
            n_new = num_rows - first_new
            st.lookups += n_cold
            st.hot_lookups += uniq.size - n_cold
            st.new_rows += n_new
            st.misses += n_miss - n_new
            st.hits += n_cold - n_miss
            return self._locations(uniq.size, inverse, slots, hot, cold, seq)

    def _locations(self, n_unique, inverse, slots, hot, cold, seq) -> Locations:
        import torch

        inv = torch.from_numpy(inverse)
        if cold is None or cold.all():
            cold_slots = slots if cold is None else slots[cold]
            return Locations(
                inv,
                n_unique,
                None,
                torch.from_numpy(cold_slots),
                None,
                None,
                None,
                seq,
                self._generation,
            )
        pos = np.arange(n_unique, dtype=np.int64)
        hot_idx = hot[~cold]
        dev = self._device
        return Locations(
            inverse=inv,
            num_unique=n_unique,
            cold_pos=torch.from_numpy(pos[cold]),
            cold_slots=torch.from_numpy(slots[cold]),
            hot_pos=torch.from_numpy(pos[~cold]).to(dev),
            hot_idx=torch.from_numpy(hot_idx).to(dev),
            hot_idx_cpu=hot_idx,
            seq=seq,
            generation=self._generation,
        )

    def _acquire(self, k: int) -> np.ndarray:
        """k cache slots: free ones, then fresh ones (growing the slab), then LRU victims."""
        taken = []
        if self._free.size:
            n = min(k, self._free.size)
            taken.append(self._free[-n:])
            self._free = self._free[:-n]
            k -= n
        if k and self._slab.shape[0] - self._hw < k:
            self._grow_slab(self._hw + k)
        n = min(k, self._slab.shape[0] - self._hw)
        if n:
            taken.append(np.arange(self._hw, self._hw + n, dtype=np.int64))
            self._hw += n
            k -= n
        for t in taken:
            self._last_use[t] = self._seq  # not victims of the eviction below
        if k:
            taken.append(self._evict(k))
        return np.concatenate(taken) if len(taken) != 1 else taken[0]

    def _evict(self, k: int) -> np.ndarray:
        self.wait_checkpoint()  # its rows may be clean in memory but not yet on disk
        lu = self._last_use[: self._hw].copy()
        lu[lu > self._seq - self.config.pin_window] = _NEVER  # pinned by recent prefetches
        lu[self._row_of_slot[: self._hw] < 0] = _NEVER  # free slots are taken before evicting
        victims = np.argpartition(lu, k - 1)[:k] if k < lu.size else np.arange(lu.size)
        if victims.size < k or lu[victims].max() == _NEVER:
            msg = (
                f"`cache_rows` {self.config.cache_rows!r} is too small: the last "
                f"{self.config.pin_window} prefetches pin more rows than it holds"
            )
            raise StoreError(msg)
        victims = victims.astype(np.int64)
        rows = self._row_of_slot[victims]
        dirty = self._dirty[victims]
        if dirty.any():
            self._write_back(victims[dirty], rows[dirty])
        self._slot_of_row[rows] = -1
        self._row_of_slot[victims] = -1
        self._stats.evictions += victims.size
        return victims

    def _load(self, rows: np.ndarray, slots: np.ndarray, first_new: int) -> None:
        """Fill cache ``slots`` with ``rows``: new rows are initialised, old ones read from disk."""
        new = rows >= first_new
        if new.any():
            fresh = np.empty((int(new.sum()), self._dim), dtype=np.float32)
            K.init_rows(
                self._ids_of_row[rows[new]],
                np.int64(self.meta.seed),
                float(self.meta.init_scale),
                fresh,
            )
            self._slab_np[slots[new], : self._dim] = fresh
            self._slab_np[slots[new], self._dim :] = 0.0
        old = ~new
        if old.any():
            self._home.read(self._read_pos(rows[old]), self._slab_np.view(np.uint32), slots[old])
        self._slot_of_row[rows] = slots
        self._row_of_slot[slots] = rows
        self._dirty[slots] = new

    def _read_pos(self, rows: np.ndarray) -> np.ndarray:
        """Positions in the home file of the newest on-disk copy of ``rows``."""
        return 2 * rows + self._cur[rows]

    def _write_pos(self, rows: np.ndarray) -> np.ndarray:
        """Positions of the copy of ``rows`` that is not committed (the one to overwrite)."""
        return 2 * rows + 1 - self._committed[rows]

    def _write_back(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write cache ``slots`` holding ``rows`` to their uncommitted copies on disk."""
        self._release_previous()
        self._home.ensure(int(rows.max()) + 1)
        pos = self._write_pos(rows)
        self._home.write(self._slab_np.view(np.uint32), slots, pos)
        with self._cow_lock:
            self._cur[rows] = pos - 2 * rows
        self._dirty[slots] = False
        self._stats.written_back += rows.size

    def pull(self, loc: Locations) -> torch.Tensor:
        """The [U, D] rows of ``loc`` on the training device (a copy)."""
        import torch

        self._check_loc(loc)
        slab = self._slab  # read once: a loader thread may grow the slab meanwhile
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
        out[loc.hot_pos] = self._hot[:, : self._dim].index_select(0, loc.hot_idx)
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

    def update(self) -> None:
        """Apply the optimizer to every pushed row (fused, sparse) and clear the pushes."""

        with self._lock:
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
                self._hot_dirty[loc.hot_idx_cpu] = True
            slots, grads = _coalesce(cold_slots, cold_grads)
            if slots.numel():
                if self._inflight is not None:
                    self._cow_save(slots.numpy())
                self._cold_step(self._slab_np, slots.numpy(), grads)
                self._dirty[slots.numpy()] = True
            if hot_idx:
                idx, g = _coalesce(hot_idx, hot_grads)
                self._hot_step(idx, g)

    def _cold_step(self, table: np.ndarray, slots: np.ndarray, grads: torch.Tensor) -> None:
        import torch

        g = grads.to("cpu", torch.float32).contiguous().numpy()
        if self.meta.optimizer == "sgd":
            K.sgd_update(table, slots, g, float(self.config.lr))
        else:
            K.rowwise_adagrad_update(table, slots, g, float(self.config.lr), float(self.meta.eps))

    def _hot_step(self, idx: torch.Tensor, g: torch.Tensor) -> None:
        if self._device.type == "cpu":  # the cold path's kernel: bitwise the same arithmetic
            self._cold_step(self._hot.numpy(), idx.numpy(), g)
            return
        rows = self._hot.index_select(0, idx)  # (Uh, W)
        d = self._dim
        if self.meta.optimizer == "sgd":
            rows[:, :d] -= self.config.lr * g
        else:
            state = rows[:, d] + (g * g).sum(1) / d
            rows[:, d] = state
            rows[:, :d] -= (self.config.lr / (state.sqrt() + self.meta.eps)).unsqueeze(1) * g
        self._hot.index_copy_(0, idx, rows)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, step: int, *, wait: bool = True) -> Future[dict[str, Any]]:
        """Make the state after ``step`` durable; only rows changed since the last checkpoint
        are written (batch-aware, OpenEmbedding-style).

        Call at a step boundary (after :meth:`update`). The dirty rows are copied into a
        snapshot at once; writing them, fsyncing and renaming the new commit record (the commit
        point) runs in a background thread when ``wait=False``, while training goes on. Only one
        checkpoint is in flight at a time, and an eviction waits for it to finish.

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
            if self._unchanged(snapshot):
                # the commit already holds this state: a second commit record would only push
                # the one before it (the roll-back point) out of PREVIOUS
                done: Future[dict[str, Any]] = Future()
                done.set_result(self._unchanged_info(snapshot))
                return done
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="recpipe-checkpoint")
            self._inflight = self._executor.submit(self._persist, snapshot)
            future = self._inflight
        if wait:
            future.result()
        return future

    def _unchanged(self, snap: dict[str, Any]) -> bool:
        """True when ``snap`` is the committed state: same step, no row written since, same
        rows and hot set."""
        commit = self._commit
        return (
            commit.epoch > 0
            and snap["step"] == commit.step
            and snap["rows"].size == 0
            and snap["index"] is None
            and snap["num_rows"] == commit.num_rows
            and len(snap["hot_ids"]) // 8 == commit.num_hot
            and zlib.crc32(snap["hot_ids"]) == commit.hot_crc
        )

    def _unchanged_info(self, snap: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": snap["step"],
            "epoch": self._commit.epoch,
            "rows": snap["num_rows"],
            "rows_written": 0,
            "bytes_written": 0,
            "snapshot_seconds": round(snap["snapshot_seconds"], 6),
            "seconds": round(snap["snapshot_seconds"], 6),
            "writer_cpu_seconds": 0.0,
            "time": time.time(),
            "already_committed": True,
        }

    def wait_checkpoint(self) -> dict[str, Any] | None:
        """Wait for the checkpoint in flight (if any) and return its summary (errors re-raised)."""
        with self._lock:
            future, self._inflight = self._inflight, None
            return None if future is None else future.result()

    def _snapshot(self, step: int) -> dict[str, Any]:
        """Freeze what the checkpoint writes, at the step boundary (the only blocking part).

        Dirty cache slots are not copied here: they are marked frozen, the writer thread copies
        them in small batches, and an update of a frozen row first saves its image
        (copy-on-write). Hot rows are few and copied at once.
        """
        import torch

        t0 = time.perf_counter()
        slots = np.flatnonzero(self._dirty[: self._hw])
        self._dirty[slots] = False
        with self._cow_lock:
            self._frozen[slots] = True
            if self._cp_pos.size < self._frozen.size:
                self._cp_pos = np.full(self._frozen.size, -1, dtype=np.int64)
            self._cp_pos[slots] = np.arange(slots.size)
            self._cow_saved = np.full(slots.size, -1, dtype=np.int64)
            self._cow_used = 0
        hot = np.flatnonzero(self._hot_dirty)
        hot_image = self._hot[torch.from_numpy(hot)].cpu().numpy()
        self._hot_dirty[:] = False
        num_rows = self._index.num_rows
        index_bytes = None
        last = self._index_saved
        if num_rows and (last is None or num_rows * 4 >= last["rows"] * 5):
            index_bytes = self._index.frozen_view()  # grew by 1/4: the writer saves the index
        return {
            "step": step,
            "index": index_bytes,
            "slots": slots,
            "rows": np.concatenate([self._row_of_slot[slots], self._hot_rows[hot]]),
            "hot_image": hot_image,
            "num_rows": num_rows,
            "new_ids": self._ids_of_row[self._commit.num_rows : num_rows].tobytes(),
            "hot_ids": self._ids_of_row[self._hot_rows].tobytes(),
            "snapshot_seconds": time.perf_counter() - t0,
        }

    def _cow_save(self, slots: np.ndarray) -> None:
        """Before updating ``slots``, save the image of those the writer has not staged yet."""
        with self._cow_lock:
            while True:
                used = K.cow_save(
                    self._slab_np,
                    slots,
                    self._frozen,
                    self._cp_pos,
                    self._cow_saved,
                    self._cow_pool,
                    self._cow_used,
                )
                self._cow_used = used
                if used < self._cow_pool.shape[0] or not self._frozen[slots].any():
                    return
                grown = np.empty((max(2 * used, self.meta.chunk_rows), self._width), np.float32)
                grown[:used] = self._cow_pool[:used]
                self._cow_pool = grown

    def _write_frozen(
        self, slots: np.ndarray, rows: np.ndarray, pos: np.ndarray, *, batch: int = 8192
    ) -> None:
        """Write the frozen ``slots`` holding ``rows`` (or their saved images) to disk positions
        ``pos``.

        In file order (one page fault per page; in random order, which cache-slot order
        becomes once slots are reused, the same writes cost ~4x more; no sort needed),
        a batch at a time: under the copy-on-write lock a batch is only copied to a staging
        buffer (~2 MB, a millisecond), so an ``update`` never waits for the disk; the staged
        rows are then written to the memory-mapped file with the lock released. Every heavy
        loop is a Numba kernel that releases the GIL. (Starting each batch's write-back at once
        with ``sync_file_range`` was tried: 25% less writer time alone, no gain beside training.)
        """
        if not slots.size:
            return
        order = K.order_by_row(rows, int(rows.max()) + 1)
        staging = np.empty((min(batch, slots.size), self._width), dtype=np.float32)
        for lo in range(0, slots.size, batch):
            ks = order[lo : lo + batch]
            out = staging[: ks.size]
            with self._cow_lock:  # the slab may have grown meanwhile: always the current one
                K.stage_frozen(
                    self._slab_np, slots, ks, self._frozen, self._cow_saved, self._cow_pool, out
                )
            self._home.write_block(out.view(np.uint32), pos[ks])

    def _persist(self, snap: dict[str, Any]) -> dict[str, Any]:
        """Write a snapshot and commit it (background thread)."""
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        rows, num_rows, slots = snap["rows"], snap["num_rows"], snap["slots"]
        self._release_previous()
        self._home.ensure(num_rows)
        if rows.size:
            pos = self._write_pos(rows)  # never the committed copy: a crash leaves it intact
            self._write_frozen(slots, rows[: slots.size], pos[: slots.size])
            hot = snap["hot_image"]
            self._home.write(hot.view(np.uint32), np.arange(len(hot)), pos[slots.size :])
            with self._cow_lock:
                self._cur[rows] = pos - 2 * rows
            self._stats.written_back += rows.size
        if self._sync:
            self._home.sync()
        new_ids = snap["new_ids"]
        with open(self.root / "ids.bin", "ab") as f:
            f.write(new_ids)
            f.flush()
            if self._sync:
                os.fsync(f.fileno())
        self._ids_crc = zlib.crc32(new_ids, self._ids_crc)
        epoch = self._commit.epoch + 1
        hot_ids = snap["hot_ids"]
        if hot_ids:
            with open(self.root / f"hot-{epoch}.bin", "wb") as f:
                f.write(hot_ids)
                if self._sync:
                    os.fsync(f.fileno())
        with self._cow_lock:
            copies = np.packbits(self._cur[:num_rows].astype(np.bool_)).tobytes()
        write_file(self.root / f"copies-{epoch}.bin", copies, sync=self._sync)
        index_info = self._commit.index
        if snap["index"] is not None:
            data, index_info = saved_bytes(snap["index"])
            index_info = dict(index_info, epoch=epoch)
            with open(self.root / f"index-{epoch}.bin", "wb") as f:
                f.write(memoryview(data).cast("B"))
                if self._sync:
                    os.fsync(f.fileno())
        commit = CommitRecord(
            step=snap["step"],
            epoch=epoch,
            num_rows=num_rows,
            ids_crc=self._ids_crc,
            num_hot=len(hot_ids) // 8,
            hot_crc=zlib.crc32(hot_ids),
            copies_crc=zlib.crc32(copies),
            index=index_info,
        )
        previous = self._commit
        if previous.epoch:  # kept restorable until the next row write (_release_previous)
            previous.save(self.root, sync=self._sync, name="PREVIOUS")
        commit.save(self.root, sync=self._sync)  # the commit point
        with self._cow_lock:
            self._committed[:num_rows] = self._cur[:num_rows]
        self._commit = commit
        self._index_saved = index_info
        with self._previous_lock:
            self._previous = previous if previous.epoch else None
        info = {
            "step": snap["step"],
            "epoch": epoch,
            "rows": num_rows,
            "rows_written": int(rows.size),
            "bytes_written": int(rows.size) * self.meta.disk_width * 4 + len(new_ids),
            "snapshot_seconds": round(snap["snapshot_seconds"], 6),
            "seconds": round(time.perf_counter() - t0 + snap["snapshot_seconds"], 6),
            "writer_cpu_seconds": round(time.thread_time() - cpu0, 6),
            "time": time.time(),
        }
        with open(self.root / "checkpoints.jsonl", "a") as f:
            f.write(json.dumps(info) + "\n")
        self._stats.checkpoints += 1
        self._stats.last_checkpoint_step = snap["step"]
        return info

    # ------------------------------------------------------------------ hot set

    def rho(self, num_hot: int) -> float:
        """Share of counted accesses covered by the ``num_hot`` most frequent rows."""
        curve = rho_curve(self._counts[: self._index.num_rows])
        return float(curve[min(num_hot, curve.size - 1)])

    def plan_hot_set(self, *, coefficients: CostCoefficients | None = None) -> HotPlan:
        """Choose R with the cost model from the counted frequencies (measures the coefficients
        once on this machine unless given)."""
        if coefficients is None:
            if self._coefficients is None:
                self._coefficients = measure_costs(self._dim, device=self.config.device)
            coefficients = self._coefficients
        per_batch = self._counted_accesses / max(self._counted_batches, 1)
        return choose_hot_rows(
            self._counts[: self._index.num_rows],
            accesses_per_batch=per_batch,
            coefficients=coefficients,
            max_rows=self.config.hot_budget_rows,
        )

    def restart_counting(self, batches: int) -> None:
        """Forget the frequencies and count again over the next ``batches`` prefetches."""
        with self._lock:
            self._counts[:] = 0
            self._count_left = batches
            self._counted_batches = self._counted_accesses = 0

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
            n = self._index.num_rows
            counts = self._counts[:n]
            order = np.lexsort((np.arange(n), -counts))  # most frequent first, ties by row
            chosen = order[: min(num_hot, n)]
            self._demote_all()
            self._install_hot(chosen.astype(np.int64))
            return int(chosen.size)

    def _demote_all(self) -> None:
        """Move every hot row back to the cache (dirty state and optimizer state kept)."""
        rows = self._hot_rows
        if not rows.size:
            return
        image = self._hot.cpu().numpy()
        slots = self._acquire(rows.size)
        self._slab_np[slots] = image
        self._slot_of_row[rows] = slots
        self._row_of_slot[slots] = rows
        self._dirty[slots] = self._hot_dirty
        self._last_use[slots] = self._seq - self.config.pin_window  # evictable, most recent
        self._hot_of_row[rows] = -1
        self._set_hot(
            np.zeros(0, np.int64), np.zeros((0, self._width), np.float32), np.zeros(0, np.bool_)
        )

    def _install_hot(self, rows: np.ndarray) -> None:
        """Move ``rows`` (none of them hot) from the cache or the home file to the device."""
        image = np.empty((rows.size, self._width), dtype=np.float32)
        dirty = np.zeros(rows.size, dtype=np.bool_)
        slots = self._slot_of_row[rows]
        cached = slots >= 0
        if cached.any():
            cs = slots[cached]
            image[cached] = self._slab_np[cs]
            dirty[cached] = self._dirty[cs]
            self._row_of_slot[cs] = -1
            self._dirty[cs] = False
            self._last_use[cs] = -1
            self._slot_of_row[rows[cached]] = -1
            self._free = np.concatenate([self._free, cs])
        if (~cached).any():
            pos = np.flatnonzero(~cached)
            self._home.read(self._read_pos(rows[pos]), image.view(np.uint32), pos)
        self._hot_of_row[rows] = np.arange(rows.size)
        self._set_hot(rows, image, dirty)

    def _set_hot(self, rows: np.ndarray, image: np.ndarray, dirty: np.ndarray) -> None:
        import torch

        self._hot = torch.from_numpy(image).to(self._device)
        self._hot_rows = rows
        self._hot_dirty = dirty
        self._generation += 1

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
        st = self._stats
        st.rows = self._index.num_rows
        st.rows_committed = self._commit.num_rows
        st.chunks = self._home.num_chunks
        st.cache_capacity = int(self._slab.shape[0])
        st.cached_rows = int(np.count_nonzero(self._row_of_slot[: self._hw] >= 0))
        st.hot_rows = int(self._hot_rows.size)
        st.index_bytes = self._index.nbytes()
        st.cache_bytes = int(self._slab.numel() * 4)
        return st

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's id and values (float32 [rows, D + state]) in row order, from whichever
        tier holds it. For tests and tools; reads the home file for rows not in memory."""
        with self._lock:
            self.wait_checkpoint()
            n = self._index.num_rows
            values = np.empty((n, self._width), dtype=np.float32)
            slots = self._slot_of_row[:n]
            hot = self._hot_of_row[:n]
            on_disk = np.flatnonzero((slots < 0) & (hot < 0))
            if on_disk.size:
                self._home.read(self._read_pos(on_disk), values.view(np.uint32), on_disk)
            cached = np.flatnonzero(slots >= 0)
            values[cached] = self._slab_np[slots[cached]]
            if self._hot_rows.size:
                values[self._hot_rows] = self._hot.cpu().numpy()
            return self._ids_of_row[:n].copy(), values

    def lookup_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (-1 for ids never seen); does not add ids."""
        return self._index.lookup(np.asarray(ids, dtype=np.int64))

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _check_loc(self, loc: Locations) -> None:
        if loc.generation != self._generation:
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
            if self._executor is not None:
                self._executor.shutdown()
        self._home.close()
        if self._tmp:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _coalesce(idx: list[torch.Tensor], grads: list[torch.Tensor]):
    """Concatenate (index, grad) pieces, summing the gradients of repeated indices."""
    import torch

    if len(idx) == 1:
        return idx[0], grads[0]
    cat = torch.cat(idx)
    uniq, inv = torch.unique(cat, return_inverse=True)
    g = torch.cat(grads)
    out = torch.zeros(uniq.numel(), g.shape[1], dtype=g.dtype, device=g.device)
    out.index_add_(0, inv.to(g.device), g)
    return uniq, out


def open_store(path: str | os.PathLike[str], **options: Any) -> EmbeddingStore:
    """Open an existing store, restoring its last completed checkpoint (see
    :meth:`EmbeddingStore.open`)."""
    return EmbeddingStore.open(path, **options)
