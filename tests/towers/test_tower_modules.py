"""Tower modules start where the pooled embeddings stood and a step moves them boundedly.

Regression: with ``nn.Linear``'s own parametrisation a DLRM tower module's outputs started many
times larger than its inputs (biases of up to ``±1 / sqrt(fan_in)``) and one Adagrad step at
the default learning rate moved them by several times the embeddings' size; training at
compression 2 diverged in its first steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from readers.dataset import dataset_schema
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from trainer.config import DEFAULT_LR, ModelConfig
from trainer.distributed.comm import Comm
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.towers.config import TowerModuleConfig, TowerPlan
from trainer.towers.model import TowerDLRM
from trainer.towers.modules import build_tower

FEATURES, DIM, ROWS = 16, 16, 1000
CASES = [(kind, r) for kind in ("dlrm", "dcn") for r in (1, 2, 4, 8, 16)]


def _inputs(rows: int = 64) -> torch.Tensor:
    """Pooled embeddings at their initial scale (tables start in ``±sqrt(1 / rows)``)."""
    g = torch.Generator().manual_seed(1)
    return (torch.rand(rows, FEATURES, DIM, generator=g) * 2 - 1) * ROWS**-0.5


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def _tower(kind: str, r: int):
    config = TowerModuleConfig(kind, compression=r)
    return build_tower(config, features=FEATURES, dim=DIM, seed=0, tower=0)


@pytest.mark.parametrize("kind,r", CASES)
def test_tower_outputs_start_at_the_inputs_scale(kind, r):
    module, x = _tower(kind, r), _inputs()
    with torch.no_grad():
        assert 0.7 < _rms(module(x)) / _rms(x) < 1.4
        assert module(torch.zeros_like(x)).abs().max() == 0  # no input-independent offset


@pytest.mark.parametrize("kind,r", CASES)
def test_an_adagrad_step_moves_tower_outputs_less_than_the_inputs_scale(kind, r):
    module, x = _tower(kind, r), _inputs()
    out = module(x)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.Adagrad(module.parameters(), lr=DEFAULT_LR["adagrad"])
    (out * target).sum().div(len(x)).backward()
    optimizer.step()  # Adagrad's first step: about lr on every parameter, whatever its gradient
    with torch.no_grad():
        assert _rms(module(x) - out) < _rms(x)


def test_scaled_linear_is_a_linear_of_weights_over_sqrt_fan_in():
    from trainer.towers.modules import ScaledLinear

    layer = ScaledLinear(9, 4)
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)
        plain = nn.Linear(9, 4)
        plain.weight.copy_(layer.weight / 3)
        plain.bias.copy_(layer.bias / 3)
        x = torch.randn(5, 9)
        torch.testing.assert_close(layer(x), plain(x))


def test_tower_modules_train_without_diverging(towers_dataset):
    """Compression 2 at Adagrad's default lr: the training loss stays near ln 2 at first (it
    reached 6 to 30 in the first steps before). Ids unhashed: one row per id, as the sharded
    tables read them when this was measured."""
    schema = dataset_schema(towers_dataset)
    config = ModelConfig(embedding_dim=DIM, num_embeddings=ROWS, bottom_mlp=(16,), top_mlp=(32,),
                         attention="none", hash_ids=False)  # fmt: skip
    plan = TowerPlan.strided(schema.sparse_names, 2)
    torch.manual_seed(0)
    model = TowerDLRM.from_schema(schema, config, plan=plan,
                                  towers=TowerModuleConfig("dlrm", compression=2),
                                  table_factory=sharded_table_factory(optimizer="adagrad"))  # fmt: skip
    trainer = DistributedTrainer(model, comm=Comm.single(), optimizer="adagrad")
    data = RankBatchDataset(towers_dataset, config=ReaderConfig(batch_size=64, shuffle=True,
                            seed=0), rank=0, world_size=1)  # fmt: skip
    for _, batch in zip(range(20), data, strict=False):
        trainer.train_step(batch, reduce_loss=False)
    losses = trainer.pending_losses()
    assert len(losses) == 20
    assert max(losses) < 1.0, losses
