"""Towers with `--store hybrid`: each tower rank keeps the rows of the tables it holds in
embedding stores of its own (``CK/store/rank-R-of-W/<table>/``). On 2 hosts x 2 ranks with
`--dedup on` the job gives one process's per-step losses (`--store hybrid`, the global batch),
and a checkpoint through the stores resumes at the same layout."""

from __future__ import annotations

import pytest

from tests.trainer.test_one_loop import BATCH, _train, data  # noqa: F401  (data: a fixture)

STEPS = 10
# 2 hosts x 2 ranks, pass-through towers (towers pool only: no attention), deduplicated batches
FLAGS = ["--store", "hybrid", "--dedup", "on", "--attention", "none"]


def _towers(data, tmp, *extra):  # noqa: F811
    """The towers job: 2 hosts x 2 ranks of BATCH // 2 rows (a global batch of 2 BATCH)."""
    return _train(data, "one process", tmp, *FLAGS, "--towers", data[1], "--nproc", 4,
                  "--ranks-per-host", 2, "--tower-module", "none", "--batch-size", BATCH // 2,
                  *extra)  # fmt: skip


def _store_tables(ck) -> dict[int, list[str]]:
    return {int(d.name[5:10]): sorted(t.name for t in d.iterdir() if (t / "meta.json").exists())
            for d in sorted((ck / "store").glob("rank-*-of-00004"))}  # fmt: skip


@pytest.mark.slow
def test_towers_on_two_hosts_of_two_ranks_with_stores_train_as_one_process(data, tmp_path):  # noqa: F811
    """Per-step losses within 1e-6 of one process `--store hybrid` on the global batch (float32
    rounding of the tables' gradient sums), as towers in one process with `--store hybrid`;
    every table lives in exactly one rank's stores; `recpipe export` gives one process's model."""
    one = _train(data, "one process", tmp_path / "one", *FLAGS, "--steps", STEPS,
                 "--batch-size", 2 * BATCH)  # fmt: skip
    local = _train(data, "one process", tmp_path / "local", *FLAGS, "--towers", data[1],
                   "--steps", STEPS, "--batch-size", 2 * BATCH)  # fmt: skip
    assert local["towers"]["schedule"] == "local"
    towers = _towers(data, tmp_path / "towers", "--steps", STEPS)
    assert towers["towers"]["schedule"] == "sptt" and towers["towers"]["world_size"] == 4
    assert len(one["losses"]) == len(towers["losses"]) == STEPS
    worst = max(abs(a - b) for a, b in zip(one["losses"], towers["losses"], strict=True))
    assert worst <= 1e-6, (worst, one["losses"], towers["losses"])
    assert local["losses"][0] == pytest.approx(one["losses"][0], abs=1e-7)
    worst = max(abs(a - b) for a, b in zip(one["losses"], local["losses"], strict=True))
    assert worst <= 1e-6, ("towers in one process", worst)
    held = _store_tables(tmp_path / "towers")
    assert sorted(held) == [0, 1, 2, 3] and all(held.values()), held
    names = [t for tables in held.values() for t in tables]
    assert len(names) == len(set(names))  # a table in one rank's stores only
    # `recpipe export` takes each table's rows from the store of the rank that holds it: one
    # process's model (float32 rounding of the gradient sums, as with ranks' stores)
    import torch

    from recpipe_cli import main

    models = {}
    for run in ("one", "towers"):
        out = tmp_path / f"{run}.pt"
        assert main(["export", str(tmp_path / run), "--out", str(out), "--quiet"]) == 0
        models[run] = torch.load(out)["model"]
    assert models["one"].keys() == models["towers"].keys()
    worst = max(float((models["one"][k].double() - models["towers"][k].double()).abs().max())
                for k in models["one"] if models["one"][k].is_floating_point())  # fmt: skip
    assert worst <= 1e-5, worst


def _store_rows(ck) -> dict[str, tuple]:
    """Every table's rows (ids sorted) as the ranks' stores hold them at their last commit."""
    import numpy as np

    from trainer.store import open_store

    out = {}
    for folder in sorted((ck / "store").glob("rank-*-of-00004")):
        for table in folder.iterdir():
            with open_store(table) as store:
                ids, rows = store.export()
            order = np.argsort(ids)
            out[table.name] = (ids[order], rows[order])
    return out


@pytest.mark.slow
def test_towers_with_stores_resume_from_their_checkpoint(data, tmp_path):  # noqa: F811
    """4 steps, a checkpoint (every rank's stores commit, then the headers), `--resume` to 8.
    The first resumed step's loss is the uninterrupted run's bit for bit (the rows, Adagrad
    state and dense model come back exactly); later steps follow it within 1e-7 and the stores
    end within 1e-6: on 4 gloo ranks the gradient and loss sums of a restarted job are grouped
    otherwise (DDP's buckets), so the last float32 bits differ, with `--store module` alike
    (1.5e-8 in the losses here, the same figures)."""
    import numpy as np

    straight = _towers(data, tmp_path / "straight", "--steps", 8)
    ck = tmp_path / "split"
    _towers(data, ck, "--steps", 4)
    assert sorted(_store_tables(ck)) == [0, 1, 2, 3]
    resumed = _towers(data, ck, "--steps", 8, "--resume")
    assert resumed["resumed_from"] == 4
    assert len(resumed["losses"]) == 8
    assert resumed["losses"][:5] == straight["losses"][:5]
    worst = max(abs(a - b) for a, b in zip(resumed["losses"], straight["losses"], strict=True))
    assert worst <= 1e-7, worst
    assert abs(resumed["eval_loss"] - straight["eval_loss"]) <= 1e-6
    got, want = _store_rows(ck), _store_rows(tmp_path / "straight")
    assert got.keys() == want.keys() and got
    for name, (ids, rows) in want.items():
        assert np.array_equal(got[name][0], ids), name
        assert np.abs(got[name][1] - rows).max() <= 1e-6, name


def test_a_towers_checkpoint_resumes_with_the_store_it_was_written_with(data, tmp_path, capsys):  # noqa: F811
    """One process towers, 2 steps with `--store module`; `--resume --store hybrid` is refused
    in one line naming both, the checkpoint untouched (and the other way round: no store is
    replaced)."""
    from recpipe_cli import main

    for saved, other in (("module", "hybrid"), ("hybrid", "module")):
        ck = tmp_path / saved
        _train(data, "one process", ck, "--towers", data[1], "--attention", "none",
               "--steps", 2, "--store", saved)  # fmt: skip
        before = sorted(p.relative_to(ck) for p in ck.rglob("*"))
        args = ["train", data[0], "--towers", data[1], "--attention", "none", "--steps", 4,
                "--batch-size", BATCH, "--checkpoint", ck, "--resume", "--store", other,
                "--quiet"]  # fmt: skip
        capsys.readouterr()
        assert main([str(a) for a in args]) == 1
        err = capsys.readouterr().err.strip()
        assert "`--store`" in err and f"with {saved!r}, this run gives {other!r}" in err, err
        assert "\n" not in err
        assert sorted(p.relative_to(ck) for p in ck.rglob("*")) == before
