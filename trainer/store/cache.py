"""The host tier of the store: a slab of rows in memory, LRU eviction, and pins.

::

    slab         float32 [slots, W]   a row's embedding then its optimizer state
    row_of_slot  int64 [slots]        the row a slot holds (-1: free)
    last_use     int64 [slots]        the last prefetch that used it (pinned while recent)
    dirty        bool [slots]         changed since it was last written or checkpointed
    slot_of_row  int64 [rows]         where a row is cached (-1: not cached)

The slab grows by whole chunks up to ``cache_rows``; past it, the least recently used rows
that no recent prefetch pins are evicted (dirty ones written to their home copy first).

Locking: every method runs with the store lock held (the facade's), except that ``pull`` reads
``slab`` without it (reading the attribute once: a prefetch may replace it by a larger one).
The checkpoint writer reads ``slab_np`` from its thread, under its own copy-on-write lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from recpipe.errors import StoreError
from trainer._kernels import init_rows as hash_init_rows
from trainer._kernels import rowwise_adagrad
from trainer.store import _kernels as K

if TYPE_CHECKING:
    import torch

    from trainer.store.home import Home
    from trainer.store.persist import StoreMeta

__all__ = ["RowCache", "coalesce", "init_rows", "sparse_step"]

NEVER = np.iinfo(np.int64).max


def init_rows(ids: np.ndarray, dim: int, *, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """The initial rows the store gives ``ids``: uniform(-scale, scale) from a hash of (seed, id).

    The same id gets the same row whatever the order it is first seen in, and in every table
    backend (a parameter table of ``num_embeddings`` rows starts with ``init_rows(arange(n))``).

    Returns:
        float32 [len(ids), dim].
    """
    return hash_init_rows(ids, dim, seed=seed, scale=scale)


class RowCache:
    """Rows in host memory, bounded by ``cache_rows``, evicted least recently used first.

    Args:
        meta: the store's settings (row width, chunk size, init seed and scale).
        home: where rows are read from and evicted to.
        cache_rows: most rows held (None: unbounded).
        pin_window: a prefetch's rows are not evicted by the next ``pin_window - 1`` ones.
        before_evict: called before an eviction (the facade waits for the checkpoint in
            flight there: its rows may be clean in memory but not yet on disk).
    """

    def __init__(
        self,
        meta: StoreMeta,
        home: Home,
        *,
        cache_rows: int | None,
        pin_window: int,
        before_evict: Callable[[], object],
    ) -> None:
        import torch

        self._meta = meta
        self._home = home
        self._width = meta.width
        self._budget = cache_rows if cache_rows is not None else NEVER
        self._pin_window = pin_window
        self._before_evict = before_evict
        self.slab = torch.zeros(0, self._width)
        self.slab_np = self.slab.numpy()
        self.row_of_slot = np.zeros(0, dtype=np.int64)
        self._last_use = np.zeros(0, dtype=np.int64)
        self.dirty = np.zeros(0, dtype=np.bool_)
        self._hw = 0  # slots ever handed out
        self._free = np.zeros(0, dtype=np.int64)
        self.slot_of_row = np.zeros(0, dtype=np.int64)
        self.evictions = 0
        self.written_back = 0

    # ------------------------------------------------------------------ sizes

    @property
    def capacity(self) -> int:
        """Slots allocated (grows up to ``cache_rows``)."""
        return int(self.slab.shape[0])

    @property
    def used_slots(self) -> int:
        """Slots ever handed out: every occupied slot is below this."""
        return self._hw

    def num_cached(self) -> int:
        return int(np.count_nonzero(self.row_of_slot[: self._hw] >= 0))

    def grow_rows(self, cap: int) -> None:
        """Make room for rows [0, cap) (not cached)."""
        out = np.full(cap, -1, dtype=np.int64)
        out[: self.slot_of_row.size] = self.slot_of_row
        self.slot_of_row = out

    def _grow_slab(self, need: int) -> None:
        import torch

        cur = self.slab.shape[0]
        chunk = self._meta.chunk_rows
        new = min(self._budget, max(need, 2 * cur, chunk))
        new = min(self._budget, -(-new // chunk) * chunk)
        if new <= cur:
            return
        slab = torch.zeros(new, self._width)
        slab[:cur] = self.slab
        self.slab, self.slab_np = slab, slab.numpy()
        self.row_of_slot = np.concatenate([self.row_of_slot, np.full(new - cur, -1, np.int64)])
        self._last_use = np.concatenate([self._last_use, np.full(new - cur, -1, np.int64)])
        self.dirty = np.concatenate([self.dirty, np.zeros(new - cur, np.bool_)])

    # ------------------------------------------------------------------ lookups

    def touch(self, slots: np.ndarray, seq: int) -> None:
        """Pin ``slots`` for prefetch ``seq``."""
        self._last_use[slots] = seq

    def acquire(self, k: int, seq: int) -> np.ndarray:
        """k slots for prefetch ``seq``: free ones, then fresh ones (growing the slab), then
        LRU victims."""
        taken = []
        if self._free.size:
            n = min(k, self._free.size)
            taken.append(self._free[-n:])
            self._free = self._free[:-n]
            k -= n
        if k and self.slab.shape[0] - self._hw < k:
            self._grow_slab(self._hw + k)
        n = min(k, self.slab.shape[0] - self._hw)
        if n:
            taken.append(np.arange(self._hw, self._hw + n, dtype=np.int64))
            self._hw += n
            k -= n
        for t in taken:
            self._last_use[t] = seq  # not victims of the eviction below
        if k:
            taken.append(self._evict(k, seq))
        return np.concatenate(taken) if len(taken) != 1 else taken[0]

    def _evict(self, k: int, seq: int) -> np.ndarray:
        self._before_evict()
        lu = self._last_use[: self._hw].copy()
        lu[lu > seq - self._pin_window] = NEVER  # pinned by recent prefetches
        lu[self.row_of_slot[: self._hw] < 0] = NEVER  # free slots are taken before evicting
        victims = np.argpartition(lu, k - 1)[:k] if k < lu.size else np.arange(lu.size)
        if victims.size < k or lu[victims].max() == NEVER:
            budget = None if self._budget == NEVER else self._budget
            msg = (
                f"`cache_rows` {budget!r} is too small: the last "
                f"{self._pin_window} prefetches pin more rows than it holds"
            )
            raise StoreError(msg)
        victims = victims.astype(np.int64)
        rows = self.row_of_slot[victims]
        dirty = self.dirty[victims]
        if dirty.any():
            slots = victims[dirty]
            self._home.write_back(self.slab_np.view(np.uint32), slots, rows[dirty])
            self.dirty[slots] = False
            self.written_back += slots.size
        self.slot_of_row[rows] = -1
        self.row_of_slot[victims] = -1
        self.evictions += victims.size
        return victims

    def load(
        self, rows: np.ndarray, slots: np.ndarray, *, first_new: int, ids_of_row: np.ndarray
    ) -> None:
        """Fill ``slots`` with ``rows``: rows >= ``first_new`` are new and initialised from their
        id, the others are read from the home file."""
        meta = self._meta
        new = rows >= first_new
        if new.any():
            fresh = init_rows(
                ids_of_row[rows[new]], meta.dim, seed=meta.seed, scale=meta.init_scale
            )
            self.slab_np[slots[new], : meta.dim] = fresh
            self.slab_np[slots[new], meta.dim :] = 0.0
        old = ~new
        if old.any():
            self._home.read(rows[old], self.slab_np.view(np.uint32), slots[old])
        self.slot_of_row[rows] = slots
        self.row_of_slot[slots] = rows
        self.dirty[slots] = new

    # ------------------------------------------------------------------ moving rows out and in

    def take_dirty(self) -> np.ndarray:
        """The dirty slots, now marked clean (a checkpoint takes them)."""
        slots = np.flatnonzero(self.dirty[: self._hw])
        self.dirty[slots] = False
        return slots

    def remove(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Take the cached ones of ``rows`` out of the cache (their slots become free).

        Returns:
            (cached: bool [len(rows)], their images [cached, W], their dirty flags).
        """
        slots = self.slot_of_row[rows]
        cached = slots >= 0
        cs = slots[cached]
        image, dirty = self.slab_np[cs], self.dirty[cs]
        if cs.size:
            self.row_of_slot[cs] = -1
            self.dirty[cs] = False
            self._last_use[cs] = -1
            self.slot_of_row[rows[cached]] = -1
            self._free = np.concatenate([self._free, cs])
        return cached, image, dirty

    def insert(self, rows: np.ndarray, image: np.ndarray, dirty: np.ndarray, seq: int) -> None:
        """Cache ``rows`` (none cached) with values ``image``, evictable at once, most recent."""
        slots = self.acquire(rows.size, seq)
        self.slab_np[slots] = image
        self.slot_of_row[rows] = slots
        self.row_of_slot[slots] = rows
        self.dirty[slots] = dirty
        self._last_use[slots] = seq - self._pin_window


def sparse_step(
    table: np.ndarray,
    slots: np.ndarray,
    grads: torch.Tensor,
    *,
    optimizer: str,
    lr: float,
    eps: float,
    step: int = 0,
) -> None:
    """Apply the optimizer to rows ``table[slots]`` (embedding then state), the one row update
    of every backend: SGD and row-wise Adagrad in one Numba kernel, Adam as
    :func:`trainer.optim.sparse_adam_` (on views of the rows' values and moments).

    Args:
        table: float32 [slots, W], updated in place.
        slots: int64 [U] distinct rows of ``table``.
        grads: float32 [U, D] their gradients.
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
        lr, eps: the optimizer's settings.
        step: Adam's step, counting this update (its bias correction).
    """
    import torch

    g = grads.to("cpu", torch.float32).contiguous()
    dim = g.shape[1]  # the state sits in the columns after the row's D values
    if optimizer == "adam":
        from trainer.optim import sparse_adam_

        rows = torch.from_numpy(table)
        sparse_adam_(rows[:, :dim], rows[:, dim:], torch.from_numpy(slots), g, lr=lr, eps=eps,
                     step=step)  # fmt: skip
    elif optimizer == "sgd":
        K.sgd_update(table, slots, g.numpy(), float(lr))
    else:
        f32 = np.float32
        rowwise_adagrad(table[:, :dim], table[:, dim], slots, g.numpy(), f32(lr), f32(eps),
                        f32(dim))  # fmt: skip


def coalesce(
    idx: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
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
