"""Dispatching once: one rank dispatches each global batch and shares the placement; every rank
gets exactly the micro-batches the per-rank cut gives it (the same rows in the same order, step
after step and across epochs), the other ranks never dispatch, and the shadow's predicted
transfers travel as digests. The ranks are threads here, the broadcast a barrier."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from readers.dispatch.cut import DispatchOnceCut, pairs_digest, rank_cut
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from recpipe.errors import DataError

WORLD, BATCH = 3, 8
KINDS = ("reads", "pulls", "pushes", "shared", "evictions", "evict_pushes")


class _Broadcast:
    """``share`` for W threads: rank 0's payload, on every rank (a barrier with a timeout)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=60)
        self.payload: np.ndarray | None = None

    def share(self, rank: int):
        def share(payload: np.ndarray) -> np.ndarray:
            if rank == 0:
                self.payload = payload.copy()
            self.barrier.wait()
            got = self.payload.copy()
            self.barrier.wait()
            return got

        return share


def _read(root, schema, cut, *, rank: int, steps: int) -> list:
    return list(_read_iter(root, schema, cut, rank=rank, steps=steps))


def _once(root, schema, cut, *, steps: int, kinds=()) -> tuple[list, list]:
    """Every rank's batches through a :class:`DispatchOnceCut` (one thread per rank), and the
    cuts."""
    bus = _Broadcast(WORLD)
    cuts = [DispatchOnceCut(pickle.loads(pickle.dumps(cut)), rank=r, world_size=WORLD,
                            share=bus.share(r), check_kinds=kinds) for r in range(WORLD)]  # fmt: skip
    out: list = [None] * WORLD
    digests: list = [[] for _ in range(WORLD)]
    errors: list = []

    def run(rank: int) -> None:
        try:
            got = []
            for batch in _read_iter(root, schema, cuts[rank], rank=rank, steps=steps):
                got.append(batch)
                digests[rank].append(cuts[rank].last_digests[rank].copy())
            out[rank] = got
        except BaseException as exc:  # reported below
            errors.append(exc)
            bus.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for c in cuts:
        c.close()
    assert not errors, errors
    return out, [cuts, digests]


def _read_iter(root, schema, cut, *, rank: int, steps: int):
    """``steps`` batches of ``rank``, across epochs (the dispatcher starts afresh at each)."""
    config = ReaderConfig(batch_size=BATCH, shuffle=True, seed=3)
    ds = RankBatchDataset(str(root), schema=schema, config=config, rank=rank, world_size=WORLD,
                          cut=cut)  # fmt: skip
    n = 0
    while n < steps:
        for batch in ds:
            yield batch
            n += 1
            if n == steps:
                return


def _same(a, b) -> bool:
    return (a.session_ids.tolist() == b.session_ids.tolist()
            and a.labels.tolist() == b.labels.tolist()
            and np.array_equal(a.dense.numpy(), b.dense.numpy(), equal_nan=True))  # fmt: skip


@pytest.mark.parametrize(("policy", "alpha"), [("esd", 1.0), ("esd", 0.5), ("laia", 1.0),
                                               ("random", 1.0)])  # fmt: skip
def test_dispatching_once_gives_every_rank_the_per_rank_cuts_batches(
    make_dataset, tiny_schema, policy, alpha
):
    root = make_dataset(num_sessions=80, row_group_rows=40)
    cut = rank_cut(policy, schema=tiny_schema, alpha=alpha, max_piece_rows=3, cache_rows=(16,),
                   bandwidths=(1.0, 1.0, 10.0))  # fmt: skip
    steps = 18  # an epoch holds 15 steps: the second one restarts the dispatcher
    per_rank = [_read(root, tiny_schema, pickle.loads(pickle.dumps(cut)), rank=r, steps=steps)
                for r in range(WORLD)]  # fmt: skip
    once, (cuts, _) = _once(root, tiny_schema, cut, steps=steps)
    for r in range(WORLD):
        assert len(once[r]) == len(per_rank[r]) == steps
        for t in range(steps):
            assert _same(once[r][t], per_rank[r][t]), (r, t)
    # only rank 0 dispatched
    assert cuts[0].cut._dispatcher is not None
    assert all(c.cut._dispatcher is None for c in cuts[1:])


def test_the_predicted_transfers_travel_as_digests(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=80, row_group_rows=40)
    cut = rank_cut("esd", schema=tiny_schema, max_piece_rows=3, cache_rows=(16,),
                   bandwidths=(1.0, 1.0, 10.0))  # fmt: skip
    steps = 6
    reference = pickle.loads(pickle.dumps(cut))
    _read(root, tiny_schema, reference, rank=0, steps=steps)
    dispatches = {d.step: d for d in reference.recent()}
    _, (_, digests) = _once(root, tiny_schema, cut, steps=steps, kinds=KINDS)
    for r in range(WORLD):
        for t in range(steps):
            want = [pairs_digest(reference.row_pairs(getattr(dispatches[t].transfers, k)[r]))
                    for k in KINDS]  # fmt: skip
            assert digests[r][t].tolist() == want, (r, t)
    assert len({d.tobytes() for r in range(WORLD) for d in digests[r]}) > 1


def test_pairs_digest_tells_pairs_apart():
    pairs = np.array([[0, 5], [1, 7]], dtype=np.int64)
    assert pairs_digest(pairs) == pairs_digest(pairs.astype(np.int32))
    assert pairs_digest(pairs) != pairs_digest(pairs[::-1])
    assert pairs_digest(np.zeros((0, 2))) == pairs_digest(np.zeros(0, dtype=np.int64))
    assert pairs_digest(np.zeros((0, 2))) != pairs_digest(np.zeros((1, 2)))


def test_a_wrong_placement_is_refused(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=80, row_group_rows=40)
    cut = rank_cut("random", schema=tiny_schema)

    def lopsided(payload: np.ndarray) -> np.ndarray:
        return np.zeros_like(payload)  # every row to rank 0

    once = DispatchOnceCut(cut, rank=1, world_size=WORLD, share=lopsided)
    with pytest.raises(DataError, match="gives rank 1 0 rows, not 8"):
        _read(root, tiny_schema, once, rank=1, steps=1)
    with pytest.raises(DataError, match="this cut serves rank 1"):
        _read(root, tiny_schema, once, rank=2, steps=1)
    with pytest.raises(DataError, match="cannot be copied"):
        pickle.dumps(once)
