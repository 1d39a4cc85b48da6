"""A batch's id plan (trainer.idplan): computed once per step, carried with the batch to the
exchange, the caches and the collections, which look features up by position (not by the
identity of the batch's tensors, and without searching the prepared ids)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from recpipe.errors import RecpipeError
from trainer import idplan
from trainer.distributed import exchange
from trainer.distributed.comm import Comm
from trainer.distributed.exchange import ShardedTable
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM, ModelConfig
from trainer.modules import PlannedBatch, dedup_batch, lookup_values, table_ids

MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=1000, bottom_mlp=(16,), top_mlp=(16,), attention_heads=2
)


def _batches(dataset, *, count=2, dedup=True):
    ds = RankBatchDataset(
        str(dataset), config=ReaderConfig(batch_size=48, shuffle=True, seed=2), dedup=dedup,
        rank=0, world_size=1,
    )  # fmt: skip
    return [b for _, b in zip(range(count), ds, strict=False)]


def _trainer(dataset, **kwargs):
    from readers.dataset import dataset_schema

    schema = dataset_schema(str(dataset))
    model = DLRM.from_schema(
        schema, MODEL, table_factory=sharded_table_factory(optimizer="adagrad")
    )
    return DistributedTrainer(model, comm=Comm.single(), optimizer="adagrad", **kwargs)


@pytest.fixture
def no_search(monkeypatch):
    """Lookups that search the prepared ids (a batch without its plan) fail the test."""

    def search(self, ids, *args, **kwargs):
        raise AssertionError(f"table {self.config.name!r} searched its ids: no plan used")

    monkeypatch.setattr(ShardedTable, "pool", search)
    monkeypatch.setattr(ShardedTable, "rows", search)


@pytest.fixture
def plans(monkeypatch):
    """Counts the id plans computed (every consumer reads the one of its step)."""
    calls = []
    real = idplan.plan_batch

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(exchange, "plan_batch", counting)
    return calls


@pytest.mark.parametrize("cache_rows", [None, 64], ids=["exchange", "caches"])
def test_the_plan_is_computed_once_per_step_and_read_by_position(
    dist_dataset, plans, no_search, cache_rows
):
    """A training step and an evaluation each compute one plan; the exchange (or the caches)
    fetch its rows and every lookup of the model reads them at the plan's positions."""
    trainer = _trainer(dist_dataset, cache_rows=cache_rows)
    batches = _batches(dist_dataset, count=3)
    for step, batch in enumerate(batches, 1):
        trainer.train_step(batch)
        assert len(plans) == step
    result = trainer.evaluate(batches[:2])
    assert len(plans) == len(batches) + 2 and result.batches == 2


def test_the_model_reads_positions_not_tensor_identity(dist_dataset, no_search):
    """A copy of the planned batch (every tensor a new one, no storage shared) gives the same
    logits as the batch the plan was computed on; the plan of another batch is refused."""
    trainer = _trainer(dist_dataset)
    trainer.module.eval()
    first, second = _batches(dist_dataset, count=2)
    with torch.no_grad():
        planned = trainer.sparse.prepare(first, train=False)
        want = trainer.module(planned)
        twin = copy.deepcopy(planned)
        values = lookup_values(twin, twin.plan.positions)
        assert all(
            v.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
            for v, w in zip(values.values(), lookup_values(planned, values).values(), strict=True)
        )
        assert torch.equal(trainer.module(twin), want)
        stale = trainer.sparse.plan(second)  # planned, its rows not fetched
        with pytest.raises(RecpipeError, match="not the one whose rows were prepared"):
            trainer.module(stale)


def test_a_plain_batch_is_planned_as_the_model_deduplicates_it(dist_dataset, no_search):
    """`--dedup off`: the exchange plans the batch deduplicated as the model deduplicates it,
    so the model's own deduplication keeps the plan, and the logits are the deduplicated
    batch's."""
    trainer = _trainer(dist_dataset)
    trainer.module.eval()
    batch = _batches(dist_dataset, count=1)[0]
    plain = batch.to_plain()
    with torch.no_grad():
        planned = trainer.sparse.prepare(plain, train=False)
        model = trainer.module
        assert dedup_batch(planned, model.dedup_groups, model.dedup_partial) is planned
        got = model(planned)
        want = model(trainer.sparse.prepare(batch, train=False))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_plan_lists_each_tables_distinct_ids_and_each_features_positions(dist_dataset):
    """``plan.ids[t][plan.positions[f]]`` gives back the table ids of every value feature
    ``f`` looks up, the ids are distinct and in order of first appearance; a batch deduplicated
    again loses its plan."""
    trainer = _trainer(dist_dataset)
    tables = [t.config for t in trainer.sparse.tables]
    batch = _batches(dist_dataset, count=1)[0]
    planned = idplan.plan_batch(batch, tables)
    plan = planned.plan
    values = lookup_values(batch, plan.positions)
    for t, config in enumerate(tables):
        seen = []
        for f in config.features:
            assert plan.table_of[f] == t
            ids = table_ids(config, values[f]).numpy()
            assert np.array_equal(plan.ids[t][plan.positions[f].numpy()], ids)
            seen.extend(ids.tolist())
        assert plan.ids[t].tolist() == list(dict.fromkeys(seen))
    assert plan.num_unique == sum(len(set(u.tolist())) for u in plan.ids)
    assert type(planned.to_plain()) is not PlannedBatch  # expanded: other lookups
    plain = PlannedBatch.of(batch.to_plain(), plan)  # (a plan of other lookups, for the test)
    groups = [tuple(g.keys()) for g in batch.ikjts.values()]
    assert type(dedup_batch(plain, groups)) is not PlannedBatch
    with pytest.raises(RecpipeError, match=r"read by two planned tables"):
        idplan.plan_batch(batch, [*tables, tables[0]])
