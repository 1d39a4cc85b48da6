"""``recpipe fit``: fitted preprocessing over the training rows, and readers that use it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from readers.dataset import make_dataloader
from readers.fit import fit_preprocess
from readers.holdout import holdout_splits
from readers.pipeline import Pipeline
from readers.source import DatasetSource, ReaderConfig
from readers.transforms import Bucketize, Normalize, VocabLookup
from recpipe.errors import DataError, SchemaError
from tests.common.data import session_table, write_clustered

CONFIG = """
[[preprocess]]
transform = "VocabLookup"
features = ["item_id", "user_items"]
fit = { min_count = 2 }
params = { num_oov_buckets = 2 }

[[preprocess]]
transform = "Normalize"
features = ["user_age"]
fit = true

[[preprocess]]
transform = "Bucketize"
features = ["item_price"]
fit = { num_buckets = 4 }
"""
FRACTION, SEED = 0.2, 3


@pytest.fixture
def fitted(tmp_path, tiny_schema):
    root = tmp_path / "ds"
    for i in range(2):
        table = session_table(tiny_schema, num_sessions=300, seed=i, first_session=1000 * i)
        write_clustered(table, root / f"part-{i}.parquet", row_group_rows=200)
    (root / "_manifest.json").write_text(json.dumps({"schema": tiny_schema.to_toml()}))
    config = tmp_path / "pre.toml"
    config.write_text(CONFIG)
    state = fit_preprocess(root, config, eval_fraction=FRACTION, seed=SEED)
    return root, config, state


def _training_rows(root, schema) -> pa.Table:
    splits = DatasetSource(root, schema=schema).splits
    train, held = holdout_splits(splits, session_key="session_id", fraction=FRACTION, seed=SEED)
    assert held
    return pa.concat_tables(
        s.kept(pq.ParquetFile(s.path).read_row_group(s.row_group), session_key="session_id")
        for s in train
    )


def test_fitted_state_equals_a_numpy_reference_on_the_training_rows(fitted, tiny_schema):
    root, _, state = fitted
    rows = _training_rows(root, tiny_schema)
    assert state["train_rows"] == rows.num_rows
    vocab, normalize, buckets = (step["features"] for step in state["steps"])
    for feature in ("item_id", "user_items"):
        ids = pa.concat_arrays([c.flatten() for c in rows.column(feature).chunks]).to_numpy()
        uniq, counts = np.unique(ids, return_counts=True)
        keep = counts >= 2
        order = np.lexsort((uniq[keep], -counts[keep]))  # most frequent first, then smaller id
        assert vocab[feature]["vocab"] == uniq[keep][order].tolist()
    age = rows.column("user_age").to_numpy().astype(np.float64)
    assert np.isnan(age).any()  # missing values are left out of the statistics
    assert normalize["user_age"]["mean"] == pytest.approx(np.nanmean(age), rel=1e-12)
    assert normalize["user_age"]["std"] == pytest.approx(np.nanstd(age), rel=1e-9)
    price = rows.column("item_price").to_numpy().astype(np.float64)
    want = np.quantile(price, [0.25, 0.5, 0.75])
    np.testing.assert_allclose(buckets["item_price"]["boundaries"], want, rtol=1e-12)
    # the held-out rows change the statistics: they were left out
    everything = fit_preprocess(root, _entries(), eval_fraction=0.0, write=False)
    assert everything["train_rows"] > state["train_rows"]
    assert everything["steps"][1] != state["steps"][1]


def _entries():
    """The config above, as entries."""
    import tomllib

    return tomllib.loads(CONFIG)["preprocess"]


def test_readers_use_the_fitted_state(fitted, tiny_schema):
    root, config, state = fitted
    vocab, normalize, buckets = (step["features"] for step in state["steps"])
    explicit = Pipeline(
        [
            VocabLookup(features=("item_id",), vocab=vocab["item_id"]["vocab"], num_oov_buckets=2),
            VocabLookup(
                features=("user_items",), vocab=vocab["user_items"]["vocab"], num_oov_buckets=2
            ),
            Normalize(
                features=("user_age",),
                mean=normalize["user_age"]["mean"],
                std=normalize["user_age"]["std"],
            ),
            Bucketize(features=("item_price",), boundaries=buckets["item_price"]["boundaries"]),
        ],
        schema=tiny_schema,
    )
    reader = ReaderConfig(batch_size=64)
    loader = make_dataloader(root, config=reader, transforms=config)
    plain = make_dataloader(root, config=reader)
    delivered = 0
    for got, raw in zip(loader, plain, strict=True):
        assert got.equals(explicit(raw))
        delivered += 1
    assert delivered == len(loader) > 1


def test_fit_errors(fitted, tmp_path, tiny_schema):
    root, config, _ = fitted
    other = tmp_path / "other.toml"
    other.write_text(CONFIG.replace("num_buckets = 4", "num_buckets = 5"))
    with pytest.raises(SchemaError, match="fitted for another preprocessing config"):
        make_dataloader(root, transforms=other)
    (root / "_preprocess_fitted.json").unlink()
    with pytest.raises(SchemaError, match=r"#1: asks to be fitted .*\n.*recpipe fit"):
        make_dataloader(root, transforms=config)
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.replace("min_count = 2", "min_cnt = 2"))
    with pytest.raises(SchemaError, match="no `fit` option 'min_cnt'"):
        fit_preprocess(root, bad)
    clash = tmp_path / "clash.toml"
    clash.write_text(CONFIG.replace("num_oov_buckets = 2", "vocab = [1]"))
    with pytest.raises(SchemaError, match=r"`params\.vocab` is what `fit` computes"):
        fit_preprocess(root, clash)


def test_recpipe_fit_command(fitted, capsys):
    from recpipe_cli import main

    root, config, state = fitted
    (root / "_preprocess_fitted.json").unlink()
    argv = ["fit", str(root), "--preprocess", str(config), "--eval-fraction", str(FRACTION)]
    assert main([*argv, "--seed", str(SEED)]) == 0
    written = json.loads((root / "_preprocess_fitted.json").read_text())
    assert written["steps"] == state["steps"]
    assert "VocabLookup" in capsys.readouterr().out


def test_a_fitted_state_of_another_holdout_is_reported(fitted):
    from readers.fitted import fitted_holdout_mismatch

    root, _, _ = fitted
    assert fitted_holdout_mismatch(root, eval_fraction=FRACTION, seed=SEED) is None
    why = fitted_holdout_mismatch(root, eval_fraction=0.1, seed=SEED)
    assert why is not None and "--eval-fraction 0.2" in why and "recpipe fit" in why


# -------------------------------------------------------------------------------------------
# fitted on the values each step sees


CHAIN = """
[[preprocess]]
transform = "HashModulo"
features = ["item_id"]
params = { modulus = 7, hash = false }

[[preprocess]]
transform = "Truncate"
features = ["user_items"]
params = { max_len = 1 }

[[preprocess]]
transform = "VocabLookup"
features = ["item_id", "user_items"]
fit = true

[[preprocess]]
transform = "Log1p"
features = ["user_age"]

[[preprocess]]
transform = "Normalize"
features = ["user_age", "item_price"]
fit = true

[[preprocess]]
transform = "Bucketize"
features = ["item_price"]
fit = { num_buckets = 4 }
"""


def _vocab(ids: np.ndarray) -> list[int]:
    uniq, counts = np.unique(ids, return_counts=True)
    assert ids.dtype == np.int64
    return uniq[np.lexsort((uniq, -counts))].tolist()  # most frequent first, then smaller id


def test_a_fitted_step_is_fitted_on_what_the_earlier_steps_hand_it(fitted, tmp_path, tiny_schema):
    root, _, _ = fitted
    config = tmp_path / "chain.toml"
    config.write_text(CHAIN)
    state = fit_preprocess(
        root, config, eval_fraction=FRACTION, seed=SEED, out=tmp_path / "chain.json"
    )
    vocab, normalize, buckets = (step["features"] for step in state["steps"])
    rows = _training_rows(root, tiny_schema)
    # a hash-modulo, then a vocabulary: of the ids modulo 7, not of the stored ids
    item = pa.concat_arrays([c.flatten() for c in rows.column("item_id").chunks]).to_numpy()
    assert vocab["item_id"]["vocab"] == _vocab(np.mod(item, 7))
    # a truncation to the last id of each list, then a vocabulary: of the ids kept
    kept = [r[-1:] for r in rows.column("user_items").to_pylist() if r]
    assert vocab["user_items"]["vocab"] == _vocab(np.concatenate(kept))
    # log1p, then normalise: the figures of the logs (float32, as the readers hand them on)
    age = rows.column("user_age").to_numpy().astype(np.float32)
    logs = np.log1p(np.clip(age, 0, None)).astype(np.float64)
    assert normalize["user_age"]["mean"] == pytest.approx(np.nanmean(logs), rel=1e-6)
    assert normalize["user_age"]["std"] == pytest.approx(np.nanstd(logs), rel=1e-6)
    # a fitted normalise, then fitted buckets: quantiles of the normalised prices
    price = rows.column("item_price").to_numpy().astype(np.float32)
    mean, std = normalize["item_price"]["mean"], normalize["item_price"]["std"]
    assert mean == pytest.approx(np.mean(price.astype(np.float64)), rel=1e-6)
    scaled = ((price - np.float32(mean)) / np.float32(std)).astype(np.float64)
    want = np.quantile(scaled, [0.25, 0.5, 0.75])
    np.testing.assert_allclose(buckets["item_price"]["boundaries"], want, rtol=1e-6)
    # and the readers map every hashed id into the vocabulary (no out-of-vocabulary bucket)
    loader = make_dataloader(
        root, config=ReaderConfig(batch_size=256), transforms=config, fitted=tmp_path / "chain.json"
    )
    size = len(vocab["item_id"]["vocab"])
    assert all(int(b.kjt.to_dict()["item_id"].values().max()) < size for b in loader)


# -------------------------------------------------------------------------------------------
# the fitted state outside the dataset: `recpipe fit --out`, readers' `fitted`


def _snapshot(root) -> dict:
    return {
        p.relative_to(root).as_posix(): (p.stat().st_mode, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    } | {".": root.stat().st_mtime_ns}


def test_fit_out_writes_nothing_into_a_read_only_dataset(fitted, tmp_path, capsys):
    import shutil

    from recpipe_cli import main

    root, config, state = fitted
    shared = tmp_path / "shared"
    shutil.copytree(root, shared, ignore=shutil.ignore_patterns("_preprocess_fitted.json"))
    for p in [*shared.rglob("*"), shared]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    before = _snapshot(shared)
    out = tmp_path / "fitted" / "pre.json"
    out.parent.mkdir()
    argv = ["fit", str(shared), "--preprocess", str(config), "--out", str(out)]
    assert main([*argv, "--eval-fraction", str(FRACTION), "--seed", str(SEED)]) == 0
    assert _snapshot(shared) == before  # nothing written, created or touched in the dataset
    assert str(out) in capsys.readouterr().err
    written = json.loads(out.read_text())
    assert written["steps"] == state["steps"]
    assert written["dataset_digest"] == state["dataset_digest"]  # a copy is the same dataset
    # the readers take it explicitly, and deliver what the dataset's own fitted state gives
    reader = ReaderConfig(batch_size=64)
    ours = make_dataloader(shared, config=reader, transforms=config, fitted=out)
    theirs = make_dataloader(root, config=reader, transforms=config)
    assert all(a.equals(b) for a, b in zip(ours, theirs, strict=True))
    # without it, the read-only dataset has no fitted state
    with pytest.raises(SchemaError, match=r"asks to be fitted .*no .*shared/_preprocess_fitted"):
        make_dataloader(shared, transforms=config)
    # an --out that would replace an input is refused before any work
    with pytest.raises(DataError, match="`--out`"):
        fit_preprocess(shared, config, out=config)


def test_a_fitted_file_of_another_dataset_or_config_is_refused(fitted, tmp_path, tiny_schema):
    root, config, state = fitted
    other = tmp_path / "other"
    table = session_table(tiny_schema, num_sessions=100, seed=7)
    write_clustered(table, other / "part-0.parquet", row_group_rows=200)
    (other / "_manifest.json").write_text(json.dumps({"schema": tiny_schema.to_toml()}))
    theirs = tmp_path / "other.json"
    fit_preprocess(other, config, eval_fraction=FRACTION, seed=SEED, out=theirs)
    assert not (other / "_preprocess_fitted.json").exists()
    with pytest.raises(SchemaError, match=r"other\.json: fitted on another dataset \(.*other, "):
        make_dataloader(root, transforms=config, fitted=theirs)
    changed = tmp_path / "changed.toml"
    changed.write_text(CONFIG.replace("min_count = 2", "min_count = 3"))
    with pytest.raises(SchemaError, match="fitted for another preprocessing config"):
        make_dataloader(other, transforms=changed, fitted=theirs)
    # an earlier step on a fitted feature decides what is fitted: another config too
    before = tmp_path / "before.toml"
    before.write_text('[[preprocess]]\ntransform = "Clamp"\nfeatures = ["user_age"]\n'
                      "params = { max = 50.0 }\n" + CONFIG)  # fmt: skip
    with pytest.raises(SchemaError, match="fitted for another preprocessing config"):
        make_dataloader(other, transforms=before, fitted=theirs)
    # the dataset's own state, after the dataset was rebuilt with other rows
    (root / "_preprocess_fitted.json").write_text((theirs).read_text())
    with pytest.raises(SchemaError, match=r"_preprocess_fitted\.json: fitted on another dataset"):
        make_dataloader(root, transforms=config)
    # a state written before the digests (version 1) is refused, saying to fit again
    old = json.loads(theirs.read_text()) | {"version": 1}
    theirs.write_text(json.dumps(old))
    with pytest.raises(SchemaError, match=r"version 1, written by an older `recpipe fit`"):
        make_dataloader(other, transforms=config, fitted=theirs)
    # a fitted file with nothing to fill
    with pytest.raises(SchemaError, match=r"`fitted` .* without a preprocessing config"):
        make_dataloader(other, fitted=theirs)
    assert state["config_digest"] != json.loads(theirs.read_text())["dataset_digest"]


def test_missing_dense_values_are_left_out_whatever_the_parquet_statistics_say(
    tmp_path, tiny_schema
):
    # pyarrow leaves NaN out of a float column's min/max statistics: DuckDB then took
    # `isnan(x)` for false on every row, and the mean was NaN
    root = tmp_path / "ds"
    table = session_table(tiny_schema, num_sessions=100, seed=7)
    write_clustered(table, root / "part-0.parquet", row_group_rows=200)
    age = table.column("user_age").to_numpy().astype(np.float64)
    assert np.isnan(age).any()
    entries = [{"transform": "Normalize", "features": ["user_age"], "fit": True}]
    state = fit_preprocess(root, entries, schema=tiny_schema, eval_fraction=0.0, write=False)
    assert state["steps"][0]["features"]["user_age"]["mean"] == pytest.approx(np.nanmean(age))


@pytest.mark.parametrize("command", ["train", "serve"])
def test_train_and_serve_take_the_fitted_file(command, fitted, tmp_path, tiny_schema, capsys):
    from recpipe_cli import main

    root, config, _ = fitted
    other = tmp_path / "other"
    write_clustered(
        session_table(tiny_schema, num_sessions=50, seed=9), other / "p.parquet", row_group_rows=200
    )
    (other / "_manifest.json").write_text(json.dumps({"schema": tiny_schema.to_toml()}))
    theirs = tmp_path / "theirs.json"
    fit_preprocess(other, config, eval_fraction=FRACTION, seed=SEED, out=theirs)
    argv = [command, str(root), "--preprocess", str(config), "--fitted", str(theirs)]
    extra = ["--steps", "1", "--batch-size", "64"] if command == "train" else ["--port", "9"]
    assert main([*argv, *extra]) == 1  # refused before a step or a client: it reached the readers
    err = capsys.readouterr().err
    assert f"recpipe {command}: error: {theirs}: fitted on another dataset" in err


def test_a_built_dataset_fitted_out_of_place_trains(tmp_path, capsys):
    import shutil

    from recpipe_cli import main
    from tests.common.data import synthetic_dataset

    root = synthetic_dataset(tmp_path / "built", requests=300, seed=1, files=1)
    config = tmp_path / "pre.toml"
    config.write_text(
        '[[preprocess]]\ntransform = "HashModulo"\nfeatures = ["item_id"]\n'
        "params = { modulus = 40 }\n"
        '[[preprocess]]\ntransform = "VocabLookup"\nfeatures = ["item_id"]\nfit = true\n'
        '[[preprocess]]\ntransform = "Log1p"\nfeatures = ["item_price"]\n'
        '[[preprocess]]\ntransform = "Normalize"\nfeatures = ["item_price"]\nfit = true\n'
    )
    out = tmp_path / "fitted.json"
    before = _snapshot(root)
    assert main(["fit", str(root), "--preprocess", str(config), "--out", str(out)]) == 0
    assert _snapshot(root) == before
    # the manifest's sha256 identify the dataset: a copy is the same one
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    train = ["--steps", "2", "--batch-size", "16", "--embedding-dim", "4", "--num-embeddings",
             "50", "--bottom-mlp", "4", "--top-mlp", "4", "--quiet"]  # fmt: skip
    argv = ["train", str(copy), "--preprocess", str(config), "--fitted", str(out), *train]
    assert main(argv) == 0, capsys.readouterr().err
    # --fitted needs the config it was fitted for
    with pytest.raises(SystemExit) as refused:  # a usage error, before any work
        main(["train", str(copy), "--fitted", str(out), *train])
    assert refused.value.code == 2
    assert "`--fitted`" in capsys.readouterr().err
