"""Test data built without the ETL (exact, small) and with it (realistic).

* :func:`session_table` / :func:`write_clustered`: hand-made clustered Parquet for the readers;
* :func:`session_batch`: a deduplicated :class:`~recpipe.batch.Batch` built from recpipe types;
* :func:`synthetic_dataset`: synthetic logs through ``etl.build`` (the real pipeline);
* :func:`corrupt_column`: damage a column chunk so that decoding it fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recpipe.batch import Batch
from recpipe.ikjt import InverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor

__all__ = [
    "corrupt_column",
    "group_name",
    "session_batch",
    "session_table",
    "synthetic_dataset",
    "write_clustered",
]


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


def group_name(keys):
    return "+".join(keys)


def session_batch(
    schema,
    batch_size: int,
    *,
    seed: int = 0,
    mean_session_len: float = 6.0,
    shift_prob: float = 0.3,
    vocab: int = 500,
    label_signal: bool = False,
) -> Batch:
    """A deduplicated Batch of whole sessions for ``schema`` (plain: ``batch.to_plain()``).

    User features stay constant within a session except that each dedup group's lists shift
    together by one id with ``shift_prob`` per row; item/context features change every row.
    Empty lists occur. With ``label_signal`` labels depend on the item id and segment.
    """
    rng = np.random.default_rng(seed)
    rows, session_ids = 0, []
    sid = 0
    while rows < batch_size:
        n = min(int(rng.geometric(1.0 / mean_session_len)), batch_size - rows)
        session_ids += [sid] * n
        rows += n
        sid += 1
    sessions = np.array(session_ids)
    first = np.r_[True, sessions[1:] != sessions[:-1]]
    groups = [tuple(g) for g in schema.dedup_groups]
    shift_of = {}
    for g in groups:
        shift = rng.random(batch_size) < shift_prob
        for f in g:
            shift_of[f] = shift
    features = {}
    for spec in schema.sparse:
        lists = []
        if spec.kind == "user":
            shift = shift_of.get(spec.name, rng.random(batch_size) < shift_prob)
            current: list[int] = []
            for r in range(batch_size):
                if first[r]:
                    length = int(rng.integers(0, spec.max_len + 1))
                    current = rng.integers(0, vocab, length).tolist()
                elif shift[r]:
                    current = [*current, int(rng.integers(0, vocab))][-spec.max_len :]
                lists.append(current)
        else:
            for _ in range(batch_size):
                length = int(rng.integers(0 if spec.max_len > 1 else 1, spec.max_len + 1))
                lists.append(rng.integers(0, vocab, length).tolist())
        features[spec.name] = JaggedTensor.from_dense_list(
            [torch.tensor(x, dtype=torch.int64) for x in lists], dtype=torch.int64
        )
    kjt = KeyedJaggedTensor.from_jagged_dict(features)
    grouped = {f for g in groups for f in g}
    plain = kjt.select([f for f in schema.sparse_names if f not in grouped])
    dense = torch.from_numpy(rng.normal(size=(batch_size, len(schema.dense))).astype(np.float32))
    if label_signal:
        item_f = next(s.name for s in schema.sparse if s.kind == "item" and s.max_len == 1)
        item = features[item_f].values().numpy()
        logit = ((item % 7) - 3.0) * 0.8 + dense[:, 0].numpy()
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = torch.from_numpy((rng.random(batch_size) < p).astype(np.float32))
    else:
        labels = torch.from_numpy((rng.random(batch_size) < 0.3).astype(np.float32))
    return Batch(
        dense=dense,
        labels=labels,
        kjt=plain,
        ikjts={group_name(g): InverseKeyedJaggedTensor.from_kjt(kjt, g) for g in groups},
        session_ids=torch.from_numpy(sessions),
    )


def synthetic_dataset(
    root: Path,
    *,
    requests: int,
    seed: int,
    files: int = 4,
    row_group_size: int | None = None,
    bad_fraction: float = 0.0,
    schema: Any = None,
) -> Path:
    """Synthetic logs (``etl.synth``) built into a clustered dataset at ``root / "dataset"``
    (with ``schema``, default the bundled one: a schema of fewer features leaves the others out)."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    logs = generate(
        root / "raw",
        SynthConfig(num_requests=requests, seed=seed, files=files, bad_fraction=bad_fraction),
    )
    config = BuildConfig() if row_group_size is None else BuildConfig(row_group_size=row_group_size)
    out = root / "dataset"
    schema = default_schema() if schema is None else schema
    build(logs.features, out, events=logs.events, schema=schema, config=config)
    return out
