"""DLRM: built from a schema, the same logits and gradients with dedup on and off."""

from __future__ import annotations

import pytest
import torch

from recpipe.errors import RecpipeError
from schemas import default_schema, parse_schema
from tests.common.data import session_batch
from tests.common.schemas import TINY_SCHEMA
from trainer.models import DLRM, ModelConfig, attention_features, default_tables
from trainer.modules import TableConfig


@pytest.fixture(scope="module")
def schema():
    return parse_schema(TINY_SCHEMA, source="tiny.toml")


def _grads(model):
    return {
        n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def test_dlrm_dedup_matches_plain_logits_and_gradients(schema):
    batch = session_batch(schema, 96, seed=11)
    model = DLRM.from_schema(schema, ModelConfig(embedding_dim=8, num_embeddings=64)).double()

    def logits_of(b):
        model.zero_grad(set_to_none=True)
        out = model(b)
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64)).sum().backward()
        return out, _grads(model)

    out_d, g_d = logits_of(batch)
    out_p, g_p = logits_of(batch.to_plain())
    assert out_d.shape == (96,)
    torch.testing.assert_close(out_d, out_p, rtol=1e-10, atol=1e-12)
    assert g_d.keys() == g_p.keys() and len(g_d) == len(list(model.parameters()))
    for name in g_p:
        torch.testing.assert_close(g_d[name], g_p[name], rtol=1e-9, atol=1e-12)


def test_dlrm_float32_dedup_parity(schema):
    batch = session_batch(schema, 128, seed=2)
    model = DLRM.from_schema(schema, ModelConfig(embedding_dim=8, num_embeddings=64))
    torch.testing.assert_close(model(batch), model(batch.to_plain()), rtol=1e-5, atol=1e-6)


def test_from_schema_picks_the_user_history_for_attention():
    s = default_schema()
    assert attention_features(s, ModelConfig()) == ("user_liked_items", "user_liked_sellers")
    assert attention_features(s, ModelConfig(attention="none")) == ()
    model = DLRM.from_schema(s, ModelConfig(num_embeddings=100))
    assert model.attention.features == ("user_liked_items", "user_liked_sellers")
    assert set(model.ebc.features) == set(s.sparse_names) - {
        "user_liked_items",
        "user_liked_sellers",
    }
    assert model.num_vectors == 1 + len(s.sparse_names) - 2 + 1


def test_same_seed_same_parameters(schema):
    a = DLRM.from_schema(schema, ModelConfig(seed=3, num_embeddings=50))
    b = DLRM.from_schema(schema, ModelConfig(seed=3, num_embeddings=50))
    c = DLRM.from_schema(schema, ModelConfig(seed=4, num_embeddings=50))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_explicit_shared_tables(schema):
    tables = (
        TableConfig("items", 40, 8, ("user_items", "item_id"), hash_ids=True),
        TableConfig("rest", 40, 8, ("user_sellers", "user_segment", "item_tags"), hash_ids=True),
    )
    model = DLRM.from_schema(schema, ModelConfig(embedding_dim=8, tables=tables, attention="none"))
    batch = session_batch(schema, 32, seed=5)
    torch.testing.assert_close(model(batch), model(batch.to_plain()), rtol=1e-5, atol=1e-6)
    assert [t for t in model.ebc.tables] == ["items", "rest"]


def test_config_errors_quote_the_value(schema):
    with pytest.raises(RecpipeError, match="`embedding_dim` must be a positive integer, got 0"):
        ModelConfig(embedding_dim=0)
    with pytest.raises(RecpipeError, match="`attention_heads` \\(3\\) must divide"):
        ModelConfig(embedding_dim=8, attention_heads=3)
    with pytest.raises(RecpipeError, match="`attention` must be 'auto', 'none'"):
        ModelConfig(attention="all")
    with pytest.raises(RecpipeError, match="'nope' is not a sparse feature"):
        DLRM.from_schema(schema, ModelConfig(attention=("nope",)))
    bad = (TableConfig("t", 10, 4, ("ghost",)),)
    with pytest.raises(RecpipeError, match="every table must have dim"):
        ModelConfig(embedding_dim=8, tables=bad)
    with pytest.raises(RecpipeError, match="reads \\['ghost'\\]"):
        DLRM.from_schema(schema, ModelConfig(embedding_dim=4, attention_heads=2, tables=bad))


def test_default_tables_one_per_feature(schema):
    tables = default_tables(schema, ModelConfig(num_embeddings=77))
    assert [t.features for t in tables] == [(f,) for f in schema.sparse_names]
    assert all(t.num_embeddings == 77 and t.hash_ids for t in tables)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dlrm_dedup_parity_on_cuda(schema):
    batch = session_batch(schema, 128, seed=2).to("cuda")
    model = DLRM.from_schema(schema, ModelConfig(embedding_dim=8, num_embeddings=64)).cuda()
    out_d, out_p = model(batch), model(batch.to_plain())
    torch.testing.assert_close(out_d, out_p, rtol=1e-5, atol=1e-6)
    out_d.sum().backward()
    assert model.ebc.tables["item_id"].weight.grad is not None
