"""`recpipe towers`: what the commands write is checked before any work, and a tower plan must
hold every sparse feature of the dataset exactly once.

Regressions: `towers partition DS --out DS/_manifest.json` replaced the dataset's manifest with
a plan, and a plan naming 1 of the 12 sparse features trained on that one feature, exit 0.
"""

from __future__ import annotations

import pytest

from tests.common.cli import one_error_line, run_cli
from trainer.config import TrainConfig
from trainer.towers.config import TowerError, TowerPlan, TowersConfig
from trainer.towers.run import checked_plan

MODEL = ["--embedding-dim", "4", "--num-embeddings", "50", "--bottom-mlp", "4", "--top-mlp", "4"]
TRAIN = ["--steps", "1", "--batch-size", "16", "--eval-batches", "1", "--quiet", *MODEL]


def sparse_names(dataset) -> list[str]:
    from readers.dataset import dataset_schema

    return list(dataset_schema(dataset).sparse_names)


def write_plan(path, towers) -> str:
    path.write_text(TowerPlan(tuple(tuple(t) for t in towers)).to_toml())
    return str(path)


def test_partition_never_writes_into_its_dataset(towers_dataset, tmp_path, capsys):
    manifest = towers_dataset / "_manifest.json"
    before = manifest.read_bytes()
    common = ["towers", "partition", towers_dataset, "--towers", "2", "--steps", "1",
              "--batch-size", "32", "--affinity-batches", "1", "--quiet", *MODEL]  # fmt: skip
    code, err = run_cli([*common, "--out", manifest], capsys)
    assert code == 1
    one_error_line(err, f"`--out` '{manifest}' lies inside the input '{towers_dataset}'")
    code, err = run_cli(
        [*common, "--plot", towers_dataset / "p.png", "--out", tmp_path / "t"], capsys
    )
    assert code == 1
    one_error_line(err, "`--plot`", "lies inside the input")
    code, err = run_cli([*common, "--out", tmp_path], capsys)
    assert code == 1
    one_error_line(err, f"`--out` '{tmp_path}' is a directory, not a file")
    assert manifest.read_bytes() == before
    assert not (tmp_path / "t").exists()


def test_train_json_is_not_its_plan(towers_dataset, tmp_path, capsys):
    names = sparse_names(towers_dataset)
    plan = write_plan(tmp_path / "plan.toml", [names[::2], names[1::2]])
    before = (tmp_path / "plan.toml").read_text()
    code, err = run_cli(
        ["towers", "train", towers_dataset, "--towers", plan, *TRAIN, "--json", plan], capsys
    )
    assert code == 1
    one_error_line(err, f"`--json` '{plan}' is the input")
    assert (tmp_path / "plan.toml").read_text() == before


def test_a_plan_of_some_features_is_refused(towers_dataset, tmp_path, capsys):
    names = sparse_names(towers_dataset)
    assert len(names) == 12
    plan = write_plan(tmp_path / "one.toml", [[names[0]]])
    code, err = run_cli(["towers", "train", towers_dataset, "--towers", plan, *TRAIN], capsys)
    assert code == 1
    one_error_line(err, f"{plan}: 11 of the 12 sparse features of the dataset", repr(names[1:]))
    assert "hint: `recpipe towers partition" in err
    with_nproc = [*TRAIN, "--nproc", "2", "--ranks-per-host", "1"]  # refused before any worker
    code, err = run_cli(["towers", "train", towers_dataset, "--towers", plan, *with_nproc], capsys)
    assert code == 1
    one_error_line(err, "11 of the 12 sparse features")


def test_a_plan_with_unknown_features_is_refused(towers_dataset, tmp_path, capsys):
    names = sparse_names(towers_dataset)
    plan = write_plan(tmp_path / "x.toml", [[*names[:6], "nope"], names[6:]])
    code, err = run_cli(["towers", "train", towers_dataset, "--towers", plan, *TRAIN], capsys)
    assert code == 1
    one_error_line(err, "the towers name ['nope'], not sparse features of the dataset")


def test_duplicated_features_are_all_named(tmp_path):
    text = "".join(f"[[tower]]\nfeatures = {f}\n" for f in ('["a", "b"]', '["b", "a"]', '["a"]'))
    with pytest.raises(
        TowerError,
        match=r"d.toml: feature 'a' is in towers 0, 1 and 2; feature 'b' is in towers 0 and 1",
    ):
        TowerPlan.from_toml(text, source="d.toml")


def test_features_names_a_subset_explicitly(towers_dataset, tmp_path):
    names = sparse_names(towers_dataset)
    plan = write_plan(tmp_path / "two.toml", [[names[0]], [names[1]]])
    config = TrainConfig(str(towers_dataset))
    got = checked_plan(config, TowersConfig(plan, features=(names[1], names[0])))
    assert got.features == (names[0], names[1])
    with pytest.raises(TowerError, match=r"1 of the 3 sparse features of `--features` are in no"):
        checked_plan(config, TowersConfig(plan, features=tuple(names[:3])))
    full = write_plan(tmp_path / "all.toml", [names[:6], names[6:]])
    assert checked_plan(config, TowersConfig(full)).features == tuple(names)
