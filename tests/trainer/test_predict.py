"""``recpipe predict``: a checkpoint scores a dataset part, joined back to its request ids."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from readers.extras import string_key
from tests.common.cli import one_error_line, run_cli
from tests.common.data import synthetic_dataset
from trainer.checkpoint import checkpoint_file, load_checkpoint, save_checkpoint
from trainer.config import ModelConfig, TrainConfig

SMALL_MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=500, bottom_mlp=(8,), top_mlp=(16,), attention_heads=2
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """3k synthetic requests in row groups of ~512 rows."""
    root = tmp_path_factory.mktemp("predict_data")
    return synthetic_dataset(root, requests=3_000, seed=5, files=2, row_group_size=512)


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """A short one-process run with a checkpoint, evaluated on every held-out batch."""
    from trainer.train import train

    ck = tmp_path_factory.mktemp("predict_ck") / "ck"
    config = TrainConfig(
        dataset=str(dataset), batch_size=128, steps=8, eval_fraction=0.25, seed=4,
        model=SMALL_MODEL, checkpoint=str(ck),
    )  # fmt: skip
    result = train(config, progress=False)
    return ck, config, result


def _part_rows(dataset, config, *, held_out):
    """The part's rows as the dataset stores them, found independently of the reader."""
    from readers.dataset import ParquetBatchDataset
    from readers.holdout import holdout_splits

    splits = ParquetBatchDataset(str(dataset)).source.splits
    train, held = holdout_splits(
        splits, session_key="session_id", fraction=config.eval_fraction, seed=config.seed
    )
    tables = [
        s.kept(pq.ParquetFile(s.path).read_row_group(s.row_group), session_key="session_id")
        for s in (held if held_out else train)
    ]
    return pa.concat_tables(tables).select(["request_id", "user_id", "label"])


def test_predict_joins_back_to_every_heldout_request_id(dataset, trained, tmp_path, capsys):
    ck, config, _ = trained
    out = tmp_path / "preds.parquet"
    code, err = run_cli(["predict", ck, dataset, "--out", out, "--quiet"], capsys)
    assert code == 0, err
    preds = pq.read_table(out)
    assert preds.column_names == ["request_id", "user_id", "label", "score"]
    held = _part_rows(dataset, config, held_out=True)
    ids = preds.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)) == held.num_rows > 0  # every request once
    assert set(ids) == set(held.column("request_id").to_pylist())
    # the join on request_id gives back each request's user and label
    joined = held.join(preds, "request_id", join_type="inner", right_suffix="_pred")
    assert joined.num_rows == held.num_rows
    assert joined.column("user_id").to_pylist() == joined.column("user_id_pred").to_pylist()
    labels = joined.column("label").to_numpy().astype(np.float32)
    np.testing.assert_array_equal(labels, joined.column("label_pred").to_numpy())
    scores = preds.column("score").to_numpy()
    assert np.all((scores > 0) & (scores < 1))


def test_predictions_are_the_models_own_outputs(dataset, trained, tmp_path, capsys):
    """Scores equal sigmoid of the model the test rebuilds and runs on the held-out batches."""
    from readers.dataset import ParquetBatchDataset
    from readers.holdout import holdout_splits
    from readers.source import ReaderConfig
    from schemas import default_schema
    from trainer.models import DLRM

    ck, config, _ = trained
    out = tmp_path / "preds.parquet"
    code, err = run_cli(["predict", ck, dataset, "--out", out, "--quiet"], capsys)
    assert code == 0, err
    model = DLRM.from_schema(default_schema(), SMALL_MODEL)
    state = torch.load(checkpoint_file(ck), weights_only=False)
    model.load_state_dict(state["trainer"]["model"])
    model.eval()
    reader = ReaderConfig(batch_size=64, extras=("request_id",))  # another batch size
    ds = ParquetBatchDataset(str(dataset), config=reader)
    _, held = holdout_splits(
        ds.source.splits, session_key="session_id", fraction=config.eval_fraction,
        seed=config.seed,
    )  # fmt: skip
    ds.source.splits = held
    expected = {}
    with torch.no_grad():
        for batch in ds:
            scores = torch.sigmoid(model(batch))
            expected.update(zip(batch.extras["request_id"].tolist(), scores.tolist()))
    preds = pq.read_table(out)
    got = {
        string_key(r): s
        for r, s in zip(preds["request_id"].to_pylist(), preds["score"].to_pylist())
    }
    assert got.keys() == expected.keys()
    keys = sorted(got)
    np.testing.assert_allclose(
        [got[k] for k in keys], [expected[k] for k in keys], rtol=1e-5, atol=1e-6
    )


def test_metrics_only_is_the_runs_heldout_evaluation(dataset, trained, tmp_path, capsys):
    ck, _, result = trained
    summary = tmp_path / "eval.json"
    code, err = run_cli(
        ["predict", ck, dataset, "--metrics-only", "--json", summary, "--quiet"], capsys
    )
    assert code == 0, err
    doc = json.loads(summary.read_text())
    final = result.final_eval
    assert doc["samples"] == final.samples and doc["part"] == "heldout" and doc["out"] is None
    assert doc["loss"] == pytest.approx(final.loss, rel=1e-5)
    assert doc["auc"] == pytest.approx(final.auc, abs=1e-9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]  # no predictions


def test_parts_cover_the_dataset(dataset, trained, tmp_path, capsys):
    ck, config, _ = trained
    rows = {}
    for part in ("train", "all"):
        out = tmp_path / f"{part}.parquet"
        code, err = run_cli(
            ["predict", ck, dataset, "--part", part, "--out", out, "--quiet"], capsys
        )
        assert code == 0, err
        rows[part] = pq.read_table(out).column("request_id").to_pylist()
    train_ids = _part_rows(dataset, config, held_out=False).column("request_id").to_pylist()
    held_ids = _part_rows(dataset, config, held_out=True).column("request_id").to_pylist()
    assert sorted(rows["train"]) == sorted(train_ids)
    assert sorted(rows["all"]) == sorted(train_ids + held_ids)


def _rewrite(ck, tmp_path, name, **changes):
    """A copy of the checkpoint ``ck`` with ``changes`` in its state."""
    state = load_checkpoint(checkpoint_file(ck))
    for key, value in changes.items():
        state[key] = value(state) if callable(value) else value
    state.pop("version")
    target = tmp_path / name
    save_checkpoint(state, checkpoint_file(target))
    return target


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"kind": "distributed", "world_size": 2}, "multi-rank job (2 ranks"),
        ({"config": lambda s: {**s["config"], "store": "hybrid"}}, "'hybrid' embedding store"),
        ({"config": None}, "records no settings of its run"),
        ({"model_config": lambda s: {**s["model_config"], "embedding_dim": 4}}, "does not fit"),
    ],
    ids=["multi-rank", "hybrid-store", "no-settings", "other-model"],
)
def test_checkpoints_it_cannot_load_are_refused(
    dataset, trained, tmp_path, capsys, changes, needle
):
    ck = _rewrite(trained[0], tmp_path, "other", **changes)
    out = tmp_path / "p.parquet"
    code, err = run_cli(["predict", ck, dataset, "--out", out], capsys)
    assert code == 1
    one_error_line(err, "recpipe predict: error:", needle)
    assert not out.exists()


def test_another_datasets_heldout_part_is_refused(dataset, trained, tmp_path, capsys):
    ck = _rewrite(trained[0], tmp_path, "other", dataset_id="0" * 64)
    code, err = run_cli(["predict", ck, dataset, "--metrics-only"], capsys)
    assert code == 1
    one_error_line(err, "is not the dataset", "`--part all`")
    code, err = run_cli(
        ["predict", ck, dataset, "--metrics-only", "--part", "all", "--quiet"], capsys
    )
    assert code == 0, err


def test_bad_arguments_are_one_line(dataset, trained, tmp_path, capsys):
    ck = trained[0]
    code, err = run_cli(["predict", ck, dataset], capsys)
    assert code == 1
    one_error_line(err, "`--out` is missing")
    code, err = run_cli(["predict", ck, dataset, "--out", dataset / "p.parquet"], capsys)
    assert code == 1
    one_error_line(err, "`--out`", "lies inside the input")
    code, err = run_cli(["predict", tmp_path, dataset, "--metrics-only"], capsys)
    assert code == 1
    one_error_line(err, "holds no checkpoint.pt")
    code, err = run_cli(["predict", ck, tmp_path / "nope", "--metrics-only"], capsys)
    assert code == 1
    one_error_line(err, "`DATASET`", "does not exist")


def test_another_model_setting_rebuilds_from_the_checkpoint(dataset, tmp_path, capsys):
    """The model is built from the recorded settings, not from defaults."""
    from trainer.train import train

    config = TrainConfig(
        dataset=str(dataset), batch_size=256, steps=2, eval_fraction=0.25,
        model=replace(SMALL_MODEL, embedding_dim=4, top_mlp=(8, 4), attention="none"),
        checkpoint=str(tmp_path / "ck"),
    )  # fmt: skip
    result = train(config, progress=False)
    summary = tmp_path / "j.json"
    argv = ["predict", tmp_path / "ck", dataset, "--metrics-only", "--json", summary, "--quiet"]
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    doc = json.loads(summary.read_text())
    assert doc["loss"] == pytest.approx(result.final_eval.loss, rel=1e-5)


def test_help_lists_predict_and_its_help_imports_no_torch(capsys):
    from recpipe_cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "    predict " in capsys.readouterr().out
    code = (
        "import sys\n"
        "from recpipe_cli import main\n"
        "try:\n"
        "    main(['predict', '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "usage: recpipe predict" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "False"
