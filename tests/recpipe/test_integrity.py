"""`recpipe.integrity`: the manifest's file list, digests and the search for a dataset root."""

from __future__ import annotations

import doctest

import pytest

import recpipe.integrity
from recpipe.errors import DataError
from recpipe.integrity import ListedFile, check_digest, file_sha256, find_manifest, listed_files

GOOD = {"path": "dt=x/part-00000.parquet", "rows": 3, "row_groups": 1, "bytes": 4, "sha256": None}


def test_docstring_example_runs():
    assert doctest.testmod(recpipe.integrity, optionflags=doctest.ELLIPSIS).failed == 0


def test_listed_files_reads_entries_and_ignores_other_keys():
    [entry] = listed_files({"files": [{**GOOD, "sessions": 2, "x": 1}]}, source="m.json")
    assert entry == ListedFile("dt=x/part-00000.parquet", rows=3, row_groups=1, bytes=4, sessions=2)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        (None, r"manifest 'm\.json': `files` must be a list, got NoneType"),
        (["x"], r"files\[0\]: must be an object, got 'x'"),
        ([{**GOOD, "path": ""}], r"files\[0\]: `path` must be a non-empty string"),
        ([{**GOOD, "path": "/etc/x"}], r"`path` '/etc/x' must be relative and inside"),
        ([{**GOOD, "path": "a/../../x"}], r"must be relative and inside the dataset"),
        ([{**GOOD, "rows": -1}], r"\(dt=x/part-00000\.parquet\): `rows` must be a non-negative"),
        ([{**GOOD, "bytes": True}], r"`bytes` must be a non-negative integer, got True"),
        ([{**GOOD, "sha256": "ABC"}], r"`sha256` must be 64 lower-case hex digits, got 'ABC'"),
    ],
)
def test_listed_files_rejects_malformed_entries(files, match):
    with pytest.raises(DataError, match=match):
        listed_files({"files": files} if files is not None else {}, source="m.json")


def test_check_digest_and_find_manifest(tmp_path):
    part = tmp_path / "dt=x" / "part-00000.parquet"
    part.parent.mkdir()
    part.write_bytes(b"PAR1")
    size, sha = file_sha256(part)
    entry = ListedFile("dt=x/part-00000.parquet", rows=0, row_groups=0, bytes=size, sha256=sha)
    assert check_digest(tmp_path, entry) == []
    no_digest = ListedFile(entry.path, rows=0, row_groups=0, bytes=size)
    assert "records no sha256" in check_digest(tmp_path, no_digest)[0]
    assert find_manifest(part) is None
    (tmp_path / "_manifest.json").write_text("{}")
    assert find_manifest(part) == tmp_path
    part.unlink()
    part.mkdir()
    assert check_digest(tmp_path, entry) == ["is not a regular file"]
