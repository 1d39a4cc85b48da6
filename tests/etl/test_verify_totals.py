"""`recpipe etl verify` checks the manifest's description of the data, not only its file list.

Regression: deleting a part file together with its ``files[]`` entry left a dataset that
`etl verify` called OK although the files held fewer rows than the manifest's ``rows_out``.
Now the totals (rows, row groups, bytes, sessions), the count reconciliation, the quarantine
files and each file's session count are checked against the files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from etl.verify import verify_dataset
from recpipe_cli import main


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A real build of several part files (small `max_file_bytes`) with quarantined records."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate

    work = tmp_path_factory.mktemp("totals")
    logs = generate(work / "raw", SynthConfig(num_requests=1_500, seed=5, bad_fraction=0.05))
    out = work / "built"
    config = BuildConfig(row_group_size=200, max_file_bytes=40_000)
    build(logs.features, out, events=logs.events, config=config)
    return out


@pytest.fixture
def dataset(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "ds"))


def manifest_of(root: Path) -> dict:
    return json.loads((root / "_manifest.json").read_text())


def write_manifest(root: Path, manifest: dict) -> None:
    (root / "_manifest.json").write_text(json.dumps(manifest, indent=2))


def verify(root: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["etl", "verify", str(root), "--no-progress", *extra])
    return code, capsys.readouterr().out


def test_a_fresh_build_verifies(dataset, capsys):
    manifest = manifest_of(dataset)
    assert len(manifest["files"]) >= 2 and manifest["rows_quarantined"] > 0
    code, out = verify(dataset, capsys)
    assert code == 0, out


@pytest.mark.parametrize(
    "options",
    [
        {"order": "time", "max_file_bytes": 40_000},  # sessions cut across files
        {"sample_sessions": 0.5},
        {"partition_by": "hour", "max_file_bytes": 30_000},
        {"engine": "polars", "max_file_bytes": 40_000},
        {"sample_sessions": 1e-9},  # no rows out: no part files
    ],
    ids=["time", "sampled", "hour", "polars", "empty"],
)
def test_every_kind_of_build_verifies(built, tmp_path, options):
    """The totals hold for every build option that changes them (no false alarm)."""
    from etl.build import BuildConfig, build

    raw, out = built.parent / "raw", tmp_path / "out"
    config = BuildConfig(row_group_size=200, **options)
    build([raw / "features"], out, events=[raw / "events"], config=config)
    report = verify_dataset(out)
    assert report.ok, report.format()
    assert (report.files == 0) == (options.get("sample_sessions") == 1e-9)


@pytest.mark.parametrize("pages", [True, False])
def test_a_file_removed_with_its_entry_fails(dataset, capsys, pages):
    manifest = manifest_of(dataset)
    gone = manifest["files"].pop(0)
    (dataset / gone["path"]).unlink()
    write_manifest(dataset, manifest)
    code, out = verify(dataset, capsys, *([] if pages else ["--no-pages"]))
    assert code == 1
    held = manifest["rows_out"] - gone["rows"]
    assert (
        f"_manifest.json: its files hold {held:,} rows, `rows_out` says {manifest['rows_out']:,}"
        in out
    )
    assert "`row_groups` says" in out and "`bytes_out` says" in out
    assert "OK" not in out


def test_totals_edited_to_match_still_fail_on_reconciliation_and_sessions(dataset, capsys):
    manifest = manifest_of(dataset)
    gone = manifest["files"].pop(0)
    (dataset / gone["path"]).unlink()
    for key, value in (("rows_out", gone["rows"]), ("row_groups", gone["row_groups"]),
                       ("bytes_out", gone["bytes"])):  # fmt: skip
        manifest[key] -= value
    write_manifest(dataset, manifest)
    code, out = verify(dataset, capsys, "--no-pages")
    assert code == 1
    assert "_manifest.json: the counts do not reconcile: `rows_in` " in out
    assert "`sessions` says" in out


def test_the_quarantine_files_hold_what_the_manifest_counts(dataset, capsys):
    manifest = manifest_of(dataset)
    features = dataset / manifest["quarantine"]["features"]
    table = pq.read_table(features)
    pq.write_table(table.slice(1), features)
    code, out = verify(dataset, capsys, "--no-pages")
    assert code == 1
    assert (
        f"_quarantine/features.parquet: holds {table.num_rows - 1:,} rows, `rows_quarantined` "
        f"says {manifest['rows_quarantined']:,}" in out
    )
    features.unlink()
    code, out = verify(dataset, capsys, "--no-pages")
    assert "_quarantine/features.parquet: missing: the manifest names it" in out


def test_a_file_whose_sessions_differ_from_its_entry_fails(dataset, capsys):
    manifest = manifest_of(dataset)
    manifest["files"][0]["sessions"] += 1
    manifest["sessions"] += 1
    write_manifest(dataset, manifest)
    report = verify_dataset(dataset, pages=False)
    assert report.ok  # the totals agree; only reading the data tells
    code, out = verify(dataset, capsys)
    entry = manifest["files"][0]
    assert code == 1
    assert (
        f"{entry['path']}: the manifest says {entry['sessions']:,} sessions, the file has "
        f"{entry['sessions'] - 1:,}" in out
    )


def test_duplicate_entries_are_refused(dataset):
    from recpipe.errors import DataError

    manifest = manifest_of(dataset)
    manifest["files"].append(dict(manifest["files"][0]))
    write_manifest(dataset, manifest)
    with pytest.raises(DataError, match=r"files\[\d+\]: lists .*part-00000\.parquet' twice"):
        verify_dataset(dataset)
