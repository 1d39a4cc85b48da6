"""A wide schema (1,200 features) builds with every local engine and validates.

Regression test of issue 33, item 16 (failed before its fix): a schema of 1,000 features or
more could not be built by any engine nor validated: the fast path summed one term per feature
in a chain of ``+`` that DuckDB refuses past 1,000 levels (``Max expression depth limit of 1000
exceeded``). Marked slow: DuckDB takes seconds to plan each statement over so many columns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recpipe_cli import main

DENSE = 1_150
SPARSE = 50


def _schema(path: Path) -> Path:
    lines = ["[dataset]", 'name = "wide"']
    lines += [f'[[dense]]\nname = "d{i}"' for i in range(DENSE)]
    lines += [f'[[sparse]]\nname = "s{i}"\nkind = "item"\nmax_len = 4' for i in range(SPARSE)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _record(i: int) -> dict:
    return {
        "request_id": f"r{i}",
        "ts": 1_000 + i,
        "session_id": f"s{i // 5}",
        "dense": {f"d{j}": float(i + j) for j in range(DENSE)},
        "sparse": {f"s{j}": [i, j] for j in range(SPARSE)},
    }


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, Path]:
    """The schema and 20 records: 17 good (one written with blanks, one with an unknown dense
    key: read by the slower tiers), one whose last dense feature is a string, one with a
    non-finite value, one with a list of strings."""
    root = tmp_path_factory.mktemp("wide")
    rows = [json.dumps(_record(i)) for i in range(17)]
    rows[3] = json.dumps(_record(3), indent=1).replace("\n", " ")
    odd = _record(4)
    odd["dense"]["not_in_schema"] = 1.0
    rows[4] = json.dumps(odd)
    bad = [_record(i) for i in range(17, 20)]
    bad[0]["dense"][f"d{DENSE - 1}"] = "12"
    bad[1]["dense"]["d700"] = float("inf")
    bad[2]["sparse"][f"s{SPARSE - 1}"] = ["a"]
    rows += [json.dumps(r) for r in bad]
    logs = root / "features.jsonl"
    logs.write_text("\n".join(rows) + "\n")
    return _schema(root / "wide.toml"), logs


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["duckdb", "polars"])
def test_a_schema_of_1200_features_builds(tmp_path, wide, capsys, engine):
    schema, logs = wide
    out = tmp_path / engine
    argv = ["etl", "build", str(logs), "--out", str(out), "--schema", str(schema)]
    assert main([*argv, "--engine", engine, "--quiet", "--json"]) == 0, capsys.readouterr().err
    manifest = json.loads(capsys.readouterr().out)
    assert (manifest["rows_in"], manifest["rows_out"], manifest["rows_quarantined"]) == (20, 17, 3)
    quarantine = pq.read_table(out / "_quarantine" / "features.parquet").to_pylist()
    details = sorted(r["detail"] for r in quarantine)
    assert any(f"dense.d{DENSE - 1}" in d for d in details), details
    assert any("dense.d700" in d for d in details), details
    assert any(f"sparse.s{SPARSE - 1}" in d for d in details), details
    table = pq.read_table(sorted(out.rglob("part-*.parquet"))[0])
    assert table.num_columns > DENSE + SPARSE
    got = table.filter(table.column("request_id").to_numpy(zero_copy_only=False) == "r3")
    assert got.column(f"d{DENSE - 1}").to_pylist() == [3.0 + DENSE - 1]


@pytest.mark.slow
def test_a_schema_of_1200_features_validates(wide, capsys):
    schema, logs = wide
    code = main(["etl", "validate", str(logs), "--schema", str(schema)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "expression depth" not in out.err + out.out
    assert code == 0, out.out + out.err  # three bad records: warnings, as the build keeps the rest
    assert "3 would be quarantined" in out.out
    assert f"dense.d{DENSE - 1}" in out.out
