"""Launching: `recpipe train --nproc N` (torchrun's API), plain `torchrun -m trainer`, and a
worker killed with SIGKILL failing the whole command within a minute."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_cases
import psutil
import pytest
import torch

from trainer.models import ModelConfig

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--batch-size", str(dist_cases.BATCH), "--embedding-dim", "8", "--num-embeddings",
         "1000", "--eval-fraction", "0", "--count-steps", "2", "--no-progress"]  # fmt: skip
MODEL = ModelConfig(embedding_dim=8, num_embeddings=1000)  # what SMALL builds


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _recpipe() -> str:
    return str(Path(sys.executable).with_name("recpipe"))


@pytest.fixture
def server(dist_dataset):
    """`recpipe serve` of the test dataset, as `--shuffle --seed 0 --batch-size 32` serves it."""
    from readers.service import DatasetProducer, ReaderServer, ServiceConfig

    producer = DatasetProducer(str(dist_dataset), batch_size=dist_cases.BATCH, shuffle=True,
                               seed=0, warmup_batches=0)  # fmt: skip
    config = ServiceConfig(readers=0, report_every_s=0)
    with ReaderServer(producer, config=config, log=io.StringIO()) as srv:
        yield "{}:{}".format(*srv.address)


def test_nproc_then_plain_torchrun_resume_at_three_ranks(dist_dataset, tmp_path, server):
    """Save at 2 ranks (`recpipe train --nproc 2`, each rank a client of the reader service),
    resume at 3 (plain torchrun, reading in-process): the rows move to their new owners, the hot
    set comes back, and the losses are those of one process on the same global batches (the
    2-rank job's first 3, then the 3-rank job's)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run.json"
    first = subprocess.run(
        [_recpipe(), "train", str(dist_dataset), "--nproc", "2", "--steps", "3", "--checkpoint",
         str(ckpt), "--json", str(out), "--hot-rows", "40", "--service", server, *SMALL],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["steps"] == 3 and doc["distributed"]["world_size"] == 2
    assert doc["distributed"]["hot_rows"] == 40
    assert doc["distributed"]["exchange"]["steps"] == 6  # 3 steps on each of 2 ranks
    assert "recpipe train: done" in first.stdout
    reader_at_3 = torch.load(ckpt / "checkpoint.pt", weights_only=False)["reader"]
    torchrun = Path(sys.executable).with_name("torchrun")
    second = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "3", "-m", "trainer",
         str(dist_dataset), "--steps", "6", "--checkpoint", str(ckpt), "--resume",
         "--json", str(out), *SMALL],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["steps"] == 6 and doc["distributed"]["world_size"] == 3
    assert doc["distributed"]["hot_rows"] == 40
    assert "(resumed at 3)" in second.stdout
    assert second.stdout.count("recpipe train: done") == 1  # rank 0 reports, the others not
    saved = torch.load(ckpt / "checkpoint.pt", weights_only=False)
    ref = dist_cases.resume_reference(str(dist_dataset), MODEL, reader_at_3, steps=(3, 3))
    for got, want in zip(saved["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    tables = dist_cases.checkpoint_tables(str(ckpt))
    assert dist_cases.compare_tables(tables, ref["tables"]) <= 1e-5


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in launcher.children(recursive=True):
        try:
            if "--launch-spec" in p.cmdline():
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_worker_killed_with_sigkill_fails_the_job_within_a_minute(dist_dataset, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [_recpipe(), "train", str(dist_dataset), "--nproc", "2", "--epochs", "10000",
         "--checkpoint", str(ckpt), "--checkpoint-every", "1", *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (ckpt / "checkpoint.pt").exists():  # training runs: a step was checkpointed
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        workers = _workers(psutil.Process(proc.pid))
        assert len(workers) == 2
        os.kill(workers[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
        assert proc.returncode != 0
        assert "worker(s) failed" in err and "killed by signal 9" in err, err[-3000:]
    finally:
        if proc.poll() is None:
            for p in _workers(psutil.Process(proc.pid)):
                p.kill()
            proc.kill()
            proc.communicate(timeout=30)


def test_a_diverging_multi_rank_run_stops_without_saving(dist_dataset, tmp_path):
    """`--lr 1e30` on 2 ranks: the losses become non-finite; every rank stops at the same step
    (the losses are all-reduced), the command ends in one line naming the step and `--lr`, and
    the checkpoint of the first step, saved before, is still the one on disk."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [_recpipe(), "train", str(dist_dataset), "--nproc", "2", "--steps", "6", "--lr", "1e30",
         "--checkpoint", str(ckpt), "--checkpoint-every", "1",
         "--log-every", "1", *SMALL],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=420,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the training loss is" in proc.stderr and "try a lower `--lr`" in proc.stderr
    state = torch.load(ckpt / "checkpoint.pt", weights_only=False)
    stopped = int(proc.stderr.split("step ")[1].split(":")[0])
    assert 1 <= state["trainer"]["step"] < stopped


def test_the_failure_message_names_the_killed_rank_first_whichever_torchrun_saw_first():
    """A rank killed by a signal leaves no error; the rank that lost it exits 1 a moment later
    and may carry the earlier timestamp (the race CI hit). The signal is the cause."""
    from types import SimpleNamespace

    from trainer.distributed.launch import _failures

    failures = {
        0: SimpleNamespace(exitcode=1, timestamp=100),
        1: SimpleNamespace(exitcode=-9, timestamp=101),
    }
    text = _failures(SimpleNamespace(failures=failures))
    assert text.startswith("rank 1 (killed by signal 9), rank 0 (exit code 1)")
    two_exits = {
        3: SimpleNamespace(exitcode=1, timestamp=7),
        2: SimpleNamespace(exitcode=2, timestamp=5),
    }
    assert _failures(SimpleNamespace(failures=two_exits)).startswith("rank 2 (exit code 2), rank 3")
