"""The cache shadow is exact: replayed against straightforward caches (an OrderedDict LRU per
rank, a version number per row), it predicts the same hits, misses, pushes and evictions."""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readers.dispatch.keys import RowIndex
from readers.dispatch.shadow import ABSENT, FRESH, STALE, CacheShadow
from recpipe.errors import DataError


class ReferenceCaches:
    """Real caches, written as plainly as possible: rank j's cache maps row -> the version it
    holds, in least-recently-used order; each row has a latest version and maybe a dirty
    holder. One step follows the protocol of docs/dispatch.md line by line."""

    def __init__(self, world: int, capacity: list[int], key) -> None:
        self.caches = [OrderedDict() for _ in range(world)]
        self.capacity = capacity
        self.key = key  # row -> (table, id): the order rows of one step are used in
        self.version: Counter = Counter()
        self.dirty: dict[int, int] = {}

    def step(self, reads: list[set[int]]) -> dict[str, list[list[int]]]:
        world = len(self.caches)
        out = {
            k: [[] for _ in range(world)]
            for k in ("pulls", "pushes", "shared", "evictions", "evict_pushes")
        }
        readers = Counter(x for r in reads for x in r)
        for x in sorted(readers):  # a dirty row another rank reads is written home first
            holder = self.dirty.get(x)
            if holder is not None and any(x in reads[j] for j in range(world) if j != holder):
                out["pushes"][holder].append(x)
                del self.dirty[x]
        for j, r in enumerate(reads):
            for x in sorted(r):
                if self.caches[j].get(x) != self.version[x]:
                    out["pulls"][j].append(x)
                    self.caches[j][x] = self.version[x]  # pulled: the latest version
        for x, n in readers.items():
            self.version[x] += 1
            if n == 1:  # one reader: its copy is the new version, dirty
                (j,) = [j for j in range(world) if x in reads[j]]
                self.caches[j][x] = self.version[x]
                self.dirty[x] = j
            else:  # several: gradients go home, every copy is stale
                for j in range(world):
                    if x in reads[j]:
                        out["shared"][j].append(x)
                self.dirty.pop(x, None)
        for j, r in enumerate(reads):
            for x in sorted(r, key=self.key):
                self.caches[j].move_to_end(x)
            while len(self.caches[j]) > self.capacity[j]:
                x, _ = self.caches[j].popitem(last=False)
                out["evictions"][j].append(x)
                if self.dirty.get(x) == j:
                    out["evict_pushes"][j].append(x)
                    del self.dirty[x]
        return {k: [sorted(v) for v in lists] for k, lists in out.items()}

    def state(self, world: int, rows: int) -> np.ndarray:
        out = np.full((world, rows), ABSENT, dtype=np.uint8)
        for j, cache in enumerate(self.caches):
            for x, v in cache.items():
                out[j, x] = FRESH if v == self.version[x] else STALE
        return out


@st.composite
def replays(draw):
    world = draw(st.integers(1, 4))
    capacity = draw(st.integers(0, 8))
    num_rows = draw(st.integers(1, 14))
    # rows get (table, id) keys whose order differs from the row numbers
    ids = draw(st.lists(st.integers(0, 10**6), min_size=num_rows, max_size=num_rows, unique=True))
    tables = draw(st.lists(st.integers(0, 1), min_size=num_rows, max_size=num_rows))
    steps = draw(
        st.lists(
            st.lists(
                st.sets(st.integers(0, num_rows - 1), max_size=6), min_size=world, max_size=world
            ),
            min_size=1,
            max_size=10,
        )
    )
    return world, capacity, ids, tables, steps


def _index(ids, tables) -> RowIndex:
    index = RowIndex(["a", "b"])
    for i, (x, t) in enumerate(zip(ids, tables, strict=True)):
        assert index.rows(t, np.array([x]))[0] == i
    return index


@settings(max_examples=300, deadline=None)
@given(replays())
def test_shadow_predicts_what_real_caches_do(case):
    world, capacity, ids, tables, steps = case
    index = _index(ids, tables)
    shadow = CacheShadow(world_size=world, capacity=capacity, index=index)
    ref = ReferenceCaches(world, [capacity] * world, key=lambda x: (tables[x], ids[x]))
    for reads in steps:
        got = shadow.step([np.array(sorted(r), dtype=np.int64) for r in reads])
        want = ref.step(reads)
        for kind, lists in want.items():
            assert [g.tolist() for g in getattr(got, kind)] == lists, kind
        assert (shadow.state[:, : len(ids)] == ref.state(world, len(ids))).all()
        assert shadow.cached.tolist() == [len(c) for c in ref.caches]
        dirty = np.full(len(ids), -1)
        for x, j in ref.dirty.items():
            dirty[x] = j
        assert shadow.dirty_on[: len(ids)].tolist() == dirty.tolist()


def test_long_replay_keeps_the_recency_queue_compact():
    """Thousands of steps through caches of different sizes: still exact, and each rank's
    recency queue stays a few times its cache (it holds every read otherwise)."""
    rng = np.random.default_rng(0)
    ids = rng.permutation(10_000)[:300].tolist()
    tables = rng.integers(0, 2, 300).tolist()
    capacity = [40, 80, 500]
    shadow = CacheShadow(world_size=3, capacity=capacity, index=_index(ids, tables))
    ref = ReferenceCaches(3, capacity, key=lambda x: (tables[x], ids[x]))
    for _ in range(2000):
        reads = [
            set(rng.choice(300, size=rng.integers(0, 30), replace=False).tolist()) for _ in range(3)
        ]
        got = shadow.step([np.array(sorted(r), dtype=np.int64) for r in reads])
        want = ref.step(reads)
        assert [g.tolist() for g in got.pulls] == want["pulls"]
        assert [g.tolist() for g in got.evict_pushes] == want["evict_pushes"]
    assert (shadow.state[:, :300] == ref.state(3, 300)).all()
    for lru, cap in zip(shadow._lru, capacity, strict=True):
        assert lru.tail - lru.head <= 2 * (cap + 30) + 1024


def test_bad_arguments():
    index = RowIndex(["t"])
    with pytest.raises(DataError, match="`world_size`"):
        CacheShadow(world_size=0, capacity=1, index=index)
    with pytest.raises(DataError, match="`capacity`"):
        CacheShadow(world_size=2, capacity=[-1, 2], index=index)
    with pytest.raises(DataError, match="one array per rank"):
        CacheShadow(world_size=2, capacity=1, index=index).step([np.zeros(0, np.int64)])
