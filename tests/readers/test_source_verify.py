"""`ReaderConfig(verify=...)`: page checksums on read, sizes and sha256 at open."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from readers.source import DatasetSource, ReaderConfig
from recpipe.errors import CorruptInputError, DataError
from tests.common.tables import tables_equal
from tests.etl._integrity import flip_data_page, seal_dataset


def read_all(source: DatasetSource) -> pa.Table:
    return pa.concat_tables([t for t, _ in source.iter_tables(source.splits)])


def test_config():
    assert ReaderConfig().verify == "pages"
    with pytest.raises(DataError, match=r"`verify` must be 'off', 'pages' or 'full', got 'crc'"):
        ReaderConfig(verify="crc")


@pytest.mark.parametrize("partitions", [False, True])
def test_every_level_reads_the_same_rows_of_an_intact_dataset(
    make_dataset, tiny_schema, partitions
):
    root = seal_dataset(make_dataset(partitions=partitions))
    tables = {
        v: read_all(DatasetSource(root, schema=tiny_schema, config=ReaderConfig(verify=v)))
        for v in ("off", "pages", "full")
    }
    assert tables["off"].num_rows > 0
    assert tables_equal(tables["pages"], tables["off"]) and tables_equal(
        tables["full"], tables["off"]
    )


def test_pages_names_the_corrupt_page_or_skips_its_row_group(make_dataset, tiny_schema):
    root = seal_dataset(make_dataset(num_sessions=80, row_group_rows=60))
    clean = read_all(DatasetSource(root, schema=tiny_schema))
    path = root / "part-00001.parquet"
    flip_data_page(path, row_group=0, column="item_tags", count=16)
    with pytest.raises(CorruptInputError) as caught:
        read_all(DatasetSource(root, schema=tiny_schema))
    text = str(caught.value)
    assert f"{path}: row group 0 column `item_tags` cannot be decoded" in text
    assert "CRC checksum verification failed" in text and "recpipe etl verify" in text

    source = DatasetSource(root, schema=tiny_schema, config=ReaderConfig(on_error="skip"))
    delivered = read_all(source)
    [skip] = source.skipped
    assert (skip.path, skip.row_group) == (str(path), 0)
    first = next(s for s in source.splits if s.path == str(path))
    assert delivered.num_rows == clean.num_rows - first.num_rows == clean.num_rows - skip.rows
    # the rows delivered are the clean rows without that row group
    before = sum(s.num_rows for s in source.splits if s.path < str(path))
    expected = pa.concat_tables([clean.slice(0, before), clean.slice(before + skip.rows)])
    assert tables_equal(delivered, expected)


def test_full_checks_sizes_and_digests_when_the_source_opens(make_dataset, tiny_schema):
    root = seal_dataset(make_dataset(num_sessions=80, row_group_rows=60))
    path = root / "part-00000.parquet"
    flip_data_page(path, row_group=0, column="user_items", count=8)
    with pytest.raises(CorruptInputError, match=rf"{path}: sha256 differs: .*\(verify='full'\)"):
        DatasetSource(root, schema=tiny_schema, config=ReaderConfig(verify="full"))
    config = ReaderConfig(verify="full", on_error="skip")
    source = DatasetSource(root, schema=tiny_schema, config=config)
    [skip] = source.skipped
    assert (skip.path, skip.row_group) == (str(path), None)
    assert {s.path for s in source.splits} == {str(root / "part-00001.parquet")}

    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(CorruptInputError, match=r"size differs: the manifest says"):
        DatasetSource(root, schema=tiny_schema, config=ReaderConfig(verify="full"))


def test_full_needs_a_manifest_with_digests(make_dataset, tiny_schema):
    root = make_dataset()
    full = ReaderConfig(verify="full")
    with pytest.raises(DataError, match=r"verify='full' needs the dataset's _manifest\.json"):
        DatasetSource(root, schema=tiny_schema, config=full)
    seal_dataset(root)
    manifest = json.loads((root / "_manifest.json").read_text())
    del manifest["files"][0]["sha256"]
    (root / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"records no sha256 for it\nhint: rebuild the dataset"):
        DatasetSource(root, schema=tiny_schema, config=full)
    manifest["files"] = manifest["files"][1:]
    (root / "_manifest.json").write_text(json.dumps(manifest))
    # a file the manifest does not list is a stray at every level (tests/readers/
    # test_source_manifest.py), so verify='full' never meets it
    with pytest.raises(DataError, match=r"part-00000\.parquet: not listed in the manifest"):
        DatasetSource(root, schema=tiny_schema, config=full)
