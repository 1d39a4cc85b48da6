"""Reading raw JSON-Lines logs: input expansion, streaming line reader, unroutable records.

Shared by ``etl shard`` and ``etl build``. Lines come back as raw bytes with their 1-based line
number so that bad records can be quarantined verbatim with their location.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "a.jsonl").write_bytes(b'{"x": 1}\\n\\n{"x": 2}')
>>> list(iter_lines(d / "a.jsonl"))
[(1, b'{"x": 1}'), (3, b'{"x": 2}')]
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import orjson
import zstandard

from recpipe.errors import CorruptInputError, DataError

__all__ = [
    "JSONL_PATTERNS",
    "UNROUTABLE_NAME",
    "expand_inputs",
    "iter_lines",
    "iter_unroutable",
    "unroutable_record",
]

#: File patterns of raw JSON-Lines logs, plain or zstd-compressed.
JSONL_PATTERNS: tuple[str, ...] = ("*.jsonl", "*.jsonl.zst")
#: File name of the shard holding lines ``etl shard`` could not route.
UNROUTABLE_NAME = "_unroutable.jsonl.zst"

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PARQUET_MAGIC = b"PAR1"
_CHUNK = 1 << 20


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(("_", ".")) for part in path.relative_to(root).parts)


def _matches(path: Path, patterns: Sequence[str]) -> bool:
    return any(path.match(p) for p in patterns)


def expand_inputs(
    inputs: str | Path | Iterable[str | Path],
    *,
    patterns: Sequence[str] = JSONL_PATTERNS,
) -> list[Path]:
    """Expand files, directories and globs into a sorted, de-duplicated list of files.

    Directories are searched recursively for files matching ``patterns``; files and directories
    whose name starts with ``_`` or ``.`` (``_manifest.json``, ``_unroutable.jsonl.zst``,
    ``.tmp``) are skipped there. A file named explicitly is always taken.

    Args:
        inputs: one path/glob or a list of them.
        patterns: file-name patterns taken from directories and globs.

    Raises:
        DataError: if an input does not exist, matches nothing, or no files are found at all.
    """
    items = [inputs] if isinstance(inputs, str | Path) else list(inputs)
    if not items:
        raise DataError("`inputs`: no input given")
    found: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            hits = [
                p
                for p in path.rglob("*")
                if p.is_file() and _matches(p, patterns) and not _hidden(p, path)
            ]
            if not hits:
                raise DataError(
                    f"`inputs`: directory {str(path)!r} holds no files matching {list(patterns)}"
                )
            found += sorted(hits)
        elif glob.has_magic(str(item)):
            hits = [Path(p) for p in sorted(glob.glob(str(item), recursive=True))]
            hits = [p for p in hits if p.is_file() and not p.name.startswith(("_", "."))]
            if not hits:
                raise DataError(f"`inputs`: glob {str(item)!r} matches no files")
            found += hits
        else:
            raise DataError(f"`inputs`: {str(item)!r} does not exist")
    seen: set[Path] = set()
    out = []
    for p in found:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _iter_chunks(path: Path) -> Iterator[bytes]:
    """Yield decompressed byte chunks of a plain or zstd file (detected by magic bytes)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed in finally, generator
    except OSError as exc:
        raise DataError(f"cannot open input {str(path)!r}: {exc}") from None
    try:
        head = fh.read(4)
        if head == _PARQUET_MAGIC:
            raise CorruptInputError(
                f"{path}: is a Parquet file, not JSON Lines (expected .jsonl or .jsonl.zst)"
            )
        if not head:
            return
        is_zstd = head == _ZSTD_MAGIC
        if not is_zstd and path.name.endswith(".zst"):
            raise CorruptInputError(
                f"{path}: not a zstd file (bad magic bytes {head!r}); the file is corrupt "
                "or was renamed"
            )
        if not is_zstd:
            yield head
            while chunk := fh.read(_CHUNK):
                yield chunk
            return
        pending = head
        dctx = zstandard.ZstdDecompressor()
        dobj = dctx.decompressobj()
        in_frame = False  # the current frame has started but not ended
        offset = 0  # compressed bytes consumed
        while True:
            data = pending or fh.read(_CHUNK)
            pending = b""
            if not data:
                break
            while data:
                try:
                    out = dobj.decompress(data)
                except zstandard.ZstdError as exc:
                    raise CorruptInputError(
                        f"{path}: corrupt zstd data in compressed bytes {offset}..{offset + len(data)}"
                        f": {exc}"
                    ) from None
                in_frame = True
                if out:
                    yield out
                if dobj.eof:  # a frame ended; the rest may be another frame
                    offset += len(data) - len(dobj.unused_data)
                    data = dobj.unused_data
                    dobj = dctx.decompressobj()
                    in_frame = False
                else:
                    offset += len(data)
                    data = b""
        if in_frame:
            raise CorruptInputError(
                f"{path}: truncated zstd file (the last frame ends early, after "
                f"{offset} compressed bytes); the file is incomplete"
            )
    finally:
        fh.close()


def iter_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """Stream the non-blank lines of a ``.jsonl`` or ``.jsonl.zst`` file.

    Line endings (``\\n`` or ``\\r\\n``) are stripped; blank lines are skipped but counted, so
    line numbers match the decompressed file. A last line without a newline is returned too.

    Args:
        path: the file; zstd is detected by its magic bytes, whatever the extension.

    Yields:
        ``(line_number, line)``, 1-based.

    Raises:
        CorruptInputError: naming the file, on a broken or truncated zstd frame or a Parquet file.
    """
    path = Path(path)
    tail = b""
    lineno = 0
    for chunk in _iter_chunks(path):
        parts = (tail + chunk).split(b"\n") if tail else chunk.split(b"\n")
        tail = parts.pop()
        for line in parts:
            lineno += 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if line.strip():
                yield lineno, line
    if tail.strip():
        lineno += 1
        yield lineno, tail.removesuffix(b"\r")


def unroutable_record(source: str | Path, line: int, reason: str, raw: bytes) -> bytes:
    """One line of ``_unroutable.jsonl.zst``: the raw line and where it came from.

    ``raw`` is kept verbatim as a string when it is valid UTF-8, else as ``raw_hex``.
    """
    record: dict[str, object] = {"source": str(source), "line": line, "reason": reason}
    try:
        record["raw"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        record["raw_hex"] = raw.hex()
    return orjson.dumps(record)


def iter_unroutable(path: str | Path) -> Iterator[tuple[str, int, str, bytes]]:
    """Read back ``_unroutable.jsonl.zst``.

    Yields:
        ``(source_file, source_line, reason, raw_line_bytes)``.

    Raises:
        CorruptInputError: if the file or one of its records is damaged.
    """
    for lineno, line in iter_lines(path):
        try:
            rec = orjson.loads(line)
            raw = rec["raw"].encode("utf-8") if "raw" in rec else bytes.fromhex(rec["raw_hex"])
            yield str(rec["source"]), int(rec["line"]), str(rec["reason"]), raw
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise CorruptInputError(
                f"{path}: line {lineno}: not an unroutable-line record "
                "(expected keys `source`, `line`, `reason`, `raw`)"
            ) from None
