"""A checkpoint directory is never wiped, shared, trusted when damaged or resumed by another run
(issue 33, items 4-7 and 10): a fresh run refuses a directory holding a checkpoint unless
``--overwrite``; ``--resume`` needs one; one run at a time holds the directory's lock; every
checkpoint file carries a sha256 checked on load; a non-finite loss stops the run without
saving; a resumed run must have the checkpoint's settings and dataset; a failed write (disk
full) is one line naming the file and keeps the previous checkpoint."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recpipe.errors import RecpipeError
from tests.common.data import synthetic_dataset
from trainer.checkpoint import (
    checkpoint_file,
    checksum_file,
    claim_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.models import ModelConfig
from trainer.train import TrainConfig, train

MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=500, bottom_mlp=(16,), top_mlp=(16,), attention_heads=2
)
# the same run as a `recpipe train` command line (MODEL, batch 128, held-out 0.2)
CLI_MODEL = ["--embedding-dim", "8", "--num-embeddings", "500", "--bottom-mlp", "16",
             "--top-mlp", "16", "--attention-heads", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """3k synthetic requests in row groups of ~512 rows."""
    root = tmp_path_factory.mktemp("ckpt_safety")
    return synthetic_dataset(root, requests=3000, seed=5, files=1, row_group_size=512)


def _config(dataset, checkpoint, **kw) -> TrainConfig:
    base = {"dataset": str(dataset), "batch_size": 128, "eval_fraction": 0.2,
            "eval_batches": 1, "model": MODEL, "checkpoint": None if checkpoint is None else str(checkpoint)}  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _cli(dataset, checkpoint, *extra: str) -> list[str]:
    return ["train", str(dataset), "--batch-size", "128", "--eval-fraction", "0.2",
            "--eval-batches", "1", *CLI_MODEL, "--checkpoint", str(checkpoint), "--quiet",
            *extra]  # fmt: skip


def _digests(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the lock, by its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _step(checkpoint: Path) -> int:
    return load_checkpoint(checkpoint_file(checkpoint))["trainer"]["step"]


@pytest.fixture(scope="module")
def hybrid_run(dataset, tmp_path_factory):
    """A hybrid-store run checkpointed at step 4."""
    ck = tmp_path_factory.mktemp("hybrid") / "ck"
    train(_config(dataset, ck, steps=4, store="hybrid"), progress=False)
    return ck


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# -- item 4: nothing wiped -------------------------------------------------------------------
def test_a_fresh_run_refuses_a_directory_holding_a_checkpoint(
    dataset, hybrid_run, tmp_path, capsys
):
    """It used to exit 0 having replaced the 4-step state and the stores with a 2-step run."""
    from recpipe_cli import main

    ck = _copy(hybrid_run, tmp_path / "ck")
    before = _digests(ck)
    assert main(_cli(dataset, ck, "--store", "hybrid", "--steps", "2")) == 1
    _one_error_line(capsys, f"`--checkpoint` {str(ck)!r} already holds a checkpoint",
                    "--resume continues it, --overwrite replaces it")  # fmt: skip
    assert _digests(ck) == before
    # --overwrite replaces it, told to
    assert main(_cli(dataset, ck, "--store", "hybrid", "--steps", "2", "--overwrite")) == 0
    assert _step(ck) == 2


def test_resume_without_a_checkpoint_fails_and_deletes_nothing(
    dataset, hybrid_run, tmp_path, capsys
):
    """`rm CK/checkpoint.pt; train --resume` used to start at step 0 and delete the stores."""
    from recpipe_cli import main

    ck = _copy(hybrid_run, tmp_path / "ck")
    checkpoint_file(ck).unlink()
    checksum_file(checkpoint_file(ck)).unlink()
    before = _digests(ck)
    assert main(_cli(dataset, ck, "--store", "hybrid", "--steps", "6", "--resume")) == 1
    _one_error_line(capsys, f"`--resume`: {str(ck)!r} holds no checkpoint",
                    "store/ is left by a run that stopped")  # fmt: skip
    assert _digests(ck) == before
    for empty in (tmp_path / "new", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert main(_cli(dataset, empty, "--steps", "2", "--resume")) == 1
        _one_error_line(capsys, f"`--resume`: {str(empty)!r} holds no checkpoint")


def test_overwrite_and_resume_together_are_refused(dataset, tmp_path):
    with pytest.raises(RecpipeError, match="give `resume` or `overwrite`, not both"):
        _config(dataset, tmp_path, resume=True, overwrite=True)
    with pytest.raises(RecpipeError, match="`overwrite` needs a `checkpoint` directory"):
        _config(dataset, None, overwrite=True)


# -- item 5: one run per directory -----------------------------------------------------------
_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, str(os.getpid()).encode(), 0)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_run_on_the_same_directory_fails_at_once(dataset, tmp_path, capsys):
    """Two runs on one checkpoint used to both exit 0 (and corrupt the stores)."""
    from recpipe_cli import main

    ck = tmp_path / "ck"
    ck.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(ck / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(_cli(dataset, ck, "--steps", "1")) == 1
        _one_error_line(capsys, f"{ck} is in use by pid {holder.pid}")
    finally:
        holder.communicate("", timeout=60)
    assert os.listdir(ck) == [".lock"]  # nothing written
    # the holder is gone: its lock file (naming a dead pid) blocks nothing
    assert main(_cli(dataset, ck, "--steps", "1")) == 0
    # while this process runs on it, the directory names this process
    with claim_checkpoint(ck, resume=True, overwrite=False):
        assert main(_cli(dataset, ck, "--steps", "2", "--resume")) == 1
        _one_error_line(capsys, f"{ck} is in use by pid {os.getpid()}")


# -- item 6: checksums, non-finite losses ----------------------------------------------------
def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_file_is_refused_by_name(dataset, tmp_path, capsys):
    """A flipped bit in checkpoint.pt used to change the model silently."""
    from recpipe_cli import main

    ck = tmp_path / "ck"
    train(_config(dataset, ck, steps=2), progress=False)
    path = checkpoint_file(ck)
    assert checksum_file(path).read_text().endswith("  checkpoint.pt\n")
    _flip_bit(path, path.stat().st_size // 2)
    assert main(_cli(dataset, ck, "--steps", "3", "--resume")) == 1
    _one_error_line(capsys, f"{path}: the file does not match its checksum", "damaged")


def test_rank_files_are_checksummed_too(tmp_path):
    """The multi-rank job writes its rank files with `save_checkpoint`: a flipped exponent bit
    in one used to resume into NaN."""
    path = tmp_path / "sparse" / "step-000000004" / "rank-00001-of-00002.pt"
    rows = {"step": 4, "rank": 1, "world_size": 2, "rows": torch.ones(64, 8)}
    save_checkpoint(rows, path)
    assert torch.equal(load_checkpoint(path)["rows"], rows["rows"])
    _flip_bit(path, path.read_bytes().rindex(b"\x80\x3f") + 1)  # a float 1.0's exponent
    with pytest.raises(RecpipeError, match=r"rank-00001-of-00002.pt: the file does not match"):
        load_checkpoint(path)
    checksum_file(path).unlink()
    with pytest.raises(RecpipeError, match=r"rank-00001-of-00002.pt: its checksum .* is missing"):
        load_checkpoint(path)


def test_a_save_stopped_after_its_commit_is_completed_on_load(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1}, path)
    real = os.replace

    def stop_at_the_last_rename(src, dst):
        if Path(dst) == path:
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "replace", stop_at_the_last_rename)
    with pytest.raises(RecpipeError, match="committed and is completed when it is read"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 2  # the checksum names step 2's bytes
    assert load_checkpoint(path)["step"] == 2 and not (tmp_path / "checkpoint.pt.tmp").exists()


def test_a_non_finite_loss_stops_the_run_without_saving(dataset, tmp_path, capsys):
    """`--lr inf` (or a huge one) used to train to NaN, save a NaN checkpoint and exit 0."""
    from recpipe_cli import main

    ck = tmp_path / "ck"
    args = _cli(dataset, ck, "--steps", "6", "--checkpoint-every", "1", "--optimizer", "sgd")
    assert main([*args, "--lr", "1e30"]) == 1
    line = _one_error_line(capsys, "the training loss is nan", "try a lower `--lr` (it is 1e+30)")
    assert line.startswith("recpipe train: error: step 2:")  # step 1's update broke the model
    assert _step(ck) == 1  # the last finite checkpoint, not a NaN one
    state = load_checkpoint(checkpoint_file(ck))
    assert all(torch.isfinite(v).all() for v in state["trainer"]["model"].values())
    with pytest.raises(SystemExit) as exc:
        main([*_cli(dataset, tmp_path / "inf", "--steps", "2"), "--lr", "inf"])
    assert exc.value.code == 2
    assert "`--lr` must be a finite number > 0, got inf" in capsys.readouterr().err


# -- item 7: the same run --------------------------------------------------------------------
@pytest.fixture(scope="module")
def module_run(dataset, tmp_path_factory):
    """A run with the tables in the module, checkpointed at step 2."""
    ck = tmp_path_factory.mktemp("module") / "ck"
    train(_config(dataset, ck, steps=2), progress=False)
    return ck


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--embedding-dim", "16"], "`--embedding-dim`: the checkpoint {ck!r} was trained with 8, this run gives 16"),
        (["--bottom-mlp", "32"], "`--bottom-mlp`: the checkpoint {ck!r} was trained with 16, this run gives 32"),
        (["--optimizer", "sgd"], "`--optimizer`: the checkpoint {ck!r} was trained with 'adagrad', this run gives 'sgd'"),
        (["--store", "hybrid"], "`--store`: the checkpoint {ck!r} was trained with 'module', this run gives 'hybrid'"),
        (["--seed", "1"], "`--seed`: the checkpoint {ck!r} was trained with 0, this run gives 1"),
        (["--eval-fraction", "0.1"], "`--eval-fraction`: the checkpoint {ck!r} was trained with 0.2, this run gives 0.1"),
    ],
)  # fmt: skip
def test_resume_with_other_settings_names_the_flag(
    dataset, module_run, tmp_path, capsys, extra, needle
):
    """These used to end in raw state_dict / KeyError tracebacks, or (--seed, --eval-fraction)
    to resume with the held-out split moved."""
    from recpipe_cli import main

    ck = _copy(module_run, tmp_path / "ck")
    before = _digests(ck)
    assert main(_cli(dataset, ck, "--steps", "3", "--resume", *extra)) == 1  # the last one counts
    _one_error_line(capsys, needle.format(ck=str(checkpoint_file(ck))))
    assert _digests(ck) == before


def test_resume_on_another_dataset_is_refused(dataset, module_run, tmp_path, capsys):
    from recpipe_cli import main

    other = synthetic_dataset(tmp_path / "other", requests=1500, seed=6, files=1,
                              row_group_size=512)  # fmt: skip
    ck = _copy(module_run, tmp_path / "ck")
    assert main(_cli(other, ck, "--steps", "3", "--resume")) == 1
    _one_error_line(capsys, f"`DATASET` {str(other)!r} is not the dataset the checkpoint")
    # the same dataset elsewhere is the same dataset; lr and steps may change on resume
    moved = _copy(dataset, tmp_path / "moved")
    assert main(_cli(moved, ck, "--steps", "3", "--resume", "--lr", "0.01")) == 0
    assert _step(ck) == 3


# -- item 10: a failed write ----------------------------------------------------------------
def _fail_fsync_of(monkeypatch, suffix: str, *, after: int = 0) -> None:
    """``os.fsync`` of a file whose path ends with ``suffix`` fails with ENOSPC (after
    ``after`` successful ones)."""
    real, seen = os.fsync, [0]

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.endswith(suffix):
            seen[0] += 1
            if seen[0] > after:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_disk_full_while_saving_keeps_the_previous_checkpoint(
    dataset, tmp_path, monkeypatch, capsys
):
    """It used to end in a raw OSError traceback."""
    from recpipe_cli import main

    ck = tmp_path / "ck"
    _fail_fsync_of(monkeypatch, "checkpoint.pt.tmp", after=1)  # the save of step 2 works
    assert main(_cli(dataset, ck, "--steps", "4", "--checkpoint-every", "2")) == 1
    monkeypatch.undo()
    path = checkpoint_file(ck)
    _one_error_line(capsys, f"{path}: cannot write the checkpoint: No space left on device "
                    "(the disk is full); the previous checkpoint is kept")  # fmt: skip
    assert _step(ck) == 2 and sorted(os.listdir(ck)) == [".lock", "checkpoint.pt",
                                                         "checkpoint.pt.sha256"]  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_disk_full_in_an_embedding_store_is_one_line(
    dataset, hybrid_run, tmp_path, monkeypatch, capsys
):
    from recpipe_cli import main

    ck = _copy(hybrid_run, tmp_path / "ck")
    _fail_fsync_of(monkeypatch, "rows.bin")
    assert main(_cli(dataset, ck, "--store", "hybrid", "--steps", "6", "--resume")) == 1
    monkeypatch.undo()
    _one_error_line(capsys, f"{ck / 'store'}", "cannot write the embedding store's checkpoint "
                    "of step 6: No space left on device; the previous checkpoint is kept")  # fmt: skip
    assert _step(ck) == 4


# -- --device -----------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu0", ""])
def test_a_nonsense_device_is_a_usage_error(dataset, tmp_path, capsys, device):
    """`--device tpu` used to end in torch's raw RuntimeError traceback."""
    from recpipe_cli import main

    with pytest.raises(SystemExit) as exc:
        main([*_cli(dataset, tmp_path / "ck", "--steps", "1"), "--device", device])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: `--device` must be cpu, cuda or cuda:N, got {device!r}" in err


# -- a multi-rank launch -------------------------------------------------------------------
def test_a_multi_rank_launch_claims_its_checkpoint_before_any_worker(
    dataset, module_run, tmp_path, capsys
):
    """`recpipe train --nproc N` used to replace a checkpoint as one process did; its launcher
    now checks the directory (and the settings of a resume) before starting a worker."""
    from recpipe_cli import main

    ck = _copy(module_run, tmp_path / "ck")
    before = _digests(ck)
    assert main([*_cli(dataset, ck, "--steps", "3"), "--nproc", "2"]) == 1
    _one_error_line(capsys, f"`--checkpoint` {str(ck)!r} already holds a checkpoint")
    assert main([*_cli(dataset, ck, "--steps", "3", "--resume"), "--nproc", "2",
                 "--embedding-dim", "16"]) == 1  # fmt: skip
    _one_error_line(capsys, "`--embedding-dim`: the checkpoint", "was trained with 8")
    with claim_checkpoint(ck, resume=True, overwrite=False):
        assert main([*_cli(dataset, ck, "--steps", "3", "--resume"), "--nproc", "2"]) == 1
        _one_error_line(capsys, f"{ck} is in use by pid {os.getpid()}")
    assert _digests(ck) == before
