"""``--optimizer adam`` with the embedding store: the store's rows train with torch's
``SparseAdam`` (lazy Adam, its moments m and v kept beside each row in every tier: host cache,
hot set, the home file), its step count (the bias correction) committed with each checkpoint,
so a reopened store goes on bit for bit; ``recpipe train --store hybrid --optimizer adam`` trains
as parameter tables under ``SparseAdam`` do, in one process and on 2 ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from tests.trainer.test_one_loop import (  # noqa: F401  (data: a fixture)
    BATCH,
    _train,
    data,
)
from tests.trainer.test_store_training import DIM, POOL, SCALE, loss_of, make_batch, store_step
from trainer.store import EmbeddingStore, StoreConfig, StoreEmbeddingBag, init_rows, open_store

LR = 0.02
ADAM = ["--optimizer", "adam"]
STORE = ["--store", "hybrid"]


def _store(path, **kw) -> EmbeddingStore:
    config = StoreConfig(dim=DIM, optimizer="adam", lr=LR, init_scale=SCALE, chunk_rows=16, **kw)
    return EmbeddingStore.create(path, config)


class SparseAdamTable:
    """The reference: an ``nn.EmbeddingBag`` over the pool's vocabulary (sparse gradients)
    under ``torch.optim.SparseAdam``."""

    def __init__(self) -> None:
        weight = torch.from_numpy(init_rows(POOL, DIM, seed=0, scale=SCALE))
        self.bag = nn.EmbeddingBag(POOL.size, DIM, mode="sum", include_last_offset=True,
                                   sparse=True, _weight=weight)  # fmt: skip
        self.opt = torch.optim.SparseAdam(self.bag.parameters(), lr=LR)

    def step(self, step: int) -> float:
        ids, offsets, inverse, labels = make_batch(step)
        idx = torch.from_numpy(np.searchsorted(POOL, ids.numpy()))
        loss = loss_of(self.bag(idx, offsets)[inverse], labels)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Values and moments (m | v) of ``ids``."""
        at = np.searchsorted(POOL, ids)
        state = self.opt.state[self.bag.weight]
        moments = torch.cat([state["exp_avg"], state["exp_avg_sq"]], 1)
        return self.bag.weight.detach().numpy()[at], moments.numpy()[at]


@pytest.mark.parametrize("cache_rows", [None, 60])
def test_the_store_trains_as_sparse_adam(tmp_path, cache_rows):
    """40 steps: the store's per-step losses, values and moments are ``SparseAdam``'s on an
    in-module table (to float32 rounding of the rows' gradient sums), while rows move to the
    hot set and back with their moments, are evicted to the home file (60 cached rows) and
    checkpointed; the store counts one optimizer step per update."""
    ref = SparseAdamTable()
    with _store(tmp_path / "s", cache_rows=cache_rows) as store:
        assert store.meta.state_dim == 2 * DIM
        bag = StoreEmbeddingBag(store)
        for step in range(40):
            if step == 15:
                assert store.reshard(10) == 10
            if step == 30:
                store.reshard(4)
            if step % 10 == 9:
                store.checkpoint(step)
            got, want = store_step(bag, step), ref.step(step)
            assert got == pytest.approx(want, rel=1e-6, abs=1e-6), step
        assert store.optimizer_step == 40
        ids, rows = store.export()
        values, moments = ref.rows(ids)
        np.testing.assert_allclose(rows[:, :DIM], values, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rows[:, DIM:], moments, rtol=1e-4, atol=1e-7)
        assert np.abs(rows[:, DIM:]).max() > 0  # the moments are the store's own
        if cache_rows is not None:
            assert store.stats().evictions > 0


def _train_store(store: EmbeddingStore, steps: range) -> list[float]:
    bag = StoreEmbeddingBag(store)
    return [store_step(bag, step) for step in steps]


@pytest.mark.parametrize("cache_rows", [None, 50])
def test_a_reopened_store_goes_on_bit_for_bit(tmp_path, cache_rows):
    """12 updates, a checkpoint, 12 more: a store reopened from the checkpoint and trained on
    the same 12 batches gives the same losses, values and moments bit for bit. The checkpoint's
    step label is not the optimizer's count: the commit keeps the count itself (12), and a
    roll-back to the commit before restores that one's (6) where it is kept (no eviction since)."""
    with _store(tmp_path / "s", cache_rows=cache_rows) as store:
        _train_store(store, range(6))
        store.reshard(8)  # hot rows: their moments are committed from the device copy
        store.checkpoint(600)
        _train_store(store, range(6, 12))
        store.checkpoint(1200)
        straight = _train_store(store, range(12, 24))
        ids, rows = store.export()
    with open_store(tmp_path / "s", lr=LR, cache_rows=cache_rows) as store:
        assert store.optimizer_step == 12
        resumed = _train_store(store, range(12, 24))
        assert store.optimizer_step == 24
        ids2, rows2 = store.export()
    assert resumed == straight
    order, order2 = np.argsort(ids), np.argsort(ids2)
    assert np.array_equal(ids[order], ids2[order2])
    assert np.array_equal(rows[order], rows2[order2])
    if cache_rows is None:  # no eviction wrote a row since 1200: its PREVIOUS is kept
        with open_store(tmp_path / "s", lr=LR, step=600) as store:
            assert store.optimizer_step == 6


def test_a_commit_record_without_the_count_takes_its_step(tmp_path):
    """A commit record written before the count was kept (no ``optimizer_step``) gives the
    count ``max(step, 0)``: what a trainer that checkpoints at its step has taken."""
    from trainer.store.persist import CommitRecord

    record = CommitRecord(step=7, epoch=1, num_rows=0, ids_crc=0, num_hot=0, hot_crc=0)
    assert record.optimizer_steps == 7
    assert CommitRecord.empty().optimizer_steps == 0
    assert CommitRecord(**{**record.__dict__, "optimizer_step": 3}).optimizer_steps == 3


def test_update_counts_a_step_without_rows(tmp_path):
    """As ``SparseAdam`` counts a step whose gradient has no row, ``update()`` counts one with
    nothing pushed; a caller's own count (a rank's) replaces it."""
    from recpipe.errors import StoreError

    with _store(None) as store:
        store.update()
        store.update()
        assert store.optimizer_step == 2
        store.update(step=9)
        assert store.optimizer_step == 9
        with pytest.raises(StoreError, match="must be >= 1"):
            store.update(step=0)


# -- recpipe train ------------------------------------------------------------------------------
def _close(a: list[float], b: list[float], tol: float = 1e-6) -> None:
    assert len(a) == len(b) > 0
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= tol, worst


def test_one_process_store_trains_as_parameter_tables_under_adam(data, tmp_path):  # noqa: F811
    """`recpipe train --store hybrid --optimizer adam` gives the per-step losses of
    `--optimizer adam` with parameter tables (``SparseAdam``) within 1e-6 over 20 steps, the
    first bit for bit; N steps, a checkpoint and `--resume` to 2N give the uninterrupted run's
    losses bit for bit (the stores reopen at the checkpoint's step count)."""
    flags = ["--steps", 20, "--batch-size", 2 * BATCH, *ADAM]
    params = _train(data, "one process", tmp_path / "params", *flags)
    store = _train(data, "one process", tmp_path / "store", *flags, *STORE)
    assert store["losses"][0] == params["losses"][0]
    _close(params["losses"], store["losses"])
    n = 4
    straight = _train(data, "one process", tmp_path / "straight", "--steps", 2 * n, *ADAM, *STORE)
    _train(data, "one process", tmp_path / "split", "--steps", n, *ADAM, *STORE)
    current = [json.loads(p.read_text()) for p in (tmp_path / "split" / "store").glob("*/CURRENT")]
    assert current and all(c["optimizer_step"] == n for c in current)
    resumed = _train(data, "one process", tmp_path / "split", "--steps", 2 * n, "--resume",
                     *ADAM, *STORE)  # fmt: skip
    assert resumed["resumed_from"] == n
    assert resumed["losses"] == straight["losses"]


@pytest.mark.slow
def test_two_ranks_with_stores_train_as_one_process_under_adam(data, tmp_path):  # noqa: F811
    """`--nproc 2 --store hybrid --optimizer adam --batch-size B` gives the per-step losses of
    one process `--optimizer adam --batch-size 2B` (parameter tables under ``SparseAdam``)
    within 1e-6 over 12 steps, with a hot set chosen after 4 counted steps (the hot replica's
    Adam and the stores' at the same step count)."""
    steps = 12
    one = _train(data, "one process", tmp_path / "one", "--steps", steps,
                 "--batch-size", 2 * BATCH, *ADAM)  # fmt: skip
    two = _train(data, "2 ranks", tmp_path / "two", "--steps", steps, *STORE, *ADAM,
                 "--count-steps", 4, "--hot-rows", 64)  # fmt: skip
    assert one["losses"][0] == two["losses"][0]
    _close(one["losses"], two["losses"])
    for rank in range(2):
        folder = tmp_path / "two" / "store" / f"rank-{rank:05d}-of-00002"
        metas = [json.loads(p.read_text()) for p in folder.glob("*/meta.json")]
        assert metas and all(m["optimizer"] == "adam" for m in metas)


@pytest.mark.slow
def test_saved_at_two_ranks_resumed_at_three_under_adam(data, tmp_path):  # noqa: F811
    """`--store hybrid --optimizer adam` saved at 2 ranks (48 rows each) after 4 steps with a
    hot set, resumed at 3 (32 rows each) to 8: each new rank reads its rows and their moments
    (``[n, 2D]``) from the old ranks' stores, and the losses follow the uninterrupted 2-rank
    run within 1e-6 (the first 4 bit for bit)."""
    n, hot = 4, ["--count-steps", 2, "--hot-rows", 64]
    run = [*STORE, *ADAM, *hot]
    straight = _train(data, "2 ranks", tmp_path / "straight", "--steps", 2 * n, *run,
                      "--batch-size", 48)  # fmt: skip
    ck = tmp_path / "split"
    _train(data, "2 ranks", ck, "--steps", n, *run, "--batch-size", 48)
    resumed = _train(data, "2 ranks", ck, "--steps", 2 * n, "--resume", *run, "--nproc", 3,
                     "--batch-size", 32)  # fmt: skip
    assert resumed["resumed_from"] == n
    assert resumed["losses"][:n] == straight["losses"][:n]
    _close(resumed["losses"], straight["losses"])
    assert len(list((ck / "store").glob("rank-*-of-00003"))) == 3
