"""One process with the hybrid store reads a batch's id plan (#29 item 4): the trainer plans
each batch once when it reaches the device, each store table prefetches its plan's distinct ids
once per step, and every feature pools its ids at their positions among them. The rows, the
losses and the evaluation are those of a prefetch per feature, bit for bit."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from unittest import mock

import pytest
import torch

from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from tests.trainer.test_one_loop import (  # noqa: F401  (data: a fixture)
    BATCH,
    _train,
    data,
)
from trainer.config import ModelConfig
from trainer.models import DLRM, default_tables
from trainer.modules import TableConfig
from trainer.store.store import EmbeddingStore
from trainer.store.table import StoreTable
from trainer.train import Trainer

STEPS = 6
MODEL = ModelConfig(embedding_dim=4, num_embeddings=200, bottom_mlp=(8,), top_mlp=(8,),
                    attention_heads=2)  # fmt: skip
SHARED = ("item_id", "item_seller", "user_liked_items")  # pooled, pooled, attention


@pytest.fixture
def plans(monkeypatch):
    """Counts the id plans the one-process trainer computes (``.call_count``)."""
    train_module = importlib.import_module("trainer.train")  # (trainer.train: a function too)
    counting = mock.Mock(wraps=train_module.plan_batch)
    monkeypatch.setattr(train_module, "plan_batch", counting)
    return counting


@pytest.fixture
def prefetches(monkeypatch):
    """Counts each store's prefetches."""
    seen: Counter[int] = Counter()
    real = EmbeddingStore.prefetch

    def counting(self, ids):
        seen[id(self)] += 1
        return real(self, ids)

    monkeypatch.setattr(EmbeddingStore, "prefetch", counting)
    return seen


def _model_config(schema) -> ModelConfig:
    """One table per feature, but ``items`` read by two pooled features and an attention
    feature (the model splits it into a pooled and a sequence module of one name)."""
    tables = [t for t in default_tables(schema, MODEL) if t.name not in SHARED]
    tables.append(TableConfig("items", MODEL.num_embeddings, MODEL.embedding_dim, SHARED))
    return dataclasses.replace(MODEL, tables=tuple(tables))


def _trainer(dataset, optimizer: str) -> Trainer:
    from readers.dataset import dataset_schema

    schema = dataset_schema(str(dataset))

    def factory(table, seed):
        return StoreTable.create(None, table, optimizer=optimizer, lr=0.05, seed=seed,
                                 device="cpu")  # fmt: skip

    model = DLRM.from_schema(schema, _model_config(schema), table_factory=factory)
    return Trainer(model, optimizer=optimizer, lr=0.05, exact_dense=True)


def _batches(dataset, dedup: bool):
    ds = RankBatchDataset(str(dataset), config=ReaderConfig(batch_size=BATCH, shuffle=True,
                          seed=3), dedup=dedup, rank=0, world_size=1)  # fmt: skip
    return [b for _, b in zip(range(STEPS + 2), ds, strict=False)]


def _stores(trainer: Trainer) -> list[StoreTable]:
    return [m for m in trainer.model.modules() if isinstance(m, StoreTable)]


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "plain"])
def test_store_tables_read_one_plan_per_step_as_a_prefetch_per_feature(
    data,  # noqa: F811
    plans,
    prefetches,
    optimizer,
    dedup,
):
    """Every step and every evaluated batch is planned once, and each store table (``items``'
    pooled part reads two features) prefetches once per step; the per-step losses, the logits,
    every row of every store and the evaluation equal the unplanned model's (a prefetch per
    feature) bit for bit. Adam too: a feature's push covers its table's rows, zero where it
    reads none, and another feature of the step reads each of those, so the same rows step."""
    dataset, _ = data
    batches = _batches(dataset, dedup)
    planned, unplanned = _trainer(dataset, optimizer), _trainer(dataset, optimizer)
    unplanned._planned = []  # the model's lookups prefetch their own ids (no plan)
    tables = _stores(planned)
    assert {t.config.features for t in tables} >= {("item_id", "item_seller")}
    for step, batch in enumerate(batches[:STEPS], 1):
        before = Counter(prefetches)
        got_loss, got_logits = planned.train_step(batch)
        assert plans.call_count == step
        assert all(prefetches[id(t.store)] - before[id(t.store)] == 1 for t in tables)
        want_loss, want_logits = unplanned.train_step(batch)
        assert torch.equal(got_loss, want_loss), step
        assert torch.equal(got_logits, want_logits), step
    for mine, theirs in zip(tables, _stores(unplanned), strict=True):
        assert mine.config == theirs.config
        ids, rows = mine.store.export()
        other_ids, other_rows = theirs.store.export()
        order, other_order = ids.argsort(), other_ids.argsort()
        assert (ids[order] == other_ids[other_order]).all()
        assert (rows[order] == other_rows[other_order]).all(), mine.config.name
    got = planned.evaluate(batches[STEPS:])
    assert plans.call_count == STEPS + 2
    want = unplanned.evaluate(batches[STEPS:])
    assert dataclasses.astuple(got) == dataclasses.astuple(want) and got.batches == 2


def test_store_hybrid_training_plans_once_per_step(data, tmp_path, plans, monkeypatch):  # noqa: F811
    """``recpipe train --store hybrid`` in one process: one plan per step and per evaluated
    batch, and the per-step losses and the held-out loss of a run whose store tables look
    every feature up on its own (no plan), bit for bit."""
    flags = ["--steps", STEPS, "--store", "hybrid"]
    run = _train(data, "one process", tmp_path / "planned", *flags)
    assert plans.call_count == STEPS + 1  # --eval-batches 1
    monkeypatch.setattr(Trainer, "_plan", lambda self, batch: batch)
    unplanned = _train(data, "one process", tmp_path / "unplanned", *flags)
    assert plans.call_count == STEPS + 1
    assert run["losses"] == unplanned["losses"] and len(run["losses"]) == STEPS
    assert run["eval_loss"] == unplanned["eval_loss"]
