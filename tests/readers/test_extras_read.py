"""``ReaderConfig(extras=...)``: pass-through columns of a built dataset read into
``Batch.extras`` (in-process, rank readers and the reader service), the string key against a
plain-Python reference, and the errors for columns a reader cannot deliver."""

from __future__ import annotations

import dataclasses
import io
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from readers.dataset import iter_batches, make_dataloader
from readers.extras import NULL_KEY, extra_column_keys, string_key, string_keys
from readers.ranks import RankBatchDataset
from readers.service import DatasetProducer, ReaderServer, ServiceClient, ServiceConfig
from readers.source import DatasetSource, ReaderConfig, discover_files
from recpipe.batch import Batch
from recpipe.errors import DataError
from recpipe_cli import main
from tests.common.data import session_table, synthetic_dataset, write_clustered

EXTRAS = ("request_id", "user_id", "session_id_raw")


def _reference_key(text: str) -> int:
    """The documented key, written independently: 64-bit words unpacked with ``struct``."""
    mask = (1 << 64) - 1
    golden = 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    data = text.encode("utf-8")
    padded = data + b"\0" * (-len(data) % 8)
    h = mix((len(data) + golden) & mask)
    for (word,) in struct.iter_unpack("<Q", padded):
        h = mix(((h ^ word) + golden) & mask)
    (key,) = struct.unpack("<q", struct.pack("<Q", h))
    return key


TEXTS = ["", "a", "r-00001", "r-000001", "r-0000001", "u" * 16, "u" * 17, "näive ✓ 用户", "\0"]


def test_string_key_matches_a_plain_python_reference():
    assert [string_key(t) for t in TEXTS] == [_reference_key(t) for t in TEXTS]
    assert string_key(None) == NULL_KEY
    assert len({string_key(t) for t in TEXTS}) == len(TEXTS)
    assert string_key("") != string_key("\0")  # the length is hashed in


def test_string_keys_of_arrow_arrays_equal_the_scalar_key():
    values = [*TEXTS, None, "x"]
    expected = [string_key(v) for v in values]
    array = pa.array(values, type=pa.string())
    assert string_keys(array).tolist() == expected
    assert string_keys(array.slice(3, 5)).tolist() == expected[3:8]  # an offset into the buffers
    assert string_keys(pa.array(values, type=pa.large_string())).tolist() == expected
    chunked = pa.chunked_array([values[:4], values[4:]], type=pa.string())
    assert string_keys(chunked).tolist() == expected
    assert string_keys(pa.array([], type=pa.string())).tolist() == []
    assert string_keys(pa.array([None, None], type=pa.string())).tolist() == [NULL_KEY] * 2


def test_integer_columns_keep_their_values_and_nulls_become_the_sentinel():
    keys = extra_column_keys("n", pa.array([5, None, -(2**62)], type=pa.int64()))
    assert keys.dtype == np.int64 and keys.tolist() == [5, NULL_KEY, -(2**62)]
    assert extra_column_keys("n", pa.array([1, 2], type=pa.uint8())).tolist() == [1, 2]
    with pytest.raises(DataError, match=r"`n` row 1 holds int64 min"):
        extra_column_keys("n", pa.array([1, NULL_KEY], type=pa.int64()))
    with pytest.raises(DataError, match=r"extras column `f` has type double"):
        extra_column_keys("f", pa.array([1.5]))


def test_integer_values_outside_int64_and_the_sentinel_behind_a_null_are_named():
    with pytest.raises(DataError, match="`u` holds a value outside int64"):
        extra_column_keys("u", pa.array([1, 2**63], type=pa.uint64()))
    with pytest.raises(DataError, match="`n` row 1 holds int64 min"):
        extra_column_keys("n", pa.array([None, NULL_KEY], type=pa.int64()))


# -- a built dataset -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small dataset built by the ETL from synthetic logs (pass-through columns included)."""
    return synthetic_dataset(
        tmp_path_factory.mktemp("extras"), requests=400, seed=7, files=2, row_group_size=64
    )


@pytest.fixture(scope="module")
def rows(built):
    """The dataset's rows in the readers' unshuffled order (files by path, row groups in order)."""
    return pa.concat_tables(pq.read_table(p) for p in discover_files(built))


def _expected_keys(rows: pa.Table) -> dict[str, list[int]]:
    return {name: [string_key(v) for v in rows.column(name).to_pylist()] for name in EXTRAS}


def _without_extras(batch: Batch) -> Batch:
    return Batch(batch.dense, batch.labels, batch.kjt, batch.ikjts, batch.session_ids)


def _concat(batches: list[Batch], name: str) -> list[int]:
    return torch.cat([b.extras[name] for b in batches]).tolist()


@pytest.mark.parametrize("dedup", [True, False])
def test_extras_equal_the_keys_of_the_parquet_rows_in_order(built, rows, dedup):
    plain = list(iter_batches(built, config=ReaderConfig(batch_size=50), dedup=dedup))
    got = list(iter_batches(built, config=ReaderConfig(batch_size=50, extras=EXTRAS), dedup=dedup))
    assert len(got) == len(plain) > 2
    assert all(not b.extras for b in plain)
    assert all(_without_extras(g).equals(p) for g, p in zip(got, plain))  # inputs unchanged
    assert all(list(g.extras) == list(EXTRAS) for g in got)
    assert all(
        t.dtype == torch.int64 and t.shape == (g.batch_size,)
        for g in got
        for t in g.extras.values()
    )
    expected = _expected_keys(rows)
    assert {name: _concat(got, name) for name in EXTRAS} == expected
    assert torch.cat([g.session_ids for g in got]).tolist() == rows.column("session_id").to_pylist()


def _row_index(rows: pa.Table) -> dict[int, tuple[int, float]]:
    """request key -> (session id, label) of that row of the dataset."""
    keys = string_keys(rows.column("request_id")).tolist()
    assert len(set(keys)) == rows.num_rows  # request ids are unique
    pairs = zip(rows.column("session_id").to_pylist(), rows.column("label").to_pylist())
    return dict(zip(keys, pairs))


def _assert_aligned(batches: list[Batch], rows: pa.Table, *, every_row: bool = True) -> None:
    """Every delivered row's extras belong to the Parquet row whose inputs it carries (and,
    with ``every_row``, every row is delivered once)."""
    index = _row_index(rows)
    user = dict(zip(index, string_keys(rows.column("user_id")).tolist()))
    seen = []
    for b in batches:
        for rid, uid, sid, label in zip(
            b.extras["request_id"].tolist(), b.extras["user_id"].tolist(),
            b.session_ids.tolist(), b.labels.tolist(),
        ):  # fmt: skip
            assert index[rid] == (sid, label) and user[rid] == uid
            seen.append(rid)
    assert len(set(seen)) == len(seen)
    if every_row:
        assert sorted(seen) == sorted(index)


@pytest.mark.parametrize("dedup", [True, False])
def test_shuffled_loader_with_workers_carries_each_rows_own_extras(built, rows, dedup):
    config = ReaderConfig(batch_size=40, shuffle=True, seed=3, shuffle_buffer=8)
    with_extras = dataclasses.replace(config, extras=("request_id", "user_id"))
    plain = list(make_dataloader(built, config=config, dedup=dedup, num_workers=2))
    got = list(make_dataloader(built, config=with_extras, dedup=dedup, num_workers=2))
    assert len(got) == len(plain)
    assert all(_without_extras(g).equals(p) for g, p in zip(got, plain))
    _assert_aligned(got, rows)


def test_rank_readers_carry_extras(built, rows):
    config = ReaderConfig(batch_size=32, shuffle=True, seed=1, extras=("request_id", "user_id"))
    batches = [
        b for r in range(2) for b in RankBatchDataset(built, config=config, rank=r, world_size=2)
    ]
    assert len(batches) > 4
    _assert_aligned(batches, rows, every_row=False)  # the epoch remainder is not delivered


def test_the_reader_service_carries_extras(built, rows):
    producer = DatasetProducer(str(built), batch_size=48, extras=("request_id", "user_id"))
    config = ServiceConfig(readers=0, report_every_s=0, heartbeat_s=0.5)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        host, port = server.address
        with ServiceClient(host, port, read_timeout_s=60) as client:
            got = list(client)
    expected = list(
        iter_batches(built, config=ReaderConfig(batch_size=48, extras=("request_id", "user_id")))
    )
    assert len(got) == len(expected) > 0 and all(g.equals(e) for g, e in zip(got, expected))
    _assert_aligned(got, rows)


def test_extras_columns_are_read_only_when_asked(built):
    plain = DatasetSource(built, schema=_schema(built))
    asked = DatasetSource(built, schema=_schema(built), config=ReaderConfig(extras=("user_id",)))
    assert "user_id" not in plain.columns and asked.columns[-1] == "user_id"
    table = plain.read_split(plain.splits[0])
    assert not set(EXTRAS) & set(table.column_names)


def _schema(built):
    from readers.dataset import dataset_schema

    return dataset_schema(built)


# -- errors ----------------------------------------------------------------------------------


def test_an_unknown_extras_column_is_named_with_the_closest_and_the_columns(built):
    with pytest.raises(
        DataError,
        match=r"extras column `request_idd` is not in the dataset "
        r"\(did you mean `request_id`\?\); its columns: session_id, ts, .*user_id",
    ):
        next(iter_batches(built, config=ReaderConfig(extras=("request_idd",))))


def test_extras_that_are_model_inputs_or_not_integer_or_text_are_refused(
    built, tiny_schema, tmp_path
):
    with pytest.raises(DataError, match=r"`extras` column `label` is a model input"):
        DatasetSource(built, schema=_schema(built), config=ReaderConfig(extras=("label",)))
    with pytest.raises(DataError, match=r"`extras` must be a list of column names, got 'user_id'"):
        ReaderConfig(extras="user_id")
    with pytest.raises(DataError, match=r"`extras` names a column twice"):
        ReaderConfig(extras=("user_id", "user_id"))
    table = session_table(tiny_schema, num_sessions=3, seed=0)
    table = table.append_column("score", pa.array([0.5] * table.num_rows))
    write_clustered(table, tmp_path / "ds" / "part.parquet", row_group_rows=10)
    with pytest.raises(DataError, match=r"part.parquet: extras column `score` has type double"):
        DatasetSource(tmp_path / "ds", schema=tiny_schema, config=ReaderConfig(extras=("score",)))


def test_integer_and_null_extras_of_a_hand_made_dataset(tiny_schema, tmp_path):
    table = session_table(tiny_schema, num_sessions=6, seed=2)
    n = table.num_rows
    ints = [None if i % 5 == 0 else i * 10**12 for i in range(n)]
    texts = [None if i % 3 == 0 else f"req-{i}" for i in range(n)]
    table = table.append_column("n", pa.array(ints, pa.int64())).append_column("t", pa.array(texts))
    write_clustered(table, tmp_path / "ds" / "part.parquet", row_group_rows=8)
    config = ReaderConfig(batch_size=7, extras=("t", "n", "ts"))
    batches = list(iter_batches(tmp_path / "ds", schema=tiny_schema, config=config))
    assert _concat(batches, "n") == [NULL_KEY if v is None else v for v in ints]
    assert _concat(batches, "t") == [string_key(v) for v in texts]
    assert _concat(batches, "ts") == table.column("ts").to_pylist()


def test_serve_refuses_an_unknown_extras_column_before_it_starts(built, capsys):
    code = main(["serve", str(built), "--extras", "request_id,usr_id", "--port", "0"])
    assert code != 0
    assert (
        "extras column `usr_id` is not in the dataset (did you mean `user_id`?)"
        in capsys.readouterr().err
    )
