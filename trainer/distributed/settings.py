"""The ranks of a job agree on what they run: settings and dataset, checked at start-up.

Ranks started with another ``--lr``, ``--seed`` or ``--hot-rows`` would train apart without a
word, and ranks started on another dataset or with other ``--steps`` would wait for each other
until ``--dist-timeout``. So, right after the process group forms and before any other work,
every rank sends a digest of its settings to every other::

    every rank: SHA-256 of its settings (sorted JSON) -> all_gather of 32 bytes
    all equal: go on
    any differs: all_gather the settings themselves (a small JSON) -> every rank raises the
                 same DistributedError, naming each differing setting (as its flag) and every
                 rank's value

Both exchanges are collectives of the job's group, bounded by its timeout. The settings are the
run's options (:class:`~trainer.config.TrainConfig`, the model's, the exchange's), except what
each rank may set for itself (:data:`LOCAL`); the dataset counts by its identity (the files its
manifest lists: a copy of the same data elsewhere is the same dataset), and so do the files a
run reads (``--preprocess``, ``--dedup-groups``, a tower plan) by their bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any

import torch

from trainer.distributed.comm import Comm, DistributedError

__all__ = ["LOCAL", "check_same_settings", "job_settings"]

#: Options each rank may set for itself: local resources (its threads, its readers' read-ahead
#: and checks, which change no batch) and rank 0's own outputs.
LOCAL: tuple[str, ...] = ("workers", "metrics", "tensorboard", "threads", "read_ahead", "verify")

_FLAGS = {"dataset": "DATASET", "timeout_s": "--dist-timeout", "towers": "--towers"}
_MAX_LISTED = 4  # settings named in one message


def _flag(name: str) -> str:
    return _FLAGS.get(name) or "--" + name.replace("_", "-")


def _file(path: str | os.PathLike[str] | None) -> Any:
    """A file the run reads, compared by its bytes (``None``, or a value that is not a file,
    as given)."""
    if path is None or not os.path.isfile(path):
        return path
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    return {"shown": f"{os.fspath(path)!r} (sha256 {digest[:12]})", "same": digest}


def _dataset(path: str | os.PathLike[str]) -> dict[str, Any]:
    from trainer.checkpoint import dataset_identity

    identity = dataset_identity(path)
    shown = f"files {identity[:12]}" if identity else "no readable manifest"
    return {"shown": f"{os.fspath(path)!r} ({shown})", "same": identity or os.fspath(path)}


def job_settings(config: Any, options: Any = None, **files: str | None) -> dict[str, Any]:
    """What the ranks of a job must share, JSON-ready.

    Args:
        config: the run (a :class:`~trainer.config.TrainConfig`): its fields but :data:`LOCAL`,
            the model's but its seed (the run's ``seed`` replaces it), the device's type (each
            rank has its own device), whether it reads from a service (each rank may reach it
            at another address), its dataset by identity and its files by their bytes.
        options: the exchange's (a dataclass, e.g.
            :class:`~trainer.distributed.config.DistributedConfig`), or ``None``.
        files: more files the run reads, by name (e.g. ``towers=`` a tower plan).

    Returns:
        ``{setting: value}``; a file or the dataset is ``{"shown": ..., "same": ...}`` (only
        ``same`` is compared).
    """
    out: dict[str, Any] = {}
    for f in fields(config):
        if f.name in LOCAL or f.name == "model":
            continue
        out[f.name] = getattr(config, f.name)
    out.update({k: v for k, v in asdict(config.model).items() if k != "seed"})
    out["device"] = str(config.device).split(":", 1)[0]
    out["service"] = config.service is not None
    out["dataset"] = _dataset(config.dataset)
    for name in ("preprocess", "dedup_groups"):
        out[name] = _file(out[name])
    if options is not None:
        out.update(asdict(options) if is_dataclass(options) else dict(options))
    out.update({name: _file(path) for name, path in files.items()})
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def _same(value: Any) -> Any:
    return value["same"] if isinstance(value, Mapping) and "same" in value else value


def _shown(value: Any) -> str:
    if isinstance(value, Mapping) and "shown" in value:
        return str(value["shown"])
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if value else "(none)"
    if value is None:
        return "(not given)"
    return repr(value) if isinstance(value, str) else str(value)


def _digest(settings: Mapping[str, Any]) -> bytes:
    same = {k: _same(v) for k, v in settings.items()}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).digest()


def check_same_settings(comm: Comm, settings: Mapping[str, Any]) -> None:
    """Refuse, on every rank, a job whose ranks were started with other settings (collective:
    every rank calls it, with its own :func:`job_settings`).

    Raises:
        DistributedError: naming each differing setting by its flag and every rank's value;
            or a rank died or hung (the group's timeout).
    """
    what = "the start-up check of the ranks' settings"
    mine = torch.frombuffer(bytearray(_digest(settings)), dtype=torch.uint8)
    digests = comm.all_gather(mine, what=what)
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    text = torch.frombuffer(bytearray(json.dumps(dict(settings)).encode()), dtype=torch.uint8)
    every = [json.loads(bytes(t.tolist()).decode()) for t in comm.all_gather_rows(text, what=what)]
    parts = []
    for name in sorted({k for s in every for k in s}):
        values = [s.get(name) for s in every]
        if all(_same(v) == _same(values[0]) for v in values):
            continue
        ranks: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            ranks.setdefault(_shown(value), []).append(rank)
        listed = ", ".join(
            f"{shown} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
            for shown, rs in ranks.items()
        )
        parts.append(f"`{_flag(name)}` {listed}")
    more = f"; and {len(parts) - _MAX_LISTED} more" if len(parts) > _MAX_LISTED else ""
    msg = (
        f"the {comm.world_size} ranks were started with different settings: "
        + "; ".join(parts[:_MAX_LISTED])
        + more
        + "\nhint: start every rank with the same options and the same dataset"
    )
    raise DistributedError(msg)
