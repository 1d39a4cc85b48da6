"""Output paths: `recpipe.paths.check_output` (re-exported by `etl.paths`), and every
command's outputs through the real CLI.

The CLI cases are regressions: an output that was an input was replaced by the result
(`etl build SHARDS --out SHARDS --overwrite` exited 0), and `--out AFILE/x` or `--out /proc/x`
ended in raw FileExistsError / FileNotFoundError tracebacks.
"""

from __future__ import annotations

import doctest
import os
from pathlib import Path

import pytest

import recpipe.paths
from etl.paths import check_output
from recpipe.errors import DataError
from recpipe.paths import check_outputs
from recpipe_cli import main
from tests.common.cli import one_error_line, run_cli

LINES = "".join(
    f'{{"request_id": "r{i}", "session_id": "s{i % 3}", "user_id": {i % 3}, '
    f'"ts": {1_700_000_000_000 + i}, "dense": {{"user_age": 30.0}}, '
    f'"sparse": {{"item_id": [{i}]}}}}\n'
    for i in range(12)
)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (or ``root`` itself) with its bytes."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def logs(tmp_path) -> Path:
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "f.jsonl").write_text(LINES)
    return folder


@pytest.fixture
def shards(tmp_path, logs) -> Path:
    out = tmp_path / "shards"
    assert main(["etl", "shard", str(logs), "--out", str(out), "--num-shards", "2", "--quiet"]) == 0
    return out


# --------------------------------------------------------------------------------------------
# check_output
# --------------------------------------------------------------------------------------------


def test_docstring_example_runs():
    assert doctest.testmod(recpipe.paths, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize(
    ("out", "relation"),
    [("logs", "is"), (".", "contains"), ("logs/ds", "lies inside"), ("logs/_x", "lies inside")],
)
def test_output_overlapping_an_input_is_refused(tmp_path, logs, out, relation):
    with pytest.raises(DataError, match=rf"`--out` '.*' {relation} the input '.*logs'"):
        check_output(tmp_path / out, kind="dataset", inputs=[[logs]], overwrite=True)


def test_overlap_is_found_through_symlinks_and_globs(tmp_path, logs):
    link = tmp_path / "link"
    link.symlink_to(logs, target_is_directory=True)
    with pytest.raises(DataError, match=rf"is the input '{link}' \(which resolves to '{logs}'\)"):
        check_output(logs, kind="shards", inputs=[link], overwrite=True)
    with pytest.raises(DataError, match="lies inside the input"):
        check_output(link / "ds", kind="dataset", inputs=[str(logs / "*.jsonl"), logs])
    with pytest.raises(DataError, match=r"contains the input '.*f\.jsonl'"):
        check_output(logs, kind="dataset", inputs=[str(tmp_path / "l*" / "*.jsonl")])


def test_stats_may_write_into_a_hidden_folder_of_its_dataset_only(tmp_path):
    dataset = tmp_path / "ds"
    dataset.mkdir()
    check_output(dataset / "_stats", kind="stats", inputs=[dataset])
    assert (dataset / "_stats").is_dir()
    with pytest.raises(DataError, match="lies inside the input"):
        check_output(dataset / "stats", kind="stats", inputs=[dataset])
    with pytest.raises(DataError, match="lies inside the input"):
        check_output(dataset / "_stats", kind="dataset", inputs=[dataset])


def test_missing_inputs_and_none_are_ignored(tmp_path):
    check_output(tmp_path / "out", kind="dataset", inputs=[None, tmp_path / "nope", [None]])
    assert (tmp_path).is_dir() and not (tmp_path / "out").exists()  # only the parent is made


def test_under_a_file(tmp_path):
    (tmp_path / "AFILE").write_text("x")
    for kind in ("dataset", "shards", "synth", "stats"):
        with pytest.raises(
            DataError, match=r"`--out` '.*AFILE/x/y': '.*AFILE' is a file, not a directory"
        ):
            check_output(tmp_path / "AFILE" / "x" / "y", kind=kind)


def test_existing_file(tmp_path):
    (tmp_path / "f").write_text("x")
    for kind in ("dataset", "shards", "synth", "stats"):
        with pytest.raises(DataError, match=r"'.*f' exists and is not a directory"):
            check_output(tmp_path / "f", kind=kind, overwrite=True)
    assert (tmp_path / "f").read_text() == "x"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_not_creatable():
    for kind in ("dataset", "shards", "synth", "stats"):
        with pytest.raises(DataError, match=r"`--out` '/proc/recpipe-x/y' cannot be created: "):
            check_output("/proc/recpipe-x/y", kind=kind)
    with pytest.raises(DataError, match=r"`--out` '/proc/recpipe-x': cannot write in '/proc'"):
        check_output("/proc/recpipe-x", kind="dataset")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(DataError, match=r"cannot write in '.*locked'|cannot be created"):
            check_output(locked / "ds", kind="dataset")
        with pytest.raises(DataError, match=r"cannot write in '.*locked'"):
            check_output(locked, kind="stats")
    finally:
        locked.chmod(0o755)


def test_existing_directories_by_kind(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    for kind in ("dataset", "shards", "synth"):
        with pytest.raises(DataError, match=r"is not empty and is not (a )?recpipe .*refusing to"):
            check_output(theirs, kind=kind, overwrite=True)
    check_output(theirs, kind="stats")  # writes its own files only
    assert snapshot(theirs) == {"notes.txt": b"mine"}

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "_manifest.json").write_text("{}")
    with pytest.raises(
        DataError, match=r"already exists \(a recpipe dataset\)\nhint: pass --overwrite"
    ):
        check_output(ours, kind="dataset")
    check_output(ours, kind="dataset", overwrite=True)
    with pytest.raises(DataError, match="is not recpipe shards"):
        check_output(ours, kind="shards", overwrite=True)

    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", kind="dataset")
    synth = tmp_path / "synth"
    synth.mkdir()
    (synth / "_synth.json").write_text("{}")
    check_output(synth, kind="synth")  # rewritten in place, as before
    assert not [p for p in tmp_path.rglob(".*probe*")]  # no probe left behind


def test_file_outputs(tmp_path, logs):
    """One output file (`--json`, `--out plan.toml`): not an input nor inside one, not an
    existing directory; an existing file is replaced (its parent is made)."""
    with pytest.raises(DataError, match=r"`--json` '.*logs/_manifest.json' lies inside the input"):
        check_output(logs / "_manifest.json", kind="file", inputs=[logs], arg="--json")
    with pytest.raises(DataError, match=r"`--json` '.*f\.jsonl' is the input"):
        check_output(logs / "f.jsonl", kind="file", inputs=[logs / "f.jsonl"], arg="--json")
    with pytest.raises(DataError, match=r"`--json` '.*logs' is a directory, not a file"):
        check_output(logs, kind="file", arg="--json")
    (tmp_path / "AFILE").write_text("x")
    with pytest.raises(DataError, match=r"'.*AFILE' is a file, not a directory"):
        check_output(tmp_path / "AFILE" / "out.json", kind="file")
    check_output(tmp_path / "AFILE", kind="file")  # replaced by the command
    check_output(tmp_path / "new" / "out.json", kind="file", inputs=[logs])
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "out.json").exists()
    assert not [p for p in tmp_path.rglob(".*probe*")]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_file_output_not_creatable():
    with pytest.raises(
        DataError, match=r"`--json` '/proc/recpipe-x.json': cannot write in '/proc'"
    ):
        check_output("/proc/recpipe-x.json", kind="file", arg="--json")


def test_directory_outputs(tmp_path, logs):
    """A folder of the command's own files (`--checkpoint`): anywhere but in an input."""
    for out in (logs, logs / "ckpt", logs / "_ckpt", logs / "f.jsonl", tmp_path):
        with pytest.raises(DataError, match=r"`--checkpoint` .* the input"):
            check_output(out, kind="directory", inputs=[logs], arg="--checkpoint")
    (tmp_path / "AFILE").write_text("x")
    with pytest.raises(DataError, match=r"`--checkpoint` '.*AFILE' exists and is not a directory"):
        check_output(tmp_path / "AFILE", kind="directory", arg="--checkpoint")
    check_output(tmp_path / "ckpt", kind="directory", inputs=[logs], arg="--checkpoint")
    assert (tmp_path / "ckpt").is_dir()


def test_outputs_of_one_command_do_not_overlap(tmp_path, logs):
    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"`--metrics` '.*m.csv' is the same path as `--json`"):
        check_outputs([("--json", out / "m.csv", "file"), ("--metrics", out / "m.csv", "file")])
    with pytest.raises(DataError, match=r"`--json` '.*ck/s.json' lies inside `--checkpoint`"):
        check_outputs([("--checkpoint", out / "ck", "directory"),
                       ("--json", out / "ck" / "s.json", "file")])  # fmt: skip
    with pytest.raises(DataError, match=r"`--out` '.*logs/t.toml' lies inside the input"):
        check_outputs([("--out", logs / "t.toml", "file"), ("--plot", None, "file")],
                      inputs=[logs])  # fmt: skip
    check_outputs([("--json", out / "s.json", "file"), ("--checkpoint", out / "ck", "directory")])


def test_bad_kind(tmp_path):
    with pytest.raises(DataError, match=r"`kind` must be one of .*got 'nope'"):
        check_output(tmp_path, kind="nope")


# --------------------------------------------------------------------------------------------
# Every command through the CLI: the inputs survive byte for byte
# --------------------------------------------------------------------------------------------


def test_build_refuses_to_replace_its_own_input(shards, capsys):
    before = snapshot(shards)
    code, err = run_cli(
        ["etl", "build", shards, "--out", shards, "--overwrite", "--no-progress"], capsys
    )
    assert code == 1
    assert f"`--out` '{shards}' is the input '{shards}'" in err
    assert snapshot(shards) == before


def test_build_refuses_an_output_holding_its_inputs(tmp_path, shards, logs, capsys):
    events = logs / "f.jsonl"
    before = snapshot(tmp_path)
    code, err = run_cli(
        ["etl", "build", shards, "--events", events, "--out", tmp_path, "--overwrite"], capsys
    )
    assert code == 1 and "contains the input" in err
    code, err = run_cli(["etl", "build", shards, "--out", shards / "ds"], capsys)
    assert code == 1 and "lies inside the input" in err
    schema = tmp_path / "schema" / "s.toml"
    schema.parent.mkdir()
    schema.write_text(Path(__file__).parents[2].joinpath("schemas/examples/synth.toml").read_text())
    code, err = run_cli(
        ["etl", "build", shards, "--schema", schema, "--out", schema.parent, "--overwrite"], capsys
    )
    assert code == 1 and f"contains the input '{schema}'" in err
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("schema/")} == before


def test_shard_refuses_to_replace_its_input(tmp_path, logs, capsys):
    before = snapshot(logs)
    for out in (logs, tmp_path):
        code, err = run_cli(["etl", "shard", logs, "--out", out, "--overwrite", "--quiet"], capsys)
        assert code == 1 and "the input" in err, err
    assert snapshot(logs) == before


def test_stats_refuses_to_write_into_its_dataset(tmp_path, shards, capsys):
    dataset = tmp_path / "ds"
    build = ["etl", "build", str(shards), "--out", str(dataset), "--no-progress"]
    assert main([*build, "--allow-missing-features"]) == 0  # a small hand-made corpus
    capsys.readouterr()
    before = snapshot(dataset)
    for out in (dataset, dataset / "part-00000.parquet", dataset / "plots"):
        code, err = run_cli(["stats", dataset, "--out", out, "--no-plots"], capsys)
        assert code == 1 and "the input" in err, err
    assert snapshot(dataset) == before
    code, err = run_cli(["stats", dataset, "--no-plots"], capsys)  # the default, DATASET/_stats
    assert code == 0, err
    assert (dataset / "_stats" / "stats.json").is_file()


def test_synth_refuses_a_folder_that_is_not_synthetic_logs(tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "features").mkdir(parents=True)
    (mine / "features" / "part-00000.jsonl.zst").write_bytes(b"my real logs")
    code, err = run_cli(["synth", "--out", mine, "--requests", "50", "--quiet"], capsys)
    assert code == 1 and "is not recpipe synthetic logs (it has no _synth.json)" in err
    assert snapshot(mine) == {"features/part-00000.jsonl.zst": b"my real logs"}
    out = tmp_path / "raw"
    for _ in range(2):  # a synth folder is rewritten in place
        code, err = run_cli(["synth", "--out", out, "--requests", "50", "--quiet"], capsys)
        assert code == 0, err


@pytest.mark.parametrize("command", ["build", "shard", "stats", "synth"])
def test_bad_out_is_a_clear_error_for_every_command(tmp_path, logs, command, capsys):
    (tmp_path / "AFILE").write_text("x")
    argv = {
        "build": ["etl", "build", logs, "--no-progress", "--out"],
        "shard": ["etl", "shard", logs, "--quiet", "--out"],
        "stats": ["stats", tmp_path / "no-dataset", "--out"],
        "synth": ["synth", "--requests", "50", "--quiet", "--out"],
    }[command]
    code, err = run_cli([*argv, tmp_path / "AFILE" / "x"], capsys)
    assert code == 1
    assert f"`--out` '{tmp_path}/AFILE/x': '{tmp_path}/AFILE' is a file, not a directory" in err
    if Path("/proc/self").is_dir():
        code, err = run_cli([*argv, "/proc/recpipe-x"], capsys)
        assert code == 1
        assert "`--out` '/proc/recpipe-x'" in err and "Traceback" not in err
    assert (tmp_path / "AFILE").read_text() == "x"


# --------------------------------------------------------------------------------------------
# The other commands' outputs (`recpipe train`, `recpipe fit`; `recpipe towers` in
# tests/towers/test_towers_outputs.py): regressions, `train DS --json DS/_manifest.json`
# replaced the dataset's manifest and `--checkpoint DS/part-00000.parquet` was a raw
# FileExistsError
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    from tests.common.data import synthetic_dataset

    return synthetic_dataset(tmp_path_factory.mktemp("paths"), requests=300, seed=1, files=1)


TRAIN = ["--steps", "1", "--batch-size", "16", "--embedding-dim", "4", "--num-embeddings", "50",
         "--bottom-mlp", "4", "--top-mlp", "4", "--eval-fraction", "0", "--quiet"]  # fmt: skip


@pytest.mark.parametrize(
    ("option", "out", "says"),
    [
        ("--json", "_manifest.json", "lies inside the input"),
        ("--metrics", "metrics.csv", "lies inside the input"),
        ("--checkpoint", "part-00000.parquet", "lies inside the input"),
        ("--checkpoint", ".", "is the input"),
        ("--tensorboard", "_tb", "lies inside the input"),
    ],
)
def test_train_never_writes_into_its_dataset(small_dataset, option, out, says, capsys):
    before = snapshot(small_dataset)
    path = small_dataset / out
    code, err = run_cli(["train", small_dataset, *TRAIN, option, path], capsys)
    assert code == 1
    one_error_line(err, f"`{option}` '{os.path.normpath(path)}", says)
    assert snapshot(small_dataset) == before


def test_train_outputs_elsewhere(small_dataset, tmp_path, capsys):
    (tmp_path / "AFILE").write_text("x")
    cases = [
        (["--checkpoint", tmp_path / "AFILE"], "`--checkpoint`", "exists and is not a directory"),
        (["--json", tmp_path], "`--json`", "is a directory, not a file"),
        (["--json", tmp_path / "AFILE" / "s.json"], "`--json`", "is a file, not a directory"),
        (["--json", tmp_path / "s.csv", "--metrics", tmp_path / "s.csv"], "`--metrics`",
         "is the same path as `--json`"),
    ]  # fmt: skip
    if Path("/proc/self").is_dir():
        cases.append((["--json", "/proc/recpipe-x.json"], "`--json`", "cannot write in '/proc'"))
    for extra, flag, says in cases:
        code, err = run_cli(["train", small_dataset, *TRAIN, *extra], capsys)
        assert code == 1, (extra, err)
        one_error_line(err, flag, says)
    assert (tmp_path / "AFILE").read_text() == "x"
    assert not (tmp_path / "s.json").exists()


def test_fit_refuses_a_fitted_state_it_cannot_write_before_any_work(
    small_dataset, tmp_path, capsys
):
    config = tmp_path / "pre.toml"
    config.write_text(
        '[[preprocess]]\ntransform = "Normalize"\nfeatures = ["user_age"]\nfit = true\n'
    )
    target = small_dataset / "_preprocess_fitted.json"
    target.mkdir()  # something in the way: a directory where the fitted state goes
    try:
        code, err = run_cli(["fit", small_dataset, "--preprocess", config], capsys)
    finally:
        target.rmdir()
    assert code == 1
    one_error_line(err, f"`dataset` '{target}' is a directory, not a file")
