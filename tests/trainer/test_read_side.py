"""Read-side options stay read-side: the dedup groups a run reads with never change its model;
``--attention auto`` is resolved from the dataset's schema as written, and shown."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ModelConfig, TrainConfig

SMALL = ModelConfig(embedding_dim=8, num_embeddings=500, bottom_mlp=(8,), top_mlp=(8,))


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """Synthetic logs built with no dedup group: ``--dedup-groups auto`` proposes some (the
    user-history group among them), which the old ``--attention auto`` picked its features
    from."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    root = tmp_path_factory.mktemp("bare")
    logs = generate(root / "raw", SynthConfig(num_requests=3000, seed=5, files=2))
    build(logs.features, root / "ds", events=logs.events, schema=default_schema().with_dedup(()),
          config=BuildConfig(row_group_size=512))  # fmt: skip
    return root / "ds"


def _model(config: TrainConfig) -> torch.nn.Module:
    from trainer.models import DLRM
    from trainer.train import model_config, read_schema

    return DLRM.from_schema(read_schema(config), model_config(config))


def test_dedup_groups_do_not_change_the_model(bare, tmp_path):
    from trainer.train import train

    common = {"batch_size": 256, "steps": 2, "eval_fraction": 0.1, "model": SMALL}
    plain = TrainConfig(str(bare), checkpoint=str(tmp_path / "a"), **common)
    auto = TrainConfig(str(bare), dedup_groups="auto", checkpoint=str(tmp_path / "b"), **common)
    one, two = _model(plain).state_dict(), _model(auto).state_dict()
    assert {k: v.shape for k, v in one.items()} == {k: v.shape for k, v in two.items()}
    for name, value in one.items():
        assert torch.equal(value, two[name]), name
    shapes = []
    for cfg in (plain, auto):
        train(cfg, progress=False)
        state = torch.load(f"{cfg.checkpoint}/checkpoint.pt", weights_only=False)
        shapes.append({k: tuple(v.shape) for k, v in state["trainer"]["model"].items()})
        assert state["model_config"]["attention"] == ()  # resolved, as the schema has it
    assert shapes[0] == shapes[1]


def test_summary_and_json_show_the_resolved_attention(tmp_path, capsys):
    from recpipe_cli import main
    from tests.common.data import synthetic_dataset

    ds = synthetic_dataset(tmp_path, requests=1500, seed=3, files=1, row_group_size=512)
    out = tmp_path / "s.json"
    argv = ["train", str(ds), "--steps", "1", "--batch-size", "128", "--embedding-dim", "8",
            "--num-embeddings", "100", "--threads", "1", "--json", str(out), "--quiet"]  # fmt: skip
    before = torch.get_num_threads()
    try:
        assert main(argv) == 0
        assert torch.get_num_threads() == 1  # set before the run
    finally:
        torch.set_num_threads(before)
    text = capsys.readouterr().out
    assert "user_liked_items,user_liked_sellers" in text
    doc = json.loads(out.read_text())
    assert doc["attention"] == ["user_liked_items", "user_liked_sellers"]
    assert doc["threads"] == 1


def test_a_checkpoint_recording_auto_resolves_as_its_run_did(bare):
    from readers.dataset import dataset_schema
    from trainer.train import _saved_attention_resolved

    state = {"model_config": {"attention": "auto", "embedding_dim": 8}}
    _saved_attention_resolved(state, dataset_schema(bare))  # no dedup group: no attention
    assert state["model_config"] == {"attention": (), "embedding_dim": 8}
    named = {"model_config": {"attention": ("user_follows",)}}
    _saved_attention_resolved(named, dataset_schema(bare))
    assert named["model_config"]["attention"] == ("user_follows",)
