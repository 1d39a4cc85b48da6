"""Numba CPU kernels of the embedding store: hashing, the id index, row init, checksums, optimizers.

They stay here, not in ``recpipe/kernels/`` (jagged-tensor ops, each with a CPU and a CUDA form
on torch tensors): these are CPU-only, work on the store's own numpy arrays and on-disk words,
and have no user outside :mod:`trainer.store`.

Every kernel is batch-oriented (one call per batch, never one per id) and releases the GIL, so a
loader thread can index the next batch while the training thread runs the current step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recpipe.kernels.splitmix import mix64 as _mix64

__all__: list[str] = []  # private: used by trainer.store only

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FNV_PRIME = np.uint64(0x100000001B3)
_FNV_BASIS = np.uint64(0xCBF29CE484222325)
_S32 = np.uint64(32)
_S63 = np.uint64(63)
_LOW32 = np.uint64(0xFFFFFFFF)
EMPTY = -1


@njit(cache=True, nogil=True)
def hash_ids(ids):
    """Hash int64 ids to uint64 (the same function the index uses)."""
    out = np.empty(ids.size, dtype=np.uint64)
    for i in range(ids.size):
        out[i] = _mix64(np.uint64(ids[i]))
    return out


# --------------------------------------------------------------------------------------------
# Sharded open-addressing index. All shards live in one flat int64 array of (key, row) pairs, so
# a probe touches one cache line; shard s occupies pairs [off[s], off[s] + mask[s] + 1). The
# shard is chosen by the high hash bits, the slot by the low bits, so shards can be rehashed
# one at a time. An empty slot has row EMPTY, so every int64 key (negative, zero,
# huge) is a valid id.
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def index_lookup(ids, table, off, mask, shift, out):
    """out[i] = row of ids[i], or EMPTY when absent."""
    for i in range(ids.size):
        k = ids[i]
        h = _mix64(np.uint64(k))
        s = np.int64(h >> np.uint64(shift)) if shift < 64 else 0
        m = mask[s]
        base = off[s]
        j = np.int64(h & np.uint64(m))
        while True:
            p = 2 * (base + j)
            v = table[p + 1]
            if v == EMPTY:
                out[i] = EMPTY
                break
            if table[p] == k:
                out[i] = v
                break
            j = (j + 1) & m


@njit(cache=True, nogil=True)
def index_insert(ids, table, off, mask, count, shift, next_row, start, out):
    """Look up ids[start:], giving absent ones consecutive new rows in order of first appearance.

    Stops early when a shard would pass a load factor of 1/2.

    Returns:
        (stop, next_row, shard): ``stop == ids.size`` when done, else the shard to grow before
        calling again with ``start=stop``.
    """
    n = ids.size
    for i in range(start, n):
        k = ids[i]
        h = _mix64(np.uint64(k))
        s = np.int64(h >> np.uint64(shift)) if shift < 64 else 0
        m = mask[s]
        base = off[s]
        j = np.int64(h & np.uint64(m))
        while True:
            p = 2 * (base + j)
            v = table[p + 1]
            if v == EMPTY:
                if (count[s] + 1) * 2 > m + 1:
                    return i, next_row, s
                table[p] = k
                table[p + 1] = next_row
                count[s] += 1
                out[i] = next_row
                next_row += 1
                break
            if table[p] == k:
                out[i] = v
                break
            j = (j + 1) & m
    return n, next_row, -1


@njit(cache=True, nogil=True)
def index_rehash(table, lo, hi, new_table, new_base, new_mask):
    """Re-insert the entries of old slots [lo, hi) into a fresh shard region."""
    for q in range(lo, hi):
        v = table[2 * q + 1]
        if v == EMPTY:
            continue
        k = table[2 * q]
        j = np.int64(_mix64(np.uint64(k)) & np.uint64(new_mask))
        while new_table[2 * (new_base + j) + 1] != EMPTY:
            j = (j + 1) & new_mask
        new_table[2 * (new_base + j)] = k
        new_table[2 * (new_base + j) + 1] = v


# --------------------------------------------------------------------------------------------
# Per-batch dedup of rows, deterministic init, checksums, copies, optimizers.
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def unique_rows(rows, stamp, upos, seq):
    """Unique rows in order of first appearance and the inverse map, in O(n) with stamps."""
    n = rows.size
    uniq = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    u = 0
    for i in range(n):
        r = rows[i]
        if stamp[r] != seq:
            stamp[r] = seq
            upos[r] = u
            uniq[u] = r
            u += 1
        inverse[i] = upos[r]
    return uniq[:u].copy(), inverse


@njit(cache=True, nogil=True, inline="always")
def _row_checksum(words, row, width):
    h = _FNV_BASIS ^ _mix64(np.uint64(row))
    for j in range(width):
        h = (h ^ np.uint64(words[j])) * _FNV_PRIME
    h = _mix64(h)
    return np.uint32((h ^ (h >> _S32)) & _LOW32)


@njit(cache=True, nogil=True)
def write_rows(src, slots, pos, dst):
    """dst[pos[i], :w] = src[slots[i]] and dst[pos[i], w] = checksum(pos[i], words)."""
    width = src.shape[1]
    for i in range(slots.size):
        p = pos[i]
        s = slots[i]
        for j in range(width):
            dst[p, j] = src[s, j]
        dst[p, width] = _row_checksum(src[s], p, width)


@njit(cache=True, nogil=True)
def write_block(src, pos, dst):
    """dst[pos[i], :w] = src[i] and dst[pos[i], w] = checksum(pos[i], words) (pos sorted: the
    file is walked front to back, one page fault per page)."""
    width = src.shape[1]
    for i in range(pos.size):
        p = pos[i]
        for j in range(width):
            dst[p, j] = src[i, j]
        dst[p, width] = _row_checksum(src[i], p, width)


@njit(cache=True, nogil=True)
def cow_save(slab, slots, frozen, cp_pos, saved, pool, used):
    """Copy-on-write: before ``slots`` are updated, append the image of those still frozen (not
    yet staged by the checkpoint writer) to ``pool`` (densely, so its pages stay few and warm
    from one checkpoint to the next), note where in ``saved`` and unfreeze them.

    Returns:
        the number of pool rows used; stops early (leaving the rest frozen) when the pool is
        full: the caller grows it and calls again.
    """
    width = slab.shape[1]
    n = used
    for i in range(slots.size):
        s = slots[i]
        if frozen[s]:
            if n >= pool.shape[0]:
                return n
            k = cp_pos[s]
            for j in range(width):
                pool[n, j] = slab[s, j]
            saved[k] = n
            n += 1
            frozen[s] = False
    return n


@njit(cache=True, nogil=True)
def stage_frozen(slab, slots, ks, frozen, saved, pool, out):
    """out[i] = the snapshot value of entry ks[i]: its saved image, else its slab row (still
    frozen, so unchanged since the snapshot); unfreezes the slots."""
    width = out.shape[1]
    for i in range(ks.size):
        k = ks[i]
        s = slots[k]
        q = saved[k]
        if q >= 0:
            for j in range(width):
                out[i, j] = pool[q, j]
        else:
            for j in range(width):
                out[i, j] = slab[s, j]
        frozen[s] = False


@njit(cache=True, nogil=True)
def order_by_row(rows, num_rows):
    """The order that sorts distinct ``rows`` (all < num_rows) ascending, in O(n + num_rows)."""
    at = np.full(num_rows, -1, dtype=np.int64)
    for k in range(rows.size):
        at[rows[k]] = k
    out = np.empty(rows.size, dtype=np.int64)
    n = 0
    for r in range(num_rows):
        if at[r] >= 0:
            out[n] = at[r]
            n += 1
    return out


@njit(cache=True, nogil=True)
def index_image(off, mask, table, rows, out):
    """out = [off, mask, table] with the entries of rows >= ``rows`` blanked (saved index)."""
    ns = off.size
    for i in range(ns):
        out[i] = off[i]
        out[ns + i] = mask[i]
    base = 2 * ns
    for q in range(table.size // 2):
        v = table[2 * q + 1]
        if v >= rows:
            out[base + 2 * q] = 0
            out[base + 2 * q + 1] = EMPTY
        else:
            out[base + 2 * q] = table[2 * q]
            out[base + 2 * q + 1] = v


@njit(cache=True, nogil=True)
def read_rows(src, pos, dst, slots):
    """dst[slots[i]] = src[pos[i], :w] after checking its checksum; returns the first bad i or -1."""
    width = dst.shape[1]
    for i in range(pos.size):
        p = pos[i]
        if _row_checksum(src[p], p, width) != src[p, width]:
            return i
        s = slots[i]
        for j in range(width):
            dst[s, j] = src[p, j]
    return -1


@njit(cache=True, nogil=True)
def verify_rows(src, pos):
    """First i whose row at src[pos[i]] fails its checksum, or -1."""
    width = src.shape[1] - 1
    for i in range(pos.size):
        p = pos[i]
        if _row_checksum(src[p], p, width) != src[p, width]:
            return i
    return -1


@njit(cache=True, nogil=True)
def sgd_update(table, slots, grads, lr):
    """table[slots[i], :D] -= lr * grads[i] (slots unique)."""
    dim = grads.shape[1]
    for i in range(slots.size):
        s = slots[i]
        for j in range(dim):
            table[s, j] -= np.float32(lr) * grads[i, j]


@njit(cache=True, nogil=True)
def count_rows(rows, counts):
    """counts[rows[i]] += 1 for every i (access frequencies for the hot set)."""
    for i in range(rows.size):
        counts[rows[i]] += 1


@njit(cache=True, nogil=True)
def pool_forward(rows, inverse, offsets, mean, out):
    """out[b] = sum (or mean) of rows[inverse[i]] for i in [offsets[b], offsets[b + 1])."""
    dim = rows.shape[1]
    for b in range(offsets.size - 1):
        lo, hi = offsets[b], offsets[b + 1]
        for j in range(dim):
            out[b, j] = 0.0
        for i in range(lo, hi):
            r = inverse[i]
            for j in range(dim):
                out[b, j] += rows[r, j]
        if mean and hi > lo:
            scale = np.float32(1.0) / np.float32(hi - lo)
            for j in range(dim):
                out[b, j] *= scale


@njit(cache=True, nogil=True)
def pool_backward(grad, inverse, offsets, mean, out):
    """out[inverse[i]] += grad[b] (/ length for the mean) for every id i of every bag b."""
    dim = grad.shape[1]
    out[:] = 0.0
    for b in range(offsets.size - 1):
        lo, hi = offsets[b], offsets[b + 1]
        scale = np.float32(1.0) / np.float32(hi - lo) if mean and hi > lo else np.float32(1.0)
        for i in range(lo, hi):
            r = inverse[i]
            for j in range(dim):
                out[r, j] += grad[b, j] * scale


@njit(cache=True, nogil=True)
def checksum64(words):
    """A fast 64-bit checksum of uint64 words (4 independent lanes, then mixed)."""
    n = words.size
    h0 = _FNV_BASIS
    h1 = _FNV_BASIS ^ _M1
    h2 = _FNV_BASIS ^ _M2
    h3 = _FNV_BASIS ^ _GOLDEN
    i = 0
    while i + 4 <= n:
        h0 = (h0 ^ words[i]) * _FNV_PRIME
        h1 = (h1 ^ words[i + 1]) * _FNV_PRIME
        h2 = (h2 ^ words[i + 2]) * _FNV_PRIME
        h3 = (h3 ^ words[i + 3]) * _FNV_PRIME
        i += 4
    while i < n:
        h0 = (h0 ^ words[i]) * _FNV_PRIME
        i += 1
    h = _mix64(h0) ^ _mix64(h1 + _GOLDEN) ^ _mix64(h2 + _M1) ^ _mix64(h3 + _M2)
    return _mix64(h ^ np.uint64(n))


_EMPTY_WORD = np.uint64(0xFFFFFFFFFFFFFFFF)  # EMPTY as a uint64 word


@njit(cache=True, nogil=True)
def index_words_check(words, num_shards, count):
    """checksum64(words) of a saved index ``[off | mask | table]`` (uint64 words, the table of
    (id, row) pairs) and count[s] = the occupied slots of shard s, in one pass when the words
    allow it (every shard's (id, row) pairs start at a multiple of 4 words, as a saved index's
    do: then each 4-word group is one shard's two slots).

    Returns:
        (checksum, tiles): ``tiles`` is False when off/mask do not tile the table (the first
        shard at slot 0, each next one where the one before ends, the last at the table's end);
        ``count`` is then left as it was.
    """
    n = words.size
    base = 2 * num_shards
    tiles = num_shards > 0 and n >= base
    aligned = base % 4 == 0
    at = np.int64(0)
    if tiles:
        for s in range(num_shards):
            o = np.int64(words[s])
            m = np.int64(words[num_shards + s])
            if o != at or m < 0 or m >= n:
                tiles = False
                break
            aligned = aligned and m % 2 == 1
            at += m + 1
    if not tiles or base + 2 * at != n:
        return checksum64(words), False
    if not aligned:
        for s in range(num_shards):
            lo = np.int64(words[s])
            c = np.int64(0)
            for q in range(lo, lo + np.int64(words[num_shards + s]) + 1):
                if words[base + 2 * q + 1] != _EMPTY_WORD:
                    c += 1
            count[s] = c
        return checksum64(words), True
    h0 = _FNV_BASIS
    h1 = _FNV_BASIS ^ _M1
    h2 = _FNV_BASIS ^ _M2
    h3 = _FNV_BASIS ^ _GOLDEN
    for i in range(0, base, 4):
        h0 = (h0 ^ words[i]) * _FNV_PRIME
        h1 = (h1 ^ words[i + 1]) * _FNV_PRIME
        h2 = (h2 ^ words[i + 2]) * _FNV_PRIME
        h3 = (h3 ^ words[i + 3]) * _FNV_PRIME
    i = base
    for s in range(num_shards):
        cap = np.int64(words[num_shards + s]) + 1
        end = i + 2 * cap
        # empty slots: their row word is EMPTY (-1), the only row with the top bit set; sums
        # of shifts, no branch (a separate counting loop, or a compare here, costs 2x more)
        e1 = np.uint64(0)
        e3 = np.uint64(0)
        while i < end:
            w1 = words[i + 1]
            w3 = words[i + 3]
            h0 = (h0 ^ words[i]) * _FNV_PRIME
            h1 = (h1 ^ w1) * _FNV_PRIME
            h2 = (h2 ^ words[i + 2]) * _FNV_PRIME
            h3 = (h3 ^ w3) * _FNV_PRIME
            e1 += w1 >> _S63
            e3 += w3 >> _S63
            i += 4
        count[s] = cap - np.int64(e1 + e3)
    h = _mix64(h0) ^ _mix64(h1 + _GOLDEN) ^ _mix64(h2 + _M1) ^ _mix64(h3 + _M2)
    return _mix64(h ^ np.uint64(n)), True


@njit(cache=True, nogil=True)
def gather_rows(src, slots, out):
    """out[i] = src[slots[i], :out.shape[1]]."""
    width = out.shape[1]
    for i in range(slots.size):
        s = slots[i]
        for j in range(width):
            out[i, j] = src[s, j]
