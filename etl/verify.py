"""``recpipe etl verify DATASET``: is the dataset exactly what the build wrote?

Five checks, against the dataset's ``_manifest.json`` (see :mod:`recpipe.integrity`):

1. **totals**: the manifest agrees with itself: ``rows_out``, ``row_groups``, ``bytes_out``
   and ``sessions`` are those of its ``files[]``, its counts reconcile
   (:func:`recpipe.integrity.check_totals`), so a file deleted together with its entry shows;
2. **files**: every file the manifest lists exists with its size and sha256, and holds the
   rows and row groups the manifest says;
3. **no strays**: no Parquet file that a reader would read (any ``*.parquet`` outside folders
   whose name starts with ``_`` or ``.``) is missing from the manifest;
4. **quarantine**: the quarantine files the manifest names hold ``rows_quarantined`` and
   ``events_quarantined`` rows;
5. **pages**: every page of every listed file is read with Parquet page-checksum (CRC)
   verification, which names the row group and column of a corrupt page, and each file's
   distinct session ids are counted against its ``sessions``. A file written without page
   checksums passes the CRC part without proof; the sha256 still covers it.

>>> import tempfile, pathlib
>>> verify_dataset(pathlib.Path(tempfile.mkdtemp()))
Traceback (most recent call last):
...
recpipe.errors.DataError: '...' has no _manifest.json: not a dataset built by `recpipe etl build`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recpipe.config_cli import add_quiet_option
from recpipe.errors import RecpipeError
from recpipe.integrity import (
    MANIFEST_NAME,
    ListedFile,
    check_digest,
    check_totals,
    listed_files,
    mismatch_error,
    read_manifest,
)

__all__ = ["Problem", "VerifyReport", "register_cli", "verify_dataset", "verify_digests"]


@dataclass(frozen=True)
class Problem:
    """One thing that differs: the file (relative to the dataset) and what."""

    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


@dataclass
class VerifyReport:
    """What :func:`verify_dataset` checked and found.

    Attributes:
        root: the dataset directory.
        files: files the manifest lists.
        rows: rows the manifest lists.
        row_groups: row groups the manifest lists.
        bytes: bytes the manifest lists.
        digests_checked: files whose size and sha256 were compared.
        pages_checked: row groups read with page-checksum verification (0 with ``pages=False``).
        problems: every difference found; none means the dataset is intact.
    """

    root: Path
    files: int = 0
    rows: int = 0
    row_groups: int = 0
    bytes: int = 0
    digests_checked: int = 0
    pages_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "dataset": str(self.root),
            "ok": self.ok,
            "files": self.files,
            "rows": self.rows,
            "row_groups": self.row_groups,
            "bytes": self.bytes,
            "digests_checked": self.digests_checked,
            "pages_checked": self.pages_checked,
            "problems": [{"path": p.path, "what": p.what} for p in self.problems],
        }

    def format(self) -> str:
        """The terminal summary."""
        lines = [
            f"dataset   {self.root}",
            f"listed    {self.files:,} files, {self.rows:,} rows, {self.row_groups:,} row groups, "
            f"{self.bytes / 1e6:.1f} MB",
            f"sha256    {self.digests_checked:,} of {self.files:,} files compared",
            f"pages     {self.pages_checked:,} row groups read with page-checksum verification",
        ]
        if self.ok:
            lines.append("OK: every file matches the manifest")
        else:
            lines.append(f"FAILED: {len(self.problems)} problem(s)")
            lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    def raise_if_failed(self, *, hint: str | None = None) -> None:
        """Raise :class:`~recpipe.errors.CorruptInputError` listing the problems, if any."""
        if not self.ok:
            raise mismatch_error(self.root, [(p.path, p.what) for p in self.problems], hint=hint)


def verify_dataset(
    dataset_dir: str | Path, *, pages: bool = True, progress: bool = False
) -> VerifyReport:
    """Check a dataset against its manifest (see the module docstring).

    Args:
        dataset_dir: the dataset directory (``etl build --out``).
        pages: also read every page with page-checksum verification (decodes the whole
            dataset; ``False`` checks sizes, digests and strays only).
        progress: show progress bars (bytes hashed, row groups read) on stderr.

    Returns:
        The report; :attr:`VerifyReport.ok` says whether the dataset is intact.

    Raises:
        DataError: the directory has no readable manifest, or its ``files`` list is malformed.
    """
    root = Path(dataset_dir)
    manifest = read_manifest(root)
    entries = listed_files(manifest, source=str(root / MANIFEST_NAME))
    report = VerifyReport(
        root=root,
        files=len(entries),
        rows=sum(e.rows for e in entries),
        row_groups=sum(e.row_groups for e in entries),
        bytes=sum(e.bytes for e in entries),
    )
    report.problems += [Problem(MANIFEST_NAME, what) for what in check_totals(manifest, entries)]
    intact = _check_digests(report, entries, progress=progress)
    _check_strays(report, entries)
    _check_quarantine(report, manifest)
    if pages:
        present = [e for e in entries if e.path in intact]
        _check_pages(report, present, session_key=_session_key(manifest), progress=progress)
    report.problems.sort(key=lambda p: p.path)  # stable: a file's problems in check order
    return report


def verify_digests(dataset_dir: str | Path, *, progress: bool = False) -> VerifyReport | None:
    """Sizes, sha256 and strays only (no decoding): the cheap check ``recpipe stats`` runs.

    Returns:
        The report, or ``None`` when there is nothing to check against: no manifest, or one
        that records no sha256 (a dataset built before digests were recorded).

    Raises:
        DataError: the manifest exists but cannot be read or is malformed.
    """
    root = Path(dataset_dir)
    if not (root / MANIFEST_NAME).is_file():
        return None
    entries = listed_files(read_manifest(root), source=str(root / MANIFEST_NAME))
    if entries and all(e.sha256 is None for e in entries):
        return None
    return verify_dataset(root, pages=False, progress=progress)


def _bar(desc: str, total: int, unit: str, *, progress: bool):
    from recpipe.progress import progress_bar

    scale = unit == "B"
    return progress_bar(
        total=total, desc=desc, unit=unit, unit_scale=scale, disable=not progress, file=sys.stderr
    )


def _check_digests(report: VerifyReport, entries: list[ListedFile], *, progress: bool) -> set[str]:
    """Sizes and sha256 of the listed files; returns the paths of those present."""
    present = set()
    with _bar("sha256", report.bytes, "B", progress=progress) as bar:
        for entry in entries:
            problems = check_digest(report.root, entry, on_bytes=bar.update)
            report.problems += [Problem(entry.path, p) for p in problems]
            if (report.root / entry.path).is_file():
                present.add(entry.path)
                report.digests_checked += entry.sha256 is not None
    return present


def _check_strays(report: VerifyReport, entries: list[ListedFile]) -> None:
    """Parquet files a reader would read that the manifest does not list; a folder that cannot
    be listed is a problem too (it could hide one)."""
    listed = {e.path for e in entries}

    def unlistable(exc: OSError) -> None:
        rel = Path(exc.filename).relative_to(report.root).as_posix()
        report.problems.append(Problem(rel, f"cannot be listed: {exc.strerror}"))

    for folder, dirs, names in os.walk(report.root, onerror=unlistable):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        for name in sorted(names):
            rel = (Path(folder) / name).relative_to(report.root).as_posix()
            if name.endswith(".parquet") and not name.startswith(("_", ".")) and rel not in listed:
                report.problems.append(
                    Problem(
                        rel, "not listed in the manifest, but readers of the dataset would read it"
                    )
                )


def _check_quarantine(report: VerifyReport, manifest: dict[str, Any]) -> None:
    """The quarantine files the manifest names hold the rows it counts (footers only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    named = manifest.get("quarantine")
    if not isinstance(named, dict):
        return
    for kind, key in (("features", "rows_quarantined"), ("events", "events_quarantined")):
        rel, said = named.get(kind), manifest.get(key)
        if not isinstance(rel, str) or not isinstance(said, int):
            continue
        path = report.root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            report.problems.append(
                Problem(MANIFEST_NAME, f"`quarantine.{kind}` {rel!r} leaves the dataset")
            )
        elif not path.is_file():
            report.problems.append(Problem(rel, "missing: the manifest names it as the quarantine"))
        else:
            try:
                held = pq.read_metadata(path).num_rows
            except (pa.ArrowException, OSError) as exc:
                report.problems.append(Problem(rel, f"not a readable Parquet file: {exc}"))
                continue
            if held != said:
                report.problems.append(Problem(rel, f"holds {held:,} rows, `{key}` says {said:,}"))


def _session_key(manifest: dict[str, Any]) -> str | None:
    """The session column named by the manifest's schema (``None``: it has none)."""
    text = manifest.get("schema")
    if not isinstance(text, str):
        return None
    from schemas import parse_schema

    try:
        return parse_schema(text, source=f"{MANIFEST_NAME} (schema)").session_key
    except RecpipeError:
        return None  # the readers refuse it by name; the files can still be checked


def _check_pages(
    report: VerifyReport, entries: list[ListedFile], *, session_key: str | None, progress: bool
) -> None:
    """Read every row group of ``entries`` with page-checksum verification; check the footer's
    row and row-group counts and the distinct values of ``session_key`` against the manifest."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = sum(e.row_groups for e in entries)
    with _bar("pages", total, "row group", progress=progress) as bar:
        for entry in entries:
            path = report.root / entry.path
            try:
                pf = pq.ParquetFile(path, page_checksum_verification=True)
            except (pa.ArrowException, OSError) as exc:
                report.problems.append(Problem(entry.path, f"not a readable Parquet file: {exc}"))
                bar.update(entry.row_groups)
                continue
            with pf:
                meta = pf.metadata
                if (meta.num_rows, meta.num_row_groups) != (entry.rows, entry.row_groups):
                    report.problems.append(
                        Problem(
                            entry.path,
                            f"the manifest says {entry.rows:,} rows in {entry.row_groups:,} row "
                            f"groups, the file has {meta.num_rows:,} in {meta.num_row_groups:,}",
                        )
                    )
                count = entry.sessions is not None and session_key in pf.schema_arrow.names
                sessions, readable = [], True
                for rg in range(meta.num_row_groups):
                    try:
                        table = pf.read_row_group(rg, use_threads=False)
                        if count:
                            sessions.append(np.unique(table.column(session_key).to_numpy()))
                    except (pa.ArrowException, OSError) as exc:
                        readable = False
                        column = _bad_column(pf, rg)
                        where = f"row group {rg}" + (f" column `{column}`" if column else "")
                        report.problems.append(Problem(entry.path, f"{where}: {_first_line(exc)}"))
                    report.pages_checked += 1
                    bar.update(1)
                held = len(np.unique(np.concatenate(sessions))) if sessions else 0
                if count and readable and held != entry.sessions:
                    report.problems.append(
                        Problem(
                            entry.path,
                            f"the manifest says {entry.sessions:,} sessions, the file has {held:,}",
                        )
                    )


def _bad_column(pf: Any, row_group: int) -> str | None:
    import pyarrow as pa

    for name in pf.schema_arrow.names:
        try:
            pf.read_row_group(row_group, columns=[name], use_threads=False)
        except (pa.ArrowException, OSError):
            return name
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def register_cli(stages: argparse._SubParsersAction) -> None:
    """Add ``verify`` to the ``recpipe etl`` stages."""
    parser = stages.add_parser(
        "verify",
        help="check a dataset against its manifest: sizes, sha256, strays, page checksums",
        description=(
            "Check that a dataset built by `recpipe etl build` is exactly what the build wrote: "
            "the manifest's totals (rows, row groups, bytes, sessions) are those of its file "
            "list and its counts reconcile; every file listed in _manifest.json exists with its "
            "size, sha256, rows, row groups and sessions; no unlisted Parquet file would be "
            "read; the quarantine holds the rows counted; and every page passes its Parquet "
            "page checksum (CRC), naming the row group and column of a corrupt one. Exits 1 on "
            "any difference, listing each. This is the full check: `recpipe stats` compares "
            "sizes and sha256 only, and readers check page checksums as they read "
            '(ReaderConfig(verify="pages"), the default).'
        ),
    )
    parser.add_argument("dataset", type=Path, help="dataset directory (etl build --out)")
    parser.add_argument(
        "--no-pages",
        action="store_true",
        help="skip the page checksums and session counts (totals, sizes, sha256, strays and "
        "quarantine only: no decoding)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_quiet_option(parser)
    parser.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    report = verify_dataset(args.dataset, pages=not args.no_pages, progress=not args.quiet)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1
