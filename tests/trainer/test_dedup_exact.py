"""Dedup on == dedup off, bit for bit on the CPU, for every optimizer (issue 28 item 7).

A deduplicated batch sums the gradients of a unique row's duplicates before the embedding and
attention backward; the plain batch is deduplicated by the model the same way
(:meth:`trainer.models.DLRM.set_dedup_groups`), so per-step losses, parameters and gradients
are equal as floats, not just close.
"""

from __future__ import annotations

import pytest
import torch

from schemas import default_schema, parse_schema
from tests.common.data import session_batch, synthetic_dataset
from tests.common.schemas import TINY_SCHEMA
from trainer.models import DLRM, ModelConfig
from trainer.modules import dedup_batch
from trainer.train import TrainConfig, train

STEPS = 30


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Synthetic sessions (their user features repeat from row to row), ~9k training rows."""
    root = tmp_path_factory.mktemp("dedup_exact")
    return synthetic_dataset(root, requests=12_000, seed=5, files=2, row_group_size=1024)


def _run(dataset, checkpoint, *, dedup, optimizer, attention="auto", dedup_groups=None):
    model = ModelConfig(embedding_dim=8, num_embeddings=2000, bottom_mlp=(16,), top_mlp=(32,),
                        attention_heads=2, attention=attention)  # fmt: skip
    config = TrainConfig(
        dataset=str(dataset), dedup=dedup, dedup_groups=dedup_groups, steps=STEPS,
        batch_size=256, optimizer=optimizer, model=model, eval_fraction=0.2, eval_batches=1,
        checkpoint=str(checkpoint), threads=1,
    )  # fmt: skip
    return train(config, progress=False)


def _assert_same_training(on, off):
    assert on.dedup_factor > 1.5 and off.dedup_factor == 1.0  # the batches did repeat rows
    assert len(on.losses) == STEPS
    assert on.losses == off.losses  # float ==, step by step
    p_on = torch.load(on.checkpoint, weights_only=False)["trainer"]["model"]
    p_off = torch.load(off.checkpoint, weights_only=False)["trainer"]["model"]
    assert p_on.keys() == p_off.keys()
    for name in p_on:
        assert torch.equal(p_on[name], p_off[name]), name


@pytest.mark.parametrize(
    ("optimizer", "attention"),
    [
        pytest.param("sgd", "auto", marks=pytest.mark.slow),
        ("adagrad", "auto"),
        pytest.param("adam", "auto", marks=pytest.mark.slow),
        pytest.param("adagrad", "none", marks=pytest.mark.slow),
    ],
)
def test_dedup_on_and_off_train_bit_for_bit(dataset, tmp_path, optimizer, attention):
    """Before the plain path summed each batch row's gradient on its own: Adagrad's losses
    parted at step 1-3 and Adam's at step 2 (SGD's losses agreed, its parameters did not)."""
    kw = {"optimizer": optimizer, "attention": attention}
    on = _run(dataset, tmp_path / "on", dedup=True, **kw)
    off = _run(dataset, tmp_path / "off", dedup=False, **kw)
    _assert_same_training(on, off)


@pytest.mark.slow
def test_partial_dedup_trains_bit_for_bit(dataset, tmp_path):
    """The shifted history read as a partial IKJT (opt-in: ``[dedup] partial``) is exact too."""
    schema = default_schema()
    groups = ", ".join("[" + ", ".join(f'"{k}"' for k in g) + "]" for g in schema.dedup_groups)
    toml = tmp_path / "groups.toml"
    toml.write_text(f'[dedup]\ngroups = [{groups}]\npartial = ["user_recent_items"]\n')
    kw = {"optimizer": "adagrad", "dedup_groups": str(toml)}
    on = _run(dataset, tmp_path / "on", dedup=True, **kw)
    off = _run(dataset, tmp_path / "off", dedup=False, **kw)
    _assert_same_training(on, off)


def test_plain_batch_is_deduplicated_as_the_readers_do():
    schema = parse_schema(TINY_SCHEMA, source="tiny.toml")
    batch = session_batch(schema, 96, seed=4)
    plain = batch.to_plain()
    assert dedup_batch(plain, schema.dedup_groups).equals(batch)
    assert dedup_batch(plain, ()) is plain and dedup_batch(batch, schema.dedup_groups) is batch


@pytest.mark.parametrize("attention", ["auto", "none"])
def test_gradients_are_equal_as_floats(attention):
    """float32 logits and every gradient (sparse ones coalesced) of a plain batch are those of
    its deduplicated form; without the model's groups they are not (the plain sums)."""
    schema = parse_schema(TINY_SCHEMA, source="tiny.toml")
    batch = session_batch(schema, 128, seed=2)
    config = ModelConfig(embedding_dim=8, num_embeddings=64, attention=attention)
    model = DLRM.from_schema(schema, config)
    labels = torch.linspace(0, 1, 128)

    def grads(b):
        model.zero_grad(set_to_none=True)
        logits = model(b)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        return logits.detach(), {
            n: p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad.clone()
            for n, p in model.named_parameters()
        }

    out_d, g_d = grads(batch)
    out_p, g_p = grads(batch.to_plain())
    assert torch.equal(out_d, out_p)
    assert all(torch.equal(g_d[n], g_p[n]) for n in g_d), [
        n for n in g_d if not torch.equal(g_d[n], g_p[n])
    ]
    model.set_dedup_groups(())  # every row on its own: the same sums in another order
    _, g_rows = grads(batch.to_plain())
    assert any(not torch.equal(g_d[n], g_rows[n]) for n in g_d)
