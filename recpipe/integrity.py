"""The integrity record of a clustered dataset: its manifest's file list, sizes and sha256.

``recpipe etl build`` lists every part file it wrote in ``_manifest.json``::

    "files": [{"path": "part-00000.parquet", "rows": 3000, "row_groups": 7,
               "sessions": 180, "bytes": 188489, "sha256": "9f2c..."}, ...]

``path`` is relative to the dataset directory (``dt=.../part-00000.parquet`` with hour
partitions), ``bytes`` the file's size and ``sha256`` the hex digest of its bytes. Both the ETL
(``recpipe etl verify``, ``recpipe stats``) and the readers (``ReaderConfig(verify="full")``)
check files against it through this module, so the rules live in one place.

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
from typing import Any

from recpipe.errors import DataError

__all__ = [
    "MANIFEST_NAME",
    "ListedFile",
    "check_digest",
    "file_sha256",
    "find_manifest",
    "listed_files",
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
        DataError: ``files`` is missing or an entry lacks a key, has a bad type, or a path that
            is absolute or leaves the dataset directory.
    """
    files = manifest.get("files")
    if not isinstance(files, list):
        msg = f"manifest {source!r}: `files` must be a list, got {type(files).__name__}"
        raise DataError(msg)
    out = []
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
        out.append(ListedFile(path, sha256=sha, **numbers))
    return out


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


def find_manifest(path: str | os.PathLike[str]) -> Path | None:
    """The dataset directory holding a part file: the nearest ancestor with a manifest.

    Returns:
        That directory, or ``None`` when no ancestor has a ``_manifest.json``.
    """
    for parent in Path(os.path.abspath(path)).parents:
        if (parent / MANIFEST_NAME).is_file():
            return parent
    return None
