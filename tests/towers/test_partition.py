"""The tower partitioner: balance bound, determinism, planted groups, plan files."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.towers.config import TowerError, TowerPlan, load_plan
from trainer.towers.partition import (
    affinity_from_gram,
    balanced_kmeans,
    metric_mds,
    partition_features,
    size_bounds,
)


def planted_affinity(groups: int, per_group: int, *, seed: int = 0, noise: float = 0.1):
    """|cos| affinities of features in ``groups`` blocks: high inside a block, low across."""
    rng = np.random.default_rng(seed)
    n = groups * per_group
    label = np.repeat(np.arange(groups), per_group)
    perm = rng.permutation(n)  # the planted groups are not contiguous in feature order
    label = label[perm]
    aff = np.where(label[:, None] == label[None, :], 0.8, 0.1) + rng.uniform(0, noise, (n, n))
    aff = np.clip((aff + aff.T) / 2, 0, 1)
    np.fill_diagonal(aff, 1.0)
    names = [f"f{i}" for i in range(n)]
    planted = {frozenset(names[i] for i in np.flatnonzero(label == g)) for g in range(groups)}
    return names, aff, planted


@pytest.mark.parametrize("towers,balance", [(2, 1.0), (3, 1.5), (4, 2.0), (5, 1.3)])
@pytest.mark.parametrize("strategy", ["coherent", "diverse"])
def test_towers_respect_the_balance_bound(towers, balance, strategy):
    rng = np.random.default_rng(towers)
    n = 24
    gram = rng.normal(size=(n, 8)) @ rng.normal(size=(8, n))
    names = [f"f{i}" for i in range(n)]
    part = partition_features(names, affinity_from_gram(gram @ gram.T), towers=towers,
                              strategy=strategy, balance=balance, seed=3)  # fmt: skip
    sizes = part.plan.sizes
    assert len(sizes) == towers
    assert sorted(part.plan.features) == sorted(names)
    assert max(sizes) <= balance * min(sizes) + 1e-9, sizes


def test_an_impossible_balance_is_refused_naming_it():
    with pytest.raises(TowerError, match=r"`balance` 1 cannot split 7 features into 2 towers"):
        size_bounds(7, 2, 1.0)
    with pytest.raises(TowerError, match="`towers` must be in"):
        size_bounds(3, 4, 2.0)


def test_the_partition_is_deterministic_for_a_seed():
    names, aff, _ = planted_affinity(3, 5, seed=1, noise=0.6)
    runs = [partition_features(names, aff, towers=3, balance=1.5, seed=7) for _ in range(2)]
    assert runs[0].plan == runs[1].plan
    assert np.array_equal(runs[0].coords, runs[1].coords)
    assert runs[0].plan.to_toml() == runs[1].plan.to_toml()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coherent_towers_recover_planted_groups(seed):
    names, aff, planted = planted_affinity(4, 4, seed=seed)
    part = partition_features(names, aff, towers=4, strategy="coherent", balance=1.0, seed=seed)
    assert {frozenset(t) for t in part.plan.towers} == planted


def test_diverse_towers_spread_planted_groups():
    names, aff, planted = planted_affinity(3, 3, seed=4)
    part = partition_features(names, aff, towers=3, strategy="diverse", balance=1.0, seed=0)
    for tower in part.plan.towers:
        for group in planted:
            assert len(group & set(tower)) == 1, (tower, group)


def test_mds_stress_does_not_increase_and_fits_a_metric():
    pts = np.random.default_rng(0).normal(size=(9, 2))
    d = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1))
    _, stress = metric_mds(d, dims=2, seed=0, steps=2000)
    assert stress < 1e-6 * (d**2).sum()
    _, short = metric_mds(d, dims=2, seed=0, steps=3)
    assert stress <= short


def test_balanced_kmeans_keeps_exact_sizes():
    x = np.random.default_rng(5).normal(size=(12, 2))
    assign, _ = balanced_kmeans(x, 3, balance=1.0, seed=0)
    assert np.bincount(assign).tolist() == [4, 4, 4]


def test_plan_round_trips_and_bad_files_name_the_problem(tmp_path):
    plan = TowerPlan((("a", "b"), ("c",)), strategy="coherent", balance=2.0, seed=1, source='x "y"')
    path = plan.save(tmp_path / "t.toml")
    assert load_plan(path) == plan
    (tmp_path / "dup.toml").write_text('[[tower]]\nfeatures = ["a"]\n[[tower]]\nfeatures = ["a"]\n')
    with pytest.raises(TowerError, match=r"dup.toml: feature 'a' is in towers 0 and 1"):
        load_plan(tmp_path / "dup.toml")
    with pytest.raises(TowerError, match="cannot be read"):
        load_plan(tmp_path / "missing.toml")
    with pytest.raises(TowerError, match="tower 1 has no feature"):
        TowerPlan((("a",), ()))


class _Pooled:
    """A stand-in for a model's embedding collection: fixed pooled rows per batch."""

    def __init__(self, features, rows):
        self.features, self.rows = features, rows

    def __call__(self, batch):
        return {f: self.rows[batch][:, i] for i, f in enumerate(self.features)}


def test_gram_matrix_raw_and_centred():
    import torch

    from trainer.towers.affinity import gram_matrix

    rng = torch.Generator().manual_seed(0)
    rows = [torch.randn(5, 3, 4, generator=rng) + 2.0 for _ in range(3)]  # (B, F, N), mean 2
    model = torch.nn.Module()
    model.ebc = _Pooled(("a", "b", "c"), rows)
    r = torch.cat(rows).double()
    features, raw, samples = gram_matrix(model, range(3))
    assert features == ("a", "b", "c") and samples == 15
    np.testing.assert_allclose(raw, torch.einsum("bfn,bgn->fg", r, r).numpy() / 15, rtol=1e-12)
    _, centred, _ = gram_matrix(model, range(3), center=True)
    c = r - r.mean(0, keepdim=True)
    np.testing.assert_allclose(centred, torch.einsum("bfn,bgn->fg", c, c).numpy() / 15, atol=1e-12)
    _, _, samples = gram_matrix(model, range(3), max_batches=2)
    assert samples == 10


@pytest.mark.slow
def test_partition_recovers_planted_groups_from_synthetic_data(tmp_path):
    """End to end: `synth --planted-groups 3 --planted-features 3`, a short training run on the
    planted features, centred affinities, MDS in 8 dimensions, balanced k-means: the towers are
    the planted groups. (The raw mean of R Rᵀ, and a 2-D MDS, do not separate them here.)"""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate, planted_groups, planted_schema
    from trainer.config import ModelConfig
    from trainer.towers.config import PartitionConfig
    from trainer.towers.run import partition

    cfg = SynthConfig(num_requests=4000, seed=5, planted_groups=3, planted_features=3,
                      planted_strength=2.0, planted_noise=0.1)  # fmt: skip
    logs = generate(tmp_path / "raw", cfg)
    build(logs.features, tmp_path / "ds", events=logs.events, schema=planted_schema(cfg),
          config=BuildConfig(row_group_size=256))  # fmt: skip
    groups = planted_groups(cfg)
    model = ModelConfig(embedding_dim=8, num_embeddings=1000, bottom_mlp=(16,), top_mlp=(16,),
                        attention="none")  # fmt: skip
    config = PartitionConfig(str(tmp_path / "ds"), towers=3, balance=1.0, steps=300, lr=1.0,
                             batch_size=128, features=tuple(f for g in groups for f in g),
                             center=True, dims=8, model=model)  # fmt: skip
    part = partition(config)
    assert {frozenset(t) for t in part.plan.towers} == {frozenset(g) for g in groups}
    assert "centred R Rᵀ" in part.plan.source
