"""Pass-through columns of a dataset as ``Batch.extras`` tensors, and the key of a string.

``ReaderConfig(extras=("request_id", "user_id"))`` makes a reader read those columns (and only
then: a reader not asked for them never reads them) and put one ``[B]`` int64 tensor per column
into ``Batch.extras``, in the rows' order:

* an integer column becomes its values as int64;
* a string column becomes :func:`string_key` of each value: a stable 64-bit hash of its UTF-8
  bytes, so predictions can be joined back to the logs by computing the same key on the other
  side (:func:`string_key` for one string, :func:`string_keys` for an Arrow array);
* NULL becomes :data:`NULL_KEY` (``-2**63``), in either kind of column; no string and no
  integer column value maps to it (a string whose hash is ``NULL_KEY`` gets ``NULL_KEY + 1``,
  and int64 min is refused in an integer column).

The key of a string, in 64-bit wrapping arithmetic, with ``mix64`` splitmix64's finaliser
(:mod:`recpipe.kernels.splitmix`) and ``GOLDEN = 0x9E3779B97F4A7C15``::

    b = text.encode("utf-8")
    h = mix64(len(b) + GOLDEN)
    for each 8-byte word w of b, little-endian, the last one zero-padded:
        h = mix64((h ^ w) + GOLDEN)
    key = h read as a signed int64 (NULL_KEY + 1 if that is NULL_KEY)

>>> string_key("r-000001")
6624213019634914290
>>> string_key(None) == NULL_KEY
True
>>> import pyarrow as pa
>>> string_keys(pa.array(["r-000001", None])).tolist() == [string_key("r-000001"), NULL_KEY]
True
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from recpipe.errors import DataError

__all__ = ["NULL_KEY", "check_extras", "extra_column_keys", "string_key", "string_keys"]

NULL_KEY = -(2**63)
"""The extras value of a NULL (int64 min)."""

_GOLDEN = 0x9E3779B97F4A7C15  # recpipe.kernels.splitmix.GOLDEN (that module imports Numba)
_MASK_64 = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _mix64_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (the same numbers as ``mix64``)."""
    x = ((x ^ (x >> 30)) * _M1) & _MASK_64
    x = ((x ^ (x >> 27)) * _M2) & _MASK_64
    return x ^ (x >> 31)


def string_key(text: str | None) -> int:
    """The ``Batch.extras`` key of one string (pure Python): a stable 64-bit hash of its UTF-8
    bytes as a signed int64, :data:`NULL_KEY` for ``None``. See the module docstring for the
    definition; :func:`string_keys` computes the same for an Arrow array.

    Args:
        text: the column value.
    """
    if text is None:
        return NULL_KEY
    if not isinstance(text, str):
        msg = f"`text` must be a string or None, got {text!r}"
        raise DataError(msg)
    data = text.encode("utf-8")
    h = _mix64_int((len(data) + _GOLDEN) & _MASK_64)
    for i in range(0, len(data), 8):
        word = int.from_bytes(data[i : i + 8], "little")
        h = _mix64_int(((h ^ word) + _GOLDEN) & _MASK_64)
    key = h - (1 << 64) if h >= 1 << 63 else h
    return NULL_KEY + 1 if key == NULL_KEY else key


def string_keys(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """:func:`string_key` of every value of an Arrow string array, as an int64 NumPy array.

    Args:
        array: a ``string`` or ``large_string`` array (chunked or not).
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        msg = f"`array` must be an Arrow string array, got type {array.type}"
        raise DataError(msg)
    n = len(array)
    _, offsets_buf, data_buf = array.buffers()
    offset_type = np.int64 if pa.types.is_large_string(array.type) else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[array.offset : array.offset + n + 1]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    )
    from readers._string_hash import string_hashes  # Numba, imported when first needed

    hashes = np.empty(n, dtype=np.uint64)
    string_hashes(offsets.astype(np.int64), data, np.uint64(_GOLDEN), hashes)
    keys = hashes.view(np.int64)
    keys[keys == NULL_KEY] = NULL_KEY + 1
    if array.null_count:
        keys[array.is_null().to_numpy(zero_copy_only=False)] = NULL_KEY
    return keys


def _integer_keys(name: str, array: pa.ChunkedArray) -> np.ndarray:
    try:
        values = array.cast(pa.int64())  # safe cast: a uint64 above int64 max raises
    except pa.ArrowInvalid as exc:
        msg = f"extras column `{name}` holds a value outside int64: {exc}"
        raise DataError(msg) from None
    keys = values.fill_null(NULL_KEY).to_numpy()
    valid = ~values.is_null().to_numpy(zero_copy_only=False)
    clash = np.flatnonzero((keys == NULL_KEY) & valid)
    if clash.size:
        row = int(clash[0])
        msg = (
            f"extras column `{name}` row {row} holds int64 min ({NULL_KEY}), the value that "
            "stands for NULL in `Batch.extras`"
        )
        raise DataError(msg)
    return np.ascontiguousarray(keys)


def extra_column_keys(name: str, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The int64 ``Batch.extras`` values of one column: integers as they are, strings through
    :func:`string_keys`, NULL as :data:`NULL_KEY`.

    Raises:
        DataError: a column of another type, or an integer column holding ``NULL_KEY``.
    """
    if isinstance(column, pa.Array):
        column = pa.chunked_array([column])
    kind = column.type
    if pa.types.is_integer(kind):
        return _integer_keys(name, column)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return string_keys(column)
    msg = f"extras column `{name}` has type {kind}; only integer and string columns can be extras"
    raise DataError(msg)


def check_extras(names: Sequence[str], available: pa.Schema, *, where: str) -> None:
    """Check that every name of ``names`` is an integer or string column of ``available``.

    Args:
        names: the requested extras.
        available: the Arrow schema of a dataset file.
        where: the file, for the message.

    Raises:
        DataError: a column is missing (the message lists the file's columns and the closest
            name) or of another type.
    """
    for name in names:
        idx = available.get_field_index(name)
        if idx < 0:
            close = difflib.get_close_matches(name, available.names, n=1, cutoff=0.6)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            msg = (
                f"{where}: extras column `{name}` is not in the dataset{hint}; its columns: "
                f"{', '.join(available.names)}"
            )
            raise DataError(msg)
        kind = available.field(idx).type
        ok = pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
        if not ok:
            msg = (
                f"{where}: extras column `{name}` has type {kind}; only integer and string "
                "columns can be extras"
            )
            raise DataError(msg)
