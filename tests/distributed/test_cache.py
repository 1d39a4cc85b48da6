"""Per-rank embedding caches in one process (world of one): every read is the rank's own, so
the cache holds the only copy of the rows it updated; training and evaluation give bitwise what
the 2FP exchange gives, with any capacity."""

from __future__ import annotations

import dist_cases
import pytest
import torch

from readers.dataset import dataset_schema
from recpipe.errors import RecpipeError
from trainer.distributed.cache import RECORD_KINDS, CachedEmbeddings
from trainer.distributed.comm import Comm
from trainer.distributed.shard import SparseOptimizer
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM


def _trainer(dataset, opt, *, cache_rows):
    schema = dataset_schema(dataset)
    factory = sharded_table_factory(optimizer=opt)
    model = DLRM.from_schema(schema, dist_cases.SMALL_MODEL, table_factory=factory)
    return DistributedTrainer(model, comm=Comm.single(), optimizer=opt, cache_rows=cache_rows)


@pytest.mark.parametrize(("opt", "cache_rows"), [("adagrad", 64), ("adagrad", 0), ("sgd", 4096)])
def test_one_rank_with_a_cache_trains_and_evaluates_like_the_exchange(dist_dataset, opt,
                                                                      cache_rows):  # fmt: skip
    batches = dist_cases.rank_batches(str(dist_dataset), rank=0, world=1, dedup=True, steps=4)
    plain = _trainer(str(dist_dataset), opt, cache_rows=None)
    cached = _trainer(str(dist_dataset), opt, cache_rows=cache_rows)
    cached.sparse.keep_records = True
    for batch in batches[:3]:
        assert torch.equal(plain.train_step(batch)[0], cached.train_step(batch)[0])
    # the latest rows: those the cache holds dirty, read back without changing the cache
    dirty_before = cached.sparse.cache.dirty.copy()
    got, want = cached.sparse.owned_rows(), plain.sparse.owned_rows()
    assert (cached.sparse.cache.dirty == dirty_before).all()
    for name in want:
        assert torch.equal(got[name]["ids"], want[name]["ids"])
        assert torch.equal(got[name]["values"], want[name]["values"])
    # evaluation reads the dirty copies too, and leaves the cache as it was
    assert cached.evaluate(batches[3:]) == plain.evaluate(batches[3:])
    assert (cached.sparse.cache.dirty == dirty_before).all()
    (totals,) = cached.sparse.totals()
    assert set(totals) == set(RECORD_KINDS)
    assert totals["shared"] == totals["pushes"] == 0  # one rank: nobody else reads its rows
    assert (totals["evictions"] > 0) == (cache_rows < 4096)
    assert cached.sparse.cache.size <= cache_rows


def test_bad_cache_options(dist_dataset):
    schema = dataset_schema(str(dist_dataset))
    model = DLRM.from_schema(schema, dist_cases.SMALL_MODEL,
                             table_factory=sharded_table_factory(optimizer="sgd"))  # fmt: skip
    common = {"comm": Comm.single(), "optimizer": SparseOptimizer("sgd", 0.1)}
    with pytest.raises(RecpipeError, match="`capacity` must be a non-negative integer"):
        CachedEmbeddings(model, capacity=-1, **common)
    with pytest.raises(RecpipeError, match="`table_order` must name the model's tables"):
        CachedEmbeddings(model, capacity=8, table_order=["nope"], **common)
    sparse = CachedEmbeddings(model, capacity=8, **common)
    with pytest.raises(RecpipeError, match="no hot set"):
        sparse.reshard(4)
    with pytest.raises(RecpipeError, match="resume it without `cache_rows`"):
        sparse.set_hot([[1]] + [[]] * (len(sparse.tables) - 1))
