"""Features read as a partial IKJT (lists that shift by one id): the embedding modules look up
each packed id once and give the numbers of the expanded lists; training with partial dedup
gives the losses of training without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recpipe.batch import Batch
from recpipe.ikjt import PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor
from tests.common.tensors import kjt_from_rows
from trainer.modules import ParameterTable, PooledEmbeddings, SequenceEmbeddings, TableConfig

# "recent" shifts by one id per row (appends while short, then slides); "seen" is unrelated.
RECENT = [[1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [], [9], [9, 8], [7], [7, 6]]
OTHER = [[5], [6, 5], [], [7, 7, 7], [1], [2], [3, 3], [4], [8]]


def _batches() -> tuple[Batch, Batch]:
    kjt = kjt_from_rows({"recent": RECENT, "other": OTHER})
    b = len(RECENT)
    common = {"dense": torch.zeros(b, 1), "labels": torch.zeros(b)}
    partial = PartialInverseKeyedJaggedTensor.from_kjt(kjt, ["recent", "other"])
    return (
        Batch(kjt=KeyedJaggedTensor.from_jagged_dict({}, stride=b), ikjts={"p": partial}, **common),
        Batch(kjt=kjt, **common),
    )


class _CountingTable(ParameterTable):
    """Records how many ids each lookup asks for."""

    def __init__(self, config, seed=0):
        super().__init__(config, seed)
        self.asked: list[int] = []

    def pool(self, ids, offsets, *, mode):
        self.asked.append(ids.numel())
        return super().pool(ids, offsets, mode=mode)

    def rows(self, ids):
        self.asked.append(ids.numel())
        return super().rows(ids)


def _tables(pooling="sum"):
    return [
        TableConfig("recent", 40, 4, ("recent",), pooling=pooling, hash_ids=True),
        TableConfig("other", 40, 4, ("other",), pooling=pooling, hash_ids=True),
    ]


def _grads(module, batch):
    module.zero_grad(set_to_none=True)
    out = module(batch)
    weights = torch.linspace(-1, 1, 4)
    loss = sum(((v if torch.is_tensor(v) else v.values) * weights).sum() for v in out.values())
    loss.backward()
    return out, {
        n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
        for n, p in module.named_parameters()
    }


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pooled_partial_equals_plain_with_fewer_lookups(pooling):
    partial, plain = _batches()
    ebc = PooledEmbeddings(_tables(pooling), seed=4, table_factory=_CountingTable).double()
    out_p, grads_p = _grads(ebc, partial)
    out_b, grads_b = _grads(ebc, plain)
    for key in ("recent", "other"):
        assert torch.equal(out_p[key], out_b[key]), key  # the same bags, bit for bit
        torch.testing.assert_close(grads_p[f"tables.{key}.weight"], grads_b[f"tables.{key}.weight"])
    recent = ebc.tables["recent"].asked
    packed = PartialInverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"r": RECENT}))
    assert recent == [packed.num_values, sum(map(len, RECENT))]  # partial: packed ids only
    assert packed.num_values < sum(map(len, RECENT))


def test_sequence_partial_equals_plain():
    partial, plain = _batches()
    seq = SequenceEmbeddings(_tables(), seed=1).double()
    out_p, grads_p = _grads(seq, partial)
    out_b, grads_b = _grads(seq, plain)
    for key in ("recent", "other"):
        got, want = out_p[key], out_b[key].expand()
        assert got.inverse is None and got.group == "p"
        assert torch.equal(got.values, want.values) and torch.equal(got.offsets, want.offsets)
    for name in grads_b:
        torch.testing.assert_close(grads_p[name], grads_b[name])


def test_key_windows_read_back_each_key():
    kjt = kjt_from_rows({"recent": RECENT, "other": OTHER})
    partial = PartialInverseKeyedJaggedTensor.from_kjt(kjt)
    for key in ("recent", "other"):
        ids, positions, offsets = partial.key_windows(key)
        assert torch.equal(ids[positions], kjt[key].values())
        assert torch.equal(offsets, kjt[key].offsets())
    assert partial.key_windows("recent")[0].numel() < sum(map(len, RECENT))
    doubled = partial.map_values(lambda v: v * 2).to_kjt()  # element-wise, windows kept
    assert torch.equal(doubled["recent"].values(), kjt["recent"].values() * 2)
    with pytest.raises(Exception, match="`key` 'nope' is not a key"):
        partial.key_windows("nope")


@pytest.mark.slow
def test_training_with_partial_dedup_gives_the_losses_without(tmp_path):
    """user_recent_items read as a partial IKJT (the groups file's `partial`), the same run with
    the groups only and with dedup off train to the same losses over these 8 steps (over 20
    Adagrad steps the partial path's other summation order moves them by ~1e-3 relative: the
    reason the bundled schema leaves it opt-in)."""
    from tests.common.data import synthetic_dataset
    from trainer.models import ModelConfig
    from trainer.train import TrainConfig, train

    dataset = synthetic_dataset(tmp_path / "d", requests=4000, seed=2, files=2, row_group_size=512)
    groups = tmp_path / "groups.toml"
    groups.write_text(
        '[dedup]\ngroups = [["user_segment", "user_country", "user_follows"], '
        '["user_liked_items", "user_liked_sellers"], ["user_recent_queries"]]\n'
    )
    model = ModelConfig(embedding_dim=8, num_embeddings=500, bottom_mlp=(8,), top_mlp=(8,))
    common = {"batch_size": 256, "steps": 8, "eval_fraction": 0.1, "model": model}
    partial = tmp_path / "partial.toml"
    partial.write_text(groups.read_text() + 'partial = ["user_recent_items"]\n')
    with_partial = train(
        TrainConfig(str(dataset), dedup_groups=str(partial), **common), progress=False
    )
    groups_only = train(
        TrainConfig(str(dataset), dedup_groups=str(groups), **common), progress=False
    )
    off = train(TrainConfig(str(dataset), dedup=False, **common), progress=False)
    assert with_partial.dedup_factor > groups_only.dedup_factor > off.dedup_factor == 1.0
    np.testing.assert_allclose(with_partial.losses, groups_only.losses, rtol=1e-5)
    np.testing.assert_allclose(with_partial.losses, off.losses, rtol=1e-5)
