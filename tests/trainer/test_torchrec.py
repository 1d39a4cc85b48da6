"""trainer.torchrec: TorchRec's embedding collections swapped in by one import, dedup included.

The reference is TorchRec itself (torchrec 1.8.0 on fbgemm-gpu-cpu): the same model built with
TorchRec's collection and with ours, from the same torch seed, must hold the same weights and give
the same outputs and gradients on the same batches, fed as TorchRec KJTs (the plain path) and as
recpipe Batches/IKJTs (the dedup path), also after optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recpipe._deps import optional_import
from recpipe.batch import Batch
from recpipe.errors import DataError, DependencyError, RecpipeError
from recpipe.ikjt import InverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor
from schemas import parse_schema
from tests.common.data import session_batch
from tests.common.schemas import TINY_SCHEMA

try:
    trm = optional_import("torchrec.modules.embedding_modules", purpose="the TorchRec swap tests")
    trc = optional_import("torchrec.modules.embedding_configs", purpose="the TorchRec swap tests")
    trj = optional_import("torchrec.sparse.jagged_tensor", purpose="the TorchRec swap tests")
    dlrm = optional_import("torchrec.models.dlrm", purpose="the TorchRec swap tests")
except DependencyError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"TorchRec cannot be imported here: {exc}", allow_module_level=True)

import trainer.torchrec as ours
from recpipe.torchrec_interop import ikjt_to_torchrec, to_torchrec

pytestmark = pytest.mark.torchrec

DIM = 8
TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(scope="module")
def schema():
    return parse_schema(TINY_SCHEMA, source="tiny.toml")


@pytest.fixture(scope="module")
def batches(schema):
    """Three deduplicated batches (two IKJT groups + a plain KJT each); ids below 500."""
    return [session_batch(schema, 48, seed=s) for s in (1, 2, 3)]


def _bag_tables(pooling=None, *, twice=True):
    """Tables with a shared table; with ``twice`` item_id also reads a second table."""
    pooling = pooling or trc.PoolingType.SUM
    tables = [
        # a table shared by two features of different groups (output keys feature@table)
        trc.EmbeddingBagConfig(
            name="item_table", embedding_dim=DIM, num_embeddings=500,
            feature_names=["user_items", "item_id"], pooling=pooling,
        ),
        trc.EmbeddingBagConfig(
            name="sellers", embedding_dim=DIM, num_embeddings=500,
            feature_names=["user_sellers"], pooling=pooling,
        ),
        trc.EmbeddingBagConfig(
            name="misc", embedding_dim=DIM, num_embeddings=500,
            feature_names=["user_segment", "item_tags"], pooling=pooling,
        ),
        trc.EmbeddingBagConfig(  # item_id again: TorchRec names both outputs feature@table
            name="item_id_2", embedding_dim=DIM, num_embeddings=500, feature_names=["item_id"],
            pooling=pooling,
        ),
    ]  # fmt: skip
    return tables if twice else tables[:-1]


def _seq_tables():
    return [
        trc.EmbeddingConfig(
            name="item_table", embedding_dim=DIM, num_embeddings=500,
            feature_names=["user_items", "item_tags"],
        ),
        trc.EmbeddingConfig(
            name="sellers", embedding_dim=DIM, num_embeddings=500, feature_names=["user_sellers"]
        ),
    ]  # fmt: skip


def _dlrm(ebc_class, pooling=None):
    torch.manual_seed(0)
    return dlrm.DLRM(
        # TorchRec's DLRM names each feature's output once: no feature reads two tables
        embedding_bag_collection=ebc_class(tables=_bag_tables(pooling, twice=False)),
        dense_in_features=2,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )


def _step(model, dense, features, labels, optimizer=None):
    """Forward, backward; returns logits and gradients (and steps ``optimizer``)."""
    model.zero_grad(set_to_none=True)
    logits = model(dense, features).squeeze(1)
    F.binary_cross_entropy_with_logits(logits, labels).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if optimizer is not None:
        optimizer.step()
    return logits.detach(), grads


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, **TOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **TOL, msg=name)


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_torchrec_dlrm_with_our_ebc_swapped_in_trains_the_same(batches, pooling):
    """Done when: same weights, same outputs and gradients (1e-6), plain KJT and dedup IKJT
    inputs, through Adam steps (dense gradients)."""
    pooling = trc.PoolingType[pooling]
    theirs = _dlrm(trm.EmbeddingBagCollection, pooling)
    mine = _dlrm(ours.EmbeddingBagCollection, pooling)  # the one import that changes
    mine_dedup = _dlrm(ours.EmbeddingBagCollection, pooling)
    state = theirs.state_dict()
    assert list(mine.state_dict()) == list(state)  # same parameters under the same keys
    for name, value in mine.state_dict().items():
        assert torch.equal(value, state[name]), name  # same init from the same seed
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (theirs, mine, mine_dedup)]
    for batch in batches:
        dense, labels = torch.nan_to_num(batch.dense), batch.labels
        plain = to_torchrec(batch.to_plain().kjt)
        ref = _step(theirs, dense, plain, labels, opts[0])
        _assert_same(_step(mine, dense, plain, labels, opts[1]), ref)
        _assert_same(_step(mine_dedup, dense, batch, labels, opts[2]), ref)
    # the embeddings were trained by Adam (dense gradients) alike; Adam divides by the root of
    # each coordinate's squared gradients, which turns the last-bit differences of a near-zero
    # gradient summed in another order (duplicates first) into ~1e-6 steps: hence 1e-5 here
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(mine.state_dict()[name], value, rtol=0, atol=0)
        torch.testing.assert_close(mine_dedup.state_dict()[name], value, rtol=1e-5, atol=1e-5)


def test_ebc_output_is_torchrecs_keyed_tensor(batches):
    torch.manual_seed(1)
    theirs = trm.EmbeddingBagCollection(tables=_bag_tables())
    torch.manual_seed(1)
    mine = ours.EmbeddingBagCollection(_bag_tables())
    batch = batches[0]
    ref = theirs(to_torchrec(batch.to_plain().kjt))
    for features in (batch, batch.to_plain(), batch.to_plain().kjt):
        out = mine(features)
        assert isinstance(out, trj.KeyedTensor)
        assert out.keys() == ref.keys() == [
            "user_items", "item_id@item_table", "user_sellers", "user_segment", "item_tags",
            "item_id@item_id_2",
        ]  # fmt: skip
        assert out.length_per_key() == ref.length_per_key()
        torch.testing.assert_close(out.values(), ref.values(), rtol=0, atol=0)


def test_ebc_pools_only_the_unique_rows_of_a_group(batches):
    mine = ours.EmbeddingBagCollection(_bag_tables())
    rows: list[tuple[str, int]] = []
    for name, bag in mine.embedding_bags.items():
        bag.register_forward_pre_hook(
            lambda m, args, name=name: rows.append((name, args[1].numel() - 1))
        )
    batch = batches[0]
    mine(batch)
    unique = batch.ikjts["user_items+user_sellers"].num_unique
    assert unique < batch.batch_size
    assert ("item_table", unique) in rows and (
        "sellers",
        unique,
    ) in rows  # user_items, user_sellers
    assert ("item_table", batch.batch_size) in rows  # item_id is plain: B rows
    assert ("misc", batch.ikjts["user_segment"].num_unique) in rows


def test_ebc_on_torchrecs_variable_batch_kjt_matches_torchrec(batches):
    """TorchRec's own dedup input (inverse_indices) expands the pooled rows the same way."""
    tables = [
        trc.EmbeddingBagConfig(
            name="t", embedding_dim=DIM, num_embeddings=500,
            feature_names=["user_items", "user_sellers"],
        )
    ]  # fmt: skip
    torch.manual_seed(2)
    theirs = trm.EmbeddingBagCollection(tables=tables)
    mine = ours.EmbeddingBagCollection(tables)
    mine.load_state_dict(theirs.state_dict())
    group = batches[1].ikjts["user_items+user_sellers"]
    vbe = ikjt_to_torchrec(group)
    w = torch.randn(group.batch_size, 2 * DIM)
    out = {}
    for name, module, features in (
        ("theirs", theirs, vbe),
        ("vbe", mine, vbe),
        ("ikjt", mine, group),
    ):
        module.zero_grad(set_to_none=True)
        values = module(features).values()
        (values * w).sum().backward()
        out[name] = (values.detach(), {"w": module.embedding_bags["t"].weight.grad.clone()})
    _assert_same(out["vbe"], out["theirs"])
    _assert_same(out["ikjt"], out["theirs"])


def test_ebc_weighted_torchrec_kjt_matches_torchrec():
    tables = [
        trc.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a"])
    ]
    torch.manual_seed(3)
    theirs = trm.EmbeddingBagCollection(tables=tables, is_weighted=True)
    torch.manual_seed(3)
    mine = ours.EmbeddingBagCollection(tables, is_weighted=True)
    kjt = trj.KeyedJaggedTensor(
        keys=["a"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]),
        weights=torch.tensor([0.5, 2.0, -1.0]),
    )  # fmt: skip
    torch.testing.assert_close(mine(kjt).values(), theirs(kjt).values(), rtol=0, atol=0)
    assert mine.is_weighted()
    plain = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths())  # recpipe's: no weights
    with pytest.raises(DataError, match="`is_weighted` collections need a TorchRec"):
        mine(InverseKeyedJaggedTensor.from_kjt(plain))


def test_sparse_gradients_are_an_option(batches):
    torch.manual_seed(4)
    dense_ebc = ours.EmbeddingBagCollection(_bag_tables())
    torch.manual_seed(4)
    sparse_ebc = ours.EmbeddingBagCollection(_bag_tables(), sparse_grad=True)
    batch = batches[2]
    grads = []
    for module in (dense_ebc, sparse_ebc):
        module(batch).values().sum().backward()
        grads.append(module.embedding_bags["item_table"].weight.grad)
    assert not grads[0].is_sparse and grads[1].is_sparse
    torch.testing.assert_close(grads[1].to_dense(), grads[0], **TOL)


def test_ec_matches_torchrec_on_plain_and_dedup_inputs(batches):
    """Done when, for sequences: the same dict of JaggedTensors and the same gradients."""
    torch.manual_seed(5)
    theirs = trm.EmbeddingCollection(tables=_seq_tables(), need_indices=True)
    torch.manual_seed(5)
    mine = ours.EmbeddingCollection(_seq_tables(), need_indices=True)
    assert list(mine.state_dict()) == list(theirs.state_dict())
    for name, value in mine.state_dict().items():
        assert torch.equal(value, theirs.state_dict()[name]), name
    for batch in batches:
        plain = to_torchrec(batch.to_plain().kjt)
        gen = torch.Generator().manual_seed(0)
        weights = None
        results = []
        for module, features in ((theirs, plain), (mine, plain), (mine, batch)):
            module.zero_grad(set_to_none=True)
            out = module(features)
            if weights is None:
                weights = {
                    k: torch.randn(jt.values().shape, generator=gen) for k, jt in out.items()
                }
            sum((jt.values() * weights[k]).sum() for k, jt in out.items()).backward()
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
            results.append((out, grads))
        (ref, ref_grads), *rest = results
        for out, grads in rest:
            assert list(out) == list(ref) == ["user_items", "item_tags", "user_sellers"]
            for key, jt in out.items():
                assert isinstance(jt, trj.JaggedTensor)
                torch.testing.assert_close(jt.values(), ref[key].values(), rtol=0, atol=0)
                assert torch.equal(jt.lengths(), ref[key].lengths())
                assert torch.equal(jt.offsets(), ref[key].offsets())
                assert torch.equal(jt.weights(), ref[key].weights())  # the ids (need_indices)
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)


def test_ec_unique_embeddings_stay_on_unique_rows(batches):
    mine = ours.EmbeddingCollection(_seq_tables())
    batch = batches[0]
    unique = mine.unique_embeddings(batch)
    group = batch.ikjts["user_items+user_sellers"]
    assert unique["user_items"].num_rows == group.num_unique
    assert unique["user_items"].inverse is group.inverse_lookup
    assert unique["item_tags"].inverse is None  # a plain feature: its B rows
    out = mine(batch)
    for key, seq in unique.items():
        torch.testing.assert_close(seq.expand().values, out[key].values(), rtol=0, atol=0)


def test_ec_refuses_torchrecs_variable_batch_kjt(batches):
    mine = ours.EmbeddingCollection(_seq_tables()[1:])
    vbe = ikjt_to_torchrec(batches[0].ikjts["user_items+user_sellers"])
    with pytest.raises(DataError, match="variable-batch KeyedJaggedTensor"):
        mine(vbe)


def test_configs_are_checked():
    with pytest.raises(RecpipeError, match="`pooling` must be SUM or MEAN"):
        ours.EmbeddingBagCollection(
            [
                trc.EmbeddingBagConfig(
                    name="t", embedding_dim=4, num_embeddings=5, pooling=trc.PoolingType.NONE
                )
            ]
        )
    twice = [trc.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5)] * 2
    with pytest.raises(RecpipeError, match="table name 't' twice"):
        ours.EmbeddingBagCollection(twice)
    with pytest.raises(RecpipeError, match=r"`tables\[0\]` must be a TorchRec EmbeddingBagConfig"):
        ours.EmbeddingBagCollection(
            [trc.EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=5)]
        )
    dims = [
        trc.EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=5),
        trc.EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=5),
    ]
    with pytest.raises(RecpipeError, match=r"one `embedding_dim`, got \{'a': 4, 'b': 8\}"):
        ours.EmbeddingCollection(dims)
    # no feature names: the table's name, as in TorchRec
    ebc = ours.EmbeddingBagCollection(
        [trc.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5)]
    )
    assert ebc.embedding_bag_configs()[0].feature_names == ["t"]
    on_meta = ours.EmbeddingBagCollection(_bag_tables(), device=torch.device("meta"))
    assert on_meta.device.type == "meta" and on_meta.embedding_bags["sellers"].weight.is_meta


def test_ids_outside_a_table_and_missing_features_are_named(batches):
    small = [
        trc.EmbeddingBagConfig(
            name="tiny", embedding_dim=4, num_embeddings=3, feature_names=["user_items"]
        )
    ]
    mine = ours.EmbeddingBagCollection(small)
    batch = batches[0]
    for features in (batch, to_torchrec(batch.to_plain().kjt)):
        with pytest.raises(
            DataError, match=r"feature 'user_items': id \d+ is outside table 'tiny' of 3 rows"
        ):
            mine(features)
    seq = ours.EmbeddingCollection(
        [
            trc.EmbeddingConfig(
                name="tiny", embedding_dim=4, num_embeddings=3, feature_names=["user_items"]
            )
        ]
    )
    with pytest.raises(DataError, match="outside table 'tiny'"):
        seq(batch)
    other = ours.EmbeddingBagCollection(
        [
            trc.EmbeddingBagConfig(
                name="t", embedding_dim=4, num_embeddings=5, feature_names=["nope"]
            )
        ]
    )
    with pytest.raises(DataError, match="'nope' is not in the batch"):
        other(batch)
    with pytest.raises(DataError, match=r"\['nope'\] are not in the KeyedJaggedTensor"):
        other(to_torchrec(batch.to_plain().kjt))


def test_missing_torchrec_says_how_to_install(monkeypatch):
    def missing(name, *, purpose=""):
        raise DependencyError(
            f"optional dependency `{name}` is not available (needed for {purpose})"
        )

    monkeypatch.setattr(ours, "optional_import", missing)
    with pytest.raises(DependencyError, match="TorchRec-compatible embedding collections"):
        ours.EmbeddingBagCollection([])


def test_a_model_of_both_collections_trains_with_adam(batches):
    """A small TorchRec-style model: pooled bags + a mean over sequence embeddings."""

    class Model(nn.Module):
        def __init__(self, bags, seqs):
            super().__init__()
            self.bags, self.seqs = bags, seqs
            self.out = nn.Linear(6 * DIM + 3 * DIM, 1)

        def forward(self, features):
            pooled = self.bags(features).values()  # (B, 6D)
            means = []
            for jt in self.seqs(features).values():
                lengths = jt.lengths()
                sums = torch.zeros(lengths.numel(), DIM).index_add_(
                    0, torch.repeat_interleave(torch.arange(lengths.numel()), lengths), jt.values()
                )
                means.append(sums / lengths.clamp(min=1)[:, None])
            return self.out(torch.cat([pooled, *means], dim=1)).squeeze(1)

    def build(module):
        torch.manual_seed(6)
        return Model(module.EmbeddingBagCollection(tables=_bag_tables()),
                     module.EmbeddingCollection(tables=_seq_tables()))  # fmt: skip

    theirs, mine = build(trm), build(ours)
    opt_t, opt_m = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (theirs, mine))
    for batch in batches * 2:
        for model, opt, features in (
            (theirs, opt_t, to_torchrec(batch.to_plain().kjt)),
            (mine, opt_m, batch),
        ):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(model(features), batch.labels).backward()
            opt.step()
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(mine.state_dict()[name], value, **TOL, msg=name)


def test_batch_without_groups_and_an_empty_batch(schema):
    mine = ours.EmbeddingBagCollection(_bag_tables())
    batch = session_batch(schema, 5, seed=9).to_plain()
    assert mine(batch).values().shape == (5, 6 * DIM)
    empty = Batch(
        dense=batch.dense[:0],
        labels=batch.labels[:0],
        kjt=batch.kjt.index_select(torch.tensor([], dtype=torch.int64)),
    )
    assert mine(empty).values().shape == (0, 6 * DIM)
