"""Which Parquet files a reader reads: the dataset's manifest lists them, the folder must agree.

A dataset built by ``recpipe etl build`` lists every part file in ``_manifest.json`` (see
:mod:`recpipe.integrity`). For a location inside such a dataset the manifest is the list:

- a file it lists that is not there is **missing**;
- a Parquet file a reader would read (outside ``_``/``.`` folders) that it does not list is a
  **stray** (a copied part file would be read twice), also when a glob or a list names it;
- the manifest's own totals (``rows_out``, ``row_groups``, ...) must be those of its list
  (:func:`recpipe.integrity.check_totals`): a file deleted with its entry still shows.

A folder without a manifest, or whose manifest has no ``files`` list (a hand-made one holding a
schema only), is read as plain Parquet: every ``*.parquet`` under it. A manifest with a
``format`` but no ``files`` list is malformed.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> _ = (root / "_manifest.json").write_text('{"files": [{"path": "part-00000.parquet", '
...     '"rows": 5, "row_groups": 1, "bytes": 100}], "rows_out": 5}')
>>> [(p.path, p.what) for p in list_files(root).problems]
[('part-00000.parquet', 'missing: the manifest lists it, the dataset directory does not have it')]
"""

from __future__ import annotations

import glob as _glob
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from recpipe.errors import DataError
from recpipe.integrity import (
    MANIFEST_NAME,
    ListedFile,
    check_totals,
    listed_files,
    mismatch_error,
    read_manifest,
)

__all__ = ["DatasetFiles", "Listed", "Mismatch", "discover_files", "is_hidden", "list_files"]

PathLike = str | os.PathLike[str]

MISSING = "missing: the manifest lists it, the dataset directory does not have it"
STRAY = "not listed in the manifest, but readers of the dataset would read it"
_HINT = (
    "a part file was deleted, added or replaced after the build: rebuild the dataset or copy "
    "it again (`recpipe etl verify DATASET` lists every difference)"
)


def is_hidden(part: str) -> bool:
    """A path part a reader never enters (``_quarantine``, ``.cache``...)."""
    return part.startswith(("_", "."))


@dataclass(frozen=True)
class Listed:
    """A file's manifest entry and the dataset directory the entry is relative to."""

    root: Path
    entry: ListedFile


@dataclass(frozen=True)
class Mismatch:
    """A difference between a manifest and its dataset directory.

    Attributes:
        root: the dataset directory.
        path: relative to ``root`` (``_manifest.json`` for a total that differs).
        what: what differs.
        rows: rows the manifest lists for a missing file (0 otherwise).
    """

    root: Path
    path: str
    what: str
    rows: int = 0

    @property
    def full_path(self) -> str:
        """The file, as a reader would name it."""
        return os.fspath(self.root / self.path)


@dataclass
class DatasetFiles:
    """What :func:`list_files` found.

    Attributes:
        files: the files to read, in path order (missing files and strays left out).
        listed: the manifest entry of each file that has one, by ``os.fspath(file)``.
        problems: missing files, strays and totals that differ, in path order per dataset.
    """

    files: list[Path] = field(default_factory=list)
    listed: dict[str, Listed] = field(default_factory=dict)
    problems: list[Mismatch] = field(default_factory=list)

    def raise_problems(self) -> None:
        """Raise one error listing every problem of the first dataset that has any.

        Raises:
            CorruptInputError: there are problems.
        """
        if self.problems:
            root = self.problems[0].root
            mine = [(p.path, p.what) for p in self.problems if p.root == root]
            raise mismatch_error(root, mine, hint=_HINT)


class _Manifests:
    """The manifests met while listing, read once each (by absolute dataset directory)."""

    def __init__(self) -> None:
        self._by_root: dict[Path, dict[str, ListedFile] | None] = {}
        self._around: dict[Path, Path | None] = {}
        self.problems: list[Mismatch] = []

    def around(self, start: Path) -> tuple[Path, dict[str, ListedFile]] | None:
        """The nearest dataset directory at or above ``start`` (absolute) and its list;
        ``None`` when there is none or the nearest manifest lists no files."""
        if start not in self._around:
            self._around[start] = next(
                (f for f in (start, *start.parents) if (f / MANIFEST_NAME).is_file()), None
            )
        root = self._around[start]
        entries = None if root is None else self._read(root)
        return None if root is None or entries is None else (root, entries)

    def _read(self, root: Path) -> dict[str, ListedFile] | None:
        if root not in self._by_root:
            manifest = read_manifest(root)
            if "files" not in manifest and "format" not in manifest:
                self._by_root[root] = None  # a hand-made manifest (a schema): plain Parquet
            else:
                entries = listed_files(manifest, source=os.fspath(root / MANIFEST_NAME))
                self._by_root[root] = {e.path: e for e in entries}
                self.problems += [
                    Mismatch(root, MANIFEST_NAME, what) for what in check_totals(manifest, entries)
                ]
        return self._by_root[root]


def list_files(source: PathLike | Sequence[PathLike]) -> DatasetFiles:
    """The files a reader of ``source`` reads, checked against their dataset's manifest.

    Args:
        source: a dataset directory (searched recursively, Hive ``key=value`` folders included,
            folders starting with ``_`` or ``.`` such as ``_quarantine/`` skipped), a Parquet
            file, a glob (``data/dt=2024-01-*/*.parquet``), or a list of these.

    Returns:
        The files and their entries; the differences from the manifest as ``problems`` (for
        the caller to raise or skip).

    Raises:
        DataError: a path does not exist, a glob matches nothing, a manifest cannot be read or
            is malformed, or a folder cannot be listed.
    """
    items = [source] if isinstance(source, str | os.PathLike) else list(source)
    manifests = _Manifests()
    out = DatasetFiles()
    files: set[Path] = set()
    problems: dict[tuple[Path, str], Mismatch] = {}
    for item in items:
        text = os.fspath(item)
        path = Path(text)
        if any(ch in text for ch in "*?["):
            matched = [Path(p) for p in _glob.glob(text, recursive=True)]
            found = [p for p in matched if p.is_file() and p.suffix == ".parquet"]
            for p in matched:
                if p.is_dir():
                    found.extend(_files_under(p))
            if not found:
                msg = f"`source` glob {text!r} matches no Parquet file"
                raise DataError(msg)
            files.update(found)
        elif path.is_dir():
            found = _files_under(path)
            located = manifests.around(Path(os.path.abspath(path)))
            missing = [] if located is None else _missing(path, *located)
            if not found and not missing:
                msg = f"`source` directory {text!r} holds no Parquet file"
                raise DataError(msg)
            for m in missing:
                problems.setdefault((m.root, m.path), m)
            files.update(found)
        elif path.is_file():
            files.add(path)
        else:
            msg = f"`source` path {text!r} does not exist"
            raise DataError(msg)
    for path in sorted(files, key=os.fspath):
        located = manifests.around(Path(os.path.abspath(path)).parent)
        if located is None:
            out.files.append(path)
            continue
        root, entries = located
        rel = Path(os.path.abspath(path)).relative_to(root).as_posix()
        entry = entries.get(rel)
        if entry is not None:
            out.files.append(path)
            out.listed[os.fspath(path)] = Listed(root, entry)
        elif not any(is_hidden(part) for part in PurePosixPath(rel).parts):
            problems.setdefault((root, rel), Mismatch(root, rel, STRAY))
    # a dataset's totals first, then its files in path order
    listed = sorted(problems.values(), key=lambda p: (os.fspath(p.root), p.path))
    out.problems = manifests.problems + listed
    return out


def _missing(folder: Path, root: Path, entries: dict[str, ListedFile]) -> list[Mismatch]:
    """The files ``entries`` lists under ``folder`` (inside dataset ``root``) that are not
    regular files."""
    here = Path(os.path.abspath(folder)).relative_to(root)
    out = []
    for rel, entry in entries.items():
        inside = PurePosixPath(rel)
        if here.parts and inside.parts[: len(here.parts)] != here.parts:
            continue
        if not (root / rel).is_file():
            out.append(Mismatch(root, rel, MISSING, rows=entry.rows))
    return out


def discover_files(source: PathLike | Sequence[PathLike]) -> list[Path]:
    """Expand a dataset location into its Parquet files, sorted by path.

    In a dataset with a manifest these are the files it lists (see the module docstring).

    Args:
        source: see :func:`list_files`.

    Returns:
        The distinct files in path order.

    Raises:
        DataError: a path does not exist or a glob matches nothing.
        CorruptInputError: a listed file is missing, a stray would be read, or the manifest's
            totals differ from its list.
    """
    listing = list_files(source)
    listing.raise_problems()
    return listing.files


def _files_under(root: Path) -> list[Path]:
    """Every ``*.parquet`` under ``root`` outside hidden folders; an unreadable folder is an
    error (``Path.rglob`` would leave it out silently)."""

    def fail(exc: OSError) -> None:
        msg = f"cannot list {exc.filename!r} under the dataset {os.fspath(root)!r}: {exc.strerror}"
        raise DataError(msg)

    out = []
    for folder, dirs, names in os.walk(root, onerror=fail):
        dirs[:] = sorted(d for d in dirs if not is_hidden(d))
        out += [Path(folder) / n for n in names if n.endswith(".parquet") and not is_hidden(n)]
    return out
