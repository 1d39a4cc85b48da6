"""The training loop: dedup on/off parity, exact resume, held-out split, AUC, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from recpipe.errors import DataError, RecpipeError
from tests.common.data import synthetic_dataset
from trainer.metrics import PredictionWindow, auc
from trainer.models import ModelConfig
from trainer.runlog import format_summary
from trainer.train import TrainConfig, Trainer, holdout_splits, train

SMALL_MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=2000, bottom_mlp=(16,), top_mlp=(32,), attention_heads=2
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """12k synthetic requests clustered into row groups of ~1k rows (about 12 row groups)."""
    root = tmp_path_factory.mktemp("train_data")
    return synthetic_dataset(root, requests=12_000, seed=3, files=2, row_group_size=1024)


def _config(dataset, tmp_path=None, **kw):
    base = {
        "dataset": str(dataset),
        "batch_size": 256,
        "eval_fraction": 0.2,
        "model": SMALL_MODEL,
        "eval_batches": 4,
    }
    base.update(kw)
    if tmp_path is not None:
        base.setdefault("checkpoint", str(tmp_path))
    return TrainConfig(**base)


def _params(checkpoint: str) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=False)["trainer"]["model"]


# -- metrics -----------------------------------------------------------------------------------
def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.random(200) < 0.4
    pos, neg = s[y], s[~y]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert auc(s, y) == pytest.approx(pairwise, abs=1e-12)
    assert np.isnan(auc(np.ones(3), np.ones(3)))
    w = PredictionWindow(2)
    for _ in range(3):
        w.add(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0]))
    assert w.auc() == 1.0


# -- held-out split ----------------------------------------------------------------------------
def test_holdout_keeps_sessions_whole(dataset):
    import pyarrow.parquet as pq

    from readers.dataset import ParquetBatchDataset

    splits = ParquetBatchDataset(str(dataset)).source.splits
    assert len(splits) >= 8
    train_s, held = holdout_splits(splits, session_key="session_id", fraction=0.25, seed=1)
    assert held and train_s

    def sessions(ss):
        return {
            v
            for s in ss
            for v in s.kept(
                pq.ParquetFile(s.path).read_row_group(s.row_group), session_key="session_id"
            )
            .column("session_id")
            .to_pylist()
        }

    assert not sessions(train_s) & sessions(held)
    assert sessions(train_s) | sessions(held) == sessions(splits)
    assert holdout_splits(splits, session_key="session_id", fraction=0.0, seed=1) == (splits, [])
    # one row group is enough: sessions are held out, not row groups
    one_train, one_held = holdout_splits(splits[:1], session_key="session_id", fraction=0.5, seed=1)
    assert len(one_train) == len(one_held) == 1
    assert one_train[0].num_rows + one_held[0].num_rows == splits[0].num_rows


# -- parity, resume ----------------------------------------------------------------------------
class _Crash(Exception):
    pass


def test_hybrid_resume_after_a_crash_between_the_stores_and_the_state_file(
    dataset, tmp_path, monkeypatch
):
    """Every store commits step 4, then the process dies before the dense state of step 4 is
    saved: resuming rolls the stores back to step 2 and trains as if nothing happened."""
    import trainer.train as train_module

    kw = {"store": "hybrid", "batch_size": 256, "eval_batches": 1, "checkpoint_every": 2}
    full = train(_config(dataset, tmp_path / "full", steps=6, **kw), progress=False)
    save = train_module.save_checkpoint

    def crash_at_step_4(state, path):
        if state["trainer"]["step"] == 4:
            raise _Crash
        save(state, path)

    monkeypatch.setattr(train_module, "save_checkpoint", crash_at_step_4)
    with pytest.raises(_Crash):
        train(_config(dataset, tmp_path / "crash", steps=6, **kw), progress=False)
    monkeypatch.undo()
    steps = [
        json.loads(x)["step"]
        for x in (tmp_path / "full" / "store" / "item_id" / "checkpoints.jsonl")
        .read_text()
        .splitlines()
    ]
    assert steps == [2, 4, 6]  # the end of the run is not checkpointed twice
    stores = tmp_path / "crash" / "store"
    assert all((p / "PREVIOUS").exists() for p in stores.iterdir())  # they did commit step 4
    resumed = train(
        _config(dataset, tmp_path / "crash", steps=6, resume=True, **kw), progress=False
    )
    assert resumed.resumed_from == 2 and resumed.losses == full.losses


def test_hybrid_resume_without_a_state_file_is_refused(dataset, tmp_path, monkeypatch):
    """The stores committed the first checkpoint, the state file never came: nothing to resume,
    and resuming says so (it used to start from step 0 and delete the stores); --overwrite
    starts from step 0 with fresh stores (not with the committed rows)."""
    import trainer.train as train_module

    kw = {"store": "hybrid", "batch_size": 256, "eval_batches": 1, "checkpoint_every": 2}
    full = train(_config(dataset, tmp_path / "full", steps=3, **kw), progress=False)
    monkeypatch.setattr(train_module, "save_checkpoint", lambda *a: (_ for _ in ()).throw(_Crash()))
    with pytest.raises(_Crash):
        train(_config(dataset, tmp_path / "crash", steps=3, **kw), progress=False)
    monkeypatch.undo()
    refused = (
        r"`--resume`: '.*crash' holds no checkpoint \(checkpoint.pt is missing; store/ is left"
    )
    with pytest.raises(RecpipeError, match=refused):
        train(_config(dataset, tmp_path / "crash", steps=3, resume=True, **kw), progress=False)
    assert (tmp_path / "crash" / "store" / "item_id" / "CURRENT").exists()  # nothing deleted
    again = train(
        _config(dataset, tmp_path / "crash", steps=3, overwrite=True, **kw), progress=False
    )
    assert again.resumed_from is None and again.losses == full.losses


@pytest.mark.slow
def test_dedup_on_and_off_train_identically(dataset, tmp_path):
    on = train(_config(dataset, tmp_path / "on", steps=20, dedup=True), progress=False)
    off = train(_config(dataset, tmp_path / "off", steps=20, dedup=False), progress=False)
    assert len(on.losses) == len(off.losses) == 20
    assert on.dedup_factor > 1.5 and off.dedup_factor == 1.0
    np.testing.assert_allclose(on.losses, off.losses, rtol=1e-5)
    p_on, p_off = _params(on.checkpoint), _params(off.checkpoint)
    assert p_on.keys() == p_off.keys()
    # Adagrad divides by the root of the summed squared gradients: an element whose gradients
    # are tiny (cancellations, summed in another order with dedup) moves by ~lr * sign(g), which
    # turns rounding differences into ~1e-4 ones for a few dozen elements (a single one up to
    # ~3e-3 with the session-hash holdout's training rows); the rest agree to 1e-5.
    close = total = 0
    for name in p_on:
        torch.testing.assert_close(p_on[name], p_off[name], rtol=1e-3, atol=5e-3, msg=name)
        close += int(((p_on[name] - p_off[name]).abs() <= 1e-5).sum())
        total += p_on[name].numel()
    assert close >= 0.999 * total
    assert on.final_eval.auc == pytest.approx(off.final_eval.auc, abs=1e-3)


@pytest.mark.slow
def test_resume_is_exact(dataset, tmp_path):
    # ~10 batches of 1024 rows per epoch: the resumed half starts a new epoch (reshuffled).
    # Attention is left out here to keep it quick (the dedup parity test covers it).
    model = ModelConfig(embedding_dim=8, num_embeddings=2000, bottom_mlp=(16,), top_mlp=(32,),
                        attention="none")  # fmt: skip
    kw = {"batch_size": 1024, "eval_batches": 1, "model": model}
    full = train(_config(dataset, tmp_path / "full", steps=12, **kw), progress=False)
    half = train(_config(dataset, tmp_path / "split", steps=6, **kw), progress=False)
    assert half.steps == 6
    resumed = train(
        _config(dataset, tmp_path / "split", steps=12, resume=True, **kw), progress=False
    )
    assert resumed.resumed_from == 6 and resumed.steps == 12
    assert resumed.losses == full.losses  # bitwise: same batches, same updates
    p_full, p_res = _params(full.checkpoint), _params(resumed.checkpoint)
    for name in p_full:
        assert torch.equal(p_full[name], p_res[name]), name
    opt_full = torch.load(full.checkpoint, weights_only=False)["trainer"]["optimizers"]
    opt_res = torch.load(resumed.checkpoint, weights_only=False)["trainer"]["optimizers"]
    for a, b in zip(opt_full, opt_res):
        for key in a["state"]:
            for k, v in a["state"][key].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][key][k]))


# -- learning ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_learns_well_above_chance(dataset, tmp_path):
    # one epoch over ~10k rows; the generator's hidden model reaches ~0.84, the item CTR
    # feature alone ~0.69 (see README); more epochs over so little data overfit
    result = train(_config(dataset, epochs=1, batch_size=256, eval_batches=None), progress=False)
    assert result.final_eval.samples > 1000
    assert result.final_eval.auc > 0.62
    assert np.mean(result.losses[-10:]) < np.mean(result.losses[:10])


# -- configs and the CLI -----------------------------------------------------------------------
def test_config_errors(dataset):
    with pytest.raises(RecpipeError, match="give `steps` or `epochs`, not both"):
        _config(dataset, steps=3, epochs=1)
    with pytest.raises(RecpipeError, match="`optimizer` must be one of"):
        _config(dataset, optimizer="lbfgs")
    with pytest.raises(RecpipeError, match="`resume` needs a `checkpoint`"):
        _config(dataset, resume=True)
    with pytest.raises(RecpipeError, match="`eval_fraction` must be in"):
        _config(dataset, eval_fraction=1.0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_other_optimizers_step(optimizer, dataset):
    from readers.dataset import ParquetBatchDataset
    from readers.source import ReaderConfig
    from trainer.models import DLRM

    ds = ParquetBatchDataset(str(dataset), config=ReaderConfig(batch_size=128))
    batch = next(iter(ds))
    model = DLRM.from_schema(ds.schema, SMALL_MODEL)
    trainer = Trainer(model, optimizer=optimizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss, logits = trainer.train_step(batch)
    assert torch.isfinite(loss) and logits.shape == (128,)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "ebc.tables.item_id.weight" in changed and "top.0.weight" in changed


def test_cli_trains_resumes_and_summarises(dataset, tmp_path, capsys):
    from recpipe_cli import main

    ck, js = tmp_path / "ck", tmp_path / "summary.json"
    args = [
        "train", str(dataset), "--steps", "3", "--batch-size", "128", "--embedding-dim", "8",
        "--num-embeddings", "500", "--eval-batches", "2", "--checkpoint", str(ck),
        "--json", str(js), "--no-progress", "--dedup", "off",
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recpipe train: done" in out and "held-out" in out
    doc = json.loads(js.read_text())
    assert doc["steps"] == 3 and 0.0 <= doc["eval_auc"] <= 1.0
    args[args.index("--steps") + 1] = "5"
    assert main([*args, "--resume"]) == 0
    assert json.loads(js.read_text())["steps"] == 5
    assert "resumed at 3" in capsys.readouterr().out


def test_cli_rejects_bad_options(dataset, capsys):
    from recpipe_cli import main

    with pytest.raises(SystemExit):
        main(["train", str(dataset), "--steps", "0"])
    assert "must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # TrainConfig's check, as a usage error
        main(["train", str(dataset), "--resume", "--no-progress"])
    assert exc.value.code == 2
    assert "`--resume` needs a `--checkpoint`" in capsys.readouterr().err


def test_summary_renders(dataset, tmp_path):
    cfg = _config(dataset, steps=2, eval_batches=1)
    result = train(cfg, progress=False)
    text = format_summary(cfg, result)
    assert "samples_per_s" in text and "peak_memory_bytes" in text and result.samples == 512


def test_hybrid_store_trains_and_resumes_exactly(dataset, tmp_path):
    from trainer.store.store import open_store

    kw = {"store": "hybrid", "batch_size": 256, "eval_batches": 1}
    full = train(_config(dataset, tmp_path / "full", steps=4, **kw), progress=False)
    train(_config(dataset, tmp_path / "split", steps=2, **kw), progress=False)
    resumed = train(
        _config(dataset, tmp_path / "split", steps=4, resume=True, **kw), progress=False
    )
    assert resumed.resumed_from == 2 and resumed.losses == full.losses
    p_full, p_res = _params(full.checkpoint), _params(resumed.checkpoint)
    assert not any("tables" in name for name in p_full)  # the rows live in the stores
    for name in p_full:
        assert torch.equal(p_full[name], p_res[name]), name
    for table in ("item_id", "user_liked_items"):
        a, b = (
            open_store(tmp_path / "full" / "store" / table),
            open_store(tmp_path / "split" / "store" / table),
        )
        ids_a, rows_a = a.export()
        ids_b, rows_b = b.export()
        order_a, order_b = np.argsort(ids_a), np.argsort(ids_b)
        assert np.array_equal(ids_a[order_a], ids_b[order_b]) and len(ids_a) > 100
        assert np.array_equal(rows_a[order_a], rows_b[order_b])
        a.close()
        b.close()


@pytest.mark.slow
def test_trains_from_the_reader_service_and_resumes(dataset, tmp_path):
    import io

    from readers.service import DatasetProducer, ReaderServer, ServiceConfig

    # the server reads as the trainer's config asks (shuffled, seed 0): a client refuses a
    # server that reads another stream
    producer = DatasetProducer(str(dataset), batch_size=256, dedup=True, shuffle=True, seed=0)
    config = ServiceConfig(readers=0, report_every_s=0, heartbeat_s=0.5)
    server = ReaderServer(producer, config=config, log=io.StringIO()).start()
    try:
        address = "{}:{}".format(*server.address)
        kw = {"service": address, "eval_batches": 1}
        full = train(_config(dataset, tmp_path / "full", steps=3, **kw), progress=False)
        train(_config(dataset, tmp_path / "split", steps=1, **kw), progress=False)
        resumed = train(
            _config(dataset, tmp_path / "split", steps=3, resume=True, **kw), progress=False
        )
    finally:
        server.close()
    assert full.samples == 3 * 256 and full.dedup_factor > 1.5
    assert resumed.resumed_from == 1 and resumed.losses == full.losses
    assert full.final_eval.samples == 256
    with pytest.raises(DataError, match="must be HOST:PORT"):
        train(_config(dataset, service="nowhere", steps=1), progress=False)


def test_on_error_skip_trains_and_resumes_through_the_library_loader(dataset, tmp_path):
    """`on_error="skip"` reads through the library's loader (the rank stream refuses skipping
    row groups): it trains, evaluates and resumes exactly."""
    kw = {"steps": 4, "on_error": "skip", "eval_batches": 1}
    full = train(_config(dataset, tmp_path / "full", **kw), progress=False)
    train(_config(dataset, tmp_path / "split", **{**kw, "steps": 2}), progress=False)
    resumed = train(_config(dataset, tmp_path / "split", resume=True, **kw), progress=False)
    assert full.steps == resumed.steps == 4 and full.final_eval.samples > 0
    assert resumed.resumed_from == 2 and resumed.losses == full.losses
