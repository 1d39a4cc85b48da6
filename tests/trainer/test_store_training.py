"""Training through the embedding store == training with in-module tables; crash recovery."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from queue import Queue

import numpy as np
import pytest
import torch
from torch import nn

from trainer.store import EmbeddingStore, StoreConfig, StoreEmbeddingBag, init_rows, open_store

DIM = 8
SCALE = 0.5
# ids over the whole int64 range, including the extremes, zero and negatives
POOL = np.unique(
    np.concatenate(
        [
            [-(2**63), 2**63 - 1, 0, -1, 1, 2**62, -(2**62)],
            np.random.default_rng(123).integers(-(2**63), 2**63 - 1, 293, dtype=np.int64),
        ]
    ).astype(np.int64)
)
LR = {"sgd": 0.5, "rowwise_adagrad": 0.1}


def make_batch(step: int, *, unique: int = 12, batch: int = 24):
    """An IKJT-like batch: ids/offsets over U unique rows, inverse_lookup [B], labels [B]."""
    rng = np.random.default_rng([7, step])
    lengths = rng.integers(1, 6, unique)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ranks = np.minimum(rng.zipf(1.3, int(offsets[-1])) - 1, POOL.size - 1)
    ids = POOL[(ranks * 7919) % POOL.size]  # skewed, spread over the pool
    inverse = rng.integers(0, unique, batch)
    labels = rng.integers(0, 2, batch).astype(np.float32)
    return (
        torch.from_numpy(ids),
        torch.from_numpy(offsets),
        torch.from_numpy(inverse),
        torch.from_numpy(labels),
    )


HEAD = torch.linspace(-1.0, 1.0, DIM)


def loss_of(pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(pooled @ HEAD, labels)


def store_step(bag: StoreEmbeddingBag, step: int, locations=None) -> float:
    ids, offsets, inverse, labels = make_batch(step)
    out = bag(ids, offsets, inverse_lookup=inverse, locations=locations)
    loss = loss_of(out, labels)
    loss.backward()
    bag.store.update()
    return loss.item()


class Reference(nn.Module):
    """The same model with an in-module ``nn.EmbeddingBag`` over the pool's vocabulary."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.vocab = POOL
        weight = torch.from_numpy(init_rows(POOL, DIM, seed=0, scale=SCALE))
        self.bag = nn.EmbeddingBag(
            POOL.size, DIM, mode="sum", include_last_offset=True, _weight=weight
        )
        self.optimizer = optimizer
        self.state = torch.zeros(POOL.size)

    def step(self, step: int) -> float:
        ids, offsets, inverse, labels = make_batch(step)
        idx = torch.from_numpy(np.searchsorted(self.vocab, ids.numpy()))
        loss = loss_of(self.bag(idx, offsets)[inverse], labels)
        self.bag.zero_grad()
        loss.backward()
        w, g = self.bag.weight.data, self.bag.weight.grad
        lr = LR[self.optimizer]
        if self.optimizer == "sgd":
            w -= lr * g
        else:  # fbgemm's row-wise Adagrad
            self.state += (g * g).mean(1)
            w -= (lr / (self.state.sqrt() + 1e-8)).unsqueeze(1) * g
        return loss.item()

    def table(self, ids: np.ndarray) -> np.ndarray:
        return self.bag.weight.data.numpy()[np.searchsorted(self.vocab, ids)]


def make_store(path, optimizer: str, **kw) -> EmbeddingStore:
    cfg = StoreConfig(
        dim=DIM, optimizer=optimizer, lr=LR[optimizer], init_scale=SCALE, chunk_rows=16, **kw
    )
    return EmbeddingStore.create(path, cfg)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("cache_rows", [None, 60])
def test_same_losses_as_in_module_tables(tmp_path, optimizer, cache_rows):
    ref = Reference(optimizer)
    with make_store(tmp_path / "s", optimizer, cache_rows=cache_rows) as store:
        bag = StoreEmbeddingBag(store)
        for step in range(40):
            if step == 15:
                assert store.reshard(10) == 10  # rows move to the hot set mid-training
            if step == 30:
                store.reshard(4)  # and back, with their optimizer state
            if step % 10 == 9:
                store.checkpoint(step)
            got, want = store_step(bag, step), ref.step(step)
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), step
        ids, values = store.export()
        np.testing.assert_allclose(values[:, :DIM], ref.table(ids), rtol=1e-5, atol=1e-6)
        assert len(np.unique(ids)) == len(ids) == store.num_rows  # no two ids share a row
        stats = store.stats()
        assert stats.hot_rows == 4
        if cache_rows is not None:
            assert stats.cached_rows <= cache_rows and stats.misses > 0


def test_memory_budget_of_ten_percent_reports_misses(tmp_path):
    """A cache of 10% of the table's rows trains the same model; the miss rate is reported."""
    ref = Reference("rowwise_adagrad")
    budget = POOL.size // 10
    with make_store(tmp_path / "s", "rowwise_adagrad", cache_rows=budget, pin_window=1) as store:
        bag = StoreEmbeddingBag(store)
        for step in range(60):
            assert store_step(bag, step) == pytest.approx(ref.step(step), rel=1e-5, abs=1e-6)
        stats = store.stats()
        assert stats.cache_capacity == budget
        assert stats.rows > 5 * budget
        assert 0.0 < stats.miss_rate < 1.0
        assert stats.evictions > 0
        ids, values = store.export()
        np.testing.assert_allclose(values[:, :DIM], ref.table(ids), rtol=1e-5, atol=1e-6)


def test_prefetch_in_a_loader_thread(tmp_path):
    """A loader thread prefetching one batch ahead gives the sequential losses."""
    with make_store(tmp_path / "a", "sgd", cache_rows=40) as a:
        bag = StoreEmbeddingBag(a)
        sequential = [store_step(bag, step) for step in range(30)]
    with make_store(tmp_path / "b", "sgd", cache_rows=40) as b:
        bag = StoreEmbeddingBag(b)
        queue: Queue = Queue(maxsize=1)  # one batch ahead: within the default pin_window of 2

        def loader() -> None:
            for step in range(30):
                queue.put(b.prefetch(make_batch(step)[0]))

        thread = threading.Thread(target=loader)
        thread.start()
        threaded = [store_step(bag, step, locations=queue.get()) for step in range(30)]
        thread.join()
    assert threaded == sequential


def test_stale_locations_after_reshard_are_refused(tmp_path):
    from recpipe.errors import StoreError

    with make_store(tmp_path / "s", "sgd") as store:
        loc = store.prefetch(make_batch(0)[0])
        store.reshard(3)
        with pytest.raises(StoreError, match="stale"):
            store.pull(loc)


# ----------------------------------------------------------------------------- crash recovery

CKPT_EVERY = 3
RESHARD_AT = 4


@contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def child_main(path: str, cache_rows: int) -> None:
    """Train forever, checkpointing every CKPT_EVERY steps; print progress (run by the test)."""
    torch.set_num_threads(1)
    store = make_store(path, "rowwise_adagrad", cache_rows=cache_rows)
    bag = StoreEmbeddingBag(store)
    inflight = None
    for step in itertools.count():
        loss = store_step(bag, step)
        print(f"STEP {step} {loss!r}", flush=True)
        if inflight is not None:  # a background checkpoint, finished while training went on
            done = inflight.result()["step"]
            Path(f"{path}.ckpt-{done}").touch()
            print(f"CKPT {done}", flush=True)
            inflight = None
        if step == RESHARD_AT:
            store.reshard(6)
        if step % CKPT_EVERY == CKPT_EVERY - 1:
            inflight = store.checkpoint(step, wait=False)


def reference_run(path, steps: int) -> EmbeddingStore:
    """The uninterrupted run up to (and including) step ``steps - 1``."""
    store = make_store(path, "rowwise_adagrad")
    bag = StoreEmbeddingBag(store)
    for step in range(steps):
        store_step(bag, step)
        if step == RESHARD_AT:
            store.reshard(6)
    return store


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_recovers_the_last_checkpoint(tmp_path, seed):
    path = str(tmp_path / "store")
    target = 3 * CKPT_EVERY - 1  # the checkpoint after which the child is killed
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"from test_store_training import child_main; child_main({path!r}, 70)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in child.stdout:
            if line.startswith(f"CKPT {target}"):
                break
        assert Path(f"{path}.ckpt-{target}").exists()
        seen = target
        for _ in range(random.Random(seed).randrange(0, 25)):  # a random moment after it
            line = child.stdout.readline()
            if line.startswith("CKPT"):
                seen = int(line.split()[1])
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    with one_thread():
        recovered = open_store(path, lr=LR["rowwise_adagrad"], cache_rows=60, verify=True)
        step = recovered.stats().last_checkpoint_step
        assert step >= seen and step % CKPT_EVERY == CKPT_EVERY - 1
        reference = reference_run(tmp_path / "ref", step + 1)
        ids_r, values_r = recovered.export()
        ids_e, values_e = reference.export()
        np.testing.assert_array_equal(ids_r, ids_e)
        assert values_r.tobytes() == values_e.tobytes()  # bitwise, optimizer state included
        bag_r, bag_e = StoreEmbeddingBag(recovered), StoreEmbeddingBag(reference)
        for s in range(step + 1, step + 6):
            assert store_step(bag_r, s) == store_step(bag_e, s)
        recovered.close()
        reference.close()


def test_mean_pooling_matches_embedding_bag(tmp_path):
    ids, offsets, _, _ = make_batch(3)
    with make_store(tmp_path / "s", "sgd") as store:
        bag = StoreEmbeddingBag(store, mode="mean")
        out = bag(ids, offsets)  # (U, D): no inverse lookup
        idx = torch.from_numpy(np.searchsorted(POOL, ids.numpy()))
        weight = torch.from_numpy(init_rows(POOL, DIM, seed=0, scale=SCALE)).requires_grad_()
        want = nn.functional.embedding_bag(
            idx, weight, offsets, mode="mean", include_last_offset=True
        )
        torch.testing.assert_close(out, want)
        (out * HEAD).sum().backward()
        (want * HEAD).sum().backward()
        store.update()
        got_ids, values = store.export()
        expected = weight.detach() - LR["sgd"] * weight.grad
        rows = torch.from_numpy(np.searchsorted(POOL, got_ids))
        torch.testing.assert_close(torch.from_numpy(values[:, :DIM]), expected[rows])


def test_reshard_by_the_cost_model_within_the_budget(tmp_path):
    from recpipe.errors import StoreError
    from trainer.store import CostCoefficients

    coefficients = CostCoefficients(c_ar=1e-9, c_a2a=1e-6)
    with make_store(tmp_path / "s", "sgd", hot_budget_rows=50, count_batches=10) as store:
        bag = StoreEmbeddingBag(store)
        for step in range(12):
            store_step(bag, step)
        plan = store.plan_hot_set(coefficients=coefficients)
        assert 0 < plan.num_hot <= 50 and plan.cost <= plan.cost_no_hot
        assert store.reshard(coefficients=coefficients) == plan.num_hot
        assert store.rho(plan.num_hot) == pytest.approx(plan.rho)
        assert store.stats().hot_rows == plan.num_hot
        with pytest.raises(StoreError, match="hot_budget_rows"):
            store.reshard(51)
