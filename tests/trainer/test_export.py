"""``recpipe export``: a checkpoint of every layout (one process with its tables in the model or
in hybrid stores, 2 ranks, towers on 2 hosts x 1 rank) becomes one-process weights whose
held-out logits are the trained run's, and that ``recpipe predict`` and plain torch load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.common.cli import one_error_line, run_cli
from tests.trainer.test_one_loop import MODEL, _recpipe
from tests.trainer.test_one_loop import data as data  # the dataset and a plan of two towers

BATCH = 32
STEPS = 3
RANKS_TOLERANCE = 1e-6  # logits: sharded lookups sum a bag's rows in another order


def _train(data, ck: Path, *extra: object) -> dict:
    """``recpipe train`` for STEPS steps with a checkpoint in ``ck``; its summary."""
    dataset, plan = data
    args = ["train", dataset, "--batch-size", BATCH, "--steps", STEPS, "--seed", 0, "--quiet",
            "--checkpoint", ck, "--json", ck.with_suffix(".json"), *MODEL, *extra]  # fmt: skip
    if "--towers" in extra:
        args[args.index("--towers") + 1] = plan
    if "--nproc" in args:
        done = _recpipe(*args)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        from recpipe_cli import main

        assert main([str(a) for a in args]) == 0
    return json.loads(ck.with_suffix(".json").read_text())


def _export(ck: Path, capsys) -> Path:
    out = ck.with_name(ck.name + "-model.pt")
    code, err = run_cli(["export", ck, "--out", out, "--quiet"], capsys)
    assert code == 0, err
    return out


def _heldout(model, config):
    """``model``'s logits on the run's held-out rows (as `recpipe predict` reads them)."""
    from trainer.predict import part_dataset, predict

    return predict(model, part_dataset(config, part="heldout", batch_size=config.batch_size))


def _exported_logits(out: Path, dataset: Path):
    from trainer.predict import load_trained_model

    model, config, _ = load_trained_model(out, dataset=dataset)
    return _heldout(model, config)


def _saved_config(ck: Path):
    """The run's config, read from its checkpoint, and the checkpoint's state."""
    from trainer.checkpoint import checkpoint_file, load_checkpoint
    from trainer.predict import _model_config, _train_config

    state = load_checkpoint(checkpoint_file(ck))
    config = _train_config(state["config"], _model_config(state["model_config"]),
                           dataset=state["config"]["dataset"], device="cpu")  # fmt: skip
    return config, state


def _predict_cli(out: Path, dataset: Path, tmp: Path, capsys) -> dict:
    """`recpipe predict OUT DATASET --metrics-only`: its summary."""
    code, err = run_cli(["predict", out, dataset, "--metrics-only", "--quiet",
                         "--json", tmp / "predict.json"], capsys)  # fmt: skip
    assert code == 0, err
    return json.loads((tmp / "predict.json").read_text())


def test_a_one_process_checkpoint_exports_bit_for_bit(data, tmp_path, capsys):
    """Its tables are in the model: the export's logits are the run's, bit for bit; plain torch
    rebuilds the model from what the file records."""
    from schemas import parse_schema
    from trainer.config import ModelConfig
    from trainer.models import DLRM
    from trainer.predict import load_trained_model

    dataset = data[0]
    ck = tmp_path / "ck"
    _train(data, ck)
    out = _export(ck, capsys)
    model, config, _ = load_trained_model(ck)
    want = _heldout(model, config)
    got = _exported_logits(out, dataset)
    assert want.rows > 0 and torch.equal(
        torch.from_numpy(got.logits), torch.from_numpy(want.logits)
    )
    # plain torch: torch.load (weights only), the recorded schema and model config
    doc = torch.load(out)
    plain = DLRM.from_schema(parse_schema(doc["schema"]), ModelConfig(**doc["model_config"]))
    plain.load_state_dict(doc["model"])
    again = _heldout(plain.eval(), config)
    assert torch.equal(torch.from_numpy(again.logits), torch.from_numpy(want.logits))
    assert doc["step"] == STEPS and doc["source"]["layout"] == "local"
    assert "optimizers" not in doc and "adagrad" not in json.dumps(list(doc["model"]))
    assert _predict_cli(out, dataset, tmp_path, capsys)["loss"] == pytest.approx(want.loss, abs=0)


def test_a_hybrid_store_checkpoint_exports_bit_for_bit(data, tmp_path, capsys):
    """`--store hybrid`: the rows come from the stores at the checkpoint's step; every id the
    stores never saw keeps its initial row, which is the row the store gives it."""
    from trainer.train import LocalEngine, read_schema

    dataset = data[0]
    ck = tmp_path / "ck"
    _train(data, ck, "--store", "hybrid")
    out = _export(ck, capsys)
    config, state = _saved_config(ck)
    engine = LocalEngine(config, read_schema(config), resume_state=state)
    try:
        engine.restore(state)
        want = _heldout(engine.trainer.model.eval(), config)
    finally:
        engine.close(failing=False)
    got = _exported_logits(out, dataset)
    assert want.rows > 0 and torch.equal(
        torch.from_numpy(got.logits), torch.from_numpy(want.logits)
    )
    tables = torch.load(out)["tables"]
    assert all(0 < t["saved"] < t["rows"] for t in tables.values())
    assert all(t["initial"] >= t["rows"] - t["saved"] for t in tables.values())


def test_an_unhashed_id_outside_the_table_is_one_clear_error(data, tmp_path, capsys):
    """A `--no-hash-ids` store grows past `--num-embeddings`: its rows have no place in a
    one-process table."""
    ck = tmp_path / "ck"
    _train(data, ck, "--store", "hybrid", "--no-hash-ids")
    out = tmp_path / "model.pt"
    code, err = run_cli(["export", ck, "--out", out, "--quiet"], capsys)
    assert code == 1
    one_error_line(err, "recpipe export: error:", "table '", "outside its 200 rows",
                   "`--no-hash-ids`")  # fmt: skip
    assert "hint: export a run trained with `--hash-ids`" in err
    assert not out.exists()


def test_what_is_not_a_checkpoint_is_refused(tmp_path, capsys):
    code, err = run_cli(["export", tmp_path / "nothing", "--out", tmp_path / "m.pt"], capsys)
    assert code == 1
    one_error_line(err, "recpipe export: error:", "not a checkpoint directory")
    (tmp_path / "junk.pt").write_bytes(b"not torch")
    code, err = run_cli(["predict", tmp_path / "junk.pt", tmp_path, "--metrics-only"], capsys)
    assert code == 1
    one_error_line(err, "recpipe predict: error:")


def _rank_logits(ck: Path, config, state):
    """The 2-rank job's model, resumed by its own engine on a world of one, scoring the
    held-out rows as the job's evaluation does (rows fetched, then the model)."""
    import numpy as np

    from trainer.cli import rank_checkpoint_options
    from trainer.distributed.comm import Comm
    from trainer.distributed.run import RankEngine
    from trainer.predict import part_dataset
    from trainer.train import read_schema

    engine = RankEngine(config, rank_checkpoint_options(state), Comm.single(),
                        schema=read_schema(config), resume_state=state)  # fmt: skip
    engine.restore(state)
    trainer = engine.trainer
    trainer.module.eval()
    out = []
    with torch.no_grad():
        for batch in part_dataset(config, part="heldout", batch_size=config.batch_size):
            out.append(trainer.module(trainer.sparse.prepare(batch, train=False)).float())
    return np.concatenate([o.numpy() for o in out])


@pytest.mark.slow
def test_a_two_rank_checkpoint_exports_to_one_process(data, tmp_path, capsys):
    """`--nproc 2`: the rows of both rank files; the logits are the job's model's within
    RANKS_TOLERANCE (a sharded lookup sums a bag's rows in another order than
    ``embedding_bag``), and `recpipe predict` of the export gives the job's held-out loss."""
    dataset = data[0]
    ck = tmp_path / "ck"
    summary = _train(data, ck, "--nproc", 2)
    out = _export(ck, capsys)
    config, state = _saved_config(ck)
    want = _rank_logits(ck, config, state)
    got = _exported_logits(out, dataset)
    assert got.rows == want.size > 0
    assert (
        float(abs(torch.from_numpy(got.logits) - torch.from_numpy(want)).max()) <= RANKS_TOLERANCE
    )
    predicted = _predict_cli(out, dataset, tmp_path, capsys)
    assert predicted["samples"] == summary["eval_samples"]
    assert abs(predicted["loss"] - summary["eval_loss"]) <= RANKS_TOLERANCE
    assert torch.load(out)["source"] == {"layout": "ranks", "world_size": 2, "store": "module",
                                         "checkpoint": str(ck.resolve())}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("module", ["none", "dlrm"])
def test_a_towers_checkpoint_exports_to_one_process(data, tmp_path, capsys, module):
    """Towers on 2 hosts x 1 rank: the head of rank 0, each tower module from its host, the
    rows of both (pass-through towers: a plain DLRM; tower modules: a TowerDLRM). The export's
    held-out loss is the run's within RANKS_TOLERANCE (the run scores its rows with its tables
    on their host and sums its loss by batch); the checkpoint itself is refused by predict."""
    dataset = data[0]
    ck = tmp_path / "ck"
    towers = ["--towers", "PLAN", "--tower-module", module]
    towers += ["--compression", 2] if module != "none" else []
    summary = _train(data, ck, "--nproc", 2, "--ranks-per-host", 1, *towers)
    out = _export(ck, capsys)
    predicted = _predict_cli(out, dataset, tmp_path, capsys)
    assert predicted["samples"] == summary["eval_samples"] > 0
    assert abs(predicted["loss"] - summary["eval_loss"]) <= RANKS_TOLERANCE
    doc = torch.load(out)
    assert doc["source"]["layout"] == "towers"
    assert (doc["tower_model"] is None) == (module == "none")
    if module != "none":  # each tower's weights are its host's, not rank 0's stale copy
        from trainer.distributed.checkpoint import read_part

        state = torch.load(ck / "checkpoint.pt", weights_only=False)
        parts = [read_part(ck, state, "towers", rank=r, world_size=2)["model"] for r in range(2)]
        tower1 = [k for k in doc["model"] if k.startswith("towers.1.")]
        assert tower1 and all(torch.equal(doc["model"][k], parts[1][k]) for k in tower1)
        assert not all(torch.equal(parts[0][k], parts[1][k]) for k in tower1)
    code, err = run_cli(["predict", ck, dataset, "--metrics-only"], capsys)
    assert code == 1
    one_error_line(err, "recpipe predict: error:", "a towers run")
