"""Resuming a hybrid-store run whose stores were damaged: the error names the checkpoint, the
table, its store and what is missing, and no store is changed."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from recpipe.errors import StoreError
from trainer.models import ModelConfig
from trainer.train import TrainConfig, train

SMALL_MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=2000, bottom_mlp=(16,), top_mlp=(32,), attention_heads=2
)


def _config(dataset, checkpoint, **kw) -> TrainConfig:
    return TrainConfig(
        dataset=str(dataset),
        batch_size=256,
        eval_fraction=0.0,
        model=SMALL_MODEL,
        store="hybrid",
        checkpoint=str(checkpoint),
        checkpoint_every=2,
        **kw,
    )


def _digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(clustered_dataset, tmp_path_factory):
    """A hybrid run checkpointed at step 2 (its stores under ``checkpoint/store/<table>``)."""
    ckpt = tmp_path_factory.mktemp("hybrid") / "run"
    train(_config(clustered_dataset, ckpt, steps=2), progress=False)
    return ckpt


@pytest.mark.parametrize("damage", ["commit_record", "store"])
def test_resume_names_the_damaged_store(clustered_dataset, trained, tmp_path, damage):
    """A store without its commit record used to give "holds the checkpoint of step -1, not of
    step 2: rows were written after a later checkpoint"; a missing store was replaced by a new
    one before the step mismatch was reported."""
    ckpt = tmp_path / "run"
    shutil.copytree(trained, ckpt)
    store = ckpt / "store" / "item_id"
    if damage == "commit_record":
        (store / "CURRENT").unlink()
    else:
        shutil.rmtree(store)
    before = _digest(ckpt)
    with pytest.raises(StoreError) as info:
        train(_config(clustered_dataset, ckpt, steps=4, resume=True), progress=False)
    msg = str(info.value)
    assert f"cannot resume from {str(ckpt / 'checkpoint.pt')!r} at step 2: table 'item_id'" in msg
    if damage == "commit_record":
        assert f"store {str(store)!r} has no commit record: CURRENT is missing" in msg
    else:
        assert f"has no embedding store at {str(store)!r} (meta.json is missing)" in msg
    assert _digest(ckpt) == before
