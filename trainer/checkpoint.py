"""Training checkpoints on disk: one file holding a run's whole state at a step boundary, its
checksum, the directory's lock, and the checks that a run may write or resume it.

``DIR/checkpoint.pt`` (``torch.save``) holds ``version``, ``trainer`` (model, optimizers, step),
``reader`` (the loader's position), ``rng`` (:func:`rng_state`), the run's history, its config
and its dataset's identity. Embedding stores checkpoint themselves (``trainer.store``); the
training loop commits them before it saves this file. ``DIR`` holds::

    checkpoint.pt          the state (torch.save)
    checkpoint.pt.sha256   its sha256, in ``sha256sum`` format: the commit record
    store/<table>/         hybrid runs: the embedding stores
    .lock                  held (``flock``) by the run using DIR

Every file :func:`save_checkpoint` writes (the multi-rank job's rank files too) gets a
``.sha256`` beside it and :func:`load_checkpoint` checks it, so a damaged file is refused by
name. A save writes ``NAME.tmp`` (fsynced), then the new checksum (fsynced, renamed: the commit
point), then renames ``NAME.tmp`` into place; a crash before the commit leaves the previous
file and checksum, after it the load finishes the rename. Disk full or another write error is
one :class:`~recpipe.errors.RecpipeError` naming the file, and the previous checkpoint stays.

A run takes ``DIR``'s lock for its whole length (:func:`claim_checkpoint`): a second run on the
same directory is refused at once, naming the holder's pid; the kernel drops the lock of a
process that dies, so a stale lock file blocks nothing. A run that does not ``resume`` refuses a
directory that already holds a checkpoint unless told to ``overwrite`` it, and ``resume`` with
no checkpoint is an error. A resumed run must be the same run: :func:`check_resume` compares the
recorded settings and dataset identity with the ones given.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import random
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.config import ModelConfig, TrainConfig

__all__ = [
    "CHECKPOINT_FILE",
    "CHECKPOINT_VERSION",
    "LOCK_FILE",
    "check_resume",
    "checkpoint_file",
    "checksum_file",
    "claim_checkpoint",
    "dataset_identity",
    "global_batch_change",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "settings_from_checkpoint",
]

_log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_VERSION = 2  # 2: a .sha256 beside every file, the dataset's identity recorded
LOCK_FILE = ".lock"
_OWNED_DIRS = ("store", "sparse")  # hybrid stores; the multi-rank job's rank files


def checkpoint_file(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint file of a checkpoint directory."""
    return Path(directory) / CHECKPOINT_FILE


def checksum_file(path: str | os.PathLike[str]) -> Path:
    """The ``.sha256`` file recording the digest of a file :func:`save_checkpoint` wrote."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def _tmp_file(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def rng_state() -> dict[str, Any]:
    """The torch, NumPy and Python RNG states (and CUDA's when there is a device)."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------------------------------
# one file and its checksum


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _write_error(path: Path, exc: OSError, *, kept: bool) -> RecpipeError:
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why += " (the disk is full)"
    then = (
        "the previous checkpoint is kept"
        if kept
        else "the new checkpoint is committed and is completed when it is read"
    )
    return RecpipeError(f"{path}: cannot write the checkpoint: {why}; {then}")


def save_checkpoint(state: Mapping[str, Any], path: Path) -> None:
    """Write ``state`` (tagged with :data:`CHECKPOINT_VERSION`) to ``path`` atomically and
    durably, with its sha256 in :func:`checksum_file` (see the module docstring for the order).

    Raises:
        RecpipeError: the file cannot be written (disk full, permissions): naming ``path``;
            the previous file and its checksum are left as they were.
    """
    buffer = io.BytesIO()
    torch.save({**state, "version": CHECKPOINT_VERSION}, buffer)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    tmp, record = _tmp_file(path), checksum_file(path)
    record_tmp = _tmp_file(record)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_synced(tmp, data)
        _write_synced(record_tmp, f"{digest}  {path.name}\n".encode())
    except OSError as exc:
        for leftover in (tmp, record_tmp):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)
        raise _write_error(path, exc, kept=True) from None
    try:
        os.replace(record_tmp, record)  # the commit point
    except OSError as exc:
        with contextlib.suppress(OSError):
            record_tmp.unlink(missing_ok=True)
        raise _write_error(path, exc, kept=True) from None
    try:
        _fsync_dir(path.parent)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise _write_error(path, exc, kept=False) from None


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"{path}: cannot read the checkpoint: {exc.strerror or exc}"
        raise RecpipeError(msg) from None


def _recorded_digest(path: Path) -> str:
    record = checksum_file(path)
    text = _read_bytes(record)
    if text is None:
        msg = (
            f"{path}: its checksum {record.name} is missing (written by a recpipe before "
            f"checkpoints were checksummed, or copied without it): the file cannot be checked"
        )
        raise RecpipeError(msg)
    digest = text.decode("ascii", "replace").split(" ", 1)[0].strip()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        msg = f"{record}: not a sha256 record, got {text[:80]!r}"
        raise RecpipeError(msg)
    return digest


def load_checkpoint(
    path: Path, *, map_location: torch.device | str = "cpu"
) -> dict[str, Any] | None:
    """The saved state, checked against its sha256; ``None`` when there is none yet.

    Raises:
        RecpipeError: the file or its checksum is missing or unreadable, the bytes do not match
            the checksum (naming the file), or it is not a recpipe checkpoint of this version.
    """
    tmp = _tmp_file(path)
    if not path.exists() and not checksum_file(path).exists():
        return None
    recorded = _recorded_digest(path)
    data = _read_bytes(path)
    actual = None if data is None else hashlib.sha256(data).hexdigest()
    if actual != recorded:
        pending = _read_bytes(tmp)
        if pending is not None and hashlib.sha256(pending).hexdigest() == recorded:
            # a save stopped between its commit and its rename: finish it
            with contextlib.suppress(OSError):
                os.replace(tmp, path)
            data, actual = pending, recorded
        elif data is None:
            msg = f"{path}: missing, though its checksum {checksum_file(path).name} is there"
            raise RecpipeError(msg)
        else:
            msg = (
                f"{path}: the file does not match its checksum (sha256 {actual[:12]}..., "
                f"{checksum_file(path).name} records {recorded[:12]}...): it is damaged"
            )
            raise RecpipeError(msg)
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as exc:  # a foreign file with a matching checksum
        msg = f"{path}: cannot read the checkpoint: {exc}"
        raise RecpipeError(msg) from exc
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        msg = f"{path}: not a recpipe training checkpoint (version {CHECKPOINT_VERSION})"
        raise RecpipeError(msg)
    return state


# -------------------------------------------------------------------------------------------
# the directory: lock, fresh / resume / overwrite


def _owned(directory: Path) -> list[str]:
    """What of a checkpoint is in ``directory`` (names, sorted)."""
    path = checkpoint_file(directory)
    names = [path.name, checksum_file(path).name, *_OWNED_DIRS]
    return sorted(n + "/" * (directory / n).is_dir() for n in names if (directory / n).exists())


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    lock = directory / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        msg = f"`--checkpoint` {str(directory)!r}: cannot create its lock file {LOCK_FILE}: {exc.strerror or exc}"
        raise RecpipeError(msg) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            msg = (
                f"{directory} is in use by pid {holder} (it holds {lock}); wait for that run "
                "to end, or give another `--checkpoint`"
            )
            raise RecpipeError(msg) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def claim_checkpoint(
    directory: str | os.PathLike[str] | None, *, resume: bool, overwrite: bool
) -> Iterator[None]:
    """Hold ``directory``'s lock while the block runs, after checking that a run may use it:
    with ``resume`` it must hold a checkpoint; without, it must hold none, unless ``overwrite``
    (the old checkpoint, its stores and rank files are then removed, the commit record first).
    ``None``: no checkpoint directory, nothing to check.

    Raises:
        RecpipeError: the directory cannot be created or locked, another run holds it (naming
            its pid), ``resume`` finds no checkpoint, or a fresh run finds one.
    """
    if directory is None:
        yield
        return
    root = Path(directory)
    if root.exists() and not root.is_dir():
        msg = f"`--checkpoint` {str(root)!r} is a file, not a directory"
        raise RecpipeError(msg)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"`--checkpoint` {str(root)!r}: cannot create the directory: {exc.strerror or exc}"
        raise RecpipeError(msg) from None
    with _locked(root):
        owned = _owned(root)
        path = checkpoint_file(root)
        has_state = path.exists() or checksum_file(path).exists()
        if resume and not has_state:
            left = f"; {', '.join(owned)} is left by a run that stopped before its first checkpoint"
            msg = (
                f"`--resume`: {str(root)!r} holds no checkpoint ({path.name} is missing"
                f"{left if owned else ''}); run without --resume"
                + (" and with --overwrite" if owned else "")
                + " to start afresh"
            )
            raise RecpipeError(msg)
        if not resume and owned:
            if not overwrite:
                msg = (
                    f"`--checkpoint` {str(root)!r} already holds a checkpoint "
                    f"({', '.join(owned)}); --resume continues it, --overwrite replaces it"
                )
                raise RecpipeError(msg)
            _remove_checkpoint(root)
        yield


def _remove_checkpoint(root: Path) -> None:
    path = checkpoint_file(root)
    _log.info("--overwrite: removing the checkpoint in %s", root)
    try:
        for name in (checksum_file(path), path, _tmp_file(path), _tmp_file(checksum_file(path))):
            name.unlink(missing_ok=True)
        for name in _OWNED_DIRS:
            if (root / name).exists():
                shutil.rmtree(root / name)
    except OSError as exc:
        msg = f"`--overwrite`: cannot remove the checkpoint in {str(root)!r}: {exc}"
        raise RecpipeError(msg) from None


# -------------------------------------------------------------------------------------------
# the same run: settings and dataset


def dataset_identity(dataset: str | os.PathLike[str]) -> str | None:
    """A digest of the dataset's files as its ``_manifest.json`` lists them (path, rows, bytes,
    sha256): the same data gives the same identity wherever it lies; ``None`` without a
    readable manifest."""
    from recpipe.errors import DataError
    from recpipe.integrity import listed_files, read_manifest

    root = Path(dataset)
    if not root.is_dir():
        return None
    try:
        files = listed_files(read_manifest(root), source=str(root))
    except DataError:
        return None
    rows = sorted((f.path, f.rows, f.bytes, f.sha256 or "") for f in files)
    return hashlib.sha256(repr(rows).encode()).hexdigest()


# TrainConfig fields a resumed run must share with its checkpoint (the model's too, but seed,
# which `seed` replaces): the model's shape, the optimizer's state, the held-out split, the
# readers' position. lr, steps, epochs, dedup on/off, device and the logging may change.
_SAME_RUN = ("store", "optimizer", "seed", "eval_fraction", "batch_size", "dedup_groups",
             "workers")  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) if value else "(none)"
    if value is None:
        return "(not given)"
    return repr(value) if isinstance(value, str) else str(value)


def _normal(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_normal(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _normal(v)) for k, v in value.items()))
    return value


# what a resumed run takes from its checkpoint unless its command line sets it
_INHERITED = ("store", "optimizer", "lr", "seed", "eval_fraction", "dedup_groups", "shuffle",
              "batch_size")  # fmt: skip


def settings_from_checkpoint(
    state: Mapping[str, Any], config: TrainConfig, *, explicit: Iterable[str], world_size: int = 1
) -> TrainConfig:
    """``config`` with the settings its checkpoint ``state`` was trained with, except those
    ``explicit`` names (written on the command line: :func:`check_resume` then refuses one
    that contradicts the checkpoint, naming the flag). The model's settings and the run's
    (:data:`_INHERITED`) are taken; the batch size as the saved global batch over
    ``world_size`` ranks, where it divides."""
    from dataclasses import replace

    saved, model = state.get("config"), state.get("model_config")
    if not isinstance(saved, Mapping) or not isinstance(model, Mapping):
        return config
    given = set(explicit)
    run: dict[str, Any] = {}
    for name in _INHERITED:
        if name in given or name not in saved:
            continue
        value = saved[name]
        if name == "batch_size":
            saved_world = int(
                state.get("world_size") or (state.get("layout") or {}).get("world_size") or 1
            )
            total = int(value) * saved_world
            if total % world_size:
                continue  # check_resume says what to do
            value = total // world_size
        run[name] = value
    known = {f.name for f in fields(ModelConfig)}
    net = {k: _as_field(v) for k, v in model.items() if k in known and k not in given}
    net.pop("seed", None)
    return replace(config, **run, model=replace(config.model, **net))


def _as_field(value: Any) -> Any:
    """A saved setting as its config field holds it (lists were tuples)."""
    return tuple(_as_field(v) for v in value) if isinstance(value, list) else value


def global_batch_change(
    state: Mapping[str, Any], config: TrainConfig, *, path: Path, world_size: int = 1
) -> str | None:
    """The warning for a resume at another global batch size (``batch_size`` per rank times
    the ranks) than the checkpoint's, or ``None``: such a run goes on from the same row of the
    epoch, but its steps are not the ones an uninterrupted run would have taken."""
    saved = state.get("config") or {}
    saved_world = int(state.get("world_size") or (state.get("layout") or {}).get("world_size") or 1)
    was = int(saved.get("batch_size") or 0) * saved_world
    now = config.batch_size * world_size
    if was == now:
        return None
    return (
        f"{path}: trained on global batches of {was} rows ({saved.get('batch_size')} per rank x "
        f"{saved_world}); this run reads {now} ({config.batch_size} x {world_size}): it goes on "
        "from the same row of the epoch, but its steps are not the ones an uninterrupted run "
        "would have taken"
    )


def check_resume(
    state: Mapping[str, Any],
    config: TrainConfig,
    *,
    path: Path,
    multi_rank: bool = False,
    world_size: int = 1,
) -> None:
    """Refuse to resume ``state`` (read from ``path``) with settings or a dataset other than
    the ones it was trained with, at ``world_size`` ranks.

    A job resumes at another number of ranks, in process or from a reader service, with any
    ``workers``; with the same global batch (``batch_size`` per rank times the ranks) it takes
    the steps an uninterrupted run takes, with another it goes on from the same row of the
    epoch (:func:`global_batch_change` says so). Only a run reading with
    ``on_error="skip"`` (the library's loader, whose position is its workers') must resume
    with its ``workers`` and its source. ``multi_rank`` is accepted for older callers.

    Raises:
        RecpipeError: naming the first setting that differs (as its flag), the checkpoint's
            value and the given one; or the dataset, when its identity differs.
    """
    del multi_rank
    saved, model = state.get("config"), state.get("model_config")
    if not isinstance(saved, Mapping) or not isinstance(model, Mapping):
        msg = f"{path}: records no settings of its run: not a checkpoint of `recpipe train`"
        raise RecpipeError(msg)
    given = asdict(config)
    library = saved.get("on_error", "raise") != "raise" or config.on_error != "raise"
    same = [n for n in _SAME_RUN if n != "batch_size" and (library or n != "workers")]
    pairs = [(name, saved.get(name), given[name]) for name in same]
    if library:
        pairs.append(("service", saved.get("service") is not None, config.service is not None))
    pairs += [
        (f.name, model.get(f.name), getattr(config.model, f.name))
        for f in fields(ModelConfig)
        if f.name != "seed"
    ]
    for name, was, now in pairs:
        if _normal(was) == _normal(now):
            continue
        if name == "service":
            was, now = (("a service" if v else "the dataset in-process") for v in (was, now))
            msg = (
                f"`--service`: the checkpoint {str(path)!r} was trained reading from {was}, "
                f"this run reads from {now}"
            )
        else:
            flag = "the model's `tables`" if name == "tables" else f"`{_flag(name)}`"
            msg = (
                f"{flag}: the checkpoint {str(path)!r} was trained with {_show(was)}, this run "
                f"gives {_show(now)}; resume with the checkpoint's value, or start afresh with "
                "--overwrite"
            )
        raise RecpipeError(msg)
    was = state.get("dataset_id")
    now = dataset_identity(config.dataset)
    if was is not None and now is not None and was != now:
        msg = (
            f"`DATASET` {config.dataset!r} is not the dataset the checkpoint {str(path)!r} was "
            f"trained on (its manifest lists other files: identity {now[:12]}..., the "
            f"checkpoint's {was[:12]}...)"
        )
        raise RecpipeError(msg)
