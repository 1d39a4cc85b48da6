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
from recpipe.errors import SchemaError
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
    with pytest.raises(SchemaError, match="fitted for other `fit` entries"):
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
