"""What a run shows: per-step metrics files, TensorBoard, the progress bar's total, logging,
`--quiet` and `--version`."""

from __future__ import annotations

import csv
import json
import logging
import types

import pytest

from recpipe.errors import DependencyError, RecpipeError
from recpipe_cli import PACKAGES, main
from tests.common.data import synthetic_dataset
from trainer import metrics as metrics_module
from trainer.metrics import METRIC_FIELDS, MetricsFile, TensorBoardLog
from trainer.models import ModelConfig
from trainer.train import TrainConfig, train

SMALL = ["--batch-size", "256", "--embedding-dim", "8", "--num-embeddings", "500",
         "--eval-batches", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """6k synthetic requests in row groups of ~1k rows."""
    root = tmp_path_factory.mktemp("visibility_data")
    return synthetic_dataset(root, requests=6_000, seed=5, files=1, row_group_size=1024)


def _read(path):
    if path.suffix == ".csv":
        with path.open() as fh:
            return list(csv.DictReader(fh))
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_file_has_a_record_per_step_and_per_evaluation(dataset, tmp_path):
    path, ck = tmp_path / "run.jsonl", tmp_path / "ck"
    base = ["train", str(dataset), *SMALL, "--checkpoint", str(ck), "--quiet",
            "--metrics", str(path), "--log-every", "2", "--eval-every", "2"]  # fmt: skip
    assert main([*base, "--steps", "4"]) == 0
    records = _read(path)
    train_rows = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [int(r["step"]) for r in train_rows] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in evals] == [2, 4]
    for r in train_rows:
        assert set(r) == set(METRIC_FIELDS)
        assert float(r["loss"]) > 0 and float(r["samples_per_s"]) > 0 and float(r["step_s"]) > 0
        assert float(r["dedup_factor"]) > 1.0  # dedup on: IKJT groups
        assert int(r["peak_memory_bytes"]) > 0 and int(r["samples"]) == 256 * int(r["step"])
        has_auc = r["auc"] not in (None, "")
        assert has_auc == (int(r["step"]) % 2 == 0)  # every --log-every steps
    assert all(0.0 <= float(r["auc"]) <= 1.0 for r in evals)

    # a crashed run wrote steps past its last checkpoint (step 4): the resumed run drops them
    with path.open("a") as fh:
        fh.write(json.dumps({"kind": "train", "step": 5, "loss": 0.5}) + "\n")
    assert main([*base, "--steps", "6", "--resume"]) == 0
    steps = [int(r["step"]) for r in _read(path) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_csv_metrics_file_and_its_resume(tmp_path):
    path = tmp_path / "sub" / "run.csv"
    log = MetricsFile(path)
    for step in (1, 2, 3):
        log.write({"kind": "train", "step": step, "loss": 0.5, "auc": float("nan")})
    log.write({"kind": "eval", "step": 3, "loss": 0.4, "auc": 0.75, "samples": 10})
    log.close()
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(METRIC_FIELDS) and len(lines) == 5
    assert lines[1].startswith("train,1,,,0.5,,")  # NaN and missing fields: empty cells
    resumed = MetricsFile(path, resume_step=2)  # steps after the checkpoint are done again
    resumed.write({"kind": "train", "step": 3, "loss": 0.45})
    resumed.close()
    rows = _read(path)
    assert [(r["kind"], r["step"], r["loss"]) for r in rows] == [
        ("train", "1", "0.5"), ("train", "2", "0.5"), ("train", "3", "0.45"),
    ]  # fmt: skip
    fresh = MetricsFile(path)  # a fresh run replaces the file
    fresh.close()
    assert path.read_text().splitlines() == [",".join(METRIC_FIELDS)]


def test_progress_bar_has_a_total(dataset, capsys):
    config = TrainConfig(
        dataset=str(dataset), epochs=1, batch_size=1024, eval_fraction=0.2, eval_batches=1,
        model=ModelConfig(embedding_dim=8, num_embeddings=500, bottom_mlp=(8,), top_mlp=(8,)),
    )  # fmt: skip
    result = train(config, progress=True)
    bar = capsys.readouterr().err
    assert result.steps > 1
    assert f"{result.steps}/{result.steps}" in bar  # tqdm's "done/total" (and so an ETA)


def test_metrics_option_is_checked(dataset, capsys):
    with pytest.raises(RecpipeError, match=r"`metrics` must name a \.csv or \.jsonl file"):
        TrainConfig(dataset=str(dataset), metrics="run.txt")
    with pytest.raises(SystemExit) as exc:
        main(["train", str(dataset), "--metrics", "run.txt"])
    assert exc.value.code == 2
    assert "`--metrics` must name a .csv or .jsonl file, got 'run.txt'" in capsys.readouterr().err


def test_tensorboard_needs_tensorboard_and_writes_scalars(tmp_path, monkeypatch):
    written = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append("closed")

    real = metrics_module.optional_import

    def fake(name, *, purpose=""):
        if name == "tensorboard":
            return types.ModuleType("tensorboard")
        if name == "torch.utils.tensorboard":
            return types.SimpleNamespace(SummaryWriter=Writer)
        return real(name, purpose=purpose)

    monkeypatch.setattr(metrics_module, "optional_import", fake)
    log = TensorBoardLog(tmp_path / "tb")
    assert log.writer.log_dir == str(tmp_path / "tb")
    log.write({"kind": "train", "step": 3, "loss": 0.25, "auc": float("nan"), "dedup_factor": 2.0})
    log.write({"kind": "eval", "step": 3, "loss": 0.3, "auc": 0.7})
    log.close()
    assert written == [
        ("train/loss", 0.25, 3), ("train/dedup_factor", 2.0, 3),  # NaN AUC left out
        ("eval/loss", 0.3, 3), ("eval/auc", 0.7, 3), "closed",
    ]  # fmt: skip


def test_tensorboard_missing_says_how_to_install(tmp_path, monkeypatch):
    def missing(name, *, purpose=""):
        msg = f"optional dependency `{name}` is not available (needed for {purpose})\nhint: pip install {name}"
        raise DependencyError(msg)

    monkeypatch.setattr(metrics_module, "optional_import", missing)
    with pytest.raises(DependencyError, match="pip install tensorboard"):
        TensorBoardLog(tmp_path)


def test_metrics_file_refuses_an_unreadable_file_to_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(RecpipeError, match="cannot read the metrics of the run to resume"):
        MetricsFile(path, resume_step=3)
    assert path.read_text() == "{not json\n"  # nothing wiped


def test_version_and_loudness(dataset, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("recpipe ")
    base = ["train", str(dataset), *SMALL, "--steps", "1"]
    assert main(["--quiet", *base]) == 0  # the global switch reaches the command
    err = capsys.readouterr().err
    assert "train:" not in err and "INFO" not in err  # no bar, no info lines
    assert all(logging.getLogger(p).level == logging.WARNING for p in PACKAGES)
    assert main(["--verbose", *base]) == 0
    err = capsys.readouterr().err
    assert "INFO trainer.train: training on" in err and "held-out loss" in err
    assert logging.getLogger("trainer").level == logging.DEBUG
    assert main([*base, "--quiet"]) == 0  # the command's own switch
    assert "INFO" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quiet", "--verbose", *base])
    assert "not allowed with argument" in capsys.readouterr().err
    logging.getLogger("trainer").setLevel(logging.NOTSET)


def test_every_package_ships_py_typed():
    import importlib.resources
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert importlib.resources.files(package).joinpath("py.typed").is_file(), package
        assert "py.typed" in data[package], package
