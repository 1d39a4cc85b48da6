"""Hand-made clustered datasets for the reader tests (small, exact, independent of the ETL)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

TINY_SCHEMA = """
[dataset]
name = "tiny"

[[dense]]
name = "user_age"
fill = 30.0

[[dense]]
name = "item_price"
fill = 0.0

[[sparse]]
name = "user_items"
kind = "user"
max_len = 6

[[sparse]]
name = "user_sellers"
kind = "user"
max_len = 4

[[sparse]]
name = "user_segment"
kind = "user"
max_len = 1

[[sparse]]
name = "item_id"
kind = "item"
max_len = 1

[[sparse]]
name = "item_tags"
kind = "item"
max_len = 3

[dedup]
groups = [["user_items", "user_sellers"], ["user_segment"]]
"""


@pytest.fixture(scope="session")
def tiny_schema():
    """A 2-dense, 5-sparse schema with two dedup groups and two plain features."""
    from schemas import parse_schema

    return parse_schema(TINY_SCHEMA, source="tiny.toml")


def session_table(schema, *, num_sessions: int, seed: int, first_session: int = 0) -> pa.Table:
    """Rows clustered by session, sorted by ts; user lists repeat or shift within a session."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 9, size=num_sessions)
    cols: dict[str, list] = {n: [] for n in schema.arrow_schema().names}
    ts = 1_700_000_000_000
    for s, n in enumerate(lens):
        items = list(rng.integers(0, 50, size=rng.integers(0, 7)))
        sellers = list(rng.integers(0, 20, size=rng.integers(0, 5)))
        segment = [int(rng.integers(0, 4))]
        age = float(rng.integers(18, 70))
        for _ in range(n):
            if rng.random() < 0.2:  # the list shifts by one id (new one in, oldest out at max_len)
                items = [*items, int(rng.integers(0, 50))][-6:]
            ts += int(rng.integers(1, 1000))
            cols["session_id"].append(first_session + s)
            cols["ts"].append(ts)
            cols["label"].append(float(rng.random() < 0.3))
            cols["user_age"].append(age if rng.random() > 0.1 else float("nan"))
            cols["item_price"].append(float(rng.gamma(2.0, 10.0)))
            cols["user_items"].append([int(x) for x in items])
            cols["user_sellers"].append([int(x) for x in sellers])
            cols["user_segment"].append(segment)
            cols["item_id"].append([int(rng.integers(0, 1000))])
            cols["item_tags"].append([int(x) for x in rng.integers(0, 30, size=rng.integers(0, 4))])
    return pa.table(cols, schema=schema.arrow_schema())


def write_clustered(table: pa.Table, path: Path, *, row_group_rows: int) -> None:
    """Write ``table`` with row groups cut at session boundaries (like the ETL)."""
    sid = table.column("session_id").to_numpy()
    starts = np.concatenate(([0], np.flatnonzero(sid[1:] != sid[:-1]) + 1, [len(sid)]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        begin = 0
        for end in starts[1:]:
            if end - begin >= row_group_rows or end == len(sid):
                writer.write_table(table.slice(begin, end - begin), row_group_size=1 << 30)
                begin = end


@pytest.fixture(scope="session")
def make_table(tiny_schema):
    """Factory: ``session_table`` over the tiny schema."""
    return lambda **kw: session_table(tiny_schema, **kw)


@pytest.fixture
def make_dataset(tmp_path, tiny_schema):
    """Factory: a clustered dataset directory of ``files`` files with small row groups."""

    def make(
        *,
        num_sessions: int = 60,
        files: int = 2,
        row_group_rows: int = 40,
        seed: int = 0,
        name: str = "ds",
        partitions: bool = False,
    ) -> Path:
        root = tmp_path / name
        per_file = -(-num_sessions // files)
        for f in range(files):
            count = min(per_file, num_sessions - f * per_file)
            table = session_table(
                tiny_schema, num_sessions=count, seed=seed * 1000 + f, first_session=f * per_file
            )
            folder = root / f"dt=2024-01-01-{f:02d}" if partitions else root
            write_clustered(table, folder / f"part-{f:05d}.parquet", row_group_rows=row_group_rows)
        (root / "_quarantine").mkdir(parents=True, exist_ok=True)
        return root

    return make


def corrupt_column(path: Path, column: str) -> None:
    """Overwrite most of row group 0's pages of ``column`` so that decoding it fails."""
    meta = pq.read_metadata(path)
    names = [meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index(column))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    size = chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    data[start + size // 4 : start + size - 2] = b"\xa5" * (size - 2 - size // 4)
    path.write_bytes(bytes(data))


@pytest.fixture(name="corrupt_column")
def corrupt_column_fixture():
    """The :func:`corrupt_column` helper."""
    return corrupt_column
