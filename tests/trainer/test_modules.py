"""Dedup embedding modules (O5, O6) and deduplicated attention pooling (O7): dedup == plain.

Batches are built directly from recpipe types by ``tests.common.data.session_batch`` (also used
by the model tests), so these tests do not depend on the ETL or the readers.
"""

from __future__ import annotations

import pytest
import torch

from recpipe.batch import Batch
from recpipe.errors import DataError, RecpipeError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor
from schemas import default_schema, parse_schema
from tests.common.data import session_batch
from tests.common.schemas import TINY_SCHEMA
from trainer.attention import AttentionPooling
from trainer.modules import (
    JaggedEmbeddings,
    ParameterTable,
    PooledEmbeddings,
    SequenceEmbeddings,
    TableConfig,
    expand_rows,
    locate_features,
)


@pytest.fixture(scope="module")
def small_schema():
    return parse_schema(TINY_SCHEMA, source="tiny.toml")


@pytest.fixture(scope="module")
def batch(small_schema):
    return session_batch(small_schema, 64, seed=3)


def _tables(schema, *, dim=4, num=50, hash_ids=True, pooling="sum"):
    return [
        TableConfig(f, num, dim, (f,), pooling=pooling, hash_ids=hash_ids)
        for f in schema.sparse_names
    ]


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def _backward_grads(module, inputs, weights):
    module.zero_grad(set_to_none=True)
    out = module(inputs)
    if isinstance(out, dict):
        loss = sum((v * weights[k]).sum() for k, v in out.items())
    else:
        loss = (out * weights).sum()
    loss.backward()
    return out, {n: _dense_grad(p).clone() for n, p in module.named_parameters()}


def test_batch_helper_deduplicates(batch):
    assert all(g.num_unique < g.batch_size for g in batch.ikjts.values())
    assert batch.to_plain().kjt.stride() == 64


# -- tables ------------------------------------------------------------------------------------
def test_table_config_validates():
    with pytest.raises(RecpipeError, match="`num_embeddings` must be a positive integer, got 0"):
        TableConfig("t", 0, 4, ("a",))
    with pytest.raises(RecpipeError, match="`pooling` must be one of"):
        TableConfig("t", 10, 4, ("a",), pooling="max")
    with pytest.raises(RecpipeError, match="each once"):
        TableConfig("t", 10, 4, ("a", "a"))
    with pytest.raises(RecpipeError, match="a feature reads exactly one table"):
        PooledEmbeddings([TableConfig("t", 10, 4, ("a",)), TableConfig("u", 10, 4, ("a",))])


def test_init_is_deterministic_and_order_independent():
    a = TableConfig("a", 30, 4, ("fa",))
    b = TableConfig("b", 30, 4, ("fb",))
    one = PooledEmbeddings([a, b], seed=5)
    two = PooledEmbeddings([b, a], seed=5)
    other = PooledEmbeddings([a, b], seed=6)
    assert torch.equal(one.tables["a"].weight, two.tables["a"].weight)
    assert torch.equal(one.tables["b"].weight, two.tables["b"].weight)
    assert not torch.equal(one.tables["a"].weight, other.tables["a"].weight)


def test_hash_ids_maps_raw_ids_into_the_table():
    table = ParameterTable(TableConfig("t", 7, 3, ("f",), hash_ids=True))
    ids = torch.tensor([3, 10, 1_000_000_000_003])
    expect = table.weight[torch.tensor([3, 3, (1_000_000_000_003) % 7])]
    torch.testing.assert_close(table.rows(ids), expect)


# -- embedding bags (O5) -----------------------------------------------------------------------
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("bad_id", [500, 10**12, -1])
def test_id_outside_the_table_names_table_feature_and_id(small_schema, batch, dedup, bad_id):
    """Regression: torch's index error named neither the table, the feature nor the id."""
    kjt = batch.to_plain().kjt
    lists = {k: kjt[k].to_dense_list() for k in kjt.keys()}
    lists["user_items"][5] = torch.tensor([3, bad_id, 4])  # in a dedup group
    rebuilt = KeyedJaggedTensor.from_jagged_dict(
        {k: JaggedTensor.from_dense_list(v, dtype=torch.int64) for k, v in lists.items()}
    )
    plain = Batch(dense=batch.dense, labels=batch.labels, kjt=rebuilt)
    inputs = plain
    if dedup:
        groups = {g: InverseKeyedJaggedTensor.from_kjt(rebuilt, g.split("+")) for g in batch.ikjts}
        grouped = [k for g in groups for k in g.split("+")]
        plain_keys = [k for k in rebuilt.keys() if k not in grouped]
        inputs = Batch(
            dense=batch.dense, labels=batch.labels, kjt=rebuilt.select(plain_keys), ikjts=groups
        )
    tables = _tables(small_schema, num=500, hash_ids=False)  # the batch draws ids below 500
    for module in (PooledEmbeddings(tables), SequenceEmbeddings(tables)):
        with pytest.raises(DataError) as exc:
            module(inputs)
        text = str(exc.value)
        assert "feature 'user_items'" in text and "table 'user_items' of 500 rows" in text
        assert f"id {bad_id} " in text and "hash_ids" in text and "num_embeddings" in text
    # with hash_ids the same ids are taken modulo the table and the lookup succeeds
    PooledEmbeddings(_tables(small_schema, num=500, hash_ids=True))(inputs)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_ebc_dedup_matches_plain_values_and_gradients(small_schema, batch, pooling):
    ebc = PooledEmbeddings(_tables(small_schema, pooling=pooling), seed=1).double()
    gen = torch.Generator().manual_seed(0)
    weights = {f: torch.randn(64, 4, generator=gen, dtype=torch.float64) for f in ebc.features}
    out_d, grads_d = _backward_grads(ebc, batch, weights)
    out_p, grads_p = _backward_grads(ebc, batch.to_plain(), weights)
    out_k, _ = _backward_grads(ebc, batch.to_plain().kjt, weights)
    for f in ebc.features:
        assert out_d[f].shape == (64, 4)
        torch.testing.assert_close(out_d[f], out_p[f], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out_k[f], out_p[f], rtol=0, atol=0)
    for name in grads_p:
        torch.testing.assert_close(grads_d[name], grads_p[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expand_rows_backward_is_index_selects_bit_for_bit(dtype):
    """The compiled backward of the expansion sums each unique row's gradient in batch order:
    the values torch's own index_select backward gives, bit for bit (unreached rows get 0)."""
    gen = torch.Generator().manual_seed(3)
    pooled = torch.randn(40, 8, generator=gen, dtype=dtype)
    inverse = torch.randint(0, 37, (300,), generator=gen)  # rows 37..39 never read
    grad = torch.randn(300, 8, generator=gen, dtype=dtype) * torch.logspace(-6, 6, 8, dtype=dtype)
    ours = pooled.clone().requires_grad_()
    out = expand_rows(ours, inverse)
    out.backward(grad)
    ref = pooled.clone().requires_grad_()
    ref.index_select(0, inverse).backward(grad)
    assert out.grad_fn is not None and "ExpandRows" in type(out.grad_fn).__name__
    assert torch.equal(out, pooled[inverse]) and torch.equal(ours.grad, ref.grad)
    assert not ours.grad[37:].any()
    assert expand_rows(pooled, None) is pooled


def test_ebc_looks_up_unique_rows_only(small_schema, batch):
    seen = []

    class CountingTable(ParameterTable):
        def pool(self, ids, offsets, *, mode):
            seen.append((self.config.name, offsets.numel() - 1))
            return super().pool(ids, offsets, mode=mode)

    ebc = PooledEmbeddings(_tables(small_schema), table_factory=CountingTable)
    ebc(batch)
    rows = dict(seen)
    assert rows["user_items"] == batch.ikjts["user_items+user_sellers"].num_unique
    assert rows["user_segment"] == batch.ikjts["user_segment"].num_unique
    assert rows["item_id"] == 64


def test_shared_table_accumulates_both_features(small_schema, batch):
    shared = TableConfig("items", 50, 4, ("user_items", "item_id"), hash_ids=True)
    ebc = PooledEmbeddings([shared], seed=2).double()
    weights = {f: torch.ones(64, 4, dtype=torch.float64) for f in ebc.features}
    _, grads_d = _backward_grads(ebc, batch, weights)
    _, grads_p = _backward_grads(ebc, batch.to_plain(), weights)
    torch.testing.assert_close(grads_d["tables.items.weight"], grads_p["tables.items.weight"])
    # every looked-up id of both features got gradient
    plain = batch.to_plain().kjt
    counts = torch.bincount(
        torch.cat([plain["user_items"].values(), plain["item_id"].values()]) % 50, minlength=50
    ).double()
    torch.testing.assert_close(grads_p["tables.items.weight"][:, 0], counts)


def test_partial_ikjt_group_falls_back_to_expansion(small_schema, batch):
    ebc = PooledEmbeddings(_tables(small_schema), seed=1)
    plain = batch.to_plain()
    partial = Batch(
        dense=batch.dense,
        labels=batch.labels,
        kjt=batch.kjt,
        ikjts={
            "user_items+user_sellers": PartialInverseKeyedJaggedTensor.from_kjt(
                plain.kjt, ["user_items", "user_sellers"]
            ),
            "user_segment": batch.ikjts["user_segment"],
        },
    )
    out_partial, out_plain = ebc(partial), ebc(plain)
    for f in ebc.features:
        torch.testing.assert_close(out_partial[f], out_plain[f])


def test_missing_feature_names_it(small_schema, batch):
    with pytest.raises(DataError, match="'nope' is not in the batch"):
        locate_features(batch, ["nope"])
    with pytest.raises(
        DataError, match="must be a Batch, a KeyedJaggedTensor or an InverseKeyedJaggedTensor"
    ):
        locate_features({"a": 1}, ["a"])


# -- sequence embeddings (O6) ------------------------------------------------------------------
def test_sequence_embeddings_stay_unique_and_expand_exactly(small_schema, batch):
    seq = SequenceEmbeddings(_tables(small_schema)[:2], seed=4).double()
    out_d = seq(batch)
    out_p = seq(batch.to_plain())
    group = batch.ikjts["user_items+user_sellers"]
    for f in ("user_items", "user_sellers"):
        assert out_d[f].inverse is group.inverse_lookup
        assert out_d[f].num_rows == group.num_unique and out_d[f].batch_size == 64
        expanded = out_d[f].expand()
        torch.testing.assert_close(expanded.values, out_p[f].values, rtol=0, atol=0)
        assert torch.equal(expanded.offsets, out_p[f].offsets)
    # gradients through the jagged index select (backward: jagged index add)
    w = torch.randn(out_p["user_items"].values.shape, dtype=torch.float64)
    seq.zero_grad(set_to_none=True)
    (seq(batch)["user_items"].expand().values * w).sum().backward()
    g_d = _dense_grad(seq.tables["user_items"].weight).clone()
    seq.zero_grad(set_to_none=True)
    (seq(batch.to_plain())["user_items"].values * w).sum().backward()
    torch.testing.assert_close(g_d, _dense_grad(seq.tables["user_items"].weight))


# -- attention pooling (O7) --------------------------------------------------------------------
def _attention(dim=8, **kw):
    return AttentionPooling(
        ["user_items", "user_sellers"],
        dim=dim,
        max_len={"user_items": 6, "user_sellers": 4},
        **kw,
    ).double()


def test_attention_dedup_matches_plain_values_and_gradients(small_schema, batch):
    seq = SequenceEmbeddings(_tables(small_schema, dim=8)[:2], seed=4).double()
    att = _attention(num_layers=2)
    calls = []
    att.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    w = torch.randn(64, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(inputs):
        seq.zero_grad(set_to_none=True)
        att.zero_grad(set_to_none=True)
        rows = []
        orig = att.pool_rows

        def spy(seqs):
            rows.append(seqs[0].num_rows)
            return orig(seqs)

        att.pool_rows = spy
        out = att(seq(inputs))
        del att.pool_rows
        (out * w).sum().backward()
        grads = {
            n: _dense_grad(p).clone() for n, p in [*seq.named_parameters(), *att.named_parameters()]
        }
        return out, grads, rows[0]

    out_d, grads_d, rows_d = run(batch)
    out_p, grads_p, rows_p = run(batch.to_plain())
    assert rows_d == batch.ikjts["user_items+user_sellers"].num_unique < rows_p == 64
    assert out_d.shape == (64, 8)
    torch.testing.assert_close(out_d, out_p, rtol=1e-10, atol=1e-12)
    assert grads_d.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_d[name], grads_p[name], rtol=1e-9, atol=1e-12)


def test_attention_rows_do_not_depend_on_other_rows(small_schema, batch):
    seq = SequenceEmbeddings(_tables(small_schema, dim=8)[:2], seed=4).double()
    att = _attention()
    plain = batch.to_plain()
    full = att(seq(plain))
    for r in (0, 5, 63):
        one = plain.kjt.index_select(torch.tensor([r]))
        torch.testing.assert_close(att(seq(one))[0], full[r], rtol=1e-10, atol=1e-12)


def test_attention_handles_empty_rows_and_truncates_to_max_len():
    dim = 4
    att = AttentionPooling(["s"], dim=dim, max_len=2, num_heads=1).double()
    values = torch.randn(5, dim, dtype=torch.float64)
    offsets = torch.tensor([0, 0, 5])  # an empty row, then 5 values (only the last 2 count)
    out = att({"s": JaggedEmbeddings(values, offsets)})
    assert torch.isfinite(out).all()
    last_two = att({"s": JaggedEmbeddings(values[3:], torch.tensor([0, 0, 2]))})
    torch.testing.assert_close(out, last_two, rtol=1e-12, atol=1e-12)
    nothing = att({"s": JaggedEmbeddings(values[:0], torch.tensor([0, 0, 0]))})
    torch.testing.assert_close(nothing[0], out[0])


def test_attention_gradcheck_on_unique_rows():
    dim = 4
    att = AttentionPooling(["s"], dim=dim, max_len=3, num_heads=2).double()
    offsets = torch.tensor([0, 2, 3, 3])  # U = 3 unique rows
    inverse = torch.tensor([0, 0, 2, 1, 0, 2])  # B = 6

    def f(values):
        return att({"s": JaggedEmbeddings(values, offsets, inverse)})

    values = torch.randn(3, dim, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (values,))


def test_attention_truncation_gives_dropped_values_no_gradient():
    """Values beyond a row's last ``max_len`` (sent to a spare row that is dropped) get an exact
    zero gradient, the kept ones a correct one."""
    dim = 4
    att = AttentionPooling(["s"], dim=dim, max_len=2, num_heads=2).double()
    offsets = torch.tensor([0, 4, 5, 8])  # rows of 4, 1 and 3 values: 2, 0 and 1 dropped
    values = torch.randn(8, dim, dtype=torch.float64, requires_grad=True)
    out = att({"s": JaggedEmbeddings(values, offsets)})
    (out * torch.randn(out.shape, dtype=torch.float64)).sum().backward()  # LayerNorm: not .sum()
    dropped = torch.tensor([0, 1, 5])
    assert torch.equal(values.grad[dropped], torch.zeros(3, dim, dtype=torch.float64))
    assert values.grad[torch.tensor([2, 3, 4, 6, 7])].abs().sum(1).gt(0).all()
    assert torch.autograd.gradcheck(
        lambda v: att({"s": JaggedEmbeddings(v, offsets)}), (values.detach().requires_grad_(),)
    )


def test_attention_validates_arguments():
    with pytest.raises(RecpipeError, match="`num_heads` must divide `dim`"):
        AttentionPooling(["s"], dim=6, num_heads=4)
    with pytest.raises(RecpipeError, match="at least one sequence feature"):
        AttentionPooling([], dim=4)


def test_default_schema_batch_builds():
    b = session_batch(default_schema(), 32, seed=1)
    assert set(b.sparse_keys) == set(default_schema().sparse_names)
