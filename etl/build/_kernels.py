"""The build's compiled passes over raw text: splitting lines, and their facts for validation.

Numba kernels outside ``recpipe/kernels/``: ``etl`` never imports torch, ``recpipe.kernels`` does.

:func:`split_lines` cuts a block of bytes into lines (the reader's rules, without the GIL).
:func:`line_facts` reports, per line, what a typed (lenient) ``from_json`` in DuckDB cannot tell:
how many ``"`` the line holds, whether its text is free of what the lenient parse would accept
silently, and whether each id is written as a string. :mod:`etl.build.validate` uses them to
accept most lines without its slower full checks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

__all__ = ["LINE_FACT_COLUMNS", "line_facts", "pack_words", "split_lines", "text_buffers"]


#: the text facts :func:`line_facts` reports per line (columns of its result)
LINE_FACT_COLUMNS: tuple[str, ...] = (
    "quotes",
    "text_ok",
    "kind_rk",
    "kind_sk",
    "kind_uk",
    "kind_tk",
)


def _find(data, start, end, pat, p0, p1):  # pragma: no cover - compiled by Numba
    """First index >= start of ``pat[p0:p1]`` in ``data[start:end]``, or -1."""
    m = p1 - p0
    first = pat[p0]
    i = start
    while i + m <= end:
        if data[i] == first:
            k = 1
            while k < m and data[i + k] == pat[p0 + k]:
                k += 1
            if k == m:
                return i
        i += 1
    return -1


def _after_blanks(data, i, end):  # pragma: no cover - compiled by Numba
    """The first byte at or after ``i`` that is not a space or tab (-1 at the end)."""
    while i < end and (data[i] == 32 or data[i] == 9):
        i += 1
    return data[i] if i < end else -1


def _facts_kernel(offsets, data, pat, pat_off, quotes, text_ok, kinds):  # pragma: no cover
    """Per line: quotes, text_ok and the four id kinds (see :func:`line_facts`).

    ``pat`` holds `"rk":`, `"sk":`, `"uk":`, `"tk":`, `"dense":`, `"sparse":`, `"dense"`,
    `"sparse"` (bounds in ``pat_off``).
    """
    n = offsets.shape[0] - 1
    for r in range(n):
        start, end = offsets[r], offsets[r + 1]
        for k in range(4):  # ids: 1 = a string value, 0 = another value, -1 = key not found
            at = _find(data, start, end, pat, pat_off[k], pat_off[k + 1])
            if at < 0:
                kinds[r, k] = -1
            else:
                c = _after_blanks(data, at + pat_off[k + 1] - pat_off[k], end)
                kinds[r, k] = 1 if c == 34 else 0
        ok = True
        tail = start  # the first `"sparse"` (the whole line without one)
        for k in (4, 5):  # a map must open an object, or its key be absent in any spelling
            name = _find(data, start, end, pat, pat_off[k + 2], pat_off[k + 3])  # `"key"`
            if name < 0:
                continue
            if k == 5:
                tail = name
            at = name  # `"key":` is usually where `"key"` first is
            if (
                at + pat_off[k + 1] - pat_off[k] > end
                or data[at + pat_off[k + 3] - pat_off[k + 2]] != 58
            ):
                at = _find(data, name, end, pat, pat_off[k], pat_off[k + 1])
            if at < 0 or _after_blanks(data, at + pat_off[k + 1] - pat_off[k], end) != 123:
                ok = False
        q = 0
        i = start
        while ok and i < end:
            c = data[i]
            i += 1
            if c >= 48 and c <= 57:  # digits: most bytes of a line
                continue
            if c == 34:
                q += 1
            elif c == 44:  # a trailing comma: `,` then blanks then `]` or `}`
                j = i
                while j < end and (data[j] == 32 or data[j] == 9 or data[j] == 10 or data[j] == 13):
                    j += 1
                if j < end and (data[j] == 93 or data[j] == 125):
                    ok = False
            elif c == 116 and i + 3 <= end:  # `true`
                ok = not (data[i] == 114 and data[i + 1] == 117 and data[i + 2] == 101)
            elif c == 102 and i + 4 <= end:  # `false`
                ok = not (
                    data[i] == 97
                    and data[i + 1] == 108
                    and data[i + 2] == 115
                    and data[i + 3] == 101
                )
            elif i > tail and (
                c == 46 or c == 69 or (c == 101 and data[i - 2] >= 48 and data[i - 2] <= 57)
            ):  # no fraction or exponent (`.`, `E`, a digit then `e`) among the sparse ids
                ok = False
        quotes[r] = q
        text_ok[r] = ok


def _split_kernel(data, start, ends, limit, prefix, text, offsets, sizes):  # pragma: no cover
    """The lines of ``data`` from ``start``, each ending at a ``\\n`` at ``ends``, into
    ``text``/``offsets``.

    A ``\\r`` before the ``\\n`` is dropped; a line longer than ``limit`` keeps its first
    ``prefix`` bytes (fewer, not to cut a UTF-8 character) and its length goes to ``sizes``
    (-1 for the other lines). Returns the bytes written to ``text``.
    """
    pos = 0
    s = start
    offsets[0] = 0
    for n in range(ends.shape[0]):
        i = ends[n]
        e = i - 1 if i > s and data[i - 1] == 13 else i
        length = e - s
        sizes[n] = -1
        if length > limit:
            sizes[n] = length
            cut = min(prefix, length)
            while cut < length and cut > prefix - 3 and (data[s + cut] & 0xC0) == 0x80:
                cut -= 1
            length = cut
        text[pos : pos + length] = data[s : s + length]
        pos += length
        offsets[n + 1] = pos
        s = i + 1
    return pos


def _line_kernel():
    """Compile the kernels (once per process; cached on disk by Numba)."""
    from numba import njit

    global _find, _after_blanks
    jit = njit(cache=True, nogil=True)
    # the kernel calls the helpers through these module globals: compile them first
    _find = jit(_find)
    _after_blanks = jit(_after_blanks)
    return jit(_facts_kernel), jit(_split_kernel)


_KERNEL = None
_KERNEL_LOCK = threading.Lock()


def _kernels():
    global _KERNEL
    with _KERNEL_LOCK:  # files are parsed on several threads
        if _KERNEL is None:
            _KERNEL = _line_kernel()
    return _KERNEL


def split_lines(
    data: np.ndarray, start: int, stop: int, *, limit: int, prefix: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lines of ``data[start:stop]`` (uint8; the last byte is ``\\n``), without the GIL.

    Returns:
        ``(text, offsets, sizes)``: the lines' bytes back to back, ``len + 1`` offsets into
        them, and each line's length when it is longer than ``limit`` (its text then holds
        only a prefix of ``prefix`` bytes or fewer, cut before a UTF-8 character), else -1.
    """
    ends = np.flatnonzero(data[start:stop] == 10) + start
    # Arrow's allocator: the engines read these bytes many times over
    text = np.frombuffer(pa.allocate_buffer(max(stop - start, 1)), dtype=np.uint8)
    offsets = np.frombuffer(pa.allocate_buffer(8 * (ends.size + 1)), dtype=np.int64)
    sizes = np.empty(ends.size, dtype=np.int64)
    used = _kernels()[1](data, start, ends, limit, prefix, text, offsets, sizes)
    return text[:used], offsets, sizes


def line_facts(lines: pa.Array, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Text facts of raw JSON lines that a typed (lenient) parse cannot tell, in one pass.

    For each line: ``quotes`` (count of ``"``); ``text_ok`` (no trailing comma, no
    ``true``/``false``, no ``.``, ``E`` or digit followed by ``e`` after the first ``"sparse"``
    (the whole line when there is none), ``dense``/``sparse`` written as objects or absent); ``kind_rk`` ..
    ``kind_tk`` for the four id keys ``keys`` (request id, session id, user id, ts): 1 when
    the value after the first ``"key":`` is a string, 0 when it is something else, -1 when
    the key is not written that way. The checks are conservative: a line they flag is only
    checked again in full.

    Args:
        lines: an Arrow ``string`` or ``large_string`` array (nulls read as empty lines).
        keys: the request id, session id, user id and time keys.
    """
    facts = _kernels()[0]
    offsets, data = text_buffers(lines)
    n = offsets.size - 1
    pat, pat_off = pack_words(
        [f'"{k}":' for k in keys] + ['"dense":', '"sparse":', '"dense"', '"sparse"']
    )
    quotes = np.zeros(n, dtype=np.int32)
    text_ok = np.zeros(n, dtype=np.bool_)
    kinds = np.zeros((n, 4), dtype=np.int8)
    facts(offsets, data, pat, pat_off, quotes, text_ok, kinds)
    out = {"quotes": quotes, "text_ok": text_ok}
    for k, name in enumerate(LINE_FACT_COLUMNS[2:]):
        out[name] = np.ascontiguousarray(kinds[:, k])
    return out


def text_buffers(lines: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The ``len + 1`` int64 offsets and the bytes of an Arrow ``string``/``large_string``
    array (another type is cast first), without copying the text; both read-only, so the
    kernels see one signature. Nulls read as empty strings."""
    if pa.types.is_string(lines.type):
        off_type = np.int32
    else:
        lines = lines if pa.types.is_large_string(lines.type) else lines.cast(pa.large_string())
        off_type = np.int64
    n = len(lines)
    bufs = lines.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_type, count=lines.offset + n + 1)[lines.offset :]
    if off_type is np.int32:
        offsets = offsets.astype(np.int64)
        offsets.flags.writeable = False
    data = (
        np.frombuffer(bufs[2], dtype=np.uint8)
        if bufs[2] is not None and bufs[2].size
        else np.frombuffer(b"\0", dtype=np.uint8)
    )
    return offsets, data


def pack_words(words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``words`` UTF-8 encoded back to back (uint8), and their ``len + 1`` int64 bounds."""
    encoded = [w.encode() for w in words]
    packed = np.frombuffer(b"".join(encoded) or b"\0", dtype=np.uint8)
    return packed, np.cumsum([0] + [len(w) for w in encoded]).astype(np.int64)
