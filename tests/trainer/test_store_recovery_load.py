"""What an open loads: the saved index (checksum and per-shard counts in one pass), the ids read
straight into the store's per-row array; the state equals the one the files describe."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from recpipe.errors import StoreError
from trainer.store import EmbeddingStore, IdIndex, StoreConfig, open_store
from trainer.store import _kernels as K
from trainer.store.index import saved_bytes
from trainer.store.persist import read_ids


def _occupied(words: np.ndarray, shards: int) -> np.ndarray:
    """The occupied slots of each shard, counted the plain way (the reference)."""
    table = words[2 * shards :]
    return np.add.reduceat(table[1::2] != K.EMPTY, words[:shards]).astype(np.int64)


# shards = 1 puts the table at word 2, so the one-pass loop's 4-word groups straddle slots:
# the kernel counts slot by slot there; capacity 2 (the smallest) and growth in between
@pytest.mark.parametrize("shards", [1, 2, 16])
@pytest.mark.parametrize("n", [0, 1, 3, 2_000])
def test_a_saved_index_loads_with_its_counts_and_checksum(shards, n):
    rng = np.random.default_rng([shards, n])
    index = IdIndex(num_shards=shards, initial_capacity=2)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64))
    index.insert(ids)
    words, info = saved_bytes(index.frozen_view())
    count = np.zeros(shards, dtype=np.int64)
    checksum, tiles = K.index_words_check(words.view(np.uint64), shards, count)
    assert tiles and int(checksum) == int(K.checksum64(words.view(np.uint64)))
    np.testing.assert_array_equal(count, _occupied(words, shards))
    for loaded in (
        IdIndex.from_bytes(words.copy(), info, copy=False),
        IdIndex.from_bytes(words.tobytes(), info),
    ):
        np.testing.assert_array_equal(loaded._count, index._count)
        np.testing.assert_array_equal(loaded._table, index._table)
        np.testing.assert_array_equal(loaded.lookup(ids), np.arange(ids.size))
        more = rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64)
        rows, _ = loaded.insert(more)  # grows exactly like the original
        np.testing.assert_array_equal(rows, index.insert(more)[0])
        index = IdIndex.from_bytes(words.copy(), info, copy=False)


def test_a_shard_of_one_slot_is_counted():
    """Shards of capacity 1 (never written by the store) still count right, slot by slot."""
    words = np.array([0, 1, 0, 0, 5, 3, 7, K.EMPTY], dtype=np.int64)  # 2 shards, 1 slot each
    count = np.zeros(2, dtype=np.int64)
    checksum, tiles = K.index_words_check(words.view(np.uint64), 2, count)
    assert tiles and int(checksum) == int(K.checksum64(words.view(np.uint64)))
    assert count.tolist() == [1, 0]


def test_a_saved_index_whose_shards_do_not_tile_the_table_is_refused():
    """A header whose shard offsets do not follow the capacities is refused even when its
    checksum matches (before, the index was taken and later probes ran past a shard)."""
    index = IdIndex(num_shards=4, initial_capacity=8)
    index.insert(np.arange(10, dtype=np.int64))
    words, info = saved_bytes(index.frozen_view())
    words[1] += 2  # shard 1 starts two slots late
    info = dict(info, checksum=int(K.checksum64(words.view(np.uint64))))
    with pytest.raises(StoreError, match="index file is corrupted"):
        IdIndex.from_bytes(words, info)


def _train(store: EmbeddingStore, rng: np.random.Generator, ids: np.ndarray) -> None:
    import torch

    loc = store.prefetch(ids)
    rows = store.pull(loc)
    store.push(loc, torch.from_numpy(rng.standard_normal(rows.shape).astype(np.float32)))
    store.update()


@pytest.mark.parametrize("late", [0, 300])  # the saved index covers every row / not the last
def test_an_opened_store_holds_the_state_its_files_describe(tmp_path, late):
    rng = np.random.default_rng(late)
    path = tmp_path / "s"
    cfg = StoreConfig(dim=4, optimizer="rowwise_adagrad", chunk_rows=64)
    with EmbeddingStore.create(path, cfg) as store:
        _train(store, rng, rng.integers(-(2**40), 2**40, 3_000))
        store.checkpoint(0)  # the index is saved here
        _train(store, rng, rng.integers(-(2**40), 2**40, late))
        store.checkpoint(1)  # ... and, with `late` rows more (< 1/4), not here
        ids, values = store.export()
        counts = store._index._count.copy()
    with open_store(path) as store:
        n = store.num_rows
        assert n == ids.size
        np.testing.assert_array_equal(store._ids_of_row[:n], ids)
        np.testing.assert_array_equal(store._index._count, counts)
        np.testing.assert_array_equal(store.lookup_rows(ids), np.arange(n))
        got_ids, got_values = store.export()
        np.testing.assert_array_equal(got_ids, ids)
        assert got_values.tobytes() == values.tobytes()
        fresh = np.arange(2**41, 2**41 + 2_000, dtype=np.int64)
        _train(store, rng, fresh)  # the per-row arrays grow past the ids read at open
        np.testing.assert_array_equal(store._ids_of_row[n : n + fresh.size], fresh)
        np.testing.assert_array_equal(store._ids_of_row[:n], ids)


def test_ids_are_read_whole_or_refused(tmp_path):
    path = tmp_path / "ids.bin"
    ids = np.arange(-5, 1_000, dtype=np.int64)
    path.write_bytes(ids.tobytes() + b"uncommitted tail")
    got = read_ids(path, ids.size, zlib.crc32(ids.tobytes()))
    np.testing.assert_array_equal(got, ids)
    assert got.flags.writeable and got.flags.owndata
    with pytest.raises(StoreError, match=r"ids\.bin.*checksum"):
        read_ids(path, ids.size, zlib.crc32(ids.tobytes()) ^ 1)
    with pytest.raises(StoreError, match=r"ids\.bin.*truncated"):
        read_ids(path, ids.size + 10, 0)
