"""One vocabulary for a run's figures: the text summary prints the keys `--json` writes, those
keys name the metrics records' fields, and the wall time says what it counts (issue 32 item 7)."""

from __future__ import annotations

import csv
import json
import re

import pytest

from tests.common.data import synthetic_dataset
from trainer.config import TrainConfig
from trainer.runlog import EvalResult, TrainResult, format_summary, summary_dict


def _labels(text: str) -> list[str]:
    """The first word of every summary line (after the title)."""
    return [line.split()[0] for line in text.splitlines()[1:]]


def _result(**kw) -> TrainResult:
    base = {
        "steps": 60, "samples": 60 * 128, "losses": [1.0] * 10 + [0.5] * 49 + [0.25],
        "train_auc": 0.7, "evals": [(30, EvalResult(0.6, 0.65, 500, 4)),
                                    (60, EvalResult(0.55, 0.68, 512, 4))],
        "samples_per_s": 1000.0, "peak_memory_bytes": 1 << 20, "dedup_factor": 2.0,
        "train_wall_s": 7.5, "eval_wall_s": 1.25, "eval_runs": 2,
    }  # fmt: skip
    base.update(kw)
    return TrainResult(**base)


def test_text_prints_the_json_keys_and_each_figure_is_what_its_name_says():
    config = TrainConfig(dataset="data/x", log_window=50)
    result = _result()
    doc = summary_dict(config, result)
    text = format_summary(config, result)
    assert _labels(text) == list(doc)  # one name per figure, in text and JSON alike
    json.dumps(doc, allow_nan=False)  # JSON-ready
    assert doc["train_loss"] == pytest.approx((49 * 0.5 + 0.25) / 50)  # the last 50 steps
    assert doc["final_step_loss"] == 0.25  # not the 50-step mean
    assert (doc["eval_step"], doc["eval_loss"], doc["eval_auc"], doc["eval_samples"]) == (
        60, 0.55, 0.68, 512)  # fmt: skip
    assert (doc["train_wall_s"], doc["eval_wall_s"], doc["wall_s"]) == (7.5, 1.25, 8.75)
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "0.2500" in lines["final_step_loss"] and "0.4950" in lines["train_loss"]
    assert "last 50 steps" in lines["train_loss"]
    assert "evaluations not counted" in lines["train_wall_s"]
    assert "train_wall_s + eval_wall_s" in lines["wall_s"]


def test_an_unevaluated_run_and_a_short_one_say_so():
    config = TrainConfig(dataset="data/x", log_window=50)
    result = _result(losses=[0.5, 0.7], evals=[], train_auc=float("nan"))
    doc = summary_dict(config, result)
    assert doc["eval_loss"] is None and doc["train_auc"] is None
    assert doc["train_loss"] == pytest.approx(0.6)
    lines = {line.split()[0]: line for line in format_summary(config, result).splitlines()[1:]}
    assert lines["eval_loss"].split()[1] == "-" and "last 2 steps" in lines["train_loss"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("runlog_names")
    return synthetic_dataset(root, requests=3_000, seed=11, files=1, row_group_size=512)


def test_cli_json_text_and_metrics_agree(dataset, tmp_path, capsys):
    from recpipe_cli import main

    js, metrics = tmp_path / "run.json", tmp_path / "run.csv"
    args = ["train", str(dataset), "--steps", "4", "--batch-size", "128", "--embedding-dim", "8",
            "--num-embeddings", "300", "--eval-fraction", "0.2", "--eval-batches", "2",
            "--eval-every", "2", "--log-window", "3", "--json", str(js), "--metrics",
            str(metrics), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    doc = json.loads(js.read_text())
    text = out[out.index("recpipe train: done") :]
    assert _labels(text) == list(doc)
    assert "final_loss" not in doc and "held-out" not in _labels(text)
    with metrics.open() as fh:
        records = list(csv.DictReader(fh))
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [int(r["step"]) for r in evals] == [2, 4]
    assert doc["final_step_loss"] == pytest.approx(float(train[-1]["loss"]))
    assert doc["train_loss"] == pytest.approx(sum(float(r["loss"]) for r in train[-3:]) / 3)
    assert doc["eval_loss"] == pytest.approx(float(evals[-1]["loss"]))
    assert doc["eval_auc"] == pytest.approx(float(evals[-1]["auc"]))
    assert doc["eval_samples"] == int(evals[-1]["samples"])
    # the evaluations' seconds are counted apart from training's, in the records and the summary
    assert doc["eval_runs"] == 2 and doc["eval_wall_s"] > 0
    assert doc["eval_wall_s"] == pytest.approx(sum(float(r["wall_s"]) for r in evals))
    assert float(train[-1]["wall_s"]) <= doc["train_wall_s"]
    assert doc["wall_s"] == pytest.approx(doc["train_wall_s"] + doc["eval_wall_s"])
    assert re.search(r"^\s+eval_wall_s\s+\S+ s\s+held-out evaluations$", text, re.M)
