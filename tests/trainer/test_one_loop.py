"""One loop for every mode, from the command line: {one process, 2 ranks, towers on 2 hosts x 1
rank} x {in process, reader service} x {2N steps, N steps + --resume + N}: the per-step losses
of the two columns are equal bit for bit, with --workers 0 and --workers 2; and the resumes across
layouts that work, or end in one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common.cli import one_error_line, run_cli

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--embedding-dim", "4", "--num-embeddings", "200", "--bottom-mlp", "8", "--top-mlp", "8",
         "--attention-heads", "2"]  # fmt: skip
N = 3  # steps before the resume
BATCH = 32  # rows per rank
TIMEOUT_S = 300


def _recpipe(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    recpipe = str(Path(sys.executable).with_name("recpipe"))
    return subprocess.run([recpipe, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=REPO)  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small clustered dataset (the bundled schema less its partial feature) and a plan of
    two towers over its sparse features."""
    import dataclasses

    from readers.dataset import dataset_schema
    from schemas import default_schema
    from tests.common.data import synthetic_dataset
    from trainer.towers.config import TowerPlan

    schema = default_schema()
    schema = dataclasses.replace(
        schema,
        sparse=tuple(f for f in schema.sparse if f.name != "user_recent_items"),
        dedup_partial=(),
    )
    root = tmp_path_factory.mktemp("one_loop")
    dataset = synthetic_dataset(root / "data", requests=1500, seed=7, row_group_size=128,
                                schema=schema)  # fmt: skip
    plan = TowerPlan.strided(dataset_schema(dataset).sparse_names, 2)
    return dataset, plan.save(root / "towers.toml")


@pytest.fixture(scope="module")
def service(data):
    """``recpipe serve`` (in this process) over the dataset: shuffled, per-rank batches of
    BATCH rows."""
    from readers.service import DatasetProducer, ReaderServer, ServiceConfig

    producer = DatasetProducer(str(data[0]), batch_size=BATCH, shuffle=True, seed=0,
                               warmup_batches=0)  # fmt: skip
    server = ReaderServer(producer, config=ServiceConfig(readers=0, report_every_s=0),
                          log=io.StringIO()).start()  # fmt: skip
    yield "{}:{}".format(*server.address)
    server.close()


MODES = {
    "one process": [],
    "2 ranks": ["--nproc", 2],
    "towers 2x1": ["--nproc", 2, "--ranks-per-host", 1],
}


def _train(data, mode, tmp, *extra):
    dataset, plan = data
    args = ["train", dataset, "--batch-size", BATCH, "--eval-batches", 1, "--seed", 0, "--quiet",
            "--checkpoint", tmp, *MODEL, *MODES[mode], *extra]  # fmt: skip
    if mode.startswith("towers"):
        args += ["--towers", plan]
    tmp = Path(tmp)
    args += ["--json", tmp.with_suffix(".json"), "--metrics", tmp.with_suffix(".jsonl")]
    if "--nproc" in args:
        done = _recpipe(*args)
        assert done.returncode == 0, done.stderr[-3000:]
    else:  # one process: in this one (no interpreter to start)
        from recpipe_cli import main

        assert main([str(a) for a in args]) == 0
    summary = json.loads(tmp.with_suffix(".json").read_text())
    records = [json.loads(line) for line in tmp.with_suffix(".jsonl").read_text().splitlines()]
    summary["losses"] = [r["loss"] for r in records if r["kind"] == "train"]
    return summary


def _losses(summary: dict) -> list[float]:
    """The per-step losses of the run (a resumed one: those its metrics file kept, then its
    own), as its ``--metrics`` file holds them."""
    return summary["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("source", ["in process", "service"])
def test_resume_continues_exactly_in_every_mode(data, service, mode, source, tmp_path):
    read = ["--service", service] if source == "service" else []
    straight = _train(data, mode, tmp_path / "straight", "--steps", 2 * N, *read)
    assert straight["steps"] == 2 * N
    workers = [0] if source == "service" else [0, 2]
    for w in workers:
        ck = tmp_path / f"split{w}"
        _train(data, mode, ck, "--steps", N, "--workers", w, *read)
        resumed = _train(data, mode, ck, "--steps", 2 * N, "--workers", w, "--resume", *read)
        assert resumed["resumed_from"] == N
        assert _losses(resumed) == _losses(straight), (mode, source, w)


@pytest.mark.slow
def test_a_checkpoint_moves_between_the_service_and_in_process(data, service, tmp_path):
    straight = _train(data, "one process", tmp_path / "straight", "--steps", 2 * N)
    _train(data, "one process", tmp_path / "a", "--steps", N, "--service", service)
    resumed = _train(data, "one process", tmp_path / "a", "--steps", 2 * N, "--resume")
    assert _losses(resumed) == _losses(straight)
    _train(data, "one process", tmp_path / "b", "--steps", N)
    served = _train(data, "one process", tmp_path / "b", "--steps", 2 * N, "--resume",
                    "--service", service)  # fmt: skip
    assert _losses(served) == _losses(straight)


@pytest.mark.slow
def test_a_multi_rank_checkpoint_resumes_in_one_process(data, tmp_path):
    """Two ranks of BATCH rows, resumed by one process reading the same global batches (2 x
    BATCH rows): it goes on (the job's engine on a world of one)."""
    _train(data, "2 ranks", tmp_path / "ck", "--steps", N)
    dataset = data[0]
    done = _recpipe("train", dataset, "--batch-size", 2 * BATCH, "--steps", 2 * N, "--resume",
                    "--checkpoint", tmp_path / "ck", "--quiet", "--eval-batches", 1, "--seed", 0,
                    *MODEL, "--json", tmp_path / "one.json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["steps"] == 2 * N and one["resumed_from"] == N


@pytest.mark.slow
def test_cross_layout_resumes_that_cannot_work_end_in_one_line(data, tmp_path, capsys):
    dataset, _ = data
    ck = tmp_path / "ck"
    base = ["train", dataset, "--batch-size", BATCH, "--checkpoint", ck, "--quiet", *MODEL]
    code, err = run_cli([*base, "--steps", 1], capsys)
    assert code == 0, err
    # another embedding dimension: the flag, the checkpoint's value and this run's
    code, err = run_cli([*base[:-len(MODEL)], *MODEL[:1], 8, *MODEL[2:], "--steps", 2,
                         "--resume"], capsys)  # fmt: skip
    assert code == 1
    one_error_line(err, "`--embedding-dim`", "4", "8")
    # a one-process checkpoint at two ranks: its tables are not sharded rows
    done = _recpipe(*base, "--steps", 2, "--resume", "--nproc", 2, "--batch-size", BATCH // 2)
    assert done.returncode == 1
    one_error_line(done.stderr, "without `--nproc`")


@pytest.mark.slow
def test_two_ranks_train_as_one_process_from_the_command_line(data, tmp_path):
    """`recpipe train --nproc 2 --batch-size B/2` reads the global batches of B rows that
    `recpipe train --batch-size B` reads in one process and, with exact dense gradients (the
    default) and attention pooling on, gives its per-step losses within 1e-6 over 100 steps and
    its held-out loss: one process's parameter tables start from the rows the ranks' sharded
    tables start from, and train with the same row-wise Adagrad. Within 1e-6 absolute, not bit
    for bit: one process sums a row's gradients in float32 in the order of the batch, the ranks
    in float64 per rank and then over ranks."""
    steps = 100
    one = _train(data, "one process", tmp_path / "one", "--steps", steps,
                 "--batch-size", 2 * BATCH)  # fmt: skip
    two = _train(data, "2 ranks", tmp_path / "two", "--steps", steps)
    assert len(one["losses"]) == len(two["losses"]) == steps
    assert one["losses"][0] == two["losses"][0]  # the same batch, the same model: bit for bit
    worst = max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True))
    assert worst <= 1e-6, worst
    assert one["eval_samples"] == two["eval_samples"] > 0
    assert abs(one["eval_loss"] - two["eval_loss"]) <= 1e-6


@pytest.mark.slow
def test_the_same_flags_train_the_same_model_in_every_engine(data, tmp_path):
    """One process (parameter tables), `--nproc 1` (the sharded engine on a world of one),
    `--store hybrid` and `--towers PLAN` in one process build the same model from the same flags
    (rows initialised from (seed, table, id), ids modulo --num-embeddings, row-wise Adagrad,
    exact dense gradients) and give the same per-step losses, within float32 rounding of the
    tables' gradient sums (float32 in parameter tables and the store, float64 in the exchange).
    Attention off: towers pool only."""
    steps, flags = 30, ["--steps", 30, "--batch-size", 2 * BATCH, "--attention", "none"]
    runs = {
        "one process": _train(data, "one process", tmp_path / "one", *flags),
        "--nproc 1": _train(data, "2 ranks", tmp_path / "nproc1", *flags, "--nproc", 1),
        "--store hybrid": _train(
            data, "one process", tmp_path / "store", *flags, "--store", "hybrid"
        ),
        "towers": _train(data, "one process", tmp_path / "towers", *flags, "--towers", data[1]),
    }
    reference = runs.pop("one process")["losses"]
    assert len(reference) == steps
    for name, run in runs.items():
        assert run["losses"][0] == pytest.approx(reference[0], abs=1e-7), name
        worst = max(abs(a - b) for a, b in zip(reference, run["losses"], strict=True))
        assert worst <= 1e-6, (name, worst)


def test_the_store_with_caches_is_refused_before_any_rank_starts(data, tmp_path):
    """`--store hybrid --cache-rows` on ranks: one line from the launching process (no
    worker started, so no "workers failed" line after it)."""
    done = _recpipe("train", data[0], "--nproc", 2, "--store", "hybrid", "--cache-rows", 64,
                    "--steps", 1, "--quiet", *MODEL)  # fmt: skip
    assert done.returncode == 1
    one_error_line(done.stderr, "`--cache-rows` 64", "hybrid")
    assert "worker" not in done.stderr
