"""Readers read what ``_manifest.json`` lists, and the files stay the ones they opened.

Regressions:

- a deleted part file made ``train`` read fewer rows and exit 0 (``verify="full"`` too); a stray
  ``part-00001.parquet`` copy added duplicated rows. A missing, stray or resized file is now an
  error naming it (or, with ``on_error="skip"``, a counted skip);
- a file and its manifest entry deleted together went unnoticed: the manifest's own totals
  (``rows_out``, ``row_groups``) are checked when a reader opens the dataset;
- ``etl build --overwrite`` of the same layout while a run read the dataset switched the data
  mid-run: each split's file must still be the one the reader opened.
"""

from __future__ import annotations

import doctest
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import readers.listing
from readers.dataset import make_dataloader
from readers.source import DatasetSource, ReaderConfig, discover_files
from recpipe.errors import CorruptInputError, DataError
from recpipe.integrity import FileChangedError
from tests.common.tables import tables_equal
from tests.etl._integrity import seal_dataset

LEVELS = ("off", "pages", "full")


def read_all(source: DatasetSource) -> pa.Table:
    return pa.concat_tables([t for t, _ in source.iter_tables(source.splits)])


@pytest.fixture
def sealed(make_dataset, tiny_schema) -> Path:
    """Three part files listed (size, sha256, rows) in a manifest with build-style totals."""
    root = seal_dataset(make_dataset(num_sessions=90, files=3, row_group_rows=30))
    path = root / "_manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(
        schema=tiny_schema.to_toml(),
        rows_out=sum(f["rows"] for f in manifest["files"]),
        row_groups=sum(f["row_groups"] for f in manifest["files"]),
        bytes_out=sum(f["bytes"] for f in manifest["files"]),
    )
    path.write_text(json.dumps(manifest, indent=2))
    return root


def edit_manifest(root: Path, edit) -> dict:
    path = root / "_manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2))
    return manifest


# -- item 11: the file list comes from the manifest --------------------------------------------


def test_docstring_example_runs():
    assert doctest.testmod(readers.listing, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("verify", LEVELS)
def test_a_deleted_part_file_is_an_error_naming_it(sealed, tiny_schema, verify):
    (sealed / "part-00001.parquet").unlink()
    with pytest.raises(DataError) as caught:
        DatasetSource(sealed, schema=tiny_schema, config=ReaderConfig(verify=verify))
    text = str(caught.value)
    assert f"dataset {str(sealed)!r} does not match its manifest:" in text
    assert "part-00001.parquet: missing: the manifest lists it" in text
    with pytest.raises(DataError, match=r"part-00001\.parquet: missing"):
        make_dataloader(sealed, config=ReaderConfig(batch_size=16, verify=verify))
    with pytest.raises(DataError, match=r"part-00001\.parquet: missing"):
        discover_files(sealed)


def test_a_deleted_part_file_is_counted_with_on_error_skip(sealed, tiny_schema):
    listed = {
        f["path"]: f["rows"] for f in json.loads((sealed / "_manifest.json").read_text())["files"]
    }
    full = DatasetSource(sealed, schema=tiny_schema)
    (sealed / "part-00001.parquet").unlink()
    source = DatasetSource(sealed, schema=tiny_schema, config=ReaderConfig(on_error="skip"))
    [skip] = source.skipped
    assert (skip.path, skip.row_group) == (str(sealed / "part-00001.parquet"), None)
    assert skip.rows == listed["part-00001.parquet"] > 0
    assert source.num_rows + skip.rows == full.num_rows


@pytest.mark.parametrize("where", ["part-00009.parquet", "dt=2024-01-01-00/part-00001.parquet"])
def test_a_stray_part_file_is_an_error_naming_it(sealed, tiny_schema, where):
    stray = sealed / where
    stray.parent.mkdir(exist_ok=True)
    shutil.copy(sealed / "part-00001.parquet", stray)  # a copy: its rows would be read twice
    for source in (
        sealed,
        str(sealed / "**" / "*.parquet"),
        [sealed / "part-00000.parquet", stray],
    ):
        with pytest.raises(DataError) as caught:
            DatasetSource(source, schema=tiny_schema)
        assert f"{where}: not listed in the manifest" in str(caught.value)
    source = DatasetSource(sealed, schema=tiny_schema, config=ReaderConfig(on_error="skip"))
    assert [s.path for s in source.skipped] == [str(stray)]
    assert str(stray) not in {s.path for s in source.splits}
    (sealed / "_quarantine" / "old.parquet").write_bytes(b"")  # not a part of the dataset
    stray.unlink()
    assert DatasetSource(sealed, schema=tiny_schema).num_rows > 0


@pytest.mark.parametrize("verify", ["off", "pages"])
def test_a_resized_file_is_an_error_at_every_level(sealed, tiny_schema, verify):
    path = sealed / "part-00002.parquet"
    size = path.stat().st_size
    with path.open("ab") as fh:
        fh.write(b"\0" * 7)
    with pytest.raises(CorruptInputError) as caught:
        DatasetSource(sealed, schema=tiny_schema, config=ReaderConfig(verify=verify))
    text = str(caught.value)
    assert (
        f"{path}: size differs: the manifest says {size:,} bytes, the file has {size + 7:,}" in text
    )


def test_a_file_with_other_rows_than_listed_is_an_error(sealed, tiny_schema):
    path = sealed / "part-00000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 1), path, row_group_size=10)

    def same_bytes(manifest):
        manifest["bytes_out"] += path.stat().st_size - manifest["files"][0]["bytes"]
        manifest["files"][0]["bytes"] = path.stat().st_size

    edit_manifest(sealed, same_bytes)
    with pytest.raises(CorruptInputError) as caught:
        DatasetSource(sealed, schema=tiny_schema, config=ReaderConfig(verify="pages"))
    assert f"{path}: the manifest says {table.num_rows:,} rows in " in str(caught.value)


def test_a_file_and_its_entry_removed_together_are_caught_by_the_totals(sealed, tiny_schema):
    (sealed / "part-00001.parquet").unlink()
    edit_manifest(sealed, lambda m: m["files"].pop(1))
    with pytest.raises(DataError) as caught:
        DatasetSource(sealed, schema=tiny_schema)
    text = str(caught.value)
    assert "_manifest.json: its files hold " in text and "rows, `rows_out` says" in text


def test_an_intact_dataset_reads_the_same_with_the_listing(sealed, tiny_schema):
    listed = DatasetSource(sealed, schema=tiny_schema)
    (sealed / "_manifest.json").unlink()  # a plain Parquet folder: discovered as before
    plain = DatasetSource(sealed, schema=tiny_schema)
    assert [s.path for s in listed.splits] == [s.path for s in plain.splits]
    assert tables_equal(read_all(listed), read_all(plain))


def test_a_manifest_without_a_file_list_reads_the_folder(make_dataset, tiny_schema):
    root = make_dataset()
    (root / "_manifest.json").write_text(json.dumps({"schema": tiny_schema.to_toml()}))
    assert DatasetSource(root, schema=tiny_schema).num_rows > 0
    (root / "_manifest.json").write_text(json.dumps({"format": "recpipe-clustered/1"}))
    with pytest.raises(DataError, match=r"`files` must be a list"):
        DatasetSource(root, schema=tiny_schema)


def test_train_refuses_a_dataset_missing_a_part_file(sealed, capsys):
    from recpipe_cli import main

    (sealed / "part-00001.parquet").unlink()
    args = ["train", str(sealed), "--steps", "2", "--batch-size", "16", "--embedding-dim", "4",
            "--num-embeddings", "64", "--no-progress"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "part-00001.parquet: missing: the manifest lists it" in err
    assert "Traceback" not in err


# -- item 12: the files a reader opened are the files it reads ---------------------------------


def rebuild_in_place(root: Path) -> None:
    """What `etl build --overwrite` of the same layout does to each part file: new files with
    the same row groups (every label 0 here) renamed over the old ones."""
    for path in sorted(root.glob("part-*.parquet")):
        pf = pq.ParquetFile(path)
        groups = [pf.read_row_group(i) for i in range(pf.num_row_groups)]
        pf.close()
        tmp = path.with_suffix(".tmp")
        with pq.ParquetWriter(tmp, groups[0].schema, compression="zstd") as writer:
            for group in groups:
                zeros = pa.array([0.0] * group.num_rows, pa.float32())
                group = group.set_column(group.schema.get_field_index("label"), "label", zeros)
                writer.write_table(group, row_group_size=group.num_rows)
        os.replace(tmp, path)


@pytest.mark.parametrize("read_ahead", [0, 1])
def test_a_dataset_rebuilt_during_a_read_is_an_error(sealed, tiny_schema, read_ahead):
    config = ReaderConfig(batch_size=8, read_ahead=read_ahead)
    source = DatasetSource(sealed, schema=tiny_schema, config=config)
    stream = source.iter_tables(source.splits)
    next(stream)
    rebuild_in_place(sealed)
    with pytest.raises(FileChangedError) as caught:
        for _ in stream:
            pass
    text = str(caught.value)
    assert "part-0000" in text and "changed since the reader opened the dataset" in text
    assert "replaced" in text


def test_a_loader_over_a_rebuilt_dataset_stops(sealed, tiny_schema):
    loader = make_dataloader(sealed, config=ReaderConfig(batch_size=8, on_error="skip"))
    batches = iter(loader)
    next(batches)
    rebuild_in_place(sealed)
    with pytest.raises(FileChangedError, match=r"part-0000\d\.parquet: changed since"):
        for _ in batches:  # not a skip: the run would mix two datasets
            pass


def test_a_worker_reports_a_rebuilt_dataset_without_its_traceback(sealed):
    loader = make_dataloader(sealed, config=ReaderConfig(batch_size=8), num_workers=1, timeout=60)
    batches = iter(loader)
    next(batches)
    rebuild_in_place(sealed)
    with pytest.raises(FileChangedError) as caught:
        for _ in batches:
            pass
    text = str(caught.value)
    assert text.startswith(f"{sealed}{os.sep}part-0000") and "changed since" in text
    assert "Traceback" not in text and "DataLoader worker" not in text


def test_a_modified_or_removed_file_during_a_read_is_an_error(sealed, tiny_schema):
    source = DatasetSource(sealed, schema=tiny_schema, config=ReaderConfig(read_ahead=0))
    first, last = source.splits[0], source.splits[-1]
    source.read_split(first)
    st = os.stat(first.path)
    os.utime(first.path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # written in place
    with pytest.raises(FileChangedError, match=r"modified"):
        source.read_split(first)
    os.unlink(last.path)
    with pytest.raises(FileChangedError, match=rf"{Path(last.path).name}: changed since .*removed"):
        source.read_split(last)


def test_etl_build_overwrite_during_a_run_is_an_error(tmp_path):
    """The issue's case: the same logs rebuilt without events (every label 0, the same files
    and row groups) while a loader reads the dataset."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate

    logs = generate(tmp_path / "raw", SynthConfig(num_requests=1_200, seed=2))
    out = tmp_path / "ds"
    config = BuildConfig(row_group_size=100)
    build(logs.features, out, events=logs.events, config=config)
    loader = make_dataloader(out, config=ReaderConfig(batch_size=64))
    batches = iter(loader)
    assert float(next(batches).labels.sum()) > 0
    before = json.loads((out / "_manifest.json").read_text())["files"]
    build(logs.features, out, config=config, overwrite=True)
    after = json.loads((out / "_manifest.json").read_text())["files"]
    assert [(f["path"], f["rows"], f["row_groups"]) for f in after] == [
        (f["path"], f["rows"], f["row_groups"]) for f in before
    ]
    with pytest.raises(FileChangedError, match=r"part-00000\.parquet: changed since .*replaced"):
        for _ in batches:
            pass
