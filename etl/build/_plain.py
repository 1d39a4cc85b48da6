"""The compiled first tier of the build's feature validation: plain lines parsed without SQL.

A log line written the plain way (the known keys once each, ids as strings or integers, ``ts`` an
integer, ``dense`` an object of numbers, ``sparse`` an object of integer lists; blanks allowed
between tokens) is read here by a Numba kernel, without the GIL, straight into typed columns.
Every other line (anything unusual: escapes, non-ASCII ids, ``null``s, unknown or repeated keys,
fractions, exponents or ``-0`` where an integer belongs, integers of more than 18 digits, lists
longer than a ``max_len`` that does not truncate, a number outside float32) is left to the SQL
tiers of :mod:`etl.build.validate`, unchanged. Every line read here is one the full checks call
good, and its row is theirs, value for value (tested line by line, by fuzzing, and by a build's
bytes with and without the tier), so a dataset does not depend on which tier read a line.

Dense numbers are cut out as text and converted by Arrow (correctly rounded, as DuckDB's JSON
reader is); DuckDB reads an integer-form dense number as an integer, so those are limited to 18
digits (an int64, rounded to a double as Arrow rounds its text) and ``-0`` (``0`` in DuckDB,
``-0.0`` in Arrow) is left to SQL.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from etl.build._kernels import pack_words, text_buffers
from etl.build._sql import FLOAT32_MAX, schema_keys, ts_bounds, ts_ms, value_columns
from schemas import DatasetSchema

__all__ = ["plain_select", "split_plain", "usable_schema"]

_MAX_DIGITS = 18  # integers of at most 18 digits fit an int64
_MAX_NUMBER = 32  # longest dense number token read here (longer ones go to SQL)
_TS, _DENSE = 3, 4  # slots of the top-level keys (ids 0-2, then ts, dense, sparse)


def _blank(data, i, e):  # pragma: no cover - compiled by Numba
    """The first index at or after ``i`` that is not a space or a tab."""
    while i < e and (data[i] == 32 or data[i] == 9):
        i += 1
    return i


def _integer(data, i, e):  # pragma: no cover - compiled by Numba
    """A plain JSON integer at ``i`` (``-?(0|[1-9][0-9]*)``, at most 18 digits, not ``-0``, not
    followed by a fraction or exponent): ``(index after it, value)``, the index -1 if none."""
    neg = i < e and data[i] == 45
    if neg:
        i += 1
    start = i
    v = 0
    while i < e:
        d = np.uint64(data[i]) - np.uint64(48)  # one test for a digit
        if d > np.uint64(9):
            break
        v = v * 10 + np.int64(d)
        i += 1
    digits = i - start
    if digits == 0 or digits > _MAX_DIGITS or (digits > 1 and data[start] == 48):
        return -1, 0
    if i < e and (data[i] == 46 or data[i] == 101 or data[i] == 69):
        return -1, 0
    if neg:
        if v == 0:
            return -1, 0
        v = -v
    return i, v


def _number(data, i, e):  # pragma: no cover - compiled by Numba
    """The end of a plain JSON number at ``i`` (not ``-0``; an integer form of at most 18
    digits; at most ``_MAX_NUMBER`` bytes), or -1."""
    start = i
    if i < e and data[i] == 45:
        i += 1
    if i >= e or data[i] < 48 or data[i] > 57:
        return -1
    first = i
    while i < e and data[i] >= 48 and data[i] <= 57:
        i += 1
    digits = i - first
    if digits > 1 and data[first] == 48:
        return -1
    real = False
    if i < e and data[i] == 46:
        real = True
        i += 1
        f = i
        while i < e and data[i] >= 48 and data[i] <= 57:
            i += 1
        if i == f:
            return -1
    if i < e and (data[i] == 101 or data[i] == 69):
        real = True
        i += 1
        if i < e and (data[i] == 43 or data[i] == 45):
            i += 1
        f = i
        while i < e and data[i] >= 48 and data[i] <= 57:
            i += 1
        if i == f:
            return -1
    if not real:
        if digits > _MAX_DIGITS:
            return -1
        if data[start] == 45 and digits == 1 and data[first] == 48:
            return -1
    if i - start > _MAX_NUMBER:
        return -1
    return i


def _string(data, i, e):  # pragma: no cover - compiled by Numba
    """The index of the closing ``"`` of a string whose content starts at ``i`` (printable
    ASCII, no escapes), or -1."""
    while i < e:
        c = data[i]
        if c == 34:
            return i
        if c == 92 or c < 32 or c > 126:
            return -1
        i += 1
    return -1


def _int_list(data, i, e, values, used):  # pragma: no cover - compiled by Numba
    """The plain integers (as :func:`_integer`) of a non-empty list from ``i`` (after ``[``)
    to its ``]``, into ``values`` from ``used``: ``(index after the ], values used)``, the
    index -1 if the list is not plain.

    The hot loop of the tier: :func:`_integer` is written out here again; with it inlined by
    Numba instead, the whole kernel was a fifth slower (measured)."""
    while True:
        neg = i < e and data[i] == 45
        if neg:
            i += 1
        start = i
        v = 0
        while i < e:
            d = np.uint64(data[i]) - np.uint64(48)  # one test for a digit
            if d > np.uint64(9):
                break
            v = v * 10 + np.int64(d)
            i += 1
        digits = i - start
        if digits == 0 or digits > _MAX_DIGITS or (digits > 1 and data[start] == 48):
            return -1, used
        if neg:
            if v == 0:
                return -1, used
            v = -v
        if i >= e:
            return -1, used
        values[used] = v
        used += 1
        c = data[i]
        if c == 44:
            i += 1
            if i < e and (data[i] == 32 or data[i] == 9):
                i = _blank(data, i, e)
            continue
        if c == 32 or c == 9:
            i = _blank(data, i, e)
            if i >= e:
                return -1, used
            c = data[i]
            if c == 44:
                i = _blank(data, i + 1, e)
                continue
        if c == 93:
            return i + 1, used
        return -1, used  # `.`, `e`, `E` (a fraction or exponent) or anything else


def _name_is(data, i, names, name_off, k):  # pragma: no cover - compiled by Numba
    """Whether name ``k`` is written at ``data[i:]`` (the caller checks the room for it)."""
    a, n = name_off[k], name_off[k + 1] - name_off[k]
    j = 0
    while j < n and data[i + j] == names[a + j]:
        j += 1
    return j == n


def _key_at(data, i, e, names, name_off, lo, hi, hint):  # pragma: no cover - compiled by Numba
    """The key whose content starts at ``i`` (after its ``"``): ``(index of its name in
    [lo, hi), index of its closing ")``, the name -1 when it is none of them. The name
    ``hint`` (the one after the last key read) is tried first."""
    if hint >= lo and hint < hi:
        end = i + name_off[hint + 1] - name_off[hint]
        if end < e and data[end] == 34 and _name_is(data, i, names, name_off, hint):
            return hint, end
    end = _string(data, i, e)
    if end < 0:
        return -1, -1
    for k in range(lo, hi):
        if name_off[k + 1] - name_off[k] == end - i and _name_is(data, i, names, name_off, k):
            return k, end
    return -1, end


def _plain_kernel(  # pragma: no cover - compiled by Numba
    offsets,
    data,
    usable,
    names,
    name_off,
    n_dense,
    n_sparse,
    max_len,
    ts_lo,
    ts_hi,
    ok,
    rows,
    spans,
    ts,
    sp_at,
    sp_len,
    values,
):
    """Parse every line whose ``usable`` is set; ``ok`` marks the lines read in full.

    ``names`` holds the top-level keys (request id, session id, user id, ts, ``dense``,
    ``sparse``), then the dense names, then the sparse names (bounds in ``name_off``).
    The m-th line read in full is line ``rows[m]``; its ``spans[k, :, m]`` are the (start,
    end) of id k's text, then of dense number k - 3's (-1 when absent), ``ts[m]`` its ts, and
    ``sp_at/sp_len[f, m]`` where list f's ids sit in ``values`` (-1 when absent;
    ``max_len[f] < 0``: no length limit). Returns the lines read and the ids written to
    ``values`` (a rejected line's are overwritten).
    """
    n = offsets.shape[0] - 1
    top = 6
    d_lo, s_lo = top, top + n_dense
    used = 0
    m = 0
    seen = np.zeros(top, dtype=np.bool_)
    for r in range(n):
        ok[r] = False
        if not usable[r]:
            continue
        s, e = offsets[r], offsets[r + 1]
        row_start = used
        for k in range(3):
            spans[k, 0, m] = -1
            spans[k, 1, m] = -1
        for f in range(n_dense):
            spans[3 + f, 0, m] = -1
            spans[3 + f, 1, m] = -1
        for f in range(n_sparse):
            sp_at[f, m] = -1
            sp_len[f, m] = -1
        for k in range(top):
            seen[k] = False
        good = True
        hint = 0
        i = _blank(data, s, e)
        if i >= e or data[i] != 123:
            continue
        i = _blank(data, i + 1, e)
        while good:
            # a key
            if i >= e or data[i] != 34:
                good = False
                break
            k, ke = _key_at(data, i + 1, e, names, name_off, 0, top, hint)
            if k < 0 or seen[k]:
                good = False
                break
            seen[k] = True
            hint = k + 1
            i = _blank(data, ke + 1, e)
            if i >= e or data[i] != 58:
                good = False
                break
            i = _blank(data, i + 1, e)
            if i >= e:
                good = False
                break
            # its value
            if k < _TS:
                if data[i] == 34:
                    ve = _string(data, i + 1, e)
                    if ve < 0:
                        good = False
                        break
                    spans[k, 0, m] = i + 1
                    spans[k, 1, m] = ve
                    i = ve + 1
                else:
                    ve, _ = _integer(data, i, e)
                    if ve < 0:
                        good = False
                        break
                    spans[k, 0, m] = i
                    spans[k, 1, m] = ve
                    i = ve
            elif k == _TS:
                ve, v = _integer(data, i, e)
                if ve < 0 or v < ts_lo or v > ts_hi:
                    good = False
                    break
                ts[m] = v
                i = ve
            else:  # dense or sparse: an object of known names
                if data[i] != 123:
                    good = False
                    break
                lo = d_lo if k == _DENSE else s_lo
                hi = lo + (n_dense if k == _DENSE else n_sparse)
                i = _blank(data, i + 1, e)
                fhint = lo
                if i < e and data[i] == 125:
                    i += 1
                else:
                    while True:
                        if i >= e or data[i] != 34:
                            good = False
                            break
                        f, fe = _key_at(data, i + 1, e, names, name_off, lo, hi, fhint)
                        if f < 0:
                            good = False
                            break
                        fhint = f + 1
                        i = _blank(data, fe + 1, e)
                        if i >= e or data[i] != 58:
                            good = False
                            break
                        i = _blank(data, i + 1, e)
                        if k == _DENSE:
                            c = f - d_lo
                            if spans[3 + c, 0, m] >= 0:
                                good = False
                                break
                            ve = _number(data, i, e)
                            if ve < 0:
                                good = False
                                break
                            spans[3 + c, 0, m] = i
                            spans[3 + c, 1, m] = ve
                            i = ve
                        else:
                            c = f - s_lo
                            if sp_at[c, m] >= 0 or i >= e or data[i] != 91:
                                good = False
                                break
                            at = used
                            i = _blank(data, i + 1, e)
                            if i < e and data[i] == 93:
                                i += 1
                            else:
                                i, used = _int_list(data, i, e, values, used)
                                if i < 0:
                                    good = False
                                    break
                            if max_len[c] >= 0 and used - at > max_len[c]:
                                good = False
                                break
                            sp_at[c, m] = at
                            sp_len[c, m] = used - at
                        i = _blank(data, i, e)
                        if i < e and data[i] == 44:
                            i = _blank(data, i + 1, e)
                        elif i < e and data[i] == 125:
                            i += 1
                            break
                        else:
                            good = False
                            break
                    if not good:
                        break
            i = _blank(data, i, e)
            if i < e and data[i] == 44:
                i = _blank(data, i + 1, e)
            elif i < e and data[i] == 125:
                i = _blank(data, i + 1, e)
                if i != e:
                    good = False
                break
            else:
                good = False
                break
        if good and spans[0, 0, m] >= 0 and seen[_TS]:  # a request id and a ts
            ok[r] = True
            rows[m] = r
            m += 1
        else:
            used = row_start
    return m, used


def _gather(data, spans, m):  # pragma: no cover - compiled by Numba
    """The first ``m`` spans of each column back to back: ``(text, base, offsets)``, column
    c's ``offsets[c]`` relative to ``base[c]``."""
    n_text = spans.shape[0]
    base = np.zeros(n_text + 1, dtype=np.int64)
    for c in range(n_text):
        size = 0
        for j in range(m):
            if spans[c, 0, j] >= 0:
                size += spans[c, 1, j] - spans[c, 0, j]
        base[c + 1] = base[c] + size
    text = np.empty(max(base[n_text], 1), dtype=np.uint8)
    offsets = np.empty((n_text, m + 1), dtype=np.int64)
    for c in range(n_text):
        p = base[c]
        offsets[c, 0] = 0
        for j in range(m):
            a = spans[c, 0, j]
            if a >= 0:
                for q in range(a, spans[c, 1, j]):
                    text[p] = data[q]
                    p += 1
            offsets[c, j + 1] = p - base[c]
    return text, base, offsets


_KERNELS = None
_LOCK = threading.Lock()


def _kernels():
    """Compile the kernels (once per process; cached on disk by Numba)."""
    global _KERNELS, _blank, _integer, _number, _string, _name_is, _int_list, _key_at
    with _LOCK:  # files are parsed on several threads
        if _KERNELS is None:
            from numba import njit

            jit = njit(cache=True, nogil=True)
            # the helpers are inlined into the kernel: calls to them made it slower (measured)
            inline = njit(cache=True, nogil=True, inline="always")
            _blank, _integer, _number = inline(_blank), inline(_integer), inline(_number)
            _string, _int_list, _key_at = inline(_string), inline(_int_list), inline(_key_at)
            _name_is = inline(_name_is)
            _KERNELS = (jit(_plain_kernel), jit(_gather))
    return _KERNELS


def usable_schema(schema: DatasetSchema) -> bool:
    """Whether this tier reads the schema's lines: no passthrough keys, no ``ids = "hash"``
    feature (string ids: the SQL tiers read those), and every key name printable ASCII
    without ``"`` or ``\\`` (written in a line as it is)."""
    return _tables(schema) is not None


@functools.lru_cache(maxsize=16)
def _tables(schema: DatasetSchema) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The kernel's key names and their bounds (top-level keys, dense, sparse) and the
    sparse ``max_len`` (-1: truncated), once per schema; None when the tier skips it."""
    words = [*schema_keys(schema), "dense", "sparse"]
    words += [f.name for f in schema.dense] + [f.name for f in schema.sparse]
    plain = all(w and all(32 <= ord(c) <= 126 and c not in '"\\' for c in w) for w in words)
    if schema.passthrough or not plain or any(f.ids == "hash" for f in schema.sparse):
        return None
    names, name_off = pack_words(words)
    max_len = np.array([-1 if f.truncate else int(f.max_len) for f in schema.sparse], np.int64)
    return names, name_off, max_len


def split_plain(schema: DatasetSchema, lines: pa.Table) -> tuple[pa.Table | None, pa.Table]:
    """Read the plain lines of a batch; returns ``(parsed, rest)``.

    Args:
        schema: the dataset schema (:func:`usable_schema`).
        lines: numbered lines (:data:`etl.build.inputs.LINE_COLUMNS`, in the nested layout).

    Returns:
        ``parsed``: ``file_id``, ``line_no``, the three ids as text, ``ts``, ``dv0..`` (float64)
        and ``sv0..`` (int64 list views), one row per plain line (None when there is none),
        for :func:`plain_select`; ``rest``: the other lines, unchanged, for the SQL tiers.
    """
    if not lines.num_rows or not usable_schema(schema):
        return None, lines
    too_long = lines.column("too_long").combine_chunks()
    usable = pc.is_null(too_long).to_numpy(zero_copy_only=False)
    ok = np.zeros(lines.num_rows, dtype=np.bool_)
    parts, rows, at = [], [], 0
    for chunk in lines.column("line").chunks:  # each as it is: no copy of the text
        n = len(chunk)
        got = _parse_chunk(schema, chunk, usable[at : at + n], ok[at : at + n])
        if got is not None:
            parts.append(got[0])
            rows.append(got[1] + at)
        at += n
    if not parts:
        return None, lines
    take = pa.array(np.concatenate(rows))
    parsed = pa.concat_tables(parts)
    parsed = parsed.add_column(0, "line_no", lines.column("line_no").take(take))
    parsed = parsed.add_column(0, "file_id", lines.column("file_id").take(take))
    return parsed, lines.filter(pa.array(~ok))


def _parse_chunk(
    schema: DatasetSchema, col: pa.Array, usable: np.ndarray, ok: np.ndarray
) -> tuple[pa.Table, np.ndarray] | None:
    """:func:`split_plain` of one chunk of lines: its parsed rows (without ``file_id`` and
    ``line_no``) and their indices in the chunk; ``ok`` is set for them. None when none."""
    kernel, gather = _kernels()
    names, name_off, max_len = _tables(schema)
    offsets, data = text_buffers(col)
    n = offsets.size - 1
    if col.null_count:
        usable = usable & col.is_valid().to_numpy(zero_copy_only=False)
    nd, ns = len(schema.dense), len(schema.sparse)
    rows = np.empty(n, dtype=np.int64)
    spans = np.empty((3 + nd, 2, n), dtype=np.int64)
    ts = np.empty(n, dtype=np.int64)
    sp_at = np.empty((ns, n), dtype=np.int64)
    sp_len = np.empty((ns, n), dtype=np.int64)
    values = np.empty(int(offsets[-1] - offsets[0]) // 2 + 1, dtype=np.int64)
    ts_lo, ts_hi = ts_bounds(schema.time_unit)  # the raw ts, in the schema's unit
    m, used = kernel(
        offsets, data, usable, names, name_off, nd, ns, max_len, ts_lo, ts_hi,
        ok, rows, spans, ts, sp_at, sp_len, values,
    )  # fmt: skip
    if not m:
        return None
    text, text_base, text_off = gather(data, spans, m)

    def absent(where: np.ndarray) -> pa.Array | None:
        return pa.array(where < 0) if (where < 0).any() else None

    def strings(c: int) -> pa.Array:
        missing = absent(spans[c, 0, :m])
        valid = None if missing is None else pc.invert(missing).buffers()[1]
        body = pa.py_buffer(text[text_base[c] : text_base[c + 1]])
        return pa.Array.from_buffers(pa.large_string(), m, [valid, pa.py_buffer(text_off[c]), body])

    cols: dict[str, pa.Array] = {
        "request_id": strings(0),
        "session_key": strings(1),
        "user_key": strings(2),
        "ts": pa.array(ts[:m]),
    }
    # dense numbers: a row with one that is not finite within float32 goes to SQL (quarantined)
    keep = np.ones(m, dtype=np.bool_)
    for f in range(nd):
        got = pc.cast(strings(3 + f), pa.float64())
        v = got.to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            keep &= np.isnan(v) | (np.isfinite(v) & (np.abs(v) <= float(FLOAT32_MAX)))
            keep &= ~np.isnan(v) | (spans[3 + f, 0, :m] < 0)
        cols[f"dv{f}"] = got
    # the lists stay where the kernel wrote them: list views into one buffer of ids
    ids = pa.array(values[:used])
    for f in range(ns):
        at, size = sp_at[f, :m], sp_len[f, :m]
        mask = absent(at)
        if mask is not None:
            at, size = np.maximum(at, 0), np.maximum(size, 0)
        cols[f"sv{f}"] = pa.LargeListViewArray.from_arrays(
            pa.array(at), pa.array(size), ids, mask=mask
        )
    parsed, rows = pa.table(cols), rows[:m]
    if not keep.all():
        ok[rows[~keep]] = False
        parsed, rows = parsed.filter(pa.array(keep)), rows[keep]
    return (parsed, rows) if rows.size else None


def plain_select(schema: DatasetSchema, src: str) -> str:
    """SQL turning :func:`split_plain`'s ``parsed`` rows (relation ``src``) into validated
    feature rows (the columns of :func:`etl.build.validate.feature_select`), every one good."""
    return f"""
SELECT
  file_id,
  line_no,
  NULL::VARCHAR AS reason,
  NULL::VARCHAR AS detail,
  NULL::VARCHAR AS raw,
  NULL::VARCHAR AS source,
  NULL::BIGINT AS source_line,
  request_id,
  session_key,
  user_key,
  {ts_ms("ts", schema.time_unit)} AS ts,
{value_columns(schema)}  NULL::VARCHAR[] AS unknown,
  NULL::VARCHAR[] AS unknown_keys
FROM {src}
"""
