"""Checkpoints of a multi-rank job: consistent at a step boundary, resumable at any world size.

Layout of a checkpoint directory::

    checkpoint.pt                            rank 0, written last (atomic rename): the step, the
                                             world size, the dense model and optimizers, the
                                             readers' position, losses, the hot sets, and
                                             ``sparse`` = the folder below
    sparse/step-000000120/
        rank-00000-of-00002.pt               each rank's header: its step, and per table where
        rank-00000-of-00002.rows             its rows lie in the .rows file next to it
        rank-00001-of-00002.pt               every row the rank owns (hot ones included, from
        rank-00001-of-00002.rows             its replica): ids + values + optimizer state

A save is collective: every rank writes its ``.rows`` file (to a temporary name, fsynced,
renamed), then its header (:func:`trainer.checkpoint.save_checkpoint`: checksummed), all ranks
meet, then rank 0 writes ``checkpoint.pt`` naming the folder and removes older folders. A crash
before that rename leaves the previous ``checkpoint.pt`` and its folder intact, so the last
complete checkpoint is always whole.

**Rows by bucket.** A ``.rows`` file holds each table's rows as fixed-size records (every
per-row field of the table's entry, side by side), grouped by *bucket* ``owner_of(id, M)`` for
a modulus ``M`` that many world sizes divide (5040 for big tables, fewer for small ones)::

    table t:  | bucket b0 rows | bucket b1 rows | ... |   records of row_bytes each
    header:   starts [M + 1] (first row of each bucket), crc32 [M] (of each bucket's bytes)

Since ``owner_of(id, W) = h % W`` and ``owner_of(id, M) = h % M`` for the same hash ``h``, the
rows rank ``r`` owns at ``W`` ranks are in the buckets ``b`` with ``b % g == r % g``,
``g = gcd(W, M)``: every ``W`` dividing ``M`` (1-10, 12, 14, 15, 16, 18, 20, 21, 24, ...) reads
exactly its own rows, any other ``W`` a ``1/g`` share that holds them. Buckets are ordered by
their residues modulo 16, 9, 5 and 7 in turn, so that a small ``W``'s buckets are long runs of
the file, read with one ``pread`` each and checked against their crc32.

Resuming at another world size: every rank reads every saved rank's header and, of its
``.rows`` file, the byte ranges of its buckets; it keeps the rows it owns now
(``owner_of(id, W)``); the hot sets are installed again from their new owners. A checkpoint
written before this layout (``rows`` inside each rank's ``.pt``) still loads: each rank reads
every rank file whole, as it did then.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import shutil
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recpipe.errors import RecpipeError
from trainer.checkpoint import CHECKPOINT_FILE, checksum_file, load_checkpoint
from trainer.checkpoint import save_checkpoint as save_state
from trainer.distributed.comm import Comm
from trainer.distributed.exchange import ShardedEmbeddings
from trainer.distributed.shard import owner_of

__all__ = [
    "CHECKPOINT_FILE",
    "SparseReads",
    "bucket_modulus",
    "load_sparse",
    "read_checkpoint",
    "read_part",
    "save_checkpoint",
    "save_parts",
]

_log = logging.getLogger(__name__)

KIND = "distributed"
ROWS_SUFFIX = ".rows"

_MODULI = (5040, 720, 240, 48, 12, 6, 2, 1)  # 5040 = 16 * 9 * 5 * 7; each divides the one before
_ROWS_PER_BUCKET = 16  # a table gets the largest modulus with at least this many rows a bucket


@dataclass
class SparseReads:
    """What reading a checkpoint's rank files cost one rank.

    Attributes:
        bytes: bytes read (headers, their checksums, and the rows' byte ranges).
        files: rank files opened.
    """

    bytes: int = 0
    files: int = 0


def _rank_file(folder: Path, rank: int, world_size: int) -> Path:
    return folder / f"rank-{rank:05d}-of-{world_size:05d}.pt"


# -------------------------------------------------------------------------------------------
# rows by bucket


def bucket_modulus(rows: int) -> int:
    """The bucket modulus ``M`` of a table of ``rows`` rows: the largest of 5040, 720, 240,
    48, 12, 6, 2, 1 that leaves at least 16 rows a bucket on average."""
    return next(m for m in _MODULI if m * _ROWS_PER_BUCKET <= rows or m == 1)


def _prime_powers(n: int) -> list[int]:
    powers, p = [], 2
    while n > 1:
        q = 1
        while n % p == 0:
            n, q = n // p, q * p
        if q > 1:
            powers.append(q)
        p += 1
    return powers


@functools.cache
def _bucket_positions(modulus: int) -> np.ndarray:
    """Where bucket ``b`` sits in a table's order: buckets sorted by ``b % 16`` (the power of
    two dividing ``modulus``), then ``b % 9``, ``b % 5``, ``b % 7``."""
    b = np.arange(modulus, dtype=np.int64)
    keys = [b % q for q in _prime_powers(modulus)]
    order = np.lexsort(keys[::-1]) if keys else b
    positions = np.empty(modulus, dtype=np.int64)
    positions[order] = b
    return positions


def _runs(modulus: int, owned: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The position ranges ``[p0, p1)`` of the buckets that hold rank ``owned[0]``'s rows at
    ``owned[1]`` ranks (every bucket when ``owned`` is ``None``)."""
    if owned is None:
        return [(0, modulus)]
    rank, world = owned
    g = math.gcd(world, modulus)
    b = np.arange(modulus, dtype=np.int64)
    at = np.sort(_bucket_positions(modulus)[b[b % g == rank % g]])
    cuts = np.flatnonzero(np.diff(at) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(at, cuts) if run.size]


def _flatten(entry: Mapping[str, Any], rows: int, path: tuple[str, ...] = ()) -> tuple[
    list[tuple[tuple[str, ...], torch.Tensor, bool]], list[tuple[tuple[str, ...], Any]]
]:  # fmt: skip
    """A table's entry as per-row fields ``(path, [rows, ...] tensor, was numpy)`` and the rest
    ``(path, value)`` (``None``, scalars, anything not one value per row)."""
    fields, other = [], []
    for key, value in entry.items():
        at = (*path, str(key))
        if isinstance(value, Mapping):
            f, o = _flatten(value, rows, at)
            fields += f
            other += o
        elif isinstance(value, np.ndarray) and value.ndim and value.shape[0] == rows:
            fields.append((at, torch.from_numpy(np.ascontiguousarray(value)), True))
        elif isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            fields.append((at, value.detach().cpu().contiguous(), False))
        else:
            other.append((at, value))
    return fields, other


def _nest(out: dict[str, Any], path: tuple[str, ...] | list[str], value: Any) -> None:
    for key in path[:-1]:
        out = out.setdefault(key, {})
    out[path[-1]] = value


def _table_records(name: str, entry: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """One table's rows as ``[rows, row_bytes]`` uint8 records in bucket order, and its index
    (without the file offset)."""
    if "ids" not in entry:
        msg = f"table {name!r}: the rows to save have no `ids` (they hold {sorted(entry)!r})"
        raise RecpipeError(msg)
    ids = np.asarray(entry["ids"], dtype=np.int64).reshape(-1)
    n = int(ids.size)
    fields, other = _flatten(entry, n)
    modulus = bucket_modulus(n)
    pos = _bucket_positions(modulus)[owner_of(ids, modulus)]
    order = torch.from_numpy(np.lexsort((ids, pos)))
    columns, described, at = [], [], 0
    for path, value, was_numpy in fields:
        per_row = math.prod(value.shape[1:])
        width = per_row * value.element_size()
        columns.append(value[order].reshape(n, per_row).view(torch.uint8).numpy())
        described.append({"path": list(path), "dtype": str(value.dtype).removeprefix("torch."),
                          "shape": list(value.shape[1:]), "at": at, "bytes": width,
                          "numpy": was_numpy})  # fmt: skip
        at += width
    records = (
        np.ascontiguousarray(np.concatenate(columns, axis=1))
        if columns
        else np.zeros((n, 0), np.uint8)
    )
    starts = np.concatenate([[0], np.cumsum(np.bincount(pos, minlength=modulus))]).astype(np.int64)
    crc = np.array([zlib.crc32(records[starts[p] : starts[p + 1]].data) for p in range(modulus)],
                   dtype=np.uint32)  # fmt: skip
    index = {"rows": n, "row_bytes": at, "fields": described, "other": other,
             "modulus": modulus, "starts": starts, "crc": crc}  # fmt: skip
    return records, index


def _write_rows(path: Path, rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Write every table's records to ``path`` (temporary name, fsynced, renamed); the index."""
    tmp = path.with_name(path.name + ".tmp")
    index: dict[str, Any] = {}
    try:
        with open(tmp, "wb") as fh:
            for name, entry in rows.items():
                records, index[name] = _table_records(name, entry)
                index[name]["offset"] = fh.tell()
                fh.write(records.reshape(-1).data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        msg = f"{path}: cannot write the checkpoint's rows: {exc.strerror or exc}; the previous checkpoint is kept"
        raise RecpipeError(msg) from None
    return index


def _read_table(
    fd: int, path: Path, name: str, ix: Mapping[str, Any], *, owned: tuple[int, int] | None,
    reads: SparseReads,
) -> dict[str, Any]:  # fmt: skip
    """One table's entry of the ``.rows`` file open as ``fd``: every row, or those of the
    buckets that hold rank ``owned[0]``'s rows at ``owned[1]`` ranks (then only its own)."""
    starts, crc, width = ix["starts"], ix["crc"], int(ix["row_bytes"])
    chunks = []
    for p0, p1 in _runs(int(ix["modulus"]), owned):
        a, b = int(starts[p0]), int(starts[p1])
        if a == b:
            continue
        size = (b - a) * width
        data = os.pread(fd, size, int(ix["offset"]) + a * width)
        reads.bytes += len(data)
        if len(data) != size:
            msg = f"{path}: table {name!r} is cut short ({len(data)} of {size} bytes at row {a}): the file is damaged"
            raise RecpipeError(msg)
        buf = np.frombuffer(data, dtype=np.uint8).reshape(b - a, width)
        for p in range(p0, p1):
            if zlib.crc32(buf[starts[p] - a : starts[p + 1] - a].data) != int(crc[p]):
                msg = f"{path}: table {name!r}, bucket at rows {int(starts[p])}..{int(starts[p + 1]) - 1}: the bytes do not match their crc32: the file is damaged"
                raise RecpipeError(msg)
        chunks.append(buf)
    records = np.concatenate(chunks) if chunks else np.zeros((0, width), dtype=np.uint8)
    entry: dict[str, Any] = {}
    for f in ix["fields"]:
        dtype = getattr(torch, f["dtype"])
        if len(records):
            col = np.array(records[:, f["at"] : f["at"] + f["bytes"]])  # a writable copy
            value = torch.from_numpy(col).view(dtype).reshape(len(col), *f["shape"])
        else:
            value = torch.zeros(0, *f["shape"], dtype=dtype)
        _nest(entry, f["path"], value.numpy() if f["numpy"] else value)
    for at, value in ix["other"]:
        _nest(entry, at, value)
    if owned is not None and len(records):
        ids = np.asarray(entry["ids"], dtype=np.int64)
        keep = np.flatnonzero(owner_of(ids, owned[1]) == owned[0])
        if keep.size < ids.size:  # a world size the modulus is not a multiple of
            entry = _read_kept(entry, keep, len(records))
    return entry


def _read_kept(entry: dict[str, Any], keep: np.ndarray, rows: int) -> dict[str, Any]:
    """``entry`` with only the rows ``keep`` of its per-row fields."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            out[key] = _read_kept(value, keep, rows)
        elif isinstance(value, np.ndarray | torch.Tensor) and value.ndim and value.shape[0] == rows:
            out[key] = (
                value[keep] if isinstance(value, np.ndarray) else value[torch.from_numpy(keep)]
            )
        else:
            out[key] = value
    return out


def _read_rows(
    path: Path, index: Mapping[str, Any], *, owned: tuple[int, int] | None, reads: SparseReads
) -> dict[str, dict[str, Any]]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        msg = f"{path}: the checkpoint's rows are missing (its header is there)"
        raise RecpipeError(msg) from None
    except OSError as exc:
        msg = f"{path}: cannot read the checkpoint's rows: {exc.strerror or exc}"
        raise RecpipeError(msg) from None
    try:
        return {name: _read_table(fd, path, name, ix, owned=owned, reads=reads)
                for name, ix in index.items()}  # fmt: skip
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------------
# parts


def save_parts(
    root: str | os.PathLike[str],
    *,
    comm: Comm,
    area: str,
    step: int,
    part: Mapping[str, Any],
    doc: Mapping[str, Any],
) -> Path:
    """A collective checkpoint at ``step``: every rank writes its ``part`` to
    ``root/area/step-N/rank-R-of-W.pt`` (its ``rows``, ``{table: {"ids", ...}}``, to the
    ``.rows`` file beside it, by bucket); once all have, rank 0 writes ``checkpoint.pt``
    (``doc`` with ``area`` naming that folder) and removes the older folders of ``area``.

    Returns:
        the path of ``checkpoint.pt``.
    """
    root = Path(root)
    folder = root / area / f"step-{step:09d}"
    folder.mkdir(parents=True, exist_ok=True)
    header = _rank_file(folder, comm.rank, comm.world_size)
    part = dict(part)
    if isinstance(part.get("rows"), Mapping):
        data = header.with_suffix(ROWS_SUFFIX)
        part["rows_index"] = _write_rows(data, part.pop("rows"))
        part["rows_file"] = data.name
    save_state(part, header)
    comm.barrier(what="the checkpoint's barrier")
    path = root / CHECKPOINT_FILE
    if comm.rank == 0:
        save_state({**doc, area: str(folder.relative_to(root))}, path)
        for old in (root / area).iterdir():
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier(what="the checkpoint's barrier")
    return path


def read_part(
    root: str | os.PathLike[str], state: Mapping[str, Any], area: str, *, rank: int,
    world_size: int, owned: tuple[int, int] | None = None, reads: SparseReads | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Rank ``rank``'s part of the checkpoint ``state`` (saved by :func:`save_parts` at
    ``world_size`` ranks), checked to be of its step.

    Args:
        owned: ``(r, W)``: read only the rows rank ``r`` of ``W`` owns (``owner_of``) of the
            part's ``rows``; ``None``: every row.
        reads: counts the bytes read.

    Raises:
        RecpipeError: the part is missing, damaged or of another step.
    """
    reads = reads if reads is not None else SparseReads()
    path = _rank_file(Path(root) / state[area], rank, world_size)
    part = load_checkpoint(path)
    if part is None:
        msg = f"{path}: rank {rank}'s part of the checkpoint is missing"
        raise RecpipeError(msg)
    reads.files += 1
    reads.bytes += path.stat().st_size + checksum_file(path).stat().st_size
    if part.get("step") != state["step"]:
        msg = f"{path}: rows of step {part.get('step')!r}, the checkpoint is at {state['step']}"
        raise RecpipeError(msg)
    if "rows_index" in part:
        data = path.with_name(part.pop("rows_file"))
        part["rows"] = _read_rows(data, part.pop("rows_index"), owned=owned, reads=reads)
    return part


def save_checkpoint(
    root: str | os.PathLike[str],
    *,
    comm: Comm,
    sparse: ShardedEmbeddings,
    step: int,
    state: Mapping[str, Any],
) -> Path:
    """Save the job at ``step`` (collective). ``state`` is what rank 0 keeps besides the rows
    (dense model, optimizers, readers, ...; the same on every rank).

    Returns:
        the path of ``checkpoint.pt``.
    """
    rows = {"step": step, "rank": comm.rank, "world_size": comm.world_size,
            "rows": sparse.owned_rows()}  # fmt: skip
    doc = {**state, "kind": KIND, "step": step, "world_size": comm.world_size,
           "hot": dict(zip(sparse.names, sparse.hot_sets(), strict=True))}  # fmt: skip
    return save_parts(root, comm=comm, area="sparse", step=step, part=rows, doc=doc)


def read_checkpoint(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job state in ``root/checkpoint.pt`` (``None`` when there is none yet).

    Raises:
        RecpipeError: the file is unreadable or not a multi-rank checkpoint.
    """
    path = Path(root) / CHECKPOINT_FILE
    state = load_checkpoint(path)
    if state is not None and state.get("kind") != KIND:
        msg = (
            f"{path}: not a multi-rank checkpoint (written by a single-process run?); resume it "
            "the way it was written"
        )
        raise RecpipeError(msg)
    return state


def load_sparse(
    root: str | os.PathLike[str], state: Mapping[str, Any], *, sparse: ShardedEmbeddings
) -> SparseReads:
    """Give this rank the rows it owns of the checkpoint ``state`` (saved at any world size),
    reading of each saved rank's rows only the buckets that hold them, and reinstall the
    saved hot sets (collective). Returns what it read."""
    saved = int(state["world_size"])
    reads = SparseReads()
    owned = (sparse.comm.rank, sparse.comm.world_size)
    parts = [
        read_part(root, state, "sparse", rank=rank, world_size=saved, owned=owned,
                  reads=reads)["rows"]
        for rank in range(saved)
    ]  # fmt: skip
    _log.debug("rank %d of %d: read %d bytes of %d rank files for its rows", *owned,
               reads.bytes, reads.files)  # fmt: skip
    sparse.load_owned_rows(parts)
    hot = state.get("hot", {})
    sparse.set_hot([hot[name].copy() if name in hot else [] for name in sparse.names])
    return reads
