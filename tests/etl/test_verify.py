"""`recpipe etl verify`, and silent Parquet corruption end to end (build -> flip -> check).

Regression: 64 flipped bytes inside `part-00000.parquet` raised nothing: `stats` exited 0 and
the readers delivered different lists. Now `etl verify` and `stats` fail naming the file, and a
reader raises naming file, row group and column, or skips and counts the row group; what it
delivers is exactly the original rows.
"""

from __future__ import annotations

import doctest
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

import etl.verify
from etl.verify import verify_dataset, verify_digests
from recpipe.errors import CorruptInputError, DataError
from recpipe_cli import main
from tests.common.tables import tables_equal
from tests.etl._integrity import flip_data_page, seal_dataset

BAD_GROUP, BAD_COLUMN = 1, "user_liked_items"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A dataset from the real build: 2,000 synthetic requests, row groups of ~300 rows."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate

    work = tmp_path_factory.mktemp("verify")
    logs = generate(work / "raw", SynthConfig(num_requests=2_000, seed=3))
    out = work / "built"
    build(logs.features, out, events=logs.events, config=BuildConfig(row_group_size=300))
    return out


@pytest.fixture
def sealed(built, tmp_path) -> Path:
    """A copy of ``built`` with page checksums and digests in its manifest."""
    return seal_dataset(Path(shutil.copytree(built, tmp_path / "ds")))


def verify_cli(dataset: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["etl", "verify", str(dataset), "--no-progress", *extra])
    return code, capsys.readouterr().out


def test_docstring_example_runs():
    assert doctest.testmod(etl.verify, optionflags=doctest.ELLIPSIS).failed == 0


def test_an_intact_dataset_verifies(sealed, capsys):
    code, out = verify_cli(sealed, capsys)
    assert code == 0, out
    manifest = json.loads((sealed / "_manifest.json").read_text())
    groups = sum(f["row_groups"] for f in manifest["files"])
    assert groups >= 3
    assert f"{groups:,} row groups read with page-checksum verification" in out
    assert out.rstrip().endswith("OK: every file matches the manifest")
    code, out = verify_cli(sealed, capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["problems"] == []
    assert report["digests_checked"] == report["files"] == len(manifest["files"])
    assert (
        report["rows"]
        == manifest["rows_out"]
        == 2_000 - sum(manifest["quarantine_by_reason"].values())
    )


def test_flipped_bytes_in_a_data_page_are_caught_everywhere(sealed, tmp_path, capsys):
    from readers.dataset import iter_batches
    from readers.source import DatasetSource, ReaderConfig
    from schemas import default_schema

    schema = default_schema()
    pristine = shutil.copytree(sealed, tmp_path / "pristine")
    part = sealed / "part-00000.parquet"
    flip_data_page(part, row_group=BAD_GROUP, column=BAD_COLUMN, count=64)

    code, out = verify_cli(sealed, capsys)
    assert code == 1
    assert "part-00000.parquet: sha256 differs: the manifest says" in out
    assert (
        f"part-00000.parquet: row group {BAD_GROUP} column `{BAD_COLUMN}`: could not verify "
        "page integrity, CRC checksum verification failed" in out
    )

    code = main(["stats", str(sealed), "--out", str(tmp_path / "stats"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"{part}: sha256 differs" in err and "recpipe etl verify" in err

    with pytest.raises(CorruptInputError) as caught:
        list(iter_batches(sealed, config=ReaderConfig(batch_size=256)))
    assert f"{part}: row group {BAD_GROUP} column `{BAD_COLUMN}` cannot be decoded" in str(
        caught.value
    )

    # skipped and counted; everything delivered is exactly the original rows
    config = ReaderConfig(batch_size=256, on_error="skip")
    bad = DatasetSource(sealed, schema=schema, config=config)
    good = DatasetSource(pristine, schema=schema, config=config)
    delivered = pa.concat_tables([t for t, _ in bad.iter_tables(bad.splits)])
    kept = [s for s in good.splits if (Path(s.path).name, s.row_group) != (part.name, BAD_GROUP)]
    expected = pa.concat_tables([good.read_split(s) for s in kept])
    assert tables_equal(delivered, expected)
    [skip] = bad.skipped
    assert (Path(skip.path), skip.row_group) == (part, BAD_GROUP)
    assert skip.rows == good.splits[BAD_GROUP].num_rows > 0
    assert delivered.num_rows + skip.rows == good.num_rows


def test_missing_resized_unreadable_and_stray_files(sealed, capsys):
    part = sealed / "part-00000.parquet"
    size = part.stat().st_size
    part.write_bytes(b"\0" * size)  # same size, not Parquet
    (sealed / "part-00099.parquet").write_bytes(b"")
    (sealed / "dt=2024-01-01-00").mkdir()
    (sealed / "dt=2024-01-01-00" / "part-00000.parquet").write_bytes(b"PAR1")
    (sealed / "_quarantine" / "other.parquet").write_bytes(b"")  # not read by readers: fine
    code, out = verify_cli(sealed, capsys)
    assert code == 1
    assert "part-00000.parquet: sha256 differs" in out
    assert "part-00000.parquet: not a readable Parquet file" in out
    assert "part-00099.parquet: not listed in the manifest, but readers" in out
    assert "dt=2024-01-01-00/part-00000.parquet: not listed in the manifest" in out
    assert "_quarantine" not in out

    part.write_bytes(b"\0" * (size + 1))
    code, out = verify_cli(sealed, capsys, "--no-pages")
    assert f"size differs: the manifest says {size:,} bytes, the file has {size + 1:,}" in out
    assert "0 row groups read" in out
    part.unlink()
    code, out = verify_cli(sealed, capsys, "--no-pages")
    assert code == 1
    assert "part-00000.parquet: missing: the manifest lists it" in out


def test_row_counts_differing_from_the_manifest(sealed, capsys):
    path = sealed / "_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][0]["rows"] += 1
    path.write_text(json.dumps(manifest))
    code, out = verify_cli(sealed, capsys)
    entry = manifest["files"][0]
    assert code == 1
    assert (
        f"part-00000.parquet: the manifest says {entry['rows']:,} rows in "
        f"{entry['row_groups']:,} row groups, the file has {entry['rows'] - 1:,} in" in out
    )


def test_a_dataset_without_digests_cannot_be_verified(built, capsys, tmp_path):
    manifest = json.loads((built / "_manifest.json").read_text())
    if all("sha256" in f for f in manifest["files"]):
        pytest.skip("the build records digests itself")
    code, out = verify_cli(built, capsys)
    assert code == 1
    assert "the manifest records no sha256 for it" in out
    assert verify_digests(built) is None
    code = main(["stats", str(built), "--out", str(tmp_path / "stats"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"stats: {built} not verified: its manifest records no sha256 digests" in err


def test_stats_no_verify_skips_the_check(sealed, tmp_path, capsys):
    flip_data_page(sealed / "part-00000.parquet", row_group=BAD_GROUP, column=BAD_COLUMN)
    main(["stats", str(sealed), "--out", str(tmp_path / "s"), "--no-plots", "--no-verify"])
    err = capsys.readouterr().err
    assert "does not match its manifest" not in err and "not verified" not in err


def test_no_manifest_or_a_malformed_one(tmp_path, capsys):
    code = main(["etl", "verify", str(tmp_path), "--no-progress"])
    assert code == 1
    assert "has no _manifest.json: not a dataset built by `recpipe etl build`" in (
        capsys.readouterr().err
    )
    (tmp_path / "_manifest.json").write_text('{"files": [{"path": "../x.parquet"}]}')
    with pytest.raises(DataError, match=r"files\[0\]: `path` '\.\./x\.parquet' must be relative"):
        verify_dataset(tmp_path)
    (tmp_path / "_manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot be read as JSON"):
        verify_dataset(tmp_path)
