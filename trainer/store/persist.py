"""The persistent tier: the on-disk home of every row, batch-consistent checkpoints, recovery.

A store directory::

    meta.json          static settings (dim, optimizer, seed, chunk size), with a CRC
    rows.bin           uint32 [capacity, 2, W + 1]: two copies of each row r, each = its D floats
                       (+ optimizer state) then a checksum of (position, words); grows by whole
                       chunks of `chunk_rows` rows; memory-mapped, rows are read/written in place
    copies-<epoch>.bin one bit per row: which copy checkpoint <epoch> committed
    ids.bin            int64 [rows]: the id of row r (a commit writes the new ids after
                       the committed ones)
    index-<epoch>.bin  the id index as of checkpoint <epoch> (saved when the table grew by 1/4
                       since the last one); recovery loads it and indexes only the newer ids
    hot-<epoch>.bin    ids of the hot set at checkpoint <epoch>
    CURRENT            the commit record: step, epoch, rows, CRCs of the files above, the
                       optimizer's step count (Adam's bias correction); written to a temporary
                       file, fsynced and renamed, so it is either old or new
    PREVIOUS           the commit record before CURRENT, kept (with its files) until the store
                       next writes a row: ``open_store(path, step=...)`` can still roll back to it
    checkpoints.jsonl  one line per completed checkpoint (for `recpipe store`); informational:
                       a torn or undecodable line is skipped and counted, never trusted

Shadow copies: between two checkpoints every write of a row (an eviction from memory, or the
checkpoint itself) goes to the copy that is *not* committed, so the committed copy of every row
stays intact on disk until the next commit. ``checkpoint(step)`` writes only the rows changed
since the last checkpoint, fsyncs, writes the new copy bitmap and renames a new CURRENT: that
rename is the commit. Until the next row is written, the rows of the checkpoint before are intact
too (a commit flips each written row to the copy that was not committed), so the previous commit
record is kept as PREVIOUS: a trainer whose dense state was saved at step s, with several stores
of which some committed s + k before a crash, reopens each store at step s. The first write after
a commit (an eviction, or the next checkpoint) deletes PREVIOUS first. ``open`` reads CURRENT
and its bitmap: exactly the last completed checkpoint, with no log to replay and no row read
(rows are checked against their checksums when they are first read). Opening writes nothing:
bytes past the committed rows in ``rows.bin`` and ``ids.bin`` (work done after the last commit)
are left in place and overwritten by the next checkpoint. Only a roll-back (``step=``) rewrites
CURRENT. A directory whose CURRENT is missing while files that only a checkpoint writes are
present is refused (:func:`load_current`): it is never taken for an empty store. The price of
the two copies is twice the disk space of the table; the gain is one write per changed row (an
undo or redo log writes each twice).

Why this storage (the figures are in ``benchmarks/results/store.json``, ``storage_choice``,
measured by ``benchmarks/store.py``): in-place writing has to read the old image of every dirty
row and write it to a log, fsynced before any in-place page may reach the disk, then write the
rows, so each row moves twice; an eviction between checkpoints would also have to log and fsync
first. The file is preallocated as it grows (``posix_fallocate``: the first checkpoint into a
sparse file costs more), and rows are written in file order (random order, which cache-slot order
becomes once slots are reused, costs several times more). A checkpoint rewrites whole 4 KB pages,
and with a third of the rows dirty nearly every page of the file is dirty, so several times the
bytes of the rows go through page faults and write-back; an append-only log would write only the
rows, but needs a row-location table, compaction of dead rows and reads across segments: the next
step if checkpoints must get cheaper. LMDB and RocksDB are not installed here; not measured.

This module imports numpy only (no torch), so ``recpipe store`` inspects a store cheaply.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recpipe.errors import StoreError
from trainer.store import _kernels as K

__all__ = [
    "CommitRecord",
    "RowFile",
    "StoreMeta",
    "inspect_store",
    "load_current",
    "refuse_store_files",
    "write_row_block",
    "written_by_a_checkpoint",
]

FORMAT_VERSION = 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc_json(payload: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(payload, sort_keys=True).encode())


def write_json_atomic(path: Path, payload: dict[str, Any], *, sync: bool) -> None:
    """Write ``payload`` + its CRC to ``path`` via a temporary file and a rename."""
    body = dict(payload, crc=_crc_json(payload))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, sort_keys=True, indent=1)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def read_json_checked(path: Path) -> dict[str, Any]:
    """Read a JSON file written by :func:`write_json_atomic`, checking its CRC."""
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        msg = f"store file {str(path)!r} is missing; is this a store directory?"
        raise StoreError(msg) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = f"store file {str(path)!r} is corrupted (not valid JSON: {exc})"
        raise StoreError(msg) from None
    if not isinstance(body, dict) or "crc" not in body:
        msg = f"store file {str(path)!r} is corrupted (no checksum)"
        raise StoreError(msg)
    crc = body.pop("crc")
    if crc != _crc_json(body):
        msg = f"store file {str(path)!r} is corrupted (checksum mismatch)"
        raise StoreError(msg)
    return body


@dataclass(frozen=True)
class StoreMeta:
    """Settings fixed when a store is created (``meta.json``)."""

    dim: int
    state_dim: int
    optimizer: str
    eps: float
    seed: int
    init_scale: float
    chunk_rows: int

    @property
    def width(self) -> int:
        """Floats per row in memory: the embedding then the optimizer state."""
        return self.dim + self.state_dim

    @property
    def disk_width(self) -> int:
        """uint32 words per row on disk: the row then its checksum."""
        return self.width + 1

    def save(self, root: Path, *, sync: bool) -> None:
        payload = {"format": FORMAT_VERSION, **self.__dict__}
        write_json_atomic(root / "meta.json", payload, sync=sync)

    @classmethod
    def load(cls, root: Path) -> StoreMeta:
        body = read_json_checked(root / "meta.json")
        if body.pop("format", None) != FORMAT_VERSION:
            msg = f"store {str(root)!r} has an unknown format version"
            raise StoreError(msg)
        return cls(**body)


@dataclass(frozen=True)
class CommitRecord:
    """A completed checkpoint (``CURRENT``, or ``PREVIOUS``)."""

    step: int
    epoch: int
    num_rows: int
    ids_crc: int
    num_hot: int
    hot_crc: int
    copies_crc: int = 0
    index: dict[str, int] | None = None  # the saved index: epoch, rows, shards, slots, checksum
    # the optimizer steps the store had taken (Adam's bias correction counts them); None in a
    # record written before it was kept: the steps are then taken to be ``max(step, 0)``
    optimizer_step: int | None = None

    @classmethod
    def empty(cls) -> CommitRecord:
        """The record of a store that has committed nothing yet (step -1, epoch 0)."""
        return cls(step=-1, epoch=0, num_rows=0, ids_crc=0, num_hot=0, hot_crc=0)

    def save(self, root: Path, *, sync: bool, name: str = "CURRENT") -> None:
        write_json_atomic(root / name, dict(self.__dict__), sync=sync)

    @classmethod
    def load(cls, root: Path, name: str = "CURRENT") -> CommitRecord:
        """Read commit record ``name``; StoreError when it is missing or damaged."""
        body = read_json_checked(root / name)
        try:
            return cls(**body)
        except TypeError:
            msg = f"store file {str(root / name)!r} is corrupted (not a commit record)"
            raise StoreError(msg) from None

    @property
    def optimizer_steps(self) -> int:
        """The optimizer steps taken by the state this record commits."""
        return max(self.step, 0) if self.optimizer_step is None else self.optimizer_step

    def files(self) -> set[str]:
        """The per-epoch files this record refers to."""
        names = {f"copies-{self.epoch}.bin", f"hot-{self.epoch}.bin"}
        if self.index is not None:
            names.add(f"index-{self.index['epoch']}.bin")
        return names


def written_by_a_checkpoint(name: str) -> bool:
    """True for the files that only a checkpoint writes (meta.json and rows.bin are not)."""
    if name in ("ids.bin", "PREVIOUS", "checkpoints.jsonl"):
        return True
    return name.startswith(("copies-", "hot-", "index-")) and name.endswith(".bin")


def refuse_store_files(root: Path) -> None:
    """StoreError if directory ``root`` already holds a store, or the files of one."""
    if (root / "meta.json").exists():
        msg = f"`path` {str(root)!r} already holds a store; use open_store() to reopen it"
        raise StoreError(msg)
    if not root.is_dir():
        return
    found = sorted(
        p.name for p in root.iterdir() if written_by_a_checkpoint(p.name) or p.name == "rows.bin"
    )
    if found:
        msg = (
            f"`path` {str(root)!r} holds store files ({', '.join(found[:6])}) but no meta.json; "
            "remove them or choose another directory"
        )
        raise StoreError(msg)


def load_current(root: Path) -> CommitRecord:
    """The store's last completed checkpoint (``CURRENT``).

    A store that has never committed (only ``meta.json`` and a ``rows.bin`` of rows evicted
    before the first checkpoint) gives :meth:`CommitRecord.empty`. A directory without CURRENT
    but with files that only a checkpoint writes is refused: CURRENT was deleted or lost (or the
    process stopped while writing the first checkpoint), and taking it for an empty store would
    hide, then overwrite, the committed rows.

    Raises:
        StoreError: CURRENT is damaged, or missing beside checkpoint files.
    """
    if (root / "CURRENT").exists():
        return CommitRecord.load(root)
    found = sorted(p.name for p in root.iterdir() if written_by_a_checkpoint(p.name))
    if not found:
        return CommitRecord.empty()
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    msg = (
        f"store {str(root)!r} has no commit record: CURRENT is missing, but the directory holds "
        f"files that only a checkpoint writes ({shown}), so its last checkpoint cannot be found. "
        "Nothing was changed. Restore CURRENT (e.g. from a backup), or remove the directory to "
        "start a new store."
    )
    raise StoreError(msg)


class RowFile:
    """``rows.bin``: uint32 [capacity * 2, W + 1] (two copies per row), memory-mapped, grown by
    whole chunks. Positions are ``2 * row + copy``.

    Args:
        path: the file.
        meta: the store's settings (row width, chunk size).
        writable: map it for writing; False opens and maps it read-only (``--verify``).
        create: create an empty file when there is none (a new store, or one that never
            committed); otherwise a missing file is a StoreError.
    """

    def __init__(self, path: Path, meta: StoreMeta, *, writable: bool, create: bool = False):
        self.path = path
        self.meta = meta
        self.writable = writable
        self._row_bytes = 2 * meta.disk_width * 4
        flags = os.O_RDWR if writable else os.O_RDONLY
        if create and writable:
            flags |= os.O_CREAT
        try:
            self._fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            raise StoreError(f"store file {str(path)!r} is missing") from None
        size = os.fstat(self._fd).st_size
        if size % (self._row_bytes * meta.chunk_rows):
            os.close(self._fd)
            msg = (
                f"store file {str(path)!r} is truncated: {size} bytes is not a whole number "
                f"of {meta.chunk_rows}-row chunks"
            )
            raise StoreError(msg)
        self.capacity = size // self._row_bytes
        self._map()

    def _map(self) -> None:
        if self.capacity:
            shape = (2 * self.capacity, self.meta.disk_width)
            mode = "r+" if self.writable else "r"
            self._mm = np.memmap(self.path, dtype=np.uint32, mode=mode, shape=shape)
            self.words = np.asarray(self._mm)  # a plain ndarray view, for the Numba kernels
        else:
            self._mm = None
            self.words = np.zeros((0, self.meta.disk_width), dtype=np.uint32)

    @property
    def num_chunks(self) -> int:
        return self.capacity // self.meta.chunk_rows

    def ensure(self, num_rows: int) -> None:
        """Grow the file (whole chunks) so that rows [0, num_rows) exist."""
        if num_rows <= self.capacity:
            return
        chunks = -(-num_rows // self.meta.chunk_rows)
        old = self.capacity * self._row_bytes
        self.capacity = chunks * self.meta.chunk_rows
        size = self.capacity * self._row_bytes
        os.ftruncate(self._fd, size)
        # allocate the blocks now: the first writes into a sparse file cost several times more
        # (where the file system cannot preallocate, the file stays sparse)
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fallocate(self._fd, old, size - old)
        self._map()

    def write(self, src_words: np.ndarray, src_index: np.ndarray, pos: np.ndarray) -> None:
        """Write rows ``src_words[src_index]`` at positions ``pos``, with their checksums."""
        K.write_rows(src_words, src_index, pos, self.words)

    def write_block(self, src_words: np.ndarray, pos: np.ndarray) -> None:
        """Write rows ``src_words[i]`` at sorted positions ``pos[i]``, with their checksums."""
        write_row_block(self.words, src_words, pos)

    def read(self, pos: np.ndarray, dst_words: np.ndarray, dst_index: np.ndarray) -> None:
        """Read positions ``pos`` into ``dst_words[dst_index]``, checking checksums."""
        bad = K.read_rows(self.words, pos, dst_words, dst_index)
        if bad >= 0:
            self._corrupted(int(pos[bad]))

    def verify(self, pos: np.ndarray) -> None:
        """Check the checksum of the rows at positions ``pos`` (StoreError at the first bad)."""
        bad = K.verify_rows(self.words, pos)
        if bad >= 0:
            self._corrupted(int(pos[bad]))

    def _corrupted(self, pos: int) -> None:
        msg = f"store file {str(self.path)!r} is corrupted: row {pos // 2} fails its checksum"
        raise StoreError(msg)

    def sync(self) -> None:
        """Make the rows written so far durable. On Linux, fsync of the file writes back the
        pages dirtied through the shared mapping too (msync would walk them a second time)."""
        if self._mm is not None and not sys.platform.startswith("linux"):
            self._mm.flush()
        os.fsync(self._fd)

    def close(self) -> None:
        self.words = np.zeros((0, self.meta.disk_width), dtype=np.uint32)
        self._mm = None
        os.close(self._fd)


def write_row_block(dst_words: np.ndarray, src_words: np.ndarray, pos: np.ndarray) -> None:
    """Write rows in the on-disk format: ``dst_words[pos[i]] = src_words[i]`` followed by the
    checksum of (position, words), walking ``pos`` (sorted) front to back.

    Args:
        dst_words: uint32 [positions, W + 1], e.g. a memory-mapped ``rows.bin``.
        src_words: uint32 [n, W] the rows' float32 words.
        pos: int64 [n] sorted positions.
    """
    K.write_block(src_words, pos, dst_words)


def write_file(path: Path, data: bytes, *, sync: bool) -> None:
    """Write a whole small file (fsynced with ``sync``); named by epoch, so never overwritten
    while committed."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def read_copies(path: Path, commit: CommitRecord) -> np.ndarray:
    """The committed copy (0 or 1) of each of the ``commit.num_rows`` rows."""
    n = commit.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int8)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"store file {str(path)!r} is missing") from None
    if len(data) != -(-n // 8) or zlib.crc32(data) != commit.copies_crc:
        msg = f"store file {str(path)!r} is corrupted or truncated (checksum mismatch)"
        raise StoreError(msg)
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n).view(np.int8)


def read_ids(path: Path, num_rows: int, crc: int) -> np.ndarray:
    """The committed prefix of ``ids.bin``, checked against the commit record."""
    need = num_rows * 8
    if need == 0:
        return np.zeros(0, dtype=np.int64)
    size = path.stat().st_size if path.exists() else 0
    if size < need:
        msg = (
            f"store file {str(path)!r} is truncated: {size} bytes, the last checkpoint needs {need}"
        )
        raise StoreError(msg)
    ids = read_words(path, need)
    if zlib.crc32(ids) != crc:
        msg = f"store file {str(path)!r} is corrupted (checksum mismatch)"
        raise StoreError(msg)
    return ids


def read_words(path: Path, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` (a multiple of 8) of file ``path``, read straight into a new int64
    array (no intermediate bytes object to copy from). StoreError if the file is missing or
    shorter."""
    out = np.empty(nbytes // 8, dtype=np.int64)
    view = memoryview(out).cast("B")
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
    except FileNotFoundError:
        raise StoreError(f"store file {str(path)!r} is missing") from None
    if got < nbytes:
        msg = f"store file {str(path)!r} is truncated: {got} bytes, {nbytes} expected"
        raise StoreError(msg)
    return out


def write_ids(path: Path, new_ids: bytes, *, at_row: int, sync: bool) -> None:
    """Write ``new_ids`` after the ``at_row`` committed ids of ``ids.bin``, cutting what an
    uncommitted checkpoint left after them (the committed prefix is never touched)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        end = at_row * 8 + len(new_ids)
        os.pwrite(fd, new_ids, at_row * 8)
        if os.fstat(fd).st_size > end:
            os.ftruncate(fd, end)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_hot(path: Path, num_hot: int, crc: int) -> np.ndarray:
    """The hot-set ids of the last checkpoint."""
    if num_hot == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        msg = f"store file {str(path)!r} is missing"
        raise StoreError(msg) from None
    if len(data) != num_hot * 8 or zlib.crc32(data) != crc:
        msg = f"store file {str(path)!r} is corrupted or truncated (checksum mismatch)"
        raise StoreError(msg)
    return np.frombuffer(data, dtype=np.int64).copy()


CHECKPOINT_LOG = "checkpoints.jsonl"
_LOG_FIELDS = ("step", "rows_written", "bytes_written", "seconds")


def append_checkpoint_log(root: Path, info: dict[str, Any]) -> None:
    """Append one line to ``checkpoints.jsonl``; a torn last line (a crash mid-append) is ended
    first, so that it does not swallow this one."""
    with open(root / CHECKPOINT_LOG, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        torn = False
        if end:
            f.seek(end - 1)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(info).encode() + b"\n")


def read_checkpoint_log(root: Path) -> tuple[list[dict[str, Any]], int]:
    """The entries of ``checkpoints.jsonl`` and the number of lines skipped.

    The log is informational (the commit record is authoritative): a torn, undecodable or
    foreign line is skipped and counted, never an error.
    """
    path = root / CHECKPOINT_LOG
    if not path.exists():
        return [], 0
    entries: list[dict[str, Any]] = []
    skipped = 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not text
            skipped += 1
            continue
        if isinstance(entry, dict) and all(
            isinstance(entry.get(k), int | float) and not isinstance(entry.get(k), bool)
            for k in _LOG_FIELDS
        ):
            entries.append(entry)
        else:
            skipped += 1
    return entries, skipped


def inspect_store(path: str | os.PathLike[str], *, history: int = 5) -> dict[str, Any]:
    """Describe a store directory without loading it: rows, chunks, hot set, checkpoints, sizes.

    Reads only; writes nothing.

    Args:
        path: the store directory.
        history: how many of the latest checkpoints to list.

    Raises:
        StoreError: not a store directory, a damaged ``meta.json`` or commit record, or a
            commit record missing beside checkpoint files (see :func:`load_current`).
    """
    root = Path(path)
    if not root.is_dir():
        msg = f"`path` {str(path)!r} is not a store directory"
        raise StoreError(msg)
    meta = StoreMeta.load(root)
    commit = load_current(root)
    sizes = {p.name: p.stat().st_size for p in sorted(root.iterdir()) if p.is_file()}
    chunk_bytes = meta.chunk_rows * 2 * meta.disk_width * 4
    hot = read_hot(root / f"hot-{commit.epoch}.bin", commit.num_hot, commit.hot_crc)
    lines, skipped = read_checkpoint_log(root)
    return {
        "path": str(root),
        "dim": meta.dim,
        "optimizer": meta.optimizer,
        "row_bytes_on_disk": 2 * meta.disk_width * 4,
        "rows": commit.num_rows,
        "chunk_rows": meta.chunk_rows,
        "chunks": sizes.get("rows.bin", 0) // chunk_bytes,
        "hot_rows": int(hot.size),
        "hot_ids_head": hot[:8].tolist(),
        "last_checkpoint": {"step": commit.step, "epoch": commit.epoch},
        "previous_checkpoint_step": (
            CommitRecord.load(root, "PREVIOUS").step if (root / "PREVIOUS").exists() else None
        ),
        "saved_index": commit.index,
        "checkpoints": len(lines),
        "checkpoint_log_lines_skipped": skipped,
        "recent_checkpoints": lines[-history:],
        "sizes": sizes,
        "total_bytes": sum(sizes.values()),
    }
