"""`recpipe.integrity`: a manifest's totals against its file list, and file identities."""

from __future__ import annotations

import os

import pytest

from recpipe.errors import CorruptInputError, DataError
from recpipe.integrity import (
    FileChangedError,
    FileId,
    ListedFile,
    check_totals,
    check_unchanged,
    listed_files,
    mismatch_error,
)

FILES = [
    ListedFile("part-00000.parquet", rows=6, row_groups=2, bytes=100, sessions=3),
    ListedFile("part-00001.parquet", rows=4, row_groups=1, bytes=50, sessions=2),
]
TOTALS = {
    "rows_in": 12,
    "rows_out": 10,
    "rows_quarantined": 1,
    "rows_sampled_out": 1,
    "reconciles": True,
    "quarantine_by_reason": {"malformed_json": 1, "non_finite": 0},
    "sessions": 4,
    "session_continuations": 1,
    "row_groups": 3,
    "bytes_out": 150,
    "bytes_in": 30,
    "inputs": [{"path": "a.jsonl", "bytes": 10}, {"path": "b.jsonl", "bytes": 20}],
}


def test_totals_that_agree():
    assert check_totals(TOTALS, FILES) == []
    assert check_totals({}, FILES) == []  # a hand-made manifest: a file list only


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"rows_out": 11}, "its files hold 10 rows, `rows_out` says 11"),
        ({"row_groups": 2}, "its files hold 3 row groups, `row_groups` says 2"),
        ({"bytes_out": 1}, "its files hold 150 bytes, `bytes_out` says 1"),
        (
            {"sessions": 5},
            "its files hold 5 sessions, `sessions` says 5 (+ 1 `session_continuations`)",
        ),
        ({"rows_in": 13}, "the counts do not reconcile: `rows_in` 13 != `rows_out` 10"),
        ({"reconciles": False}, "`reconciles` is false, but its counts reconcile"),
        ({"quarantine_by_reason": {"malformed_json": 2}}, "`quarantine_by_reason` sums to 2"),
        ({"bytes_in": 31}, "its inputs hold 30 bytes, `bytes_in` says 31"),
    ],
)
def test_each_total_that_differs_is_named(change, problem):
    problems = check_totals({**TOTALS, **change}, FILES)
    assert any(p.startswith(problem) for p in problems), problems


def test_a_file_removed_with_its_entry_breaks_rows_and_reconciliation():
    problems = check_totals(TOTALS, FILES[:1])
    assert problems[0] == "its files hold 6 rows, `rows_out` says 10"
    assert any(p.startswith("its files hold 3 sessions") for p in problems)


def test_sessions_without_continuations_may_only_exceed():
    older = {k: v for k, v in TOTALS.items() if k != "session_continuations"}
    assert check_totals(older, FILES) == []  # 5 >= 4: a session cut across files
    assert check_totals({**older, "sessions": 6}, FILES) == [
        "its files hold 5 sessions, `sessions` says 6"
    ]


def test_a_malformed_total_or_duplicate_entry_is_refused():
    with pytest.raises(DataError, match=r"manifest `rows_out` must be a non-negative integer"):
        check_totals({"rows_out": "10"}, FILES)
    entry = {"path": "a/../a/part.parquet", "rows": 1, "row_groups": 1, "bytes": 1}
    with pytest.raises(DataError, match=r"must be relative and inside"):
        listed_files({"files": [entry]}, source="m.json")
    entry = {"path": "part.parquet", "rows": 1, "row_groups": 1, "bytes": 1}
    with pytest.raises(DataError, match=r"files\[1\]: lists 'part\.parquet' twice"):
        listed_files({"files": [entry, entry]}, source="m.json")


def test_mismatch_error_lists_each_problem(tmp_path):
    problems = [(f"part-{i:05d}.parquet", "missing") for i in range(12)]
    err = mismatch_error(tmp_path, problems, hint="rebuild")
    assert isinstance(err, CorruptInputError)
    lines = str(err).splitlines()
    assert lines[0] == f"dataset {str(tmp_path)!r} does not match its manifest:"
    assert lines[1] == f"  {tmp_path / 'part-00000.parquet'}: missing"
    assert lines[-2:] == ["  ... and 2 more", "hint: rebuild"]


def test_file_identity_notices_replacement_modification_and_removal(tmp_path):
    path = tmp_path / "part.parquet"
    path.write_bytes(b"abc")
    opened = FileId.of(path)
    check_unchanged(path, opened)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(FileChangedError, match=r"modified: its modification time moved"):
        check_unchanged(path, opened)
    other = tmp_path / "new.parquet"
    other.write_bytes(b"abcd")
    os.replace(other, path)
    with pytest.raises(FileChangedError, match=r"part\.parquet: changed since .*replaced"):
        check_unchanged(path, opened)
    path.unlink()
    with pytest.raises(FileChangedError, match=r"\(removed\)") as caught:
        check_unchanged(path, opened)
    assert "hint: was the dataset rebuilt" in str(caught.value)
