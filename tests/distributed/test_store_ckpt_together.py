"""A checkpoint's stores commit together: every store of a rank (``--nproc N --store hybrid``)
or of one process (``--store hybrid``) starts its writer before any is waited for, so their
writes and fsyncs overlap instead of running one store after another; a store that cannot
write stops the save in one line once every writer has stopped."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from recpipe.errors import RecpipeError
from trainer.store.writer import CheckpointWriter

TIMEOUT_S = 60.0  # a writer waits this long for the others (the old code: one at a time)


def _all_writers_meet(monkeypatch) -> dict[str, object]:
    """Each store's writer, on entering its checkpoint, waits until every store's writer has
    entered one (a barrier over the writers made so far, with a hard timeout): stores that
    commit one after another break it (BrokenBarrierError out of the first save)."""
    made: list[CheckpointWriter] = []
    meet: dict[str, object] = {"barrier": None, "met": 0}
    init, persist = CheckpointWriter.__init__, CheckpointWriter._persist

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def meeting_persist(self, snap):
        if meet["barrier"] is None:
            meet["barrier"] = threading.Barrier(len(made), timeout=TIMEOUT_S)
        meet["barrier"].wait()  # type: ignore[attr-defined]
        meet["met"] = int(meet["met"]) + 1  # type: ignore[call-overload]
        return persist(self, snap)

    monkeypatch.setattr(CheckpointWriter, "__init__", counting_init)
    monkeypatch.setattr(CheckpointWriter, "_persist", meeting_persist)
    return meet


def _ranks_trainer(dataset, root, stores):
    from readers.dataset import dataset_schema
    from tests.distributed.dist_cases import SMALL_MODEL
    from trainer.config import DEFAULT_LR
    from trainer.distributed.comm import Comm
    from trainer.distributed.store_shard import store_table_factory
    from trainer.distributed.trainer import DistributedTrainer
    from trainer.models import DLRM

    factory = store_table_factory(optimizer="adagrad", lr=DEFAULT_LR["adagrad"], root=root,
                                  rank=0, world_size=1, open_step=None, stores=stores)  # fmt: skip
    net = DLRM.from_schema(dataset_schema(dataset), SMALL_MODEL, table_factory=factory)
    return DistributedTrainer(net, comm=Comm.single(), optimizer="adagrad", exact_dense=True)


def _trained(dist_dataset, tmp_path, steps: int = 2):
    from tests.distributed.dist_cases import rank_batches

    stores: list = []
    trainer = _ranks_trainer(dist_dataset, tmp_path, stores)
    for batch in rank_batches(str(dist_dataset), rank=0, world=1, dedup=True, steps=steps):
        trainer.train_step(batch)
    trainer.sparse.set_hot([np.sort(t.shard.export()[0][:3]) for t in trainer.tables])
    return trainer, stores


def _save(trainer, root):
    from trainer.distributed.comm import Comm
    from trainer.distributed.store_shard import save_store_checkpoint

    state = {"trainer": trainer.state_dict()}
    return save_store_checkpoint(
        root, comm=Comm.single(), sparse=trainer.sparse, step=trainer.step, state=state
    )


def test_a_ranks_stores_commit_together(dist_dataset, tmp_path, monkeypatch):
    """Every store of the rank is inside its checkpoint at the same time (it used to commit
    its stores one after another, each waited for), and each commits the step, hot rows
    included."""
    from trainer.store.persist import load_current

    meet = _all_writers_meet(monkeypatch)
    trainer, stores = _trained(dist_dataset, tmp_path)
    try:
        assert len(stores) > 2
        _save(trainer, tmp_path)
        assert meet["met"] == len(stores)
        assert {load_current(s.root).step for s in stores} == {trainer.step}
        assert not any(s._writer.in_flight for s in stores)
        for table in trainer.tables:  # the hot rows' values are the committed ones
            ids = table.hot_ids
            values, _ = table.shard.read(ids)
            assert np.array_equal(values.numpy(), table.hot_values.numpy())
    finally:
        for store in stores:
            store.close()


def test_a_store_that_cannot_write_stops_the_save_in_one_line(dist_dataset, tmp_path,
                                                             monkeypatch):  # fmt: skip
    """One store's writer fails (the disk is full): the save raises one line naming that
    store, after every other writer has stopped (none is left writing); the failed store keeps
    its previous checkpoint, and the next save commits every store."""
    from trainer.store.persist import load_current

    trainer, stores = _trained(dist_dataset, tmp_path)
    try:
        _save(trainer, tmp_path)
        first = trainer.step
        victim = stores[len(stores) // 2]
        persist = CheckpointWriter._persist

        def full(self, snap):
            if self is victim._writer:
                raise OSError(28, "No space left on device")
            return persist(self, snap)

        monkeypatch.setattr(CheckpointWriter, "_persist", full)
        from tests.distributed.dist_cases import rank_batches

        batches = rank_batches(str(dist_dataset), rank=0, world=1, dedup=True, steps=4)
        trainer.train_step(batches[2])
        with pytest.raises(RecpipeError) as err:
            _save(trainer, tmp_path)
        message = str(err.value)
        assert "\n" not in message
        assert message == (
            f"{victim.root}: cannot write the embedding store's checkpoint of step "
            f"{trainer.step}: No space left on device; the previous checkpoint is kept"
        )
        assert not any(s._writer.in_flight for s in stores)
        assert load_current(victim.root).step == first
        monkeypatch.setattr(CheckpointWriter, "_persist", persist)
        _save(trainer, tmp_path)
        assert {load_current(s.root).step for s in stores} == {trainer.step}
    finally:
        for store in stores:
            store.close()


def test_one_process_stores_commit_together(dist_dataset, tmp_path, monkeypatch):
    """`recpipe train --store hybrid --checkpoint-every`: the process's stores are inside their
    checkpoint at the same time too (it committed them one after another)."""
    import io

    from tests.distributed.dist_cases import SMALL_MODEL
    from trainer.store.persist import load_current
    from trainer.train import TrainConfig, train

    meet = _all_writers_meet(monkeypatch)
    ck = tmp_path / "ck"
    config = TrainConfig(dataset=str(dist_dataset), steps=2, batch_size=32, store="hybrid",
                         checkpoint=str(ck), checkpoint_every=2, eval_fraction=0.0, seed=0,
                         model=SMALL_MODEL)  # fmt: skip
    train(config, progress=False, log=io.StringIO())
    roots = sorted(p for p in (ck / "store").iterdir() if p.is_dir())
    assert len(roots) > 2
    assert int(meet["met"]) >= len(roots)  # type: ignore[call-overload]
    assert {load_current(r).step for r in roots} == {2}
