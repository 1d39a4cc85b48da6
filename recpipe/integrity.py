"""The integrity record of a clustered dataset: its manifest's file list, sizes and sha256.

``recpipe etl build`` lists every part file it wrote in ``_manifest.json``::

    "files": [{"path": "part-00000.parquet", "rows": 3000, "row_groups": 7,
               "sessions": 180, "bytes": 188489, "sha256": "9f2c..."}, ...]

``path`` is relative to the dataset directory (``dt=.../part-00000.parquet`` with hour
partitions), ``bytes`` the file's size and ``sha256`` the hex digest of its bytes. Both the ETL
(``recpipe etl verify``, ``recpipe stats``) and the readers (``ReaderConfig(verify="full")``)
check files against it through this module, so the rules live in one place: the file list and
its entries (:func:`listed_files`), the manifest's own totals (:func:`check_totals`), a file's
bytes (:func:`check_digest`) and, while a reader reads, that a file is still the one it opened
(:class:`FileId`, :func:`check_unchanged`).

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> _ = (root / "part-00000.parquet").write_bytes(b"PAR1")
>>> size, sha = file_sha256(root / "part-00000.parquet")
>>> entry = ListedFile("part-00000.parquet", rows=0, row_groups=0, bytes=size, sha256=sha)
>>> check_digest(root, entry)
[]
>>> _ = (root / "part-00000.parquet").write_bytes(b"PAR2")
>>> check_digest(root, entry)
['sha256 differs: the manifest says fbc62d..., the file has 6ab3c7...']
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from recpipe.errors import CorruptInputError, DataError

__all__ = [
    "MANIFEST_NAME",
    "FileChangedError",
    "FileId",
    "ListedFile",
    "check_digest",
    "check_totals",
    "check_unchanged",
    "file_sha256",
    "find_manifest",
    "listed_files",
    "mismatch_error",
    "read_manifest",
]

#: The manifest's file name, at the root of a dataset.
MANIFEST_NAME = "_manifest.json"

_CHUNK = 1 << 22  # 4 MiB reads while hashing
_SHORT = 6  # hex digits of a digest shown in messages


@dataclass(frozen=True)
class ListedFile:
    """One ``files[]`` entry of a manifest.

    Attributes:
        path: relative to the dataset directory, ``/``-separated.
        rows: rows in the file.
        row_groups: row groups in the file.
        bytes: size of the file in bytes.
        sha256: hex digest of the file's bytes; ``None`` in manifests written before the build
            recorded digests.
    """

    path: str
    rows: int
    row_groups: int
    bytes: int
    sha256: str | None = None
    sessions: int | None = None


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Load ``root/_manifest.json``.

    Raises:
        DataError: it is missing, unreadable, or not a JSON object.
    """
    path = Path(root) / MANIFEST_NAME
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        msg = f"{str(Path(root))!r} has no {MANIFEST_NAME}: not a dataset built by `recpipe etl build`"
        raise DataError(msg) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        msg = f"manifest {str(path)!r} cannot be read as JSON: {exc}"
        raise DataError(msg) from None
    if not isinstance(doc, dict):
        msg = f"manifest {str(path)!r} is not a JSON object"
        raise DataError(msg)
    return doc


def listed_files(manifest: dict[str, Any], *, source: str) -> list[ListedFile]:
    """The manifest's ``files[]`` entries, checked.

    Args:
        manifest: the loaded manifest.
        source: the manifest's path, for messages.

    Raises:
        DataError: ``files`` is missing or an entry lacks a key, has a bad type, a path that
            is absolute or leaves the dataset directory, or a path listed twice.
    """
    files = manifest.get("files")
    if not isinstance(files, list):
        msg = f"manifest {source!r}: `files` must be a list, got {type(files).__name__}"
        raise DataError(msg)
    out = []
    seen: set[str] = set()
    for i, entry in enumerate(files):
        where = f"manifest {source!r} files[{i}]"
        if not isinstance(entry, dict):
            msg = f"{where}: must be an object, got {entry!r}"
            raise DataError(msg)
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            msg = f"{where}: `path` must be a non-empty string, got {path!r}"
            raise DataError(msg)
        posix = PurePosixPath(path)
        if posix.is_absolute() or ".." in posix.parts:
            msg = f"{where}: `path` {path!r} must be relative and inside the dataset"
            raise DataError(msg)
        if posix.as_posix() in seen:
            msg = f"{where}: lists {path!r} twice"
            raise DataError(msg)
        seen.add(posix.as_posix())
        numbers = {}
        for key in ("rows", "row_groups", "bytes"):
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"{where} ({path}): `{key}` must be a non-negative integer, got {value!r}"
                raise DataError(msg)
            numbers[key] = value
        sha = entry.get("sha256")
        if sha is not None and not (
            isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
        ):
            msg = f"{where} ({path}): `sha256` must be 64 lower-case hex digits, got {sha!r}"
            raise DataError(msg)
        sessions = entry.get("sessions")
        if sessions is not None and not _count(sessions):
            msg = f"{where} ({path}): `sessions` must be a non-negative integer, got {sessions!r}"
            raise DataError(msg)
        out.append(ListedFile(posix.as_posix(), sha256=sha, sessions=sessions, **numbers))
    return out


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_totals(manifest: dict[str, Any], entries: list[ListedFile]) -> list[str]:
    """What differs between the manifest's own totals and its ``files[]`` (``[]``: they agree).

    A file deleted together with its entry leaves a file list that matches the directory; the
    totals the build recorded still tell. Each check runs when the manifest has its keys (a
    hand-made manifest may list files only):

    - ``rows_out``, ``row_groups`` and ``bytes_out`` are the sums over ``files[]``;
    - the files' ``sessions`` sum to ``sessions + session_continuations`` (a session cut by a
      file boundary counts in each of its files);
    - ``rows_in == rows_out + rows_quarantined + rows_sampled_out``, ``reconciles`` says so, and
      ``rows_quarantined`` is the sum of ``quarantine_by_reason``;
    - ``bytes_in`` is the sum of the ``inputs[]`` sizes.

    Raises:
        DataError: a total that is present is not a non-negative integer.
    """

    def total(key: str) -> int | None:
        value = manifest.get(key)
        if value is not None and not _count(value):
            msg = f"manifest `{key}` must be a non-negative integer, got {value!r}"
            raise DataError(msg)
        return value

    problems = []
    for key, unit, held in (
        ("rows_out", "rows", sum(e.rows for e in entries)),
        ("row_groups", "row groups", sum(e.row_groups for e in entries)),
        ("bytes_out", "bytes", sum(e.bytes for e in entries)),
    ):
        said = total(key)
        if said is not None and said != held:
            problems.append(f"its files hold {held:,} {unit}, `{key}` says {said:,}")
    sessions, continuations = total("sessions"), total("session_continuations")
    if sessions is not None and entries and all(e.sessions is not None for e in entries):
        held = sum(e.sessions or 0 for e in entries)
        # without `session_continuations` (older manifests) a session cut by a file boundary
        # counts in several files: the files can only hold more
        if held != sessions + (continuations or 0) and (
            continuations is not None or held < sessions
        ):
            problems.append(
                f"its files hold {held:,} sessions, `sessions` says {sessions:,}"
                + (f" (+ {continuations:,} `session_continuations`)" if continuations else "")
            )
    rows_in, rows_out, quarantined = total("rows_in"), total("rows_out"), total("rows_quarantined")
    if rows_in is not None and rows_out is not None and quarantined is not None:
        sampled = total("rows_sampled_out") or 0
        reconciles = rows_in == rows_out + quarantined + sampled
        if not reconciles:
            problems.append(
                f"the counts do not reconcile: `rows_in` {rows_in:,} != `rows_out` {rows_out:,} "
                f"+ `rows_quarantined` {quarantined:,} + `rows_sampled_out` {sampled:,}"
            )
        elif manifest.get("reconciles") is False:
            problems.append("`reconciles` is false, but its counts reconcile")
    by_reason = manifest.get("quarantine_by_reason")
    if quarantined is not None and isinstance(by_reason, dict):
        held = sum(v for v in by_reason.values() if _count(v))
        if held != quarantined:
            problems.append(
                f"`quarantine_by_reason` sums to {held:,}, `rows_quarantined` says {quarantined:,}"
            )
    inputs, bytes_in = manifest.get("inputs"), total("bytes_in")
    if bytes_in is not None and isinstance(inputs, list):
        held = sum(i["bytes"] for i in inputs if isinstance(i, dict) and _count(i.get("bytes")))
        if held != bytes_in:
            problems.append(f"its inputs hold {held:,} bytes, `bytes_in` says {bytes_in:,}")
    return problems


def mismatch_error(
    root: str | os.PathLike[str],
    problems: list[tuple[str, str]],
    *,
    hint: str | None = None,
    shown: int = 10,
) -> CorruptInputError:
    """The error for a dataset that does not match its manifest: one line per ``(path, what)``.

    Args:
        root: the dataset directory.
        problems: ``(path relative to root, what differs)``, in the order to show them.
        hint: the ``hint:`` line, if any.
        shown: problems listed before "... and N more".
    """
    lines = "\n".join(f"  {Path(root) / path}: {what}" for path, what in problems[:shown])
    more = f"\n  ... and {len(problems) - shown} more" if len(problems) > shown else ""
    msg = f"dataset {str(root)!r} does not match its manifest:\n{lines}{more}"
    if hint:
        msg += f"\nhint: {hint}"
    return CorruptInputError(msg)


def file_sha256(
    path: str | os.PathLike[str], *, on_bytes: Callable[[int], object] | None = None
) -> tuple[int, str]:
    """``(size, hex sha256)`` of a file, read in 4 MiB chunks.

    Args:
        path: the file.
        on_bytes: called with the size of each chunk read (a progress bar's ``update``).

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return size, digest.hexdigest()


def check_digest(
    root: str | os.PathLike[str],
    entry: ListedFile,
    *,
    on_bytes: Callable[[int], object] | None = None,
) -> list[str]:
    """What differs between a listed file and the file on disk (``[]``: it matches).

    The size is compared first (from the file system); the sha256 only when it matches.

    Args:
        root: the dataset directory.
        entry: the manifest entry.
        on_bytes: see :func:`file_sha256`.

    Returns:
        One sentence per difference: the file is missing or unreadable, its size or sha256
        differs, or the manifest records no sha256 for it.
    """
    path = Path(root) / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return ["missing: the manifest lists it, the dataset directory does not have it"]
    except OSError as exc:
        return [f"cannot be read: {exc}"]
    if not path.is_file():
        return ["is not a regular file"]
    if size != entry.bytes:
        return [f"size differs: the manifest says {entry.bytes:,} bytes, the file has {size:,}"]
    if entry.sha256 is None:
        return [
            "the manifest records no sha256 for it (built before digests were recorded): "
            "its bytes cannot be checked; rebuild the dataset to record them"
        ]
    try:
        _, sha = file_sha256(path, on_bytes=on_bytes)
    except OSError as exc:
        return [f"cannot be read: {exc}"]
    if sha != entry.sha256:
        return [
            f"sha256 differs: the manifest says {entry.sha256[:_SHORT]}..., "
            f"the file has {sha[:_SHORT]}..."
        ]
    return []


class FileChangedError(CorruptInputError):
    """A file of a dataset changed (was replaced, modified or removed) while a reader read it.

    Never skipped by ``on_error="skip"``: the rows before and after the change come from two
    different datasets.
    """


class FileId(NamedTuple):
    """What identifies a file's bytes cheaply: one ``stat``, no reading.

    A file replaced by another (a rebuild renames new files into place) has another inode; one
    written in place has another size or modification time.
    """

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileId:
        """The identity of ``path`` now.

        Raises:
            OSError: it cannot be stat'ed (``FileNotFoundError`` when it is gone).
        """
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def change(self, now: FileId) -> str:
        """How ``now`` differs from this identity, in words (``""``: it does not)."""
        if (now.inode, now.device) != (self.inode, self.device):
            return f"replaced by another file ({now.size:,} bytes, was {self.size:,})"
        if now.size != self.size:
            return f"modified: {now.size:,} bytes, was {self.size:,}"
        if now.mtime_ns != self.mtime_ns:
            return "modified: its modification time moved"
        return ""


def check_unchanged(path: str | os.PathLike[str], opened: FileId) -> None:
    """Raise unless ``path`` is still the file whose identity was ``opened`` (one ``stat``).

    Raises:
        FileChangedError: it was replaced, modified or removed.
    """
    try:
        change = opened.change(FileId.of(path))
    except FileNotFoundError:
        change = "removed"
    except OSError as exc:
        change = f"cannot be stat'ed: {exc}"
    if change:
        msg = (
            f"{os.fspath(path)}: changed since the reader opened the dataset ({change}): the "
            "rows read so far and the rest would come from different data\n"
            "hint: was the dataset rebuilt (`etl build --overwrite`) or copied over while it "
            "was read? restart the run once the dataset is complete"
        )
        raise FileChangedError(msg)


def find_manifest(path: str | os.PathLike[str]) -> Path | None:
    """The dataset directory holding a part file: the nearest ancestor with a manifest.

    Returns:
        That directory, or ``None`` when no ancestor has a ``_manifest.json``.
    """
    for parent in Path(os.path.abspath(path)).parents:
        if (parent / MANIFEST_NAME).is_file():
            return parent
    return None
