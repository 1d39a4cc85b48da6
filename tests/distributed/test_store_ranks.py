"""The hybrid store as each rank's shard (``recpipe train --nproc N --store hybrid``): every rank
keeps the rows it owns in stores of its own, read and written through by the 2FP exchange; the
job gives one process's per-step losses, checkpoints through the stores and resumes from them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_one_loop import (  # noqa: F401  (data: a fixture)
    BATCH,
    MODEL,
    REPO,
    TIMEOUT_S,
    _train,
    data,
)

STORE = ["--store", "hybrid"]


def _world_of_one(dataset, factory):
    from readers.dataset import dataset_schema
    from tests.distributed.dist_cases import SMALL_MODEL
    from trainer.distributed.comm import Comm
    from trainer.distributed.trainer import DistributedTrainer
    from trainer.models import DLRM

    net = DLRM.from_schema(dataset_schema(dataset), SMALL_MODEL, table_factory=factory)
    return DistributedTrainer(net, comm=Comm.single(), optimizer="adagrad", exact_dense=True)


def test_a_world_of_one_over_stores_trains_as_over_in_memory_shards(dist_dataset, tmp_path):
    """The exchange over StoreShards (rows in an EmbeddingStore per table) and over RowShards
    (in memory) trains the same tables bit for bit: 6 steps, rows entering the hot replica at
    step 2 (read from the shard) and leaving it at step 4 (written back), then an evaluation,
    which reads rows without creating any."""
    import numpy as np
    import torch

    from tests.distributed.dist_cases import rank_batches
    from trainer.config import DEFAULT_LR
    from trainer.distributed.store_shard import StoreShard, store_table_factory
    from trainer.distributed.trainer import sharded_table_factory

    batches = rank_batches(str(dist_dataset), rank=0, world=1, dedup=True, steps=7)
    stores: list = []
    runs = {
        "memory": _world_of_one(dist_dataset, sharded_table_factory(optimizer="adagrad")),
        "store": _world_of_one(dist_dataset, store_table_factory(
            optimizer="adagrad", lr=DEFAULT_LR["adagrad"], root=tmp_path, rank=0,
            world_size=1, open_step=None, stores=stores)),
    }  # fmt: skip
    assert all(isinstance(t.shard, StoreShard) for t in runs["store"].tables)
    losses: dict[str, list] = {name: [] for name in runs}
    for name, trainer in runs.items():
        for step, batch in enumerate(batches[:6]):
            if step == 2:  # the first batch's ids of every table become hot
                trainer.sparse.set_hot([np.sort(t.shard.export()[0][:5]) for t in trainer.tables])
            if step == 4:
                trainer.sparse.set_hot([np.zeros(0, np.int64) for _ in trainer.tables])
            losses[name].append(float(trainer.train_step(batch)[0]))
    assert losses["memory"] == losses["store"]
    rows = {name: trainer.sparse.owned_rows() for name, trainer in runs.items()}
    for table, saved in rows["memory"].items():
        got = rows["store"][table]
        assert torch.equal(saved["ids"], got["ids"])
        assert torch.equal(saved["values"], got["values"]) and torch.equal(
            saved["state"], got["state"]
        )
    before = [s.num_rows for s in stores]
    evals = {name: trainer.evaluate(batches[6:]) for name, trainer in runs.items()}
    assert evals["memory"] == evals["store"]
    assert [s.num_rows for s in stores] == before  # the held-out ids are not added
    for store in stores:
        store.close()


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> float:
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= tol, worst
    return worst


@pytest.mark.slow
def test_two_ranks_with_stores_train_as_one_process_with_a_store(data, tmp_path):  # noqa: F811
    """`--nproc 2 --store hybrid --batch-size B` gives the per-step losses of one process
    `--store hybrid --batch-size 2B` within 1e-6 (float32; exact dense gradients), with a hot
    set chosen after 4 counted steps; each rank's rows live in its own stores."""
    import torch

    from recpipe_cli import main

    steps = 12
    one = _train(data, "one process", tmp_path / "one", "--steps", steps,
                 "--batch-size", 2 * BATCH, *STORE)  # fmt: skip
    two = _train(data, "2 ranks", tmp_path / "two", "--steps", steps, *STORE,
                 "--count-steps", 4, "--hot-rows", 64)  # fmt: skip
    assert one["losses"][0] == two["losses"][0]
    _close(one["losses"], two["losses"])
    for rank in range(2):
        folder = tmp_path / "two" / "store" / f"rank-{rank:05d}-of-00002"
        tables = sorted(p.name for p in folder.iterdir())
        assert tables and all((folder / t / "meta.json").exists() for t in tables)
    # `recpipe export` takes the rows from the ranks' stores: one process's model (2.1e-6 at
    # most, in rows of the sequence tables: row-wise Adagrad's first steps divide a gradient by
    # its own size, so the last bits of a float32 sum vs a float64 one show; trained rows move
    # by 1e-3 and more)
    models = {}
    for run in ("one", "two"):
        out = tmp_path / f"{run}.pt"
        assert main(["export", str(tmp_path / run), "--out", str(out), "--quiet"]) == 0
        models[run] = torch.load(out)["model"]
    assert models["one"].keys() == models["two"].keys()
    worst = max(float((models["one"][k].double() - models["two"][k].double()).abs().max())
                for k in models["one"] if models["one"][k].is_floating_point())  # fmt: skip
    assert worst <= 1e-5, worst


N = 4  # steps before a resume
HOT = ["--count-steps", 2, "--hot-rows", 64]  # a hot set before the checkpoint: its rows too


def _store_dirs(ck, world: int) -> list:
    return sorted((ck / "store").glob(f"rank-*-of-{world:05d}"))


@pytest.mark.slow
def test_a_resume_at_the_same_world_size_reopens_each_ranks_stores(data, tmp_path):  # noqa: F811
    """N steps, a checkpoint (each rank's stores commit, then checkpoint.pt), `--resume` to 2N:
    the per-step losses of an uninterrupted 2N-step run, bit for bit."""
    straight = _train(data, "2 ranks", tmp_path / "straight", "--steps", 2 * N, *STORE, *HOT)
    ck = tmp_path / "split"
    _train(data, "2 ranks", ck, "--steps", N, *STORE, *HOT)
    assert len(_store_dirs(ck, 2)) == 2
    resumed = _train(data, "2 ranks", ck, "--steps", 2 * N, "--resume", *STORE, *HOT)
    assert resumed["resumed_from"] == N
    assert resumed["losses"] == straight["losses"]


@pytest.mark.slow
def test_saved_at_two_ranks_resumed_at_three_rows_move_to_their_owners(data, tmp_path):  # noqa: F811
    """Saved at 2 ranks of 48 rows, resumed at 3 of 32 (the same global batches): each new rank
    fills its new stores with the rows it owns from the old ranks' stores; the losses follow an
    uninterrupted 2-rank run within 1e-6 (gradient sums over 3 ranks, not 2), every row lives
    with its owner at 3 ranks, and the 2-rank stores go with the first 3-rank checkpoint."""
    from trainer.distributed.shard import owner_of
    from trainer.store import open_store

    two = ["--batch-size", 48]
    straight = _train(data, "2 ranks", tmp_path / "straight", "--steps", 2 * N, *STORE, *HOT, *two)
    ck = tmp_path / "split"
    _train(data, "2 ranks", ck, "--steps", N, *STORE, *HOT, *two)
    saved = {}
    for folder in _store_dirs(ck, 2):
        for table in folder.iterdir():
            with open_store(table) as store:
                ids, rows = store.export()
            saved.setdefault(table.name, []).append((ids, rows))
    resumed = _train(data, "2 ranks", ck, "--steps", 2 * N, "--resume", *STORE, *HOT,
                     "--nproc", 3, "--batch-size", 32)  # fmt: skip
    assert resumed["resumed_from"] == N
    _close(resumed["losses"], straight["losses"])
    assert resumed["losses"][:N] == straight["losses"][:N]
    assert _store_dirs(ck, 2) == [] and len(_store_dirs(ck, 3)) == 3
    moved = {name: 0 for name in saved}
    for rank, folder in enumerate(_store_dirs(ck, 3)):
        for table in folder.iterdir():
            with open_store(table) as store:
                ids, _ = store.export()
            assert (owner_of(ids, 3) == rank).all()
            moved[table.name] += ids.size
    for name, parts in saved.items():  # every saved row has an owner at 3 ranks
        assert moved[name] >= sum(ids.size for ids, _ in parts)


def _killed_run(data, ck, hook, point: str, victim: int, at: int, *extra) -> None:  # noqa: F811
    """`recpipe train --nproc 2 --store hybrid` whose rank ``victim`` is SIGKILLed at ``point``
    of the checkpoint of step ``at`` (tests/distributed/store_kill.py): the command fails."""
    mark = ck.with_suffix(".killed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{hook}{os.pathsep}{REPO}",
           "RECPIPE_STORE_KILL": f"{point}:{victim}:{at}", "RECPIPE_STORE_KILL_MARK": str(mark)}  # fmt: skip
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    recpipe = str(Path(sys.executable).with_name("recpipe"))
    args = ["train", data[0], "--batch-size", BATCH, "--eval-batches", 1, "--seed", 0, "--quiet",
            "--checkpoint", ck, *MODEL, "--nproc", 2, *extra]  # fmt: skip
    done = subprocess.run([recpipe, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=REPO)  # fmt: skip
    assert done.returncode != 0, done.stderr[-2000:]
    assert mark.exists(), done.stderr[-3000:]


@pytest.mark.slow
def test_a_rank_killed_mid_checkpoint_loses_nothing(data, tmp_path):  # noqa: F811
    """Checkpoints every 3 steps; a rank is SIGKILLed in the checkpoint of step 6 (in one of its
    stores' commits, or after its stores committed and before checkpoint.pt): `--resume` goes
    on from step 3, the last complete checkpoint (the stores that committed step 6 roll back),
    and gives an uninterrupted run's per-step losses bit for bit."""
    from trainer.store.persist import load_current

    run = ["--steps", 9, "--checkpoint-every", 3, *STORE, *HOT]
    straight = _train(data, "2 ranks", tmp_path / "straight", *run)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import tests.distributed.store_kill  # noqa: F401\n")
    for point, victim in (("commit", 1), ("header", 0)):
        ck = tmp_path / f"{point}{victim}"
        _killed_run(data, ck, hook, point, victim, 6, *run)
        committed = {load_current(t).step for d in _store_dirs(ck, 2) for t in d.iterdir()}
        assert 6 in committed and committed <= {3, 6}, committed  # stores ahead of checkpoint.pt
        if point == "commit":
            assert 3 in committed
        resumed = _train(data, "2 ranks", ck, *run, "--resume")
        assert resumed["resumed_from"] == 3, point
        after = resumed["losses"][-6:]  # steps 4..9 (what the killed run logged may be lost)
        assert after == straight["losses"][3:], point


def test_what_the_store_as_a_shard_does_not_support_is_refused_in_one_line():
    from recpipe.errors import RecpipeError
    from trainer.distributed.store_shard import check_store_options

    check_store_options(optimizer="sgd", cache_rows=0)
    check_store_options(optimizer="adagrad", cache_rows=0)
    check_store_options(optimizer="adam", cache_rows=0)  # Adam's moments beside each row
    with pytest.raises(RecpipeError, match="`--cache-rows` 100 with `--store` 'hybrid'") as cache:
        check_store_options(optimizer="adagrad", cache_rows=100)
    assert "\n" not in str(cache.value)


def test_a_new_rank_reads_its_rows_of_an_old_store_read_only(tmp_path):
    """`read_owned_rows` gives each rank of 2 exactly its rows of a store's commit, the last
    one or the one before it (a store one commit ahead of checkpoint.pt), checksummed, and
    writes nothing: every id and of the rows only the owned ones are read."""
    import numpy as np
    import torch

    from recpipe.errors import StoreError
    from trainer.distributed.shard import owner_of
    from trainer.distributed.store_shard import StoreShard, read_owned_rows
    from trainer.store import EmbeddingStore, StoreConfig

    root = tmp_path / "store"
    config = StoreConfig(dim=4, optimizer="rowwise_adagrad", lr=0.1, chunk_rows=8, sync="process")
    store = EmbeddingStore.create(root, config)
    shard = StoreShard(store)
    ids = np.arange(0, 60, 3)
    shard.write(ids, torch.randn(ids.size, 4), torch.rand(ids.size))
    store.checkpoint(1)
    saved = {1: store.export()}
    shard.write(ids[:7], torch.randn(7, 4), None)
    shard.rows(np.array([100, 101, 3]))  # two new rows
    store.checkpoint(2)
    saved[2] = store.export()
    store.close()
    files = {p.name: p.read_bytes() for p in root.iterdir()}
    width = 4 + 1
    for step, (want_ids, want_rows) in saved.items():
        got = [read_owned_rows(root, step=step, rank=r, world_size=2) for r in range(2)]
        for r, part in enumerate(got):
            assert (owner_of(part["ids"].numpy(), 2) == r).all()
            assert (
                part["bytes"]
                == 8 * want_ids.size
                + -(-want_ids.size // 8)
                + part["ids"].numel() * (width + 1) * 4
            )
        ids_got = np.concatenate([p["ids"].numpy() for p in got])
        rows_got = torch.cat([torch.cat([p["values"], p["state"][:, None]], 1) for p in got])
        order, want_order = np.argsort(ids_got), np.argsort(want_ids)
        assert np.array_equal(ids_got[order], want_ids[want_order])
        assert torch.equal(
            rows_got[torch.from_numpy(order)], torch.from_numpy(want_rows[want_order])
        )
    assert {p.name: p.read_bytes() for p in root.iterdir()} == files
    with pytest.raises(StoreError, match="not of step 0"):
        read_owned_rows(root, step=0, rank=0, world_size=2)
