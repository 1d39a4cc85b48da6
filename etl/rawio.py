"""Reading raw JSON-Lines logs: input expansion, streaming line reader, unroutable records.

Shared by ``etl shard`` and ``etl build``. Lines come back as raw bytes with their 1-based line
number so that bad records can be quarantined verbatim with their location.

Line rules (the build's reader, :func:`etl.build.inputs.read_lines`, follows the same): ``\n``
ends a line, a ``\r`` right before it belongs to the line end (``\r\n``), any other ``\r`` is
data; a UTF-8 byte-order mark opening the file is dropped; a last line without ``\n`` counts.
A line longer than ``max_line_bytes`` (:data:`DEFAULT_MAX_LINE_BYTES`) is never held whole: the
reader keeps its first :data:`LONG_LINE_PREFIX` bytes and its length, whatever its size.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "a.jsonl").write_bytes(b'{"x": 1}\\n\\n{"x": 2}')
>>> list(iter_lines(d / "a.jsonl"))
[(1, b'{"x": 1}'), (3, b'{"x": 2}')]
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import io
import os
import stat
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import orjson
import zstandard

from recpipe.errors import CorruptInputError, DataError

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "JSONL_PATTERNS",
    "LONG_LINE_PREFIX",
    "UNROUTABLE_NAME",
    "PartialLine",
    "check_unchanged_read",
    "expand_inputs",
    "file_stamp",
    "iter_lines",
    "iter_raw_lines",
    "iter_unroutable",
    "line_prefix",
    "read_chunks",
    "unroutable_record",
]

#: File patterns of raw JSON-Lines logs, plain or zstd-compressed.
JSONL_PATTERNS: tuple[str, ...] = ("*.jsonl", "*.jsonl.zst")
#: File name of the shard holding lines ``etl shard`` could not route.
UNROUTABLE_NAME = "_unroutable.jsonl.zst"

#: The longest line read whole (bytes, line end excluded); longer ones are ``line_too_long``.
DEFAULT_MAX_LINE_BYTES = 64 << 20
#: Bytes of an over-long line kept (in the quarantine's ``raw``), cut at a UTF-8 character.
LONG_LINE_PREFIX = 1024

_BOM = b"\xef\xbb\xbf"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
_PARQUET_MAGIC = b"PAR1"
_CHUNK = 1 << 20


def _matches(path: Path, patterns: Sequence[str]) -> bool:
    return any(path.match(p) for p in patterns)


def _unreadable(path: Path | str, item: str | Path, exc: OSError) -> DataError:
    """The error of a directory or file under the input ``item`` that cannot be read."""
    where = "" if str(path) == str(item) else f" (under the input {str(item)!r})"
    return DataError(f"`inputs`: cannot read {str(path)!r}{where}: {exc.strerror or exc}")


def _stat(path: Path, item: str | Path, *, follow: bool = True) -> os.stat_result | None:
    """``path``'s status (None when it does not exist); any other failure is an error."""
    try:
        return path.stat() if follow else path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _unreadable(path, item, exc) from None


def _is_file(path: Path, item: str | Path) -> bool:
    st = _stat(path, item)
    return st is not None and stat.S_ISREG(st.st_mode)


def _is_dir(path: Path, item: str | Path, *, follow: bool = True) -> bool:
    st = _stat(path, item, follow=follow)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _checked_file(path: Path, item: str | Path) -> Path:
    """``path``, once it can be opened for reading (an unreadable input is never skipped)."""
    if not os.access(path, os.R_OK):
        raise _unreadable(path, item, PermissionError(13, "Permission denied"))
    return path


def _walk(root: Path, patterns: Sequence[str]) -> list[Path]:
    """The files under ``root`` matching ``patterns``, names starting with ``_`` or ``.`` (and
    everything under such a directory) left out; symlinked directories are not followed.

    Raises:
        DataError: naming a directory or file that cannot be read (``Path.rglob`` skips such
            directories silently, which would build from part of the input).
    """

    def fail(exc: OSError) -> None:
        raise _unreadable(exc.filename or root, root, exc)

    hits = []
    for top, dirs, names in os.walk(root, onerror=fail):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in names:
            p = Path(top, name)
            if not name.startswith(("_", ".")) and _matches(p, patterns) and _is_file(p, root):
                hits.append(_checked_file(p, root))
    return sorted(hits)


def _glob(pattern: str) -> list[Path]:
    """The paths ``glob.glob(pattern, recursive=True)`` finds, sorted, but a directory it must
    list (or a path it must look at) and cannot is an error, not a silent miss.

    Raises:
        DataError: naming the path that cannot be read.
    """

    def listed(base: Path) -> list[str]:
        try:
            with os.scandir(base) as entries:
                return [e.name for e in entries]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise _unreadable(base, pattern, exc) from None

    def below(base: Path, *, files: bool, up: frozenset = frozenset()) -> list[Path]:
        """What ``**`` matches under ``base``: its directories (and files with ``files``);
        a symlinked directory is followed unless it leads back to one it is in (``up``)."""
        out = []
        for name in listed(base):
            p = base / name
            st = _stat(p, pattern)
            if name.startswith(".") or st is None:
                continue
            key = (st.st_dev, st.st_ino)
            if stat.S_ISDIR(st.st_mode) and key not in up:
                out += [p, *below(p, files=files, up=up | {key})]
            elif files or stat.S_ISDIR(st.st_mode):
                out.append(p)
        return out

    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    found = [Path(*parts[:fixed])] if fixed else [Path()]
    for depth, part in enumerate(parts[fixed:], fixed):
        last = depth == len(parts) - 1
        step: list[Path] = []
        for base in found:
            if part == "**":
                step += [base, *below(base, files=last)]
            elif glob.has_magic(part):
                names = fnmatch.filter(listed(base), part)
                step += [base / n for n in names if part.startswith(".") or n[0] != "."]
            elif _stat(base / part, pattern, follow=False) is not None:
                step.append(base / part)
        found = step if last else [p for p in step if _is_dir(p, pattern)]
    return sorted(set(found))


def expand_inputs(
    inputs: str | Path | Iterable[str | Path],
    *,
    patterns: Sequence[str] = JSONL_PATTERNS,
) -> list[Path]:
    """Expand files, directories and globs into a sorted, de-duplicated list of files.

    Directories are searched recursively for files matching ``patterns``; files and directories
    whose name starts with ``_`` or ``.`` (``_manifest.json``, ``_unroutable.jsonl.zst``,
    ``.tmp``) are skipped there. A file named explicitly is always taken. Nothing is skipped
    because it cannot be read: a directory that cannot be listed, or an input file that cannot
    be opened, is an error naming it.

    Args:
        inputs: one path/glob or a list of them.
        patterns: file-name patterns taken from directories and globs.

    Raises:
        DataError: if an input does not exist, matches nothing, cannot be read (or holds a
            directory or input file that cannot), or no files are found at all.
    """
    items = [inputs] if isinstance(inputs, str | Path) else list(inputs)
    if not items:
        raise DataError("`inputs`: no input given")
    found: list[Path] = []
    for item in items:
        path = Path(item)
        if _is_file(path, item):
            found.append(_checked_file(path, item))
        elif _is_dir(path, item):
            hits = _walk(path, patterns)
            if not hits:
                raise DataError(
                    f"`inputs`: directory {str(path)!r} holds no files matching {list(patterns)}"
                )
            found += hits
        elif glob.has_magic(str(item)):
            hits = [
                p
                for p in _glob(str(item))
                if not p.name.startswith(("_", ".")) and _is_file(p, item)
            ]
            if not hits:
                raise DataError(f"`inputs`: glob {str(item)!r} matches no files")
            found += [_checked_file(p, item) for p in hits]
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


def _iter_chunks(path: Path, size: int = _CHUNK) -> Iterator[bytes]:
    """Yield decompressed byte chunks of a plain, zstd or gzip file (detected by magic bytes).

    ``size`` is the bytes read from the file at a time.
    """
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed in finally, generator
        opened = os.fstat(fh.fileno())
    except OSError as exc:
        raise DataError(f"cannot open input {str(path)!r}: {exc}") from None
    try:
        yield from _decoded(path, fh, size)
        check_unchanged_read(path, fh, opened)
    except CorruptInputError:
        check_unchanged_read(path, fh, opened, whole=False)  # a file cut under the reader
        raise
    except OSError as exc:
        raise DataError(f"cannot read input {str(path)!r}: {exc}") from None
    finally:
        fh.close()


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """What a change of a file's bytes (or its replacement by another file) changes in its
    status: size, modification and change times, inode and device."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def check_unchanged_read(
    path: Path, fh: io.BufferedReader, opened: os.stat_result, *, whole: bool = True
) -> None:
    """Refuse a file that changed while it was read (``fh``, open on it): its size or time
    stamps differ from ``opened`` (its status when it was opened), or, read to its end
    (``whole``), the bytes read do not add up to its size (a file cut or grown under the reader).

    Raises:
        DataError: naming the file.
    """
    now = os.fstat(fh.fileno())
    read = fh.tell()
    if (whole and read != opened.st_size) or file_stamp(now) != file_stamp(opened):
        raise DataError(
            f"{path}: the file changed while it was read ({opened.st_size:,} bytes when "
            f"opened, {read:,} read, {now.st_size:,} now): refusing a file that is being "
            "written\nhint: run again once the file is complete"
        )


def _decoded(path: Path, fh: io.BufferedReader, size: int) -> Iterator[bytes]:
    """The decompressed bytes of the open file ``fh`` (``size`` read at a time), to its end."""
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
    if head[:2] == _GZIP_MAGIC:
        yield from _gzip_chunks(path, fh, size)
        return
    if not is_zstd:
        yield head
        while chunk := fh.read(size):
            yield chunk
        return
    pending = head
    dctx = zstandard.ZstdDecompressor()
    dobj = dctx.decompressobj()
    in_frame = False  # the current frame has started but not ended
    offset = 0  # compressed bytes consumed
    while True:
        data = pending or fh.read(size)
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


def _gzip_chunks(path: Path, fh: io.BufferedReader, size: int) -> Iterator[bytes]:
    fh.seek(0)
    stream = gzip.GzipFile(fileobj=fh)
    try:
        while chunk := stream.read(size):
            yield chunk
    except (OSError, EOFError, zlib.error) as exc:
        raise CorruptInputError(f"{path}: corrupt or truncated gzip data: {exc}") from None


def read_chunks(path: str | Path, *, size: int = 16 << 20) -> Iterator[bytes]:
    """The decompressed bytes of a plain, zstd or gzip file, a byte-order mark opening it dropped.

    Chunks hold at least ``size`` bytes (but the last); a line may span two of them.

    Raises:
        CorruptInputError: naming the file, on a broken or truncated zstd or gzip stream or a
            Parquet file.
    """
    parts: list[bytes] = []
    held = 0
    for chunk in _strip_bom(_iter_chunks(Path(path), size=max(1 << 16, size // 8))):
        parts.append(chunk)
        held += len(chunk)
        if held >= size:
            yield parts[0] if len(parts) == 1 else b"".join(parts)
            parts, held = [], 0
    if held:
        yield b"".join(parts)


def line_prefix(data: bytes) -> bytes:
    """The first :data:`LONG_LINE_PREFIX` bytes of ``data``, cut before a split UTF-8 character."""
    if len(data) <= LONG_LINE_PREFIX:
        return data
    cut = LONG_LINE_PREFIX
    while cut > LONG_LINE_PREFIX - 3 and data[cut] & 0xC0 == 0x80:  # a continuation byte
        cut -= 1
    return data[:cut]


class PartialLine:
    """A line read in pieces: all of it, or once it is too long, its first bytes and its size.

    Memory stays under ``max(max_line_bytes + 1, LONG_LINE_PREFIX + 4)`` bytes however long the
    line grows.
    """

    def __init__(self, max_line_bytes: int | None) -> None:
        self.limit = max_line_bytes
        # bytes kept whole; beyond them only the size is counted (+1: a `\r` before the `\n`)
        self.keep = (
            None if max_line_bytes is None else max(max_line_bytes + 1, LONG_LINE_PREFIX + 4)
        )
        self.parts: list[bytes] = []
        self.size = 0
        self.last = b""

    def add(self, piece: bytes) -> None:
        if not piece:
            return
        self.size += len(piece)
        self.last = piece[-1:]
        if self.keep is None or self.size <= self.keep:
            self.parts.append(piece)
        elif sum(map(len, self.parts)) < self.keep:  # now too long: keep a prefix
            self.parts = [b"".join([*self.parts, piece])[: self.keep]]

    def take(self, *, line_end: bool) -> tuple[bytes, int]:
        """The line (or its prefix when longer than the limit) and its size; then empty."""
        size = self.size - (line_end and self.last == b"\r")
        data = b"".join(self.parts)
        self.parts, self.size, self.last = [], 0, b""
        if self.limit is not None and size > self.limit:
            return line_prefix(data), size
        return data[:size], size


def _strip_bom(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` without a byte-order mark opening the stream."""
    head = b""
    for chunk in chunks:
        head += chunk
        if len(head) >= len(_BOM):
            break
    yield head.removeprefix(_BOM)
    yield from chunks


def iter_raw_lines(
    path: str | Path, *, max_line_bytes: int | None = DEFAULT_MAX_LINE_BYTES
) -> Iterator[tuple[int, bytes, int]]:
    """Stream the non-blank lines of a ``.jsonl`` or ``.jsonl.zst`` file with their sizes.

    Line ends follow the module's rules; blank lines are skipped but counted, so line numbers
    match the decompressed file. Memory stays bounded by ``max_line_bytes`` whatever the lines.

    Args:
        path: the file; zstd is detected by its magic bytes, whatever the extension.
        max_line_bytes: longer lines come back as their :func:`line_prefix` (None: no limit).

    Yields:
        ``(line_number, line, size)``, 1-based; ``size`` is the line's length in bytes, which
        exceeds ``len(line)`` only for a line longer than ``max_line_bytes``.

    Raises:
        CorruptInputError: naming the file, on a broken or truncated zstd frame or a Parquet file.
    """
    pending = PartialLine(max_line_bytes)
    limit = max_line_bytes
    lineno = 0
    for chunk in _strip_bom(_iter_chunks(Path(path))):
        pieces = chunk.split(b"\n")
        tail = pieces.pop()
        for piece in pieces:
            lineno += 1
            if pending.size:  # a line that began in an earlier chunk
                pending.add(piece)
                line, size = pending.take(line_end=True)
            else:
                line = piece[:-1] if piece.endswith(b"\r") else piece
                size = len(line)
                if limit is not None and size > limit:
                    line = line_prefix(line)
            if line.strip():
                yield lineno, line, size
        pending.add(tail)
    if pending.size:
        line, size = pending.take(line_end=False)  # a last `\r` without `\n` is data
        if line.strip():
            yield lineno + 1, line, size


def iter_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """Stream the non-blank lines of a ``.jsonl`` or ``.jsonl.zst`` file, whole.

    :func:`iter_raw_lines` without a length limit: line ends (``\n`` or ``\r\n``) are
    stripped; blank lines are skipped but counted, so line numbers match the decompressed
    file. A last line without a newline is returned too.

    Args:
        path: the file; zstd is detected by its magic bytes, whatever the extension.

    Yields:
        ``(line_number, line)``, 1-based.

    Raises:
        CorruptInputError: naming the file, on a broken or truncated zstd frame or a Parquet file.
    """
    for lineno, line, _ in iter_raw_lines(path, max_line_bytes=None):
        yield lineno, line


def unroutable_record(
    source: str | Path, line: int, reason: str, raw: bytes, *, size: int | None = None
) -> bytes:
    """One line of ``_unroutable.jsonl.zst``: the raw line and where it came from.

    ``raw`` is kept verbatim as a string when it is valid UTF-8, else as ``raw_hex``. ``size``
    (``"bytes"``) is given for a line too long to keep, whose ``raw`` is only its prefix.
    """
    record: dict[str, object] = {"source": str(source), "line": line, "reason": reason}
    if size is not None:
        record["bytes"] = size
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
