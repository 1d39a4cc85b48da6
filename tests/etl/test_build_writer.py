"""`etl build`'s Parquet writer: encoding on a second thread writes the same bytes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from etl.build.writer import SessionAlignedWriter, choose_dictionary

SCHEMA = pa.schema(
    [
        ("session_id", pa.int64()),
        ("ts", pa.int64()),
        ("label", pa.float32()),
        ("ids", pa.list_(pa.int64())),
    ]
)


def _rows(n: int, seed: int = 0) -> pa.Table:
    """``n`` rows sorted by (session, ts): sessions of 1..300 rows, some longer than a group."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 300, size=n)
    sizes[::7] = 900  # longer than the row groups below: split inside a session
    sid = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)[:n]
    lengths = rng.integers(0, 6, size=n)
    values = rng.integers(0, 50, size=int(lengths.sum()))
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    return pa.table(
        {
            "session_id": sid,
            "ts": np.arange(n, dtype=np.int64),
            "label": rng.random(n).astype(np.float32),
            "ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int64())),
        },
        schema=SCHEMA,
    )


def _writer(root: Path, **kw) -> SessionAlignedWriter:
    return SessionAlignedWriter(
        root=root, schema=SCHEMA, session_col="session_id", row_group_size=512, zstd_level=3, **kw
    )


def _write(root: Path, table: pa.Table, *, background: bool, hour_every: int | None, **kw):
    writer = _writer(root, background=background, **kw)
    for start in range(0, table.num_rows, 333):  # batches that do not line up with groups
        batch = table.slice(start, 333)
        part = None if hour_every is None else f"dt=h{start // hour_every}"
        writer.write(batch, partition=part)
    files = writer.close()
    counts = (writer.sessions, writer.session_continuations, writer.sessions_split_across_files)
    return writer, files, counts


@pytest.mark.parametrize(
    ("hour_every", "max_file_bytes"),
    [(None, 256 << 20), (None, 6_000), (2_997, 256 << 20), (2_997, 6_000)],
    ids=["one-file", "rollover", "partitions", "partitions-rollover"],
)
def test_background_encoding_writes_the_same_files(tmp_path, hour_every, max_file_bytes):
    table = _rows(12_000)
    out = {}
    for background in (False, True):
        root = tmp_path / f"bg{int(background)}"
        writer, files, counts = _write(
            root,
            table,
            background=background,
            hour_every=hour_every,
            max_file_bytes=max_file_bytes,
        )
        blobs = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.parquet")}
        out[background] = (files, counts, writer.dictionary, writer.dictionary_measured, blobs)
    assert len(out[False][0]) > (1 if max_file_bytes < 1 << 20 or hour_every else 0)
    assert out[True] == out[False]
    rows = sum(pq.ParquetFile(io.BytesIO(b)).metadata.num_rows for b in out[True][4].values())
    assert rows == table.num_rows


def test_background_encoding_error_is_raised_and_stops_the_thread(tmp_path):
    root = tmp_path / "taken"
    root.write_text("a file where the dataset folder should be")
    writer = _writer(root, dictionary=[], background=True)
    with pytest.raises(FileExistsError):  # opening the first file, on the encoding thread
        for _ in range(20):  # the error comes back on a later write, or on close
            writer.write(_rows(2_000))
        writer.close()
    thread = writer._encoder._thread if writer._encoder is not None else None
    writer.abort()
    assert writer._encoder is None and (thread is None or not thread.is_alive())
    assert writer.files == []


def test_abort_stops_without_writing_the_buffered_rows(tmp_path):
    writer = _writer(tmp_path, background=True)
    writer.write(_rows(1_500))
    writer.abort()
    assert writer._encoder is None and writer._writer is None
    assert sum(f.rows for f in writer.files) < 1_500  # the rows still buffered are dropped


def test_choose_dictionary_measures_every_column_as_one_at_a_time(tmp_path):
    table = _rows(5_000)
    got = choose_dictionary(table, level=3)
    assert list(got) == table.column_names
    for name in table.column_names:
        sizes = {}
        for use in (True, False):
            buf = io.BytesIO()
            pq.write_table(
                table.select([name]),
                buf,
                compression="zstd",
                compression_level=3,
                use_dictionary=use,
            )
            sizes[use] = buf.tell()
        assert got[name] == {
            "dict": sizes[True],
            "plain": sizes[False],
            "use": sizes[True] <= 0.98 * sizes[False],
        }
